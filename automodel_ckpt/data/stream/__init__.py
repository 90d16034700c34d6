"""Streamed corpora: files read as they are needed, in one global order, with a small global position.

Rooms: ``corpus`` (the ``dataset:`` target and the shard listing that is the corpus's identity), ``order`` (the
pure functions that decide the order), ``readers`` (rows of one file by reference), ``stream`` (the global stream
of packed sequences and its position), ``loader`` (DataLoader workers, data-parallel ranks, the checkpointed
position), ``validation`` (held-out sequences).
"""
