"""Node-local inventory: what a folder holds (checked against each step's manifest), which step a resume takes,
and which rank sends which files to complete every node's folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

from automodel_ckpt.ondisk import manifest
from automodel_ckpt.ondisk.checksum import default_algorithm, hash_file
from automodel_ckpt.checkpoint.storage.nodelocal.inventory import (Inventory, StepFiles, Transfer, choose, fill_plan,
                                                                   receives_from, scan, sends)
from automodel_ckpt.checkpoint.storage.nodelocal.inventory import manifest_digest

PARTS = {"metadata.json": b"{}", "model/shard-0.safetensors": b"a" * 40, "model/shard-1.safetensors": b"b" * 30,
         "optim/__0_0.distcp": b"c" * 20, "optim/__1_0.distcp": b"d" * 10}


def write_step(folder: Path, name: str, parts: dict[str, bytes], present: list[str] | None = None) -> Path:
    """A local step folder whose manifest lists ``parts``; only ``present`` (default: all) are written."""
    step = folder / name
    step.mkdir(parents=True)
    for rel, data in parts.items():
        (step / rel).parent.mkdir(parents=True, exist_ok=True)
        (step / rel).write_bytes(data)
    algorithm = default_algorithm()
    sums = {rel: hash_file(step / rel, algorithm)[1] for rel in parts}
    manifest.write(step, manifest.build_manifest(step, {rel: len(d) for rel, d in parts.items()}, sums, algorithm))
    for rel in set(parts) - set(parts if present is None else present):
        (step / rel).unlink()
    return step


def test_scan_lists_the_files_that_match_each_steps_manifest(tmp_path):
    write_step(tmp_path, "epoch_0_step_4", PARTS)
    step6 = write_step(tmp_path, "epoch_0_step_6", PARTS, present=["metadata.json", "model/shard-0.safetensors",
                                                                    "optim/__0_0.distcp"])
    (step6 / "optim/__0_0.distcp").write_bytes(b"X" * 20)  # same size, other bytes: only a checksum sees it
    write_step(tmp_path, ".staging-epoch_0_step_8", PARTS)
    write_step(tmp_path / "quarantine", "epoch_0_step_2", PARTS)
    (tmp_path / "epoch_0_step_10").mkdir()  # a save that never finished: no manifest
    os.symlink(tmp_path / "epoch_0_step_4", tmp_path / "epoch_0_step_12")

    inv = scan(tmp_path)
    assert sorted(inv.steps) == ["epoch_0_step_4", "epoch_0_step_6"]
    assert inv.steps["epoch_0_step_4"].present == {rel: len(d) for rel, d in PARTS.items()}
    six = inv.steps["epoch_0_step_6"]
    assert (six.epoch, six.step) == (0, 6) and set(six.listed) == set(PARTS)
    assert sorted(six.present) == ["metadata.json", "model/shard-0.safetensors"]
    assert len(six.problems) == 1 and "optim/__0_0.distcp: checksum mismatch" in six.problems[0]
    assert any(s.startswith("epoch_0_step_10: no manifest.json") for s in inv.skipped)
    assert any(s.startswith("epoch_0_step_12: a symlink") for s in inv.skipped)
    assert six.digest == inv.steps["epoch_0_step_4"].digest  # same content, same digest
    assert "optim/__0_0.distcp" in scan(tmp_path, checksums=False).steps["epoch_0_step_6"].present


def test_scan_can_leave_the_data_files_checksums_to_the_load(tmp_path):
    """With ``leave``, the files it names are checked by size only (the load hashes them as it reads them); the
    others still by checksum."""
    from automodel_ckpt.ondisk.loadcheck import deferred

    step = write_step(tmp_path, "epoch_0_step_6", PARTS)
    (step / "optim/__0_0.distcp").write_bytes(b"X" * 20)  # a data file: same size, other bytes
    (step / "metadata.json").write_bytes(b"[]")  # a small file: same size, other bytes
    six = scan(tmp_path, leave=deferred).steps["epoch_0_step_6"]
    assert sorted(six.present) == ["model/shard-0.safetensors", "model/shard-1.safetensors", "optim/__0_0.distcp",
                                   "optim/__1_0.distcp"]
    assert len(six.problems) == 1 and "metadata.json: checksum mismatch" in six.problems[0]
    assert "optim/__0_0.distcp" not in scan(tmp_path).steps["epoch_0_step_6"].present


def test_the_digest_is_of_the_manifests_content_not_its_formatting(tmp_path):
    a, b = write_step(tmp_path / "a", "epoch_0_step_1", PARTS), write_step(tmp_path / "b", "epoch_0_step_1", PARTS)
    content = manifest.read_manifest(b)
    (b / "manifest.json").write_text(json.dumps(content, indent=7), encoding="utf-8")
    assert scan(tmp_path / "a").steps["epoch_0_step_1"].digest == scan(tmp_path / "b").steps["epoch_0_step_1"].digest
    content["files"]["metadata.json"]["checksum"] = "0"
    assert manifest_digest(content) != manifest_digest(manifest.read_manifest(a))


# --- choose and fill_plan: pure functions of gathered inventories ----------------------------------------------

SIZES = {"metadata.json": 2, "model/r0": 40, "model/r1": 30, "model/r2": 20, "model/r3": 10}


def held(name: str, present: list[str], digest: str = "d", listed: dict[str, int] | None = None) -> StepFiles:
    _, epoch, _, step = name.split("_")
    listed = SIZES if listed is None else listed
    return StepFiles(name, int(epoch), int(step), digest, dict(listed), {r: listed[r] for r in present})


def inv(folder: str, *steps: StepFiles, host: str = "h") -> Inventory:
    return Inventory(host, folder, {s.name: s for s in steps})


def test_choose_takes_the_newest_step_whose_every_file_checks_out_somewhere():
    node0 = ["metadata.json", "model/r0", "model/r1", "model/r3"]  # its own parts and a copy of r3
    node1 = ["metadata.json", "model/r2", "model/r3", "model/r1"]  # its own parts and a copy of r1
    invs = {0: inv("n0", held("epoch_0_step_4", node0), held("epoch_0_step_6", node0)),
            1: inv("n1", held("epoch_0_step_4", node1), held("epoch_0_step_6", node1[:2])),
            2: inv("n2", held("epoch_0_step_4", ["model/r0"]), held("epoch_0_step_8", list(SIZES), digest="x")),
            3: inv("n3", held("epoch_0_step_8", list(SIZES), digest="y"))}
    skipped: list[str] = []
    chosen = choose(invs, skipped)
    assert chosen is not None and chosen.name == "epoch_0_step_6" and chosen.files == SIZES
    assert skipped == ["local step epoch_0_step_8: its manifest differs between nodes"]
    invs[0] = inv("n0", held("epoch_0_step_4", node0), held("epoch_0_step_6", node0[:3]))  # r3 now nowhere
    skipped.clear()
    assert choose(invs, skipped).name == "epoch_0_step_4"
    assert skipped[1] == "local step epoch_0_step_6: 'model/r3' checks out on no node"
    assert choose({0: inv("n0", held("epoch_0_step_4", ["model/r0"]))}) is None
    assert choose({}) is None


def test_choose_orders_by_step_then_epoch():
    invs = {0: inv("n0", held("epoch_1_step_4", list(SIZES)), held("epoch_0_step_6", list(SIZES)),
                   held("epoch_2_step_6", list(SIZES)))}
    assert choose(invs).name == "epoch_2_step_6"


def test_fill_plan_completes_every_folder_from_the_nearest_least_busy_holders():
    everything = list(SIZES)
    # Two nodes of two ranks; node 1's folder lost rank 0's part; node 2 (ranks 4, 5) is a new, empty node.
    step = "epoch_0_step_6"
    invs = {0: inv("n0", held(step, everything)), 1: inv("n0", held(step, everything)),
            2: inv("n1", held(step, [r for r in everything if r != "model/r0"])),
            3: inv("n1", held(step, [r for r in everything if r != "model/r0"])),
            4: inv("n2", host="other"), 5: inv("n2", host="other")}
    chosen = choose(invs)
    plan = fill_plan(invs, chosen)
    got: dict[str, set[str]] = {"n0": set(everything), "n1": set(everything) - {"model/r0"}, "n2": set()}
    sent = {r: 0 for r in invs}
    for t in plan:
        assert t.sender in (0, 1, 2, 3) and invs[t.sender].steps.get(step) is not None
        folder = invs[t.receiver].folder_id
        assert not got[folder] & set(t.files)  # nothing a folder has, nothing twice
        got[folder] |= set(t.files)
        sent[t.sender] += sum(SIZES.get(f, 0) for f in t.files)
    assert got["n0"] == got["n1"] == set(everything) and got["n2"] == set(everything) | {"manifest.json"}
    assert [t.files for t in plan if t.receiver in (2, 3)] == [("model/r0",)]  # node 1 gets only what it lacks
    assert max(sent.values()) - min(v for r, v in sent.items() if r < 4) <= 40  # spread over the holders
    assert {t.receiver for t in plan if invs[t.receiver].folder_id == "n2"} == {4, 5}  # both new ranks receive
    assert sends(plan, 0) == {t.receiver: list(t.files) for t in plan if t.sender == 0}
    assert receives_from(plan, 4) == [t.sender for t in plan if t.receiver == 4]


def test_fill_plan_prefers_a_sender_on_the_receivers_host():
    step = "epoch_0_step_2"
    invs = {0: inv("a", held(step, list(SIZES)), host="h1"), 1: inv("b", held(step, list(SIZES)), host="h2"),
            2: inv("c", held(step, [r for r in SIZES if r != "model/r2"]), host="h2")}
    assert fill_plan(invs, choose(invs)) == [Transfer(1, 2, ("model/r2",))]
    invs[1] = inv("b", held(step, ["model/r0"]), host="h2")  # only another host has r2; rank 2 beside has the rest
    assert fill_plan(invs, choose(invs)) == [Transfer(0, 1, ("model/r2",)), Transfer(0, 2, ("model/r2",)),
                                             Transfer(2, 1, ("metadata.json", "model/r1", "model/r3"))]


def test_a_complete_set_of_folders_needs_no_transfer():
    step = "epoch_0_step_2"
    invs = {r: inv(f"n{r}", held(step, list(SIZES))) for r in range(3)}
    assert fill_plan(invs, choose(invs)) == []
