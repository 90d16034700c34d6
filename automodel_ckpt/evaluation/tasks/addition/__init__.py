"""The embedded recipe's task as a harness task: ``addition`` (held-out two-digit sums, exact match)."""
