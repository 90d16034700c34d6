"""Inside bench_memory's steps: each phase's level and peak, the goals' lines, what a profiled step holds at its peak.

Used by ``tools/bench_memory.py --profile-step N``: step ``N`` runs under ``torch.profiler`` with
``profile_memory=True``; every CPU block allocated during it is followed from its allocation to its free, and the
blocks live at the moment the bytes allocated since the step began are largest are grouped by the innermost
operation or Python function of interest that allocated them (an FSDP all-gather, a backward kernel, the optimizer).
Blocks that were already live when the step began (weights, gradients kept from the last micro-batch, optimizer
state) are not in it: the bench's phase table gives their level.
"""

from __future__ import annotations

from collections import defaultdict

MiB = 1 << 20

# What a block is attributed to: the innermost ancestor whose name starts with one of these (a record_function of
# FSDP, a backward node, an optimizer or clipping function, a module's forward), else its nearest operator.
OWNERS = ("FSDP::", "autograd::engine::evaluate_function", "Optimizer.step", "Optimizer.zero_grad",
          "torch/optim/", "torch/nn/utils/clip_grad", "torch/distributed/checkpoint", "nn.Module:")


def _owner(node) -> str:
    nearest_op = None
    parent = node.parent
    while parent is not None:
        name = parent.name
        if nearest_op is None and name.startswith("aten::"):
            nearest_op = name
        for prefix in OWNERS:
            if name.startswith(prefix) or prefix in name:
                op = f" ({nearest_op})" if nearest_op else ""
                return name.split(": ", 1)[-1] + op if name.startswith("torch/") else name + op
        parent = parent.parent
    return nearest_op or "outside any operator"


def live_at_peak(prof, top: int = 12) -> dict:
    """The peak of the bytes allocated (net of frees) since the profile began, when it was reached (as a fraction
    of the profile), and the blocks live then by owner: ``[(owner, MiB, blocks), ...]``, largest first."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append(node)
        stack.extend(node.children)
    events.sort(key=lambda n: n.start_time_ns)
    total = peak = 0
    peak_at = -1
    for i, node in enumerate(events):
        total += node.extra_fields.alloc_size
        if total > peak:
            peak, peak_at = total, i
    live: dict[int, object] = {}
    for node in events[: peak_at + 1]:
        fields = node.extra_fields
        if fields.alloc_size > 0:
            live[fields.ptr] = node
        else:
            live.pop(fields.ptr, None)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for node in live.values():
        group = groups[_owner(node)]
        group[0] += node.extra_fields.alloc_size
        group[1] += 1
    span = (events[-1].start_time_ns - events[0].start_time_ns) if events else 0
    when = (events[peak_at].start_time_ns - events[0].start_time_ns) / span if span and peak_at >= 0 else 0.0
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"peak_mib": peak / 2**20, "at": round(when, 3), "peak_owner": _owner(events[peak_at]) if peak_at >= 0
            else None, "live": [(name, round(size / 2**20, 1), n) for name, (size, n) in ranked[:top]]}


def phases_table(results: list[dict]) -> str:
    """Rank 0's resident memory above the idle process in each phase of the first steps and the save."""
    rows = ["| ranks | optimizer | step | phase | at its start MiB | its peak MiB | peak - start MiB |",
            "|---|---|---|---|---|---|---|"]
    for res in results:
        if "failed" in res or res["activation_checkpointing"]:
            continue
        r = res["ranks"][0]
        steps = [(f"{i}" if i else "before 1", step) for i, step in enumerate(r.get("phases", []))]
        for label, step in steps + [("", r.get("saves", {}))]:
            for phase, seen in step.items():
                rows.append(f"| {res['nproc']} | {res['optimizer']} | {label} | {phase} | "
                            f"{(seen['start'] - r['idle']) / MiB:.0f} | {(seen['peak'] - r['idle']) / MiB:.0f} | "
                            f"{(seen['peak'] - seen['start']) / MiB:.0f} |")
    return "\n".join(rows)


def goal_lines(results: list[dict], report: dict) -> list[str]:
    """The whole run's two goals, one line each: the worst rank against its share, and 4 ranks against 1."""
    lines = []
    for res in results:
        if "failed" in res or "ranks" not in res:
            continue
        worst = max(res["ranks"], key=lambda r: r["whole_over_idle"] - r["whole_goal"])
        lines.append(f"{res['nproc']} ranks, {res['optimizer']}, activation checkpointing "
                     f"{res['activation_checkpointing']}: worst rank {worst['whole_over_idle'] / MiB:.0f} MiB above "
                     f"idle, goal 1.25 x {worst['state_share'] / MiB:.0f} + 256 = {worst['whole_goal'] / MiB:.0f} "
                     f"MiB ({worst['whole_over_idle'] / worst['whole_goal']:.2f} of it): "
                     f"{'pass' if res['whole_goal_met'] else 'FAIL'}")
    for key, value in report.items():
        if key.startswith("whole_added_4_over_1"):
            opt = key.removeprefix("whole_added_4_over_1").lstrip("_") or "first optimizer"
            lines.append(f"whole run above idle, 4 ranks over 1 rank ({opt}): {value:.2f} (goal <= 0.5): "
                         f"{'pass' if value <= 0.5 else 'FAIL'}")
    return lines
