"""Training algorithms: what a fine-tune trains and how (its batches, loss, state and counters), each one module."""
