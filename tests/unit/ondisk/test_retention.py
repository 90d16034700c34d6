"""Retention policy (pure), pruning on disk, and the best-checkpoint (LOWEST_VAL) decision across restarts."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from automodel_ckpt.ondisk import catalog, layout
from automodel_ckpt.checkpoint.storage import lifecycle
from automodel_ckpt.checkpoint.checkpointer import Checkpointer, SaveInfo
from automodel_ckpt.checkpoint.config import CheckpointConfig
from automodel_ckpt.ondisk.metadata import build_metadata, read_metadata, write_metadata
from automodel_ckpt.ondisk.layout import check_name_template, render_name
from automodel_ckpt.ondisk.retention import Candidate, RetentionPolicy, is_better, survivors, to_delete
from automodel_ckpt.ondisk.durable import read_pointer, set_pointer
from automodel_ckpt.distributed.env import DistEnv
from automodel_ckpt.errors import ConfigError
from tests.unit.checkpoint.ckpt_state import Counter


def recs(*metrics: float | None) -> list[Candidate]:
    """Checkpoints at steps 1, 2, ... with the given monitored values."""
    return [Candidate(f"s{i + 1}", i + 1, m) for i, m in enumerate(metrics)]


# --- the pure policy ---------------------------------------------------------------------------------------


def test_no_rules_keep_everything_and_keep_steps_alone_only_protects():
    records = recs(3.0, 2.0, 1.0, 4.0)
    assert to_delete(records, RetentionPolicy()) == []
    assert to_delete(records, RetentionPolicy(keep_steps=frozenset({2}))) == []


def test_max_recent_keeps_the_newest_k():
    assert to_delete(recs(1, 1, 1, 1, 1), RetentionPolicy(max_recent=2)) == ["s1", "s2", "s3"]


def test_max_recent_zero_still_keeps_the_newest():
    assert to_delete(recs(1, 1, 1), RetentionPolicy(max_recent=0)) == ["s1", "s2"]


@pytest.mark.parametrize("mode, kept", [("min", {"s3", "s5"}), ("max", {"s4", "s5"})])
def test_top_k_by_mode(mode, kept):
    records = recs(3.0, 2.0, 1.0, 4.0, 2.5)  # s5 is the newest, always kept
    assert survivors(records, RetentionPolicy(top_k=1, mode=mode)) == kept


def test_top_k_ignores_non_finite_and_missing_values_and_ties_go_to_the_earlier_step():
    records = recs(float("nan"), None, float("-inf"), 2.0, 2.0, float("inf"), 9.0)
    assert survivors(records, RetentionPolicy(top_k=1)) == {"s4", "s7"}
    assert survivors(records, RetentionPolicy(top_k=2)) == {"s4", "s5", "s7"}
    assert survivors(records, RetentionPolicy(top_k=1, mode="max")) == {"s7"}


def test_rules_combine_as_a_union_with_pointers_and_milestones():
    records = recs(1.0, 5.0, 4.0, 3.0, 6.0, 7.0)
    policy = RetentionPolicy(max_recent=2, top_k=1, keep_steps=frozenset({3}))
    assert survivors(records, policy, protected={"s2", "gone"}) == {"s1", "s2", "s3", "s5", "s6"}


def test_incomplete_checkpoints_are_never_counted_or_deleted():
    records = [*recs(1.0, 2.0, 3.0), Candidate(".staging-s4", 4, 0.1, complete=False)]
    deleted = to_delete(records, RetentionPolicy(max_recent=1, top_k=0))
    assert deleted == ["s1", "s2"]  # s3 stays the newest complete one; the staging one outranks nobody


@pytest.mark.parametrize(
    "candidate, current, mode, expected",
    [
        (1.0, 2.0, "min", True), (2.0, 1.0, "min", False), (1.0, 1.0, "min", False), (2.0, 1.0, "max", True),
        (float("nan"), None, "min", False), (float("inf"), None, "min", False), (None, 1.0, "min", False),
        (5.0, None, "min", True), (5.0, float("nan"), "max", True), (-float("inf"), 1.0, "min", False),
    ],
)
def test_is_better(candidate, current, mode, expected):
    assert is_better(candidate, current, mode) is expected


# --- property: random saves, pointer moves and prunes ------------------------------------------------------

_metric = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True, width=16))
_policy = st.builds(
    RetentionPolicy,
    max_recent=st.one_of(st.none(), st.integers(0, 4)),
    top_k=st.one_of(st.none(), st.integers(0, 4)),
    mode=st.sampled_from(["min", "max"]),
    keep_steps=st.frozensets(st.integers(1, 40), max_size=4),
)
_op = st.one_of(
    st.tuples(st.just("save"), st.integers(1, 3), _metric),
    st.tuples(st.just("point"), st.sampled_from(layout.POINTERS), st.integers(0, 1000)),
    st.tuples(st.just("stage"), st.booleans(), _metric),
    st.tuples(st.just("prune"), _policy),
)


def _reference_survivors(complete: list[Candidate], policy: RetentionPolicy, protected: set[str]) -> set[str]:
    """The survival rule written independently: a checkpoint survives if any rule keeps it (counting form)."""
    if not policy.prunes or not complete:
        return {r.name for r in complete}
    sign = 1 if policy.mode == "min" else -1
    finite = [r for r in complete if r.metric is not None and math.isfinite(r.metric)]
    newest = max(r.step for r in complete)
    keep = set()
    for r in complete:
        newer = sum(o.step > r.step for o in complete)
        ahead = sum((sign * o.metric, o.step) < (sign * r.metric, r.step) for o in finite) if r in finite else None
        if (
            r.name in protected
            or r.step == newest
            or r.step in policy.keep_steps
            or (policy.max_recent is not None and newer < policy.max_recent)
            or (policy.top_k is not None and ahead is not None and ahead < policy.top_k)
        ):
            keep.add(r.name)
    return keep


@settings(max_examples=400, deadline=None)
@given(st.lists(_op, max_size=40))
def test_random_save_and_prune_sequences_keep_pointer_targets_newest_and_exactly_the_union(ops):
    complete: list[Candidate] = []
    staging: Candidate | None = None
    pointers: dict[str, str] = {}
    step = 0
    for op in ops:
        if op[0] == "save":
            step += op[1]
            complete.append(Candidate(f"ckpt_{step}", step, op[2]))
            pointers[layout.LATEST] = f"ckpt_{step}"
            staging = None
        elif op[0] == "point" and complete:
            pointers[op[1]] = complete[op[2] % len(complete)].name
        elif op[0] == "stage":
            staging = Candidate(f".staging-ckpt_{step + 1}", step + 1, op[2], complete=False) if op[1] else None
        elif op[0] == "prune":
            policy = op[1]
            records = complete + ([staging] if staging else [])
            protected = set(pointers.values())
            deleted = to_delete(records, policy, protected)
            assert len(deleted) == len(set(deleted))
            assert not set(deleted) & protected
            if complete:
                assert max(complete, key=lambda r: r.step).name not in deleted
            if staging:
                assert staging.name not in deleted
            assert set(deleted) <= {r.name for r in complete}
            kept = {r.name for r in complete} - set(deleted)
            assert kept == _reference_survivors(complete, policy, protected)
            complete = [r for r in complete if r.name not in deleted]
            assert all(name in {r.name for r in complete} for name in pointers.values())


@settings(max_examples=200, deadline=None)
@given(st.lists(_metric, min_size=1, max_size=25), st.sampled_from(["min", "max"]))
def test_lowest_val_moved_by_is_better_is_what_top_1_keeps(metrics, mode):
    records, best = recs(*metrics), None
    for r in records:
        if is_better(r.metric, best.metric if best else None, mode):
            best = r
    kept = survivors(records, RetentionPolicy(top_k=1, max_recent=0, mode=mode))
    assert kept == {records[-1].name} | ({best.name} if best else set())


# --- config validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"max_recent_checkpoints": -1}, "checkpoint.max_recent_checkpoints"),
        ({"save_top_k": -2}, "checkpoint.save_top_k"),
        ({"keep_steps": [4, -1]}, "checkpoint.keep_steps"),
        ({"mode": "lowest"}, "checkpoint.mode"),
        ({"monitor": " "}, "checkpoint.monitor"),
        ({"best_metric_key": ""}, "checkpoint.best_metric_key"),
        ({"name_template": "ckpt_{epoch}"}, "must contain {step}"),
        ({"name_template": "ckpt_{step}_{loss}"}, "unknown field '{loss}'"),
    ],
)
def test_config_errors_name_the_key(changes, message):
    with pytest.raises(ConfigError, match=f".*{message.replace('{', '[{]').replace('}', '[}]')}"):
        CheckpointConfig(**changes)


@pytest.mark.parametrize(
    "template, message",
    [
        ("x_{step.real}", "unknown field '{step.real}'"),
        ("x_{}", "unknown field '{}'"),
        ("x_{step", "malformed"),
        ("{step:q}", "cannot render"),
        (".hidden_{step}", "not a usable folder name"),
        ("a/{step}", "not a usable folder name"),
    ],
)
def test_bad_name_templates(template, message):
    with pytest.raises(ConfigError, match="checkpoint.name_template") as err:
        check_name_template(template)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "template, name",
    [
        (layout.DEFAULT_NAME_TEMPLATE, "epoch_1_step_30"),
        ("step{step:05d}_val{val_loss:.2f}", "step00030_valnone"),
        ("{consumed_samples}-{step}-{train_loss:.1f}", "960-30-1.5"),
    ],
)
def test_good_name_templates_render(template, name):
    check_name_template(template)
    assert layout.checkpoint_name(1, 30, template, consumed_samples=960, train_loss=1.5, val_loss=None) == name


@pytest.mark.parametrize("template", ["s{step}_{consumed_samples:/>2}", "{consumed_samples:.>2}s{step}",
                                      "s{step}_{val_loss:/>4}"])
def test_a_template_that_renders_a_bad_name_only_at_some_values_is_refused_at_start(template):
    # each renders a plain name at the values the check once tried alone (step 1, 64 samples, losses 1.5/1.25)
    assert "/" not in layout.checkpoint_name(0, 1, template, consumed_samples=64, train_loss=1.5, val_loss=1.25)
    with pytest.raises(ConfigError, match="checkpoint.name_template: .* renders") as err:
        check_name_template(template)
    assert template in str(err.value) and len(str(err.value).splitlines()) == 1


@pytest.mark.parametrize("fields, rendered", [
    ({"step": 1, "consumed_samples": 8}, "'s1_/8'"),
    ({"step": 2, "consumed_samples": 128}, None),
    ({"step": 3, "consumed_samples": None}, None),  # unknown: "none"
])
def test_every_render_is_checked(fields, rendered):
    template = "s{step}_{consumed_samples:/>2}"
    if rendered is None:
        assert "/" not in render_name(template, 0, **fields)
        return
    with pytest.raises(ConfigError) as err:
        render_name(template, 0, **fields)
    message = str(err.value)
    assert message.startswith("checkpoint.name_template: ") and template in message and rendered in message
    assert "at step 1" in message and len(message.splitlines()) == 1


@pytest.mark.parametrize("name, problem", [
    ("", "empty"), ("a/b", "separator"), ("a\\b", "separator"), ("..", "dot"), (".staging-x", "dot"),
    ("LATEST", "uses for something else"), ("LATEST.txt", "uses for something else"),
    ("training.jsonl", "uses for something else"), ("quarantine", "uses for something else"),
    ("x" * 246, "longer than"), ("x" * 245, None), ("epoch_0_step_1", None),
])
def test_usable_checkpoint_names(name, problem):
    found = layout.name_problem(name)
    assert (found is None) if problem is None else (problem in found)


def test_a_save_whose_name_renders_a_slash_creates_nothing(tmp_path):
    ck = checkpointer(tmp_path)
    ck._cfg.name_template = "s{step}_{consumed_samples:/>2}"  # as if the check at start had let it through
    with pytest.raises(ConfigError, match=r"renders 's1_/8' at step 1"):
        save_all(ck, [(1, 1.0)])
    ck.finalize()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no staging folder, no checkpoint, no lock file left


def test_default_config_is_valid_and_keeps_everything():
    cfg = CheckpointConfig()
    assert not RetentionPolicy.from_config(cfg).prunes


# --- pruning on disk ---------------------------------------------------------------------------------------


def fake_checkpoint(root: Path, step: int, val: float | None, template: str = layout.DEFAULT_NAME_TEMPLATE) -> str:
    name = layout.checkpoint_name(0, step, template, val_loss=val)
    folder = root / name
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "weights.bin").write_bytes(b"x" * 10)
    write_metadata(folder, build_metadata(name=name, epoch=0, step=step, train_loss=None, val_loss=val,
                                          is_final=False, world_size=1, model_save_format="safetensors"))
    return name


def test_prune_on_disk_spares_pointers_staging_and_cleans_leftovers(tmp_path):
    names = [fake_checkpoint(tmp_path, s, v, "ck-{step}-{val_loss:.1f}") for s, v in [(1, 5.0), (2, 1.0), (3, 4.0),
                                                                                     (4, 3.0), (5, 6.0)]]
    set_pointer(tmp_path, layout.LATEST, names[-1])
    set_pointer(tmp_path, layout.LOWEST_VAL, names[0])  # pointers are protected whatever the metric says
    (tmp_path / ".staging-ck-6-none").mkdir()
    (tmp_path / layout.deleting_name("ck-0-none") / "model").mkdir(parents=True)
    deleted = lifecycle.prune(tmp_path, RetentionPolicy(max_recent=1, top_k=1), "val_loss")
    assert deleted == [names[2], names[3]]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.is_symlink()) == sorted(
        [".staging-ck-6-none", names[0], names[1], names[4]]
    )


def test_prune_failure_is_a_warning(tmp_path, monkeypatch):
    names = [fake_checkpoint(tmp_path, s, None) for s in (1, 2, 3)]
    real_rename = Path.rename

    def flaky(self, target):
        if self.name == names[0]:
            raise PermissionError("read-only")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", flaky)
    with pytest.warns(UserWarning, match="could not delete"):
        deleted = lifecycle.prune(tmp_path, RetentionPolicy(max_recent=1), "val_loss")
    assert deleted == [names[1]]
    assert (tmp_path / names[0]).is_dir()


# --- the best-checkpoint decision through the Checkpointer -------------------------------------------------


ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def checkpointer(tmp_path: Path, **cfg) -> Checkpointer:
    config = CheckpointConfig(checkpoint_dir=str(tmp_path), save_consolidated="false", **cfg)
    return Checkpointer(config, ENV, resolved_config_yaml="{}\n", say=lambda _: None)


def save_all(ck: Checkpointer, steps_and_vals, consumed_per_step: int = 8) -> None:
    for step, val in steps_and_vals:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ck.save({"counter": Counter()}, SaveInfo(0, step, 1.0, val, is_final=False,
                                                   extra={"consumed_samples": step * consumed_per_step}))


@pytest.mark.parametrize("mode", ["min", "max"])
def test_lowest_val_follows_the_monitor_and_is_recovered_from_disk_after_a_restart(tmp_path, mode):
    sign = 1.0 if mode == "min" else -1.0
    save_all(checkpointer(tmp_path, mode=mode), [(2, sign * 3.0), (4, sign * 1.0), (6, sign * 2.0)])
    assert read_pointer(tmp_path, layout.LOWEST_VAL) == "epoch_0_step_4"
    restarted = checkpointer(tmp_path, mode=mode)  # a new process: nothing in memory
    save_all(restarted, [(8, sign * 1.5), (10, float("nan")), (12, None), (14, sign * -float("inf"))])
    assert read_pointer(tmp_path, layout.LOWEST_VAL) == "epoch_0_step_4"
    save_all(restarted, [(16, sign * 0.5)])
    assert read_pointer(tmp_path, layout.LOWEST_VAL) == "epoch_0_step_16"
    assert read_pointer(tmp_path, layout.LATEST) == "epoch_0_step_16"


def test_best_metric_key_reads_a_named_validation_set(tmp_path):
    ck = checkpointer(tmp_path, best_metric_key="squad")
    for step, (default, squad) in [(1, (1.0, 5.0)), (2, (2.0, 4.0)), (3, (0.5, 6.0))]:
        ck.save({"counter": Counter()}, SaveInfo(0, step, None, default, False,
                                               extra={"val_metrics": {"squad": {"val_loss": squad}}}))
    assert read_pointer(tmp_path, layout.LOWEST_VAL) == "epoch_0_step_2"
    meta = read_metadata(tmp_path / "epoch_0_step_2")
    assert meta["val_metrics"] == {"val_loss": 2.0, "squad": {"val_loss": 4.0}}


def test_checkpointer_prunes_after_publish_and_names_by_template(tmp_path):
    ck = checkpointer(tmp_path, max_recent_checkpoints=1, save_top_k=1, keep_steps=[2],
                      name_template="s{step:03d}-n{consumed_samples}")
    save_all(ck, [(1, 3.0), (2, 4.0), (3, 1.0), (4, 2.0), (5, 5.0)])
    ck.finalize()  # the run ends: its lock file goes
    left = sorted(p.name for p in tmp_path.iterdir() if not p.is_symlink())
    assert left == ["s002-n16", "s003-n24", "s005-n40"]
    assert read_pointer(tmp_path, layout.LOWEST_VAL) == "s003-n24"
    meta = read_metadata(tmp_path / "s005-n40")
    assert (meta["step"], meta["consumed_samples"], meta["layout_version"]) == (5, 40, layout.LAYOUT_VERSION)
    assert catalog.latest_checkpoint(tmp_path) == tmp_path / "s005-n40"
