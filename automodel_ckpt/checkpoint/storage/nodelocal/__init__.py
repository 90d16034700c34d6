"""The node-local checkpoint tier's parts: placement of copies, file transfer between ranks, inventory, folders."""

from automodel_ckpt.checkpoint.storage.nodelocal.inventory import (
    Inventory,
    StepFiles,
    Transfer,
    choose,
    fill_plan,
    gather,
    receives_from,
    scan,
    sends,
)
from automodel_ckpt.checkpoint.storage.nodelocal.localdir import (
    check_private,
    check_space,
    claim,
    default_folder,
    read_binding,
    remove,
    run_id,
)
from automodel_ckpt.checkpoint.storage.nodelocal.placement import place
from automodel_ckpt.checkpoint.storage.nodelocal.transfer import exchange

__all__ = [
    "Inventory",
    "StepFiles",
    "Transfer",
    "check_private",
    "check_space",
    "choose",
    "claim",
    "default_folder",
    "exchange",
    "fill_plan",
    "gather",
    "place",
    "read_binding",
    "receives_from",
    "remove",
    "run_id",
    "scan",
    "sends",
]
