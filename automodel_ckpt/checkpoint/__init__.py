"""Checkpointing: what to save (discovered state), how (format backends) and when (lifecycle)."""
