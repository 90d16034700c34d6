"""Counts and sizes read from an export folder, a GGUF file or a cost log bound nothing before they are checked.

An export folder's ``config.json`` layer and head counts and its ``tokenizer.json`` token ids are checked against
the tensors its weight files hold before a GGUF is planned or written (``--dry-run`` included); a GGUF file's
metadata arrays are skipped over within caps checked against the file's size, never read whole, by `inspect`,
`verify` and `pack`; `inspect --cost` streams ``events.jsonl``, whatever its size, its line lengths or the types of
its fields. Each case runs in the corpus's limited child processes: one ``error:`` line and a non-zero exit (or a
report, for well-formed records of the wrong types), no traceback, peak memory within 150 MiB of an idle child's,
nothing touched outside the case (``Case.verb``).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.hostile.harness import lean, refused, succeeded

BIG = 200 * 2**20
EXPORT = "run/epoch_0_step_1/model/consolidated"


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _layers(n):
    return lambda config: config.update(num_hidden_layers=n)


def _heads(config):
    config["num_attention_heads"] = 3  # divides no projection of the model into heads


def _added_token_id(tokenizer):
    tokenizer["added_tokens"].append({"id": 10**12, "content": "<far>", "special": True})


def _vocab_id(tokenizer):
    tokenizer["model"]["vocab"]["zz"] = "7"


CONFIG_CASES = {"a trillion layers": _layers(10**12), "a layer count that is a string": _layers("4"),
                "heads that divide nothing": _heads}
TOKENIZER_CASES = {"a token id of 10**12": _added_token_id, "a token id that is a string": _vocab_id}


@pytest.mark.parametrize("label", CONFIG_CASES)
def test_gguf_export_checks_config_counts_against_the_tensors(make_case, server, label):
    case = make_case()
    _edit(case.work / EXPORT / "config.json", CONFIG_CASES[label])
    for extra in (["--dry-run"], []):
        outcome = case.verb("export", EXPORT, "--to", "gguf", "--out", "out.gguf", "--no-progress", *extra)
        refused(outcome, "config.json")
        lean(outcome, server.rss)
    assert not (case.work / "out.gguf").exists()


@pytest.mark.parametrize("label", TOKENIZER_CASES)
def test_gguf_export_checks_token_ids_against_the_embedding(make_case, server, label):
    case = make_case()
    _edit(case.work / EXPORT / "tokenizer.json", TOKENIZER_CASES[label])
    outcome = case.verb("export", EXPORT, "--to", "gguf", "--out", "out.gguf", "--no-progress")
    refused(outcome, "tokenizer.json", "token id")
    lean(outcome, server.rss)
    assert not (case.work / "out.gguf").exists()


# --- GGUF metadata arrays ------------------------------------------------------------------------------------------


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def _array(item_type: int, count: int) -> bytes:
    return struct.pack("<IIQ", 9, item_type, count)  # value type ARRAY, item type, count


def _nested(depth: int) -> bytes:
    value = struct.pack("<I", 9)
    for _ in range(depth):
        value += struct.pack("<IQ", 9, 1)  # an array holding one array
    return value + struct.pack("<IQ", 0, 0)


GGUF_CASES = {
    "a string array of 2**40 items": (_key("tokenizer.ggml.tokens") + _array(8, 2**40), "runs past the end"),
    "a byte array of 150 million items": (_key("tokenizer.ggml.scores") + _array(0, 150 * 10**6), "an array of"),
    "arrays nested 6 deep": (_key("general.nested") + _nested(6), "nested"),
    "a tensor of 2**31 dimensions": (_key("general.name") + struct.pack("<IQ", 8, 1) + b"x" + _key("t")
                                     + struct.pack("<I", 2**31), "dimensions"),
}


@pytest.mark.parametrize("label", GGUF_CASES)
def test_gguf_metadata_arrays_are_bounded_by_the_file(make_case, server, label):
    body, expected = GGUF_CASES[label]
    case = make_case(None)
    path = case.work / "model.gguf"
    with open(path, "wb") as f:
        f.write(struct.pack("<4sIQQ", b"GGUF", 3, 1 if "tensor" in label else 0, 1) + body)
        f.truncate(BIG)  # sparse: a reader that trusted the counts would walk or allocate it all
    for verb in (["inspect"], ["verify"], ["pack", "--out", "out.tar"]):
        outcome = case.verb(verb[0], path, *verb[1:])
        refused(outcome, expected)
        lean(outcome, server.rss)
    assert not (case.work / "out.tar").exists()


# --- the cost log ------------------------------------------------------------------------------------------------


def _many_records(path: Path) -> None:
    """200,000 records as a run writes them (some 40 MB): a reader that held them all would take some 300 MB."""
    lines = [json.dumps({"event": "checkpoint", "time": 10.0 + i, "step": i, "at_step": i, "name": f"epoch_0_step_{i}",
                         "blocked_s": 0.5, "fence_s": 0.0, "background_s": 1.0, "bytes": 1000,
                         "write_gbps": 1.0 + i % 7, "wall_share": 0.01, "preemption": False}) + "\n"
             for i in range(10_000)]
    chunk = ("".join(lines)).encode()
    with open(path, "ab") as f:
        for _ in range(20):
            f.write(chunk)


def _one_long_line(path: Path) -> None:
    with open(path, "ab") as f:
        f.truncate(f.tell() + BIG)  # 200 MB without a newline


def _wrong_types(path: Path) -> None:
    odd = [{"event": "checkpoint", "time": "noon", "step": "3", "blocked_s": "x", "bytes": [1], "write_gbps": {}},
           {"event": "checkpoint", "time": 1e308, "step": 2**70, "blocked_s": float("nan"), "bytes": float("inf")},
           {"event": "start", "time": None, "step": True, "every_steps": "10"}, [1, 2], "text", 7,
           {"event": "tracking_behind", "time": 5.0, "backend": ["a"] * 10}]
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in odd))


COST_CASES = {"200,000 records": _many_records, "one line of 200 MB": _one_long_line,
              "fields of the wrong types": _wrong_types}


@pytest.mark.parametrize("label", COST_CASES)
def test_inspect_cost_streams_the_events_log(make_case, server, label):
    case = make_case()
    COST_CASES[label](case.run_dir / "events.jsonl")
    outcome = case.verb("inspect", "run", "--cost", "--json")
    succeeded(outcome)
    lean(outcome, server.rss)
    report = json.loads(outcome.stdout)
    assert report["launches"] >= 1
    if label == "200,000 records":
        assert report["checkpoints"] >= 200_000 and report["write_gbps"] == pytest.approx(4.0)


def test_int8_calibration_builds_no_model_larger_than_its_files(make_case, server):
    """``--calibrate`` runs the model: a ``config.json`` describing a far larger one is refused before it is built."""
    case = make_case()
    _edit(case.work / EXPORT / "config.json", lambda c: c.update(hidden_size=2**16, intermediate_size=2**18))
    argv = ["export", EXPORT, "--to", "int8", "--calibrate", "2", "--out", "out-int8", "--no-progress"]
    succeeded(planned := case.verb(*argv, "--dry-run"))  # the plan runs nothing
    outcome = case.verb(*argv)
    refused(outcome, "config.json", "parameters")
    for done in (planned, outcome):
        lean(done, server.rss)
    assert not (case.work / "out-int8").exists()
