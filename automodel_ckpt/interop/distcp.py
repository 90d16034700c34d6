"""Another trainer's DCP folders (Lightning's distributed checkpoint, the HF Trainer's FSDP layout) as state dicts.

``ondisk.read_dcp_folder`` reads a folder whole; here its flattened keys are put back together: ``<model>.<name>``
-> the weights, ``<optimizer>.state.<name>.<moment>`` and ``<optimizer>.param_groups.<i>.<key>`` -> an optimizer
``state_dict`` with its parameters named, as ``get_optimizer_state_dict`` names them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from automodel_ckpt.interop.source import refuse

STATE, GROUPS = "state", "param_groups"


def weights(flat: dict[str, Any], prefix: str, where: Path) -> dict[str, torch.Tensor]:
    """The tensors under ``prefix.`` (the model's entry), named without it."""
    out = {k[len(prefix) + 1:]: v for k, v in flat.items() if k.startswith(prefix + ".")}
    if not out:
        raise refuse(where, f"it holds no '{prefix}' entry (the model's weights)")
    bad = [k for k, v in out.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise refuse(where, f"its weight '{bad[0]}' is not a tensor")
    return out


def optimizer(flat: dict[str, Any], prefix: str, where: Path) -> dict[str, Any]:
    """The optimizer ``state_dict`` under ``prefix.`` (``optimizer_0``, ``optimizer``), its parameters named."""
    state: dict[str, dict[str, Any]] = {}
    groups: dict[int, dict[str, Any]] = {}
    for key, value in flat.items():
        if not key.startswith(prefix + "."):
            continue
        rest = key[len(prefix) + 1:]
        kind, _, tail = rest.partition(".")
        if kind == STATE and "." in tail:
            name, moment = tail.rsplit(".", 1)
            state.setdefault(name, {})[moment] = value
        elif kind == GROUPS and "." in tail:
            index, field = tail.split(".", 1)
            if not index.isdigit() or int(index) >= len(flat):
                raise refuse(where, f"its entry '{key[:200]}' names no parameter group")
            groups.setdefault(int(index), {})[field] = value
        else:
            raise refuse(where, f"its entry '{key[:200]}' is no part of an optimizer's state")
    if not groups:
        raise refuse(where, f"it holds no '{prefix}' parameter groups (the optimizer's state)")
    if sorted(groups) != list(range(len(groups))):
        raise refuse(where, f"its '{prefix}' parameter groups are not numbered 0 to {len(groups) - 1}")
    ordered = [groups[i] for i in range(len(groups))]
    for group in ordered:
        params = group.get("params")
        if not (isinstance(params, list) and all(isinstance(p, str) for p in params)):
            raise refuse(where, f"a parameter group of '{prefix}' does not name its parameters")
    named = {p for g in ordered for p in g["params"]}
    stray = sorted(set(state) - named)
    if stray:
        raise refuse(where, f"its optimizer holds state for '{stray[0]}', which no parameter group names")
    return {STATE: state, GROUPS: ordered}
