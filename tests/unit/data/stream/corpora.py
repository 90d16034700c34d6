"""Small corpora written for the streaming tests, and a character tokenizer that needs no files."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


class CharTokenizer:
    """Each character is a token (its code point + 3); BOS 1 first, EOS 2 last."""

    bos_token_id = 1
    eos_token_id = 2

    def __call__(self, texts, add_special_tokens=True, **kwargs):
        head = [1] if add_special_tokens else []
        return {"input_ids": [head + [ord(c) + 3 for c in t] for t in texts]}


def document(f: int, r: int) -> str:
    return f"file {f} row {r} " + "xy" * ((f * 7 + r) % 11)


def jsonl_files(root: Path, files: int = 6, rows: int = 20, gz: bool = False) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        lines = "".join(json.dumps({"text": document(f, r)}) + "\n" for r in range(rows + f))
        if gz:
            with gzip.open(root / f"part-{f:02d}.jsonl.gz", "wt") as out:
                out.write(lines)
        else:
            (root / f"part-{f:02d}.jsonl").write_text(lines)
    return root


def text_files(root: Path, files: int = 3, rows: int = 15) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        (root / f"part-{f}.txt").write_text("".join(document(100 + f, r) + "\n" for r in range(rows)))
    return root


def parquet_files(root: Path, files: int = 3, rows: int = 25, row_group: int = 7) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        table = pa.table({"text": [document(200 + f, r) for r in range(rows)]})
        pq.write_table(table, root / f"part-{f}.parquet", row_group_size=row_group)
    return root


def arrow_files(root: Path, files: int = 2, rows: int = 20, batch: int = 6) -> Path:
    """Arrow IPC stream files (as the Hugging Face datasets cache writes them), record batches of ``batch`` rows."""
    root.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        table = pa.table({"text": [document(300 + f, r) for r in range(rows)]})
        with pa.OSFile(str(root / f"data-{f}.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            for b in table.to_batches(max_chunksize=batch):
                w.write_batch(b)
    return root
