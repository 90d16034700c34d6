"""SIGKILL fault test: kill a 2-process training job at random moments, rerun it, and check nothing is lost.

Each round starts ``ckpt-train --nproc-per-node 2`` (a checkpoint at every step) in a new session and SIGKILLs
the whole job: the launcher's process group and every process below it (torch's elastic agent starts each
worker in a session of its own, so the group alone would miss them). The moment is drawn from a seeded RNG:

* ``during_save`` (2 rounds in 3): wait until the job starts its k-th save (k in 1..3; rank 0 prints "Saving
  checkpoint to ..." as it reserves the ``.staging-*`` folder), then kill after 0-400 ms, so the kill lands
  inside the save (a save takes about 0.5 s here) or just after its publish;
* ``anytime``: kill after a delay drawn over the whole run, startup and restore included.

Rounds take turns among three ways of saving (``SAVE_MODES``), all resuming from the same checkpoint_dir:
``sync``; ``async`` (``checkpoint.is_async``: a kill can land in the background writes); ``export``
(``save_consolidated: every``: a kill can land in the inline Hugging Face export).

After every kill: no complete checkpoint was lost, every complete checkpoint still matches its manifest (no file
missing, changed or unexpected), LATEST is absent or designates a complete checkpoint, and the next run resumes
from the newest complete one. After a run that completes, nothing is leaked: no staging, deleting or export
temporary folder is left in the checkpoint_dir (``leaked_bytes`` counts what would be).
Runs that are not killed must succeed. When a run completes training, its losses in training.jsonl must equal
an uninterrupted run's bit for bit, and a fresh checkpoint_dir starts the next trial.

``KILL_COUNT`` kills are delivered (default 3; the ``storm`` variant, marked slow, at least 20), ``KILL_SEED`` picks the moments.
The results (kills, resumes, failures) are written to ``kill_fault_results.json`` in the test's tmp dir (and to
``KILL_RESULTS_JSON`` if set) and printed.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import time
from pathlib import Path

import pytest

from automodel_ckpt.ondisk import catalog, layout, manifest
from automodel_ckpt.ondisk.durable import read_pointer
from tests.integration.harness import CKPT_TRAIN, QUIET, RECIPE, env_for, kill_job, losses, start_command

MAX_STEPS = 12
ARGS = ("--step_scheduler.max_steps", str(MAX_STEPS), "--step_scheduler.ckpt_every_steps", "1",
        "--data.val_size", "64")
SAVE_MODES = {
    "sync": ("--checkpoint.save_consolidated", "false"),
    "async": ("--checkpoint.save_consolidated", "false", "--checkpoint.is_async", "true"),
    "export": ("--checkpoint.save_consolidated", "every"),
}
RUN_TIMEOUT = 600
_LOADING = re.compile(r"Loading checkpoint from (\S+)")


STORM_KILLS = 20  # the slow variant (RUN_SLOW=1)


def kill_count(at_least: int = 0) -> int:
    return max(int(os.environ.get("KILL_COUNT", 3)), at_least)


def start_job(cwd: Path, assets: Path, ckpt_dir: str, log: Path, mode: str = "sync") -> subprocess.Popen:
    cmd = [CKPT_TRAIN, "--nproc-per-node", "2", str(RECIPE), *QUIET, *ARGS, *SAVE_MODES[mode],
           "--checkpoint.checkpoint_dir", ckpt_dir]
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        return start_command(cmd, cwd=cwd, env=env_for(assets), stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)


def saves_in_progress(ckpt_dir: Path, since: float) -> list[str]:
    """``.staging-*`` folders created after ``since`` (wall clock): saves this job had started, not leftovers."""
    out = []
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return out
    for name in names:
        try:
            if layout.is_staging(name) and os.stat(ckpt_dir / name).st_ctime >= since:
                out.append(name)
        except FileNotFoundError:
            continue
    return sorted(out)


# --- one round -----------------------------------------------------------------------------------------------


def run_round(cwd: Path, assets: Path, ckpt_dir: str, log: Path, plan: dict | None, mode: str = "sync") -> dict:
    """Run the job once, saving the ``mode`` way; kill it as ``plan`` says (None: let it finish)."""
    root = cwd / ckpt_dir
    started, started_wall = time.monotonic(), time.time()
    proc = start_job(cwd, assets, ckpt_dir, log, mode)
    kill_at = started + plan["delay_s"] if plan and plan["mode"] == "anytime" else None
    outcome: dict = {"killed": False}
    while proc.poll() is None:
        now = time.monotonic()
        if now - started > RUN_TIMEOUT:
            kill_job(proc)
            return {"killed": False, "returncode": "timeout", "wall_s": round(now - started, 2)}
        if plan and plan["mode"] == "during_save" and kill_at is None:
            # rank 0 prints this line just before it reserves the .staging-* folder
            if log.read_text(errors="replace").count("Saving checkpoint to") >= plan["nth_save"]:
                kill_at = now + plan["delay_s"]
        if kill_at is not None and now >= kill_at:
            in_save = saves_in_progress(root, started_wall)
            n = kill_job(proc)
            outcome = {"killed": True, "processes_killed": n, "during_save": bool(in_save), "staging": in_save}
            break
        time.sleep(0.002)
    proc.wait()
    outcome["returncode"] = proc.returncode
    outcome["wall_s"] = round(time.monotonic() - started, 2)
    text = log.read_text(errors="replace")
    loaded = _LOADING.search(text)
    outcome["loaded"] = Path(loaded.group(1)).name if loaded else None
    outcome["saves_started"] = text.count("Saving checkpoint to")
    outcome["tail"] = text[-1500:] if not outcome["killed"] and proc.returncode != 0 else ""
    return outcome


def check_dir(root: Path, before: set[str]) -> tuple[set[str], list[str], dict]:
    """Invariants of a checkpoint_dir after a kill: (complete checkpoints, failures, facts)."""
    failures = []
    complete = {r.name for r in catalog.scan_checkpoints(root)}
    lost = sorted(before - complete)
    if lost:
        failures.append(f"complete checkpoints lost: {lost}")
    for name in sorted(complete):
        report = manifest.verify_manifest(root / name)
        if not report.ok:
            failures.append(f"{name} does not match its manifest: {manifest.summarize(report)}")
    latest = read_pointer(root, layout.LATEST)
    if latest is not None and latest not in complete:
        failures.append(f"LATEST points to '{latest}', not a complete checkpoint")
    if latest is None and complete:
        pass  # killed between the first publish and the first pointer swap: resume picks the newest
    newest = catalog.latest_checkpoint(root)
    facts = {"complete": len(complete), "latest": latest, "newest": newest.name if newest else None,
             "latest_lags": bool(newest is not None and latest != newest.name)}
    return complete, failures, facts


def leaked(root: Path) -> tuple[list[str], int]:
    """Hidden leftovers in a checkpoint_dir (staging, deleting, export temporaries) and their bytes."""
    names, nbytes = [], 0
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        if entry.name.startswith("."):
            names.append(entry.name)
            nbytes += sum(f.stat().st_size for f in entry.rglob("*") if f.is_file()) if entry.is_dir() else \
                entry.stat().st_size
    return names, nbytes


# --- the test ------------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("at_least", [0, pytest.param(STORM_KILLS, marks=pytest.mark.slow, id="storm")])
def test_sigkill_at_random_moments_loses_nothing(tmp_path, assets, at_least):
    count = kill_count(at_least)
    seed = int(os.environ.get("KILL_SEED", "1234"))
    rng = random.Random(seed)
    logs = tmp_path / "logs"
    logs.mkdir()
    t0 = time.monotonic()

    reference = run_round(tmp_path, assets, "reference", logs / "reference.log", None)
    assert reference["returncode"] == 0, reference["tail"]
    expected = losses(tmp_path / "reference")
    assert len(expected) == MAX_STEPS
    run_s = reference["wall_s"]

    results: dict = {"seed": seed, "kill_count": count, "max_steps": MAX_STEPS, "reference_wall_s": run_s,
                     "kills": 0, "kills_during_save": 0, "resumes": 0, "resumes_from_newest": 0, "fresh_starts": 0,
                     "latest_lagged": 0, "trials_completed": 0, "trials_bitwise_equal": 0, "leaked_bytes": 0,
                     "kills_by_mode": {m: 0 for m in SAVE_MODES}, "failures": [], "rounds": []}
    modes = list(SAVE_MODES)
    trial, complete, rnd = 0, set(), 0
    ckpt_dir = f"trial_{trial}"
    while True:
        rnd += 1
        root = tmp_path / ckpt_dir
        newest = catalog.latest_checkpoint(root)
        expect_from = newest.name if newest else None
        if results["kills"] < count:
            if rng.random() < 2 / 3:
                plan = {"mode": "during_save", "nth_save": rng.randint(1, 3), "delay_s": round(rng.uniform(0, 0.4), 3)}
            else:
                plan = {"mode": "anytime", "delay_s": round(rng.uniform(0.2, run_s), 3)}
        else:
            plan = None
        mode = modes[results["kills"] % len(modes)]  # the next way of saving once a kill has landed in this one
        out = run_round(tmp_path, assets, ckpt_dir, logs / f"round_{rnd:03d}.log", plan, mode)
        record = {"round": rnd, "trial": trial, "mode": mode, "plan": plan, "expected_resume": expect_from,
                  **{k: v for k, v in out.items() if k != "tail"}}
        # resume: from the newest complete checkpoint, whenever the run got that far
        if out["loaded"] is not None:
            results["resumes"] += 1
            if out["loaded"] == expect_from:
                results["resumes_from_newest"] += 1
            else:
                results["failures"].append(f"round {rnd}: resumed from {out['loaded']}, newest was {expect_from}")
        elif expect_from is not None and out["saves_started"] > 0:
            results["failures"].append(f"round {rnd}: started fresh although {expect_from} was complete")
        elif expect_from is None and out["saves_started"] > 0:
            results["fresh_starts"] += 1
        if out["killed"]:
            results["kills"] += 1
            results["kills_by_mode"][mode] += 1
            results["kills_during_save"] += int(out["during_save"])
            complete, failures, facts = check_dir(root, complete)
            results["latest_lagged"] += int(facts["latest_lags"])
            results["failures"] += [f"round {rnd}: {f}" for f in failures]
            record.update(facts)
        elif out["returncode"] != 0:
            results["failures"].append(f"round {rnd}: run failed ({out['returncode']}): {out['tail'][-600:]}")
            results["rounds"].append(record)
            break
        else:  # the job finished training
            results["trials_completed"] += 1
            got = losses(root)
            equal = got == expected
            results["trials_bitwise_equal"] += int(equal)
            record["losses_equal"] = equal
            if not equal:
                results["failures"].append(f"trial {trial}: losses differ from the uninterrupted run: "
                                           f"{got} != {expected}")
            _, failures, _ = check_dir(root, complete)
            results["failures"] += [f"trial {trial} final: {f}" for f in failures]
            names, nbytes = leaked(root)
            results["leaked_bytes"] += nbytes
            if names:
                results["failures"].append(f"trial {trial}: left behind {names} ({nbytes} bytes)")
            if results["kills"] >= count:
                results["rounds"].append(record)
                break
            trial, complete = trial + 1, set()
            ckpt_dir = f"trial_{trial}"
        results["rounds"].append(record)
    results["wall_s"] = round(time.monotonic() - t0, 1)

    text = json.dumps(results, indent=1)
    (tmp_path / "kill_fault_results.json").write_text(text)
    if os.environ.get("KILL_RESULTS_JSON"):
        Path(os.environ["KILL_RESULTS_JSON"]).write_text(text)
    summary = {k: v for k, v in results.items() if k != "rounds"}
    print("kill-fault results:", json.dumps(summary, indent=1))
    assert results["kills"] == count
    if count >= len(SAVE_MODES):  # every way of saving was hit
        assert all(results["kills_by_mode"].values()), results["kills_by_mode"]
    assert not results["failures"], "\n".join(results["failures"])
    assert results["trials_completed"] >= 1 and results["trials_bitwise_equal"] == results["trials_completed"]
