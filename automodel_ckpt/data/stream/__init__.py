"""Streamed corpora: files read as they are needed, in an order made over a fixed number of lanes, small positions."""
