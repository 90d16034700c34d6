"""Choosing what a run starts from: pick, probe, quarantine, check the run, or start from other weights; returns a decision."""
