"""`export --to gguf`: a model written as one GGUF file for llama.cpp, streamed tensor by tensor.

The ``gguf`` library (llama.cpp's own) writes the header and quantizes (``q8_0``, ``q4_0``; float types are torch's
casts, which round as ``gguf.quants`` does and use every core). The plan (``--dry-run`` prints it) fixes every
tensor's GGUF name, shape and storage type; then each tensor is read, converted, appended and dropped, so memory is
bounded by the largest tensor times the threads converting ahead, never the model. The file is written beside
``out`` and renamed into place once complete and fsynced.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import struct
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from automodel_ckpt.ondisk import fsync_dir, tmp_sibling
from automodel_ckpt.export.gguf_arch import GGUFFamily, OutputTensor, add_hparams, family_for, output_tensors
from automodel_ckpt.export.gguf_read import GGUF_SUFFIX
from automodel_ckpt.export.model_source import ModelSource
from automodel_ckpt.errors import CheckpointError, UserError, first_line
from automodel_ckpt.sizes import human_size

logger = logging.getLogger(__name__)

#: ``--type`` -> (the storage type of the model's matrices, llama.cpp's file type).
GGUF_TYPES = {"bf16": ("BF16", "MOSTLY_BF16"), "f16": ("F16", "MOSTLY_F16"), "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
              "q4_0": ("Q4_0", "MOSTLY_Q4_0")}


@dataclass
class GGUFPlan:
    """What the GGUF file holds: the family, every tensor with its storage type, and the bytes of tensor data."""

    family: GGUFFamily
    model_type: str
    tensors: list[tuple[OutputTensor, Any]]  # (tensor, gguf.GGMLQuantizationType)
    type_name: str

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(t.shape, q) for t, q in self.tensors)

    def describe(self, source: ModelSource) -> str:
        from collections import Counter

        counts = Counter(q.name for _, q in self.tensors)
        kinds = ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))
        return (f"GGUF {self.type_name} of a {self.model_type} model (llama.cpp architecture "
                f"{self.family.arch.lower()}): {len(self.tensors)} tensors ({kinds}), {human_size(self.nbytes)} of "
                f"tensor data from {human_size(source.nbytes)} read")


def plan_gguf(source: ModelSource, type_name: str) -> GGUFPlan:
    """The plan for ``source`` at ``type_name`` (one of ``GGUF_TYPES``); refuses an unknown family or type first."""
    import gguf

    if type_name not in GGUF_TYPES:
        raise UserError(f"unknown GGUF type '{type_name}'; use one of {', '.join(GGUF_TYPES)}")
    with _config_values():
        family = family_for(source.config)
    wanted = getattr(gguf.GGMLQuantizationType, GGUF_TYPES[type_name][0])
    tensors = output_tensors(family, source.config, source.shapes)
    return GGUFPlan(family, str(source.config.get("model_type")),
                    [(t, _storage_type(t, wanted)) for t in tensors], type_name)


def _storage_type(t: OutputTensor, wanted: Any) -> Any:
    """As llama.cpp's converter: norms, routers and position embeddings F32; with ``q4_0`` the embedding and output
    ``q8_0``; a row that is no whole number of blocks F16."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    if t.kind in ("norm", "router", "position"):
        return Q.F32
    if wanted == Q.Q4_0 and t.kind in ("embedding", "output"):
        wanted = Q.Q8_0
    block, _ = GGML_QUANT_SIZES[wanted]
    if t.shape[-1] % block:
        return Q.F16
    return wanted


def _nbytes(shape: tuple[int, ...], qtype: Any) -> int:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    return math.prod(shape[:-1]) * (shape[-1] // block) * size


def write_gguf(source: ModelSource, plan: GGUFPlan, out: Path, *, progress: bool = True,
               num_threads: int = 1, lineage: str | None = None) -> dict[str, Any]:
    """Write ``plan`` of ``source`` to ``out``; returns what was written (bytes, seconds, tokenizer model).
    ``num_threads`` tensors are converted ahead of the one being written (NumPy and torch release the GIL);
    ``lineage``: the export's lineage record (JSON text), written as the ``automodel_ckpt.lineage`` key."""
    import gguf
    from gguf.quants import quant_shape_to_byte_shape

    from automodel_ckpt.export.gguf_vocab import add_vocab
    from automodel_ckpt.export.plan import progress_bar

    out = Path(out)
    if out.is_dir():
        raise UserError(f"--out '{out}' is a folder; give the GGUF file's name (e.g. model{GGUF_SUFFIX})")
    start = time.perf_counter()
    try:
        with gguf_file(out, gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, plan.family.arch)]) as writer:
            _metadata(writer, source, plan)
            if lineage is not None:
                writer.add_string("automodel_ckpt.lineage", lineage)
            vocab_rows = _vocab_rows(plan)
            tokenizer_model = add_vocab(writer, source.side_dir, vocab_rows, plan.family.required_tokens)
            for t, qtype in plan.tensors:
                writer.add_tensor_info(t.name, tuple(quant_shape_to_byte_shape(t.shape, qtype)), np.dtype(np.uint8),
                                       _nbytes(t.shape, qtype), raw_dtype=qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            with progress_bar(plan.nbytes, progress, "writing GGUF") as advance, \
                    ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="gguf") as pool:
                waiting = iter(plan.tensors)
                ahead: deque[Future[np.ndarray]] = deque()
                for t, qtype in islice(waiting, max(1, num_threads)):
                    ahead.append(pool.submit(_encode, t, qtype, source))
                while ahead:
                    data = ahead.popleft().result()  # in the plan's order, as the tensor table lists them
                    following = next(waiting, None)
                    if following is not None:
                        ahead.append(pool.submit(_encode, *following, source))
                    writer.write_tensor_data(data)
                    advance(data.nbytes)
                    del data
    except OSError as exc:
        raise CheckpointError(f"GGUF export to '{out}' failed: {exc.strerror or exc}"
                              + (f" ({exc.filename})" if exc.filename else "")) from None
    seconds = time.perf_counter() - start
    logger.info("GGUF written to %s: %s in %.1f s", out, human_size(out.stat().st_size), seconds)
    return {"bytes": out.stat().st_size, "seconds": seconds, "tokenizer": tokenizer_model, "read_bytes": source.nbytes}


@contextmanager
def gguf_file(out: Path, arch_name: str) -> Iterator[Any]:
    """A ``GGUFWriter`` (empty arrays allowed) into a hidden file beside ``out``, fsynced and renamed into place when
    the block ends, removed when it fails."""
    tmp = tmp_sibling(out, secrets.token_hex(4))
    writer = _writer_class()(tmp, arch_name)
    try:
        yield writer
        writer.flush()
        os.fsync(writer.fout[0].fileno())
        writer.close()
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise


def _writer_class() -> type:
    """``gguf.GGUFWriter`` that also writes an empty array (the GGUF format allows one; the library refuses it, and
    llama.cpp requires ``tokenizer.ggml.merges`` even for a vocabulary without merges). Encoded with the library's
    own packing: the element type and a count of zero."""
    import gguf

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val: Any, vtype: Any, add_vtype: bool, sub_type: Any = None) -> bytes:
            if vtype == gguf.GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
                head = self._pack("I", vtype) if add_vtype else b""
                return head + self._pack("I", sub_type) + self._pack("Q", 0)
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return Writer


def _metadata(writer: Any, source: ModelSource, plan: GGUFPlan) -> None:
    import gguf

    config = source.config
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"{plan.model_type} {source.name}".strip())  # never the bare "mistral" transformers misreads
    with _config_values():
        add_hparams(writer, plan.family, config)
    writer.add_file_type(getattr(gguf.LlamaFileType, GGUF_TYPES[plan.type_name][1]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


@contextmanager
def _config_values() -> Iterator[None]:
    """A value of the source's ``config.json`` that is missing or of the wrong type, met while the GGUF's
    hyperparameters are read from it: one line instead of a traceback."""
    try:
        yield
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, struct.error) as exc:
        what = f"the key {exc}" if isinstance(exc, KeyError) else first_line(exc) or type(exc).__name__
        raise CheckpointError(f"GGUF export: config.json is not what this family's config holds ({what[:200]})") \
            from None


def _vocab_rows(plan: GGUFPlan) -> int:
    embd = next((t for t, _ in plan.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise CheckpointError("the model has no token embedding (model.embed_tokens / wte); it cannot be exported")
    return embd.shape[0]


def _encode(t: OutputTensor, qtype: Any, source: ModelSource) -> np.ndarray:
    """One GGUF tensor's bytes: its sources read, transformed, converted; only this tensor is in memory."""
    from gguf.quants import quantize

    parts = [source.read(name) for name in t.sources]
    value = t.make(parts)
    del parts
    if tuple(value.shape) != t.shape:
        raise CheckpointError(f"tensor {t.name} came out with shape {tuple(value.shape)}, planned {t.shape}")
    plain = _PLAIN_TYPES.get(qtype.name)
    if plain is not None:  # a float type: torch's cast (round to nearest even, as gguf.quants does), threaded
        return value.to(plain).contiguous().reshape(-1).view(torch.uint8).numpy()
    array = value.to(torch.float32).contiguous().numpy()
    del value
    data = quantize(array, qtype)
    return np.ascontiguousarray(data).view(np.uint8).reshape(-1)


_PLAIN_TYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
