"""Writing a checkpoint: reserve, write, seal, publish, prune; the small per-rank files, the background overlap, the disk-full guard."""
