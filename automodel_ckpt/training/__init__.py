"""Training-loop components: step scheduler, RNG state, LR schedules, metric logs."""
