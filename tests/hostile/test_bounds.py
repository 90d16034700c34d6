"""Bounded work: no size, count, offset, depth or length read from a folder drives memory, files or time unchecked.

Each case writes one number a file may hold (a 200 MB JSON file, a 100,000-deep JSON or YAML document, safetensors
entries that overlap, point past the end or announce a header of 2**63 bytes, a DCP ``.metadata`` pickle that asks
the restricted unpickler for 64 GiB, a metadata file asking for a billion output files or a billion ranks, an
export ``config.json`` asking for a trillion parameters) and runs every verb that reads it. The corpus guarantees,
per run: one ``error:`` line and a non-zero exit (resume: the checkpoint set aside and the genuine one loaded), no
traceback (``RecursionError`` included), no sign of the memory limit having been met, and for the big files a peak
resident memory within 150 MiB of the fork server's, so that no file was read whole before its size was checked.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path

import pytest

from tests.hostile.conftest import gauntlet, hostile_copy
from tests.hostile.harness import Outside, clean, lean, refused, refused_or_reported

BIG = 200 * 2**20
DEEP = 100_000
SHARD = "model/shard-00001-model-00001-of-00001.safetensors"


def sparse(rel: str):
    """``rel`` replaced by a sparse 200 MB file (zero bytes: no disk space, but a reader that reads it whole
    allocates it all)."""
    def tamper(checkpoint: Path, outside: Outside) -> None:
        path = checkpoint / rel
        path.unlink()
        with open(path, "wb") as f:
            f.truncate(BIG)
    return tamper


def deep(rel: str):
    def tamper(checkpoint: Path, outside: Outside) -> None:
        (checkpoint / rel).write_text("[" * DEEP + "]" * DEEP)
    return tamper


def edit_header(change):
    """Rewrite the shard's safetensors header with ``change(entries)`` applied, keeping the data area as it is."""
    def tamper(checkpoint: Path, outside: Outside) -> None:
        path = checkpoint / SHARD
        raw = path.read_bytes()
        (size,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + size])
        change({k: v for k, v in header.items() if k != "__metadata__"})
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + size:])
    return tamper


def _overlap(entries: dict) -> None:
    """Every entry of one size points at the bytes of the first: a small shard reads as many copies of one tensor."""
    by_size: dict[int, list] = {}
    for entry in entries.values():
        start, end = entry["data_offsets"]
        by_size.setdefault(end - start, []).append(entry)
    group = max(by_size.values(), key=len)
    for entry in group[1:]:
        entry["data_offsets"] = list(group[0]["data_offsets"])


def _past_the_end(entries: dict) -> None:
    entry = next(iter(entries.values()))
    start, end = entry["data_offsets"]
    entry["data_offsets"] = [start + 2**40, end + 2**40]


def huge_header_length(checkpoint: Path, outside: Outside) -> None:
    path = checkpoint / SHARD
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**63) + raw[8:])


class _Allocation:
    """Unpickles as ``bytearray(64 GiB)``: bytearray is one of the restricted unpickler's allowed globals."""

    def __reduce__(self):
        return bytearray, (64 * 2**30,)


def allocating_pickle(rel: str):
    def tamper(checkpoint: Path, outside: Outside) -> None:
        (checkpoint / rel).write_bytes(pickle.dumps(_Allocation(), protocol=2))
    return tamper


def metadata_count(rel: str, **values: object):
    def tamper(checkpoint: Path, outside: Outside) -> None:
        path = checkpoint / rel
        path.write_text(json.dumps({**json.loads(path.read_text()), **values}))
    return tamper


JSON_CASES = {"metadata.json of 200 MB": sparse("metadata.json"), "manifest.json of 200 MB": sparse("manifest.json"),
              "metadata.json 100,000 deep": deep("metadata.json"), "manifest.json 100,000 deep": deep("manifest.json")}
SHARD_CASES = {"overlapping tensors": edit_header(_overlap), "offsets past the end": edit_header(_past_the_end),
               "header length 2**63": huge_header_length}
EXPORT_CASES = {
    "config.json of 200 MB": sparse("model/.hf_metadata/config.json"),
    "original_tensors.json 100,000 deep": deep("model/.hf_metadata/original_tensors.json"),
    "a billion output files": metadata_count("model/.hf_metadata/original_tensors.json", num_files=10**9),
    "a billion ranks": metadata_count("model/.hf_metadata/saved_state.json", world_size=10**9),
    **SHARD_CASES,
}
DCP_CASES = {"model .metadata allocating 64 GiB": allocating_pickle("model/.metadata"),
             "optim .metadata allocating 64 GiB": allocating_pickle("optim/.metadata")}


@pytest.mark.parametrize("label", JSON_CASES)
def test_verify_and_inspect_read_no_json_unbounded(make_case, server, label):
    case = make_case()
    checkpoint = hostile_copy(case, 3, JSON_CASES[label])
    for outcome in (case.verb("verify", checkpoint), case.verb("inspect", "run")):
        clean(outcome)
        lean(outcome, server.rss)
    refused_or_reported(outcome := case.verb("verify", "run"))
    lean(outcome, server.rss)


@pytest.mark.parametrize("label", EXPORT_CASES)
def test_consolidate_checks_every_count_before_it_allocates(make_case, server, label):
    case = make_case()
    checkpoint = hostile_copy(case, 3, EXPORT_CASES[label])
    outcome = case.verb("consolidate", checkpoint, "--out", "export", "--no-progress")
    refused(outcome)
    lean(outcome, server.rss)
    assert not (case.work / "export").exists()


@pytest.mark.parametrize("label", DCP_CASES)
def test_the_restricted_unpickler_allocates_nothing_a_pickle_asks_for(make_case, server, label):
    case = make_case("dcp")
    checkpoint = hostile_copy(case, 3, DCP_CASES[label])
    if label.startswith("model"):
        outcome = case.verb("consolidate", checkpoint, "--out", "export", "--no-progress")
        refused(outcome)
        lean(outcome, server.rss)
    refused(case.restore_from(checkpoint))


def test_resume_sets_every_oversized_checkpoint_aside(make_case):
    gauntlet(make_case(), {**JSON_CASES, **SHARD_CASES})


def test_resume_sets_every_allocating_dcp_checkpoint_aside(make_case):
    gauntlet(make_case("dcp"), DCP_CASES)


def test_restore_from_refuses_overlapping_tensors(make_case):
    case = make_case()
    refused(case.restore_from(hostile_copy(case, 3, SHARD_CASES["overlapping tensors"])))


def test_verify_export_checks_the_parameter_count_before_building_a_model(make_case, server):
    case = make_case()
    config = case.checkpoint(1) / "model" / "consolidated" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "hidden_size": 2**16,
                                  "intermediate_size": 2**18, "num_hidden_layers": 4096, "vocab_size": 2**20}))
    outcome = case.verb("verify", "--export", case.checkpoint(1))
    refused_or_reported(outcome)
    lean(outcome, server.rss)


def test_plot_reads_no_training_log_unbounded(make_case, server):
    case = make_case()
    with open(case.run_dir / "training.jsonl", "wb") as f:
        f.truncate(BIG)
    outcome = case.verb("plot", "run", "--out", "loss.png")
    refused(outcome)
    lean(outcome, server.rss)


@pytest.mark.parametrize("verb", [(), ("preview",)])
def test_a_deeply_nested_recipe_is_one_line(make_case, verb):
    case = make_case(None)
    (case.work / "deep.yaml").write_text("seed: " + "[" * DEEP + "]" * DEEP + "\n")
    refused(case.verb(*verb, "deep.yaml"), "deep.yaml")
    os.unlink(case.work / "deep.yaml")
