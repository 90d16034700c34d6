"""``--to gguf``: one GGUF file for llama.cpp (a whole model, or a LoRA checkpoint's adapter), and what a GGUF file is.

The export is ``gguf_export`` (``--adapter``: ``gguf_adapter``); a GGUF file the other verbs meet is read by
``gguf_read``, streamed and bounded, and ``diff`` pairs its tensors with a model's by ``gguf_side``.
"""

from __future__ import annotations

import argparse
import json
import os
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from automodel_ckpt.errors import UsageError
from automodel_ckpt.export.gguf_read import (GGUF_SUFFIX, describe_gguf, gguf_lineage_text, is_gguf, open_gguf,
                                             refuse_misplaced_tensors, verify_gguf)
from automodel_ckpt.export.target import ExportRequest, ExportTarget
from automodel_ckpt.sizes import human_size

if TYPE_CHECKING:
    from automodel_ckpt.export.model_source import ModelSource

NAME = "gguf"
_ADAPTER_ONLY = f"--adapter applies to --to {NAME} (without --dry-run)"


class GGUFTarget(ExportTarget):
    name = NAME
    summary = "one GGUF file for llama.cpp"
    noun = "a GGUF file"
    suffix = GGUF_SUFFIX

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--type", default="q8_0", help="GGUF storage type: bf16, f16, q8_0 (default) or q4_0")
        parser.add_argument("--adapter", action="store_true", help="gguf, a LoRA checkpoint: its adapter as a GGUF "
                                                                   "LoRA adapter (llama.cpp --lora) instead of merged")
        parser.add_argument("--num-threads", type=int, default=min(4, os.cpu_count() or 1),
                            help="gguf: tensors converted at once (default: up to 4; memory: that many of the largest "
                                 "tensor)")

    def refuse(self, args: argparse.Namespace) -> None:
        if args.adapter:
            raise UsageError(_ADAPTER_ONLY)

    def export(self, request: ExportRequest) -> int:
        from automodel_ckpt.export.model_source import open_model

        args, src = request.args, request.src
        if args.adapter:
            if args.dry_run:
                raise UsageError(_ADAPTER_ONLY)
            from automodel_ckpt.export.gguf_adapter import write_gguf_adapter

            out = request.out(f"-lora-{args.type}{GGUF_SUFFIX}")
            done = write_gguf_adapter(src, out, args.type)
            print(f"GGUF LoRA adapter written to {out} ({human_size(done['bytes'])}, {done['factors']} factors, "
                  f"rank {done['rank']}, alpha {done['alpha']:g}; apply it to the GGUF of {done['base']})", flush=True)
            return 0
        from automodel_ckpt.export.gguf_export import plan_gguf, write_gguf

        out = request.out(f"-{args.type}{GGUF_SUFFIX}")
        with open_model(src) as source:
            plan = plan_gguf(source, args.type)
            print(plan.describe(source), flush=True)
            if args.dry_run:
                print(f"would write {out}", flush=True)
                return 0
            done = write_gguf(source, plan, out, progress=not args.no_progress, num_threads=max(1, args.num_threads),
                              lineage=json.dumps(request.lineage(), default=str) if request.lineage else None)
        print(f"GGUF written to {out} ({human_size(done['bytes'])}, {done['tokenizer']} tokenizer, "
              f"{done['seconds']:.2f} s)", flush=True)
        return 0

    def identify(self, path: Path) -> bool:
        return is_gguf(path)

    def describe(self, path: Path) -> dict[str, Any]:
        return describe_gguf(path)

    def render(self, info: dict[str, Any]) -> str:
        """What a GGUF file holds (``gguf_read.describe_gguf``) in a few lines."""
        types = ", ".join(f"{k} {v:,}" for k, v in info["types"].items()) or "no tensors"
        arch = info["architecture"] or "unknown architecture"
        shape = ", ".join(f"{k.replace('_', ' ')} {info[k]}" for k in ("block_count", "embedding_length",
                                                                        "context_length", "expert_count") if info[k])
        tokenizer = (f"{info['tokenizer.ggml.model']} tokenizer, {info['vocabulary']:,} tokens"
                     + (", chat template" if info["chat_template"] else ", no chat template"))
        return "\n".join([f"GGUF {info['gguf']}: {info['name'] or '(no name)'}, llama.cpp architecture {arch}",
                          f"  model: {shape}; {info['parameters']:,} parameters ({types})",
                          f"  {tokenizer}",
                          f"  {info['tensors']} tensors, {info['metadata_keys']} metadata keys, "
                          f"{human_size(info['bytes'])}"])

    def verify(self, path: Path, *, decode: bool) -> bool:
        """Every tensor of a GGUF file inside it, sized for its type (and, unless ``decode`` is off, finite)."""
        report = verify_gguf(path, decode=decode)
        print(f"GGUF {path} ({report.tensors} tensors, {human_size(report.bytes)}, "
              f"{'decoded' if decode else 'sizes only'})")
        for problem in report.problems:
            print(f"  {problem}")
        print("  OK: every tensor is whole" + (" and finite" if decode else "") if report.ok
              else f"  FAILED: {len(report.problems)} problem(s)")
        return report.ok

    def check(self, path: Path, consequence: str) -> None:
        """A damaged header raises; a tensor outside the data or over another is refused (``consequence``)."""
        refuse_misplaced_tensors(open_gguf(path), consequence)

    def lineage_text(self, path: Path, limit: int) -> str | None:
        return gguf_lineage_text(path, limit)

    def open_tensors(self, path: Path, stack: ExitStack) -> ModelSource:
        from automodel_ckpt.export.gguf_side import gguf_alone

        return gguf_alone(path, stack)

    def beside(self, model: ModelSource, path: Path, stack: ExitStack) -> tuple[ModelSource, ModelSource]:
        from automodel_ckpt.export.gguf_side import gguf_beside

        return gguf_beside(model, path, stack)


TARGET = GGUFTarget()
