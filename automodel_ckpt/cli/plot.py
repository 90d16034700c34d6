"""`ckpt-train plot`: a PNG of training/validation loss and learning rate, with checkpoints marked."""

from __future__ import annotations

import io
from pathlib import Path

from automodel_ckpt.ondisk import RunFolder, pointer_target, scan_checkpoints, write_atomic
from automodel_ckpt.cli.common import VerbParser
from automodel_ckpt.errors import UserError
from automodel_ckpt.training.metrics import read_jsonl


def build_parser() -> VerbParser:
    p = VerbParser("plot", "A PNG of training/validation loss and learning rate, with checkpoints marked.")
    p.add_argument("checkpoint_dir", help="the run folder (checkpoint.checkpoint_dir): a path or an object store URL")
    p.add_argument("--out", type=Path, default=None,
                   help="PNG to write (default: CHECKPOINT_DIR/loss.png; ./loss.png for a URL)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from automodel_ckpt.checkpoint import is_url, open_for_reading

    run_dir = open_for_reading(args.checkpoint_dir, key="plot")
    out = plot_run(run_dir, args.out or (Path("loss.png") if is_url(args.checkpoint_dir) else None))
    print(f"wrote {out}")
    return 0


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write the PNG (default ``run_dir/loss.png``) and return its path."""
    import matplotlib.pyplot as plt

    fig = make_figure(run_dir)
    out = Path(out) if out else Path(run_dir) / "loss.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    write_atomic(out, png.getvalue())  # a link or FIFO at ``out`` is replaced, never written through
    plt.close(fig)
    return out


def make_figure(run_dir: Path):
    run_dir = Path(run_dir)
    train = read_jsonl(RunFolder(run_dir).training_log)
    if not train:
        raise UserError(f"no {RunFolder.training_log} in '{run_dir}': nothing to plot")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("ckpt-train plot needs matplotlib: pip install 'automodel-ckpt[plot]'") from None
    val = read_jsonl(RunFolder(run_dir).validation_log)

    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True, height_ratios=[3, 1])
    steps = [r["step"] for r in train]
    ax.plot(steps, [r["loss"] for r in train], label="training loss", color="tab:blue", linewidth=1.2)
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss",
                color="tab:orange", markersize=4)
    best = pointer_target(run_dir, RunFolder.lowest_val)
    for i, ckpt in enumerate(scan_checkpoints(run_dir)):
        ax.axvline(ckpt.step, color="gray", linestyle=":", linewidth=1, label="checkpoint" if i == 0 else None)
        if best is not None and ckpt.name == best.name:
            val_loss = (ckpt.metadata or {}).get("val_loss")
            y = val_loss if isinstance(val_loss, (int, float)) else ax.get_ylim()[1]
            ax.plot([ckpt.step], [y], marker="*", markersize=16, color="tab:red", linestyle="none",
                    label=f"LOWEST_VAL ({ckpt.name})")
    ax.set_ylabel("loss")
    ax.set_title(f"{run_dir.resolve().name}: loss by optimizer step")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    ax_lr.plot(steps, [r.get("lr") for r in train], color="tab:green", linewidth=1.2)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("optimizer step")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    return fig
