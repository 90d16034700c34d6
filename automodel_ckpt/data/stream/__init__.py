"""Streamed corpora: files read as they are needed, in an order made over a fixed number of lanes, small positions.

Rooms: ``corpus`` (the ``dataset:`` target and the unit listing that is the corpus's identity), ``order`` (the
pure functions that decide the order), ``readers`` (rows of one file or byte range by reference), ``stream`` (one
lane of packed sequences and its position), ``loader`` (the lanes of each data-parallel rank and DataLoader worker,
the checkpointed positions), ``position`` (a checkpointed position read back), ``validation`` (held-out sequences).
"""
