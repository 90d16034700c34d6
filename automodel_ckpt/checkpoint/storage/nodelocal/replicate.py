"""Copies of a local step's parts on other nodes: which rank sends which staged file to which, decided alike everywhere.

A node keeps its own parts, those of the ``copies`` nodes before it (``placement``) and every file no one rank owns,
so each node's copy is self-describing and losing any ``copies`` nodes loses no part.
"""

from __future__ import annotations

from pathlib import Path

from automodel_ckpt.ondisk import layout, manifest
from automodel_ckpt.checkpoint.storage.nodelocal.inventory import Transfer, receives_from, sends
from automodel_ckpt.checkpoint.storage.nodelocal.placement import Placement
from automodel_ckpt.checkpoint.storage.nodelocal.transfer import exchange
from automodel_ckpt.distributed.env import all_gather_object, broadcast_object, current_group


def plan(listings: list[dict[str, int]], folder_ids: list[str], placement: Placement) -> list[Transfer]:
    """The transfers that give every folder its copies. ``listings[r]``: the staged files rank ``r``'s folder holds
    (``manifest.json`` included); ``folder_ids[r]``: which folder rank ``r`` writes (ranks sharing one agree)."""
    folders: dict[str, list[int]] = {}
    for rank, folder in enumerate(folder_ids):
        folders.setdefault(folder, []).append(rank)
    holders: dict[str, list[int]] = {}
    for rank, listing in enumerate(listings):
        for rel in listing:
            holders.setdefault(rel, []).append(rank)
    shared = {rel for rel in holders if rel == layout.MANIFEST_FILE or manifest.writer_rank(rel) is None}
    sent = [0] * len(listings)
    got = [0] * len(listings)
    pairs: dict[tuple[int, int], list[str]] = {}
    for folder, ranks in sorted(folders.items()):
        have = listings[ranks[0]]
        kept_for = {(placement.node_of(r) - k) % placement.nodes for r in ranks for k in range(1, placement.copies + 1)}
        wanted = set(shared) | {rel for s, listing in enumerate(listings) if placement.node_of(s) in kept_for
                                for rel in listing}
        for rel in sorted(wanted - set(have), key=lambda r: (-_size(listings, holders, r), r)):
            size = _size(listings, holders, rel)
            writer = manifest.writer_rank(rel)
            sender = writer if writer in holders[rel] else min(holders[rel], key=lambda r: (sent[r], r))
            local = sender % placement.ranks_per_node
            receiver = next((r for r in ranks if r % placement.ranks_per_node == local),
                            min(ranks, key=lambda r: (got[r], r)))
            sent[sender] += size
            got[receiver] += size
            pairs.setdefault((sender, receiver), []).append(rel)
    return [Transfer(s, r, tuple(sorted(files))) for (s, r), files in sorted(pairs.items())]


def _size(listings: list[dict[str, int]], holders: dict[str, list[int]], rel: str) -> int:
    return listings[holders[rel][0]][rel]


def copy_parts(staging: Path, rank: int, folder_ids: list[str], placement: Placement) -> None:
    """Collective: the staged step's copies sent and received (``plan``), each checked as it arrives."""
    listing = manifest.list_files(staging)
    if (staging / layout.MANIFEST_FILE).is_file():
        listing[layout.MANIFEST_FILE] = (staging / layout.MANIFEST_FILE).stat().st_size
    listings = all_gather_object(listing)
    sealed = broadcast_object(manifest.read_manifest(staging) if rank == 0 else None)  # written by rank 0 only
    transfers = plan(listings, folder_ids, placement)
    exchange(sends(transfers, rank), staging, {src: staging for src in receives_from(transfers, rank)},
             group=current_group(), expected=sealed)
