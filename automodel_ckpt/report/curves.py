"""The report's plotted panels: loss, lr and grad norm with checkpoints and stages marked, eval scores, GRPO and DPO."""

from __future__ import annotations

from typing import Any

from automodel_ckpt.ondisk import RunFolder
from automodel_ckpt.report.html import Markup, chart, el, finite, none, table

MAX_SERIES = 12  # lines of one chart whose names come from a log (reward functions, eval tasks, sources)
GRPO = ("reward", "reward_std", "kl", "completion_length", "clip_fraction")
DPO = ("reward_margin", "reward_accuracy", "reward_chosen", "reward_rejected")


def points(records: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """(step, value) of each record with a finite ``key``."""
    return [(float(r["step"]), v) for r in records if (v := finite(r.get(key))) is not None]


def marks(run: dict[str, Any]) -> list[tuple[float, str, str]]:
    """Every checkpoint (complete, quarantined, deleted by retention) and stage boundary, as chart marks."""
    rows, out = run["checkpoints"]["checkpoints"], []
    for r in rows:
        if r["step"] is not None:
            state = "complete" if r["complete"] else "incomplete"
            out.append((float(r["step"]), "checkpoint", f"{r['name']} ({state})"))
    quarantined = run["checkpoints"]["quarantined"]
    out += [(float(q["step"]), "quarantined", f"{q['name']}: quarantined") for q in quarantined
            if finite(q.get("step")) is not None]
    out += [(float(step), "deleted", f"step {step}: deleted by retention") for step in run["deleted"]]
    out += [(float(s["first_step"]) - 0.5, "stage", f"stage {s['name']} from step {s['first_step']}")
            for s in run["stages"] if s["first_step"] > 1]  # the first: the run's start
    return out


def curves(run: dict[str, Any]) -> Markup:
    train, val, m = run["logs"]["train"], run["logs"]["val"], marks(run)
    if not train and not val:
        return none("no training.jsonl or validation.jsonl records in this run folder")
    notes = [el("p", n, class_="none") for n in run["logs"]["notes"]]
    return Markup("".join([*notes, chart("loss", {"training loss": points(train, "loss"),
                                                  "validation loss": points(val, "val_loss")}, m),
                           chart("learning rate", {"lr": points(train, "lr")}, m, height=160),
                           chart("gradient norm", {"grad_norm": points(train, "grad_norm")}, m, height=160)]))


def evals(run: dict[str, Any]) -> Markup:
    rows = [r for r in run["checkpoints"]["checkpoints"] if r.get("eval")]
    best = [el("li", f"{name} -> {p['target']}" + ("" if p["exists"] else " (missing)"))
            for name, p in run["checkpoints"]["pointers"].items()
            if p["target"] is not None and name != RunFolder.latest]
    parts = [el("ul", best) if best else none("no best-checkpoint pointer (LOWEST_VAL, BEST_EVAL) is set")]
    if not rows:
        return Markup("".join(parts + [none("no checkpoint of this run was evaluated (ckpt-train eval)")]))
    tasks = list(dict.fromkeys(k for r in rows for k in r["eval"]))[:MAX_SERIES]
    parts.append(chart("eval scores", {t: [(float(r["step"]), r["eval"][t]) for r in rows
                                           if t in r["eval"] and r["step"] is not None] for t in tasks}))
    parts.append(table(["checkpoint", "step", *tasks],
                       [[r["name"], r["step"], *(f"{r['eval'][t]:.4f}" if t in r["eval"] else "-" for t in tasks)]
                        for r in rows]))
    return Markup("".join(parts))


def algorithm(run: dict[str, Any]) -> Markup:
    train, m = run["logs"]["train"], marks(run)
    keys = list(dict.fromkeys(k for r in train for k in r if isinstance(k, str)))
    per_function = [k for k in keys if k.startswith("reward_") and k not in GRPO + DPO][:MAX_SERIES]
    parts = []
    if any(k in keys for k in ("kl", "completion_length")):
        parts += [el("h3", "GRPO"), chart("reward", {k: points(train, k) for k in ("reward", "reward_std")}, m),
                  chart("reward per function", {k: points(train, k) for k in per_function}, m),
                  chart("KL to the reference", {"kl": points(train, "kl")}, m, height=160),
                  chart("completion length", {"completion_length": points(train, "completion_length")}, m,
                        height=160)]
    if "reward_margin" in keys:
        parts += [el("h3", "DPO"), chart("reward margin", {k: points(train, k) for k in DPO if k != "reward_accuracy"},
                                         m),
                  chart("reward accuracy", {"reward_accuracy": points(train, "reward_accuracy")}, m, height=160)]
    return Markup("".join(parts)) if parts else none("no GRPO or DPO metrics in training.jsonl (an SFT run)")
