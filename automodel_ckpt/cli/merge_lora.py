"""`ckpt-train merge-lora CHECKPOINT`: a PEFT checkpoint's adapter merged into its base, as a full HF folder."""

from __future__ import annotations

from pathlib import Path

from automodel_ckpt.cli.common import VerbParser


def build_parser() -> VerbParser:
    parser = VerbParser("merge-lora", "Merge a PEFT checkpoint's LoRA adapter into its base model and write a "
                                      "full HF model folder.")
    parser.add_argument("checkpoint", type=Path, help="PEFT checkpoint folder (epoch_E_step_N), its model/ folder, or "
                                                      "an archived adapter (ckpt-train pack)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: CHECKPOINT/model/merged)")
    parser.add_argument("--base", type=Path, default=None,
                        help="base model folder (default: base_model_name_or_path of adapter_config.json)")
    return parser


def main(argv: list[str]) -> int:
    from automodel_ckpt.export import merge_lora

    args = build_parser().parse_args(argv)
    out = merge_lora(args.checkpoint, args.out, args.base)
    print(f"Merged model written to {out}", flush=True)
    return 0
