"""Which node-local step a resume takes, and making it whole on every node before it is loaded.

The newest step each of whose files checks out on some node (a copy is never trusted unchecked) is chosen, and
the files a node lacks are sent to it.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Callable

from automodel_ckpt.distributed import collective
from automodel_ckpt.ondisk import manifest
from automodel_ckpt.checkpoint.storage.nodelocal.folder import NodeLocalRunFolder
from automodel_ckpt.checkpoint.storage.nodelocal.inventory import (Chosen, Inventory, choose, fill_plan, gather,
                                                                  receives_from, scan, sends)
from automodel_ckpt.checkpoint.storage.nodelocal.transfer import exchange
from automodel_ckpt.distributed.env import all_gather_object, current_group


def newest_step(run: NodeLocalRunFolder, skipped: list[str], *, leave: Callable[[str], bool] | None = None
                ) -> tuple[Chosen | None, dict[int, Inventory]]:
    """Collective: the newest local step whole on some node (or None) and every inventory; ``skipped`` grows."""
    own = collective.collectively(lambda: scan(run.local, leave=leave) if run.leads else _empty(run),
                                  "checking the node-local steps", run.rank)
    inventories = gather(own, current_group())
    for inventory in inventories.values():
        skipped.extend(f"{inventory.host}: {line}" for line in inventory.skipped if "no manifest.json" not in line)
    return choose(inventories, skipped), inventories


def _empty(run: NodeLocalRunFolder) -> Inventory:
    return Inventory(socket.gethostname(), run.folder_ids[run.rank])


def make_whole(run: NodeLocalRunFolder, chosen: Chosen, inventories: dict[int, Inventory]) -> Path:
    """Collective: send every node's folder the files of ``chosen`` it lacks; returns this node's copy of it."""
    step = run.local / chosen.name
    held = step if chosen.name in inventories[run.rank].steps else None
    sealed = next(m for m in all_gather_object(manifest.read_manifest(held) if held else None) if m is not None)
    transfers = fill_plan(inventories, chosen)
    collective.collectively(
        lambda: exchange(sends(transfers, run.rank), step, {src: step for src in receives_from(transfers, run.rank)},
                         group=current_group(), expected=sealed),
        f"completing the node-local step {chosen.name}", run.rank)
    return step
