"""Writing a checkpoint: reserve, write, seal, publish, prune; small per-rank files, async overlap, disk-full."""
