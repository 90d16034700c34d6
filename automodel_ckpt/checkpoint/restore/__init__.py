"""What a run starts from: pick, probe, quarantine, check the run, or other weights; returns a decision."""
