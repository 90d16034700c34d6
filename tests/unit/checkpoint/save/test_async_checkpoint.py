"""Async saves in-process (docs/async.md): what is written, when it is published, how failures surface.

A one-rank process group and a small model with AdamW state. A gate in front of the storage writer holds the
background write for as long as a test needs, so "still being written" is a state the test controls (no sleeps).
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import pytest
import torch

from automodel_ckpt.ondisk import layout, manifest
from automodel_ckpt.checkpoint.checkpointer import Checkpointer, SaveInfo
from automodel_ckpt.checkpoint.config import CheckpointConfig
from automodel_ckpt.ondisk.formats import sharded
from automodel_ckpt.ondisk.durable import read_pointer
from automodel_ckpt.distributed.env import init_distributed
from automodel_ckpt.errors import CheckpointError
from tests.integration.contents import comparable
from tests.unit.checkpoint import ckpt_state

FORMATS = ("safetensors", "torch_save")
State = functools.partial(ckpt_state.State, hidden=16)


@pytest.fixture(scope="module")
def env():
    return init_distributed()


class Gate:
    """Holds every background write until ``open()``; ``fail`` makes the writes raise instead."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.fail = False
        self.entered = threading.Event()

    def open(self) -> None:
        self.event.set()


@pytest.fixture
def gate(monkeypatch):
    g = Gate()
    make = sharded._writer

    def gated_writer(path, fmt, written=None, **kw):
        writer = make(path, fmt, written, **kw)
        write_data = writer.write_data

        def gated(plan, planner):
            g.entered.set()
            assert g.event.wait(120), "test gate never opened"
            if g.fail:
                raise OSError(5, "Input/output error")  # a full disk: tests/unit/ondisk/test_integrity.py
            return write_data(plan, planner)

        writer.write_data = gated
        return writer

    monkeypatch.setattr(sharded, "_writer", gated_writer)
    return g


def make_checkpointer(env, root: Path, *, is_async: bool, fmt: str = "safetensors") -> Checkpointer:
    cfg = CheckpointConfig(checkpoint_dir=str(root), model_save_format=fmt, save_consolidated="false",
                           is_async=is_async)
    return Checkpointer(cfg, env, resolved_config_yaml=f"checkpoint: {{is_async: {is_async}}}\n",
                        say=lambda _msg: None)


def info(step: int) -> SaveInfo:
    return SaveInfo(epoch=0, step=step, train_loss=1.0, val_loss=None, is_final=False)


def test_latest_moves_only_when_the_async_save_is_complete(env, tmp_path, gate):
    root = tmp_path / "ck"
    ckpt = make_checkpointer(env, root, is_async=True)
    assert ckpt.stats.is_async
    state = State()
    state.step()
    path = ckpt.save(state.states(), info(1))
    assert path == root / "epoch_0_step_1"
    assert gate.entered.wait(60)  # the background write has started and is held at the gate
    assert ckpt.stats.in_flight
    assert read_pointer(root, layout.LATEST) is None
    assert not path.exists() and (root / layout.staging_name(path.name)).is_dir()
    gate.open()
    assert ckpt._writer._pending.job.completed.result(timeout=120) == path  # written, then published in the background
    assert read_pointer(root, layout.LATEST) == path.name and manifest.verify_manifest(path).ok
    assert ckpt.stats.in_flight  # until the training thread collects the outcome
    assert ckpt.finalize() == path
    assert read_pointer(root, layout.LATEST) == path.name
    assert manifest.verify_manifest(path).ok
    assert not ckpt.stats.in_flight


def test_next_save_publishes_the_previous_one_first(env, tmp_path, gate):
    root = tmp_path / "ck"
    ckpt = make_checkpointer(env, root, is_async=True)
    state = State()
    gate.open()
    state.step()
    first = ckpt.save(state.states(), info(1))
    state.step()
    second = ckpt.save(state.states(), info(2))
    assert read_pointer(root, layout.LATEST) == first.name and manifest.verify_manifest(first).ok  # one save in flight
    assert not second.exists()
    ckpt.finalize()
    assert read_pointer(root, layout.LATEST) == second.name and manifest.verify_manifest(second).ok


def test_async_copy_is_taken_before_save_returns(env, tmp_path, gate):
    """Training goes on while the files are written: what is saved is the state at the call."""
    root = tmp_path / "ck"
    ckpt = make_checkpointer(env, root, is_async=True)
    state = State()
    state.step()
    at_save = state.snapshot()
    ckpt.save(state.states(), info(1))
    for _ in range(3):  # optimizer steps while the write is held at the gate
        state.step()
    assert any(not torch.equal(at_save[k], v) for k, v in state.snapshot().items())
    gate.open()
    path = ckpt.finalize()
    restored = State(seed=7)
    ckpt.load(restored.states(), path)
    after = restored.snapshot()
    assert after.keys() == at_save.keys()
    assert all(torch.equal(at_save[k], after[k]) for k in at_save)
    assert restored.counter.n == 1 and restored.cursor.n == 10


def test_background_failure_raises_once_and_publishes_nothing(env, tmp_path, gate):
    root = tmp_path / "ck"
    ckpt = make_checkpointer(env, root, is_async=True)
    state = State()
    state.step()
    ckpt.save(state.states(), info(1))
    gate.fail = True
    gate.open()
    with pytest.raises(CheckpointError, match="in the background failed on rank 0"):
        ckpt.finalize()
    assert read_pointer(root, layout.LATEST) is None
    assert not (root / "epoch_0_step_1").exists()
    assert not ckpt.stats.in_flight
    gate.fail = False  # the next save starts clean and removes the failed staging folder
    state.step()
    ckpt.save(state.states(), info(2))
    assert ckpt.finalize() == root / "epoch_0_step_2"
    assert not list(root.glob(".staging-*"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_async_checkpoint_equals_sync_checkpoint(env, tmp_path, fmt):
    out = {}
    for mode in (False, True):
        ckpt = make_checkpointer(env, tmp_path / f"ck_{mode}", is_async=mode, fmt=fmt)
        state = State()
        for step in (1, 2):
            state.step()
            ckpt.save(state.states(), info(step))
        ckpt.finalize()
        out[mode] = [tmp_path / f"ck_{mode}" / f"epoch_0_step_{s}" for s in (1, 2)]
    for sync_ckpt, async_ckpt in zip(out[False], out[True]):
        assert sorted(manifest.read_manifest(sync_ckpt)["files"]) == sorted(manifest.read_manifest(async_ckpt)["files"])
        assert comparable(sync_ckpt) == comparable(async_ckpt)


def test_sync_mode_publishes_before_returning(env, tmp_path):
    root = tmp_path / "ck"
    ckpt = make_checkpointer(env, root, is_async=False)
    state = State()
    state.step()
    path = ckpt.save(state.states(), info(1))
    assert read_pointer(root, layout.LATEST) == path.name and not ckpt.stats.in_flight
    assert ckpt.finalize() is None


def test_old_torch_falls_back_to_sync_with_one_warning(env, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch, "__version__", "2.8.1+cpu")
    with pytest.warns(UserWarning, match=r"is_async needs torch >= 2\.9 \(found 2\.8\.1\+cpu\); saving synchronously"):
        ckpt = make_checkpointer(env, tmp_path / "ck", is_async=True)
    assert not ckpt.stats.is_async


def test_peft_adapter_is_written_now_and_its_optimizer_in_the_background(env, tmp_path, gate):
    from transformers import LlamaConfig, LlamaForCausalLM

    from automodel_ckpt.config.schema import PeftConfig
    from automodel_ckpt.models.lora import apply_lora
    from automodel_ckpt.models.tiny import TINY_LLAMA_CONFIG

    torch.manual_seed(0)
    model = apply_lora(LlamaForCausalLM(LlamaConfig(**TINY_LLAMA_CONFIG)), PeftConfig(init_lora_weights=False))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(input_ids=torch.randint(0, 40, (2, 8))).logits.sum().backward()
    optimizer.step()
    root = tmp_path / "ck"
    ckpt = make_checkpointer(env, root, is_async=True)
    path = ckpt.save({"model": model, "optimizer": optimizer}, info(1))
    staging = root / layout.staging_name(path.name)
    assert (staging / "model" / layout.ADAPTER_WEIGHTS).is_file()  # written before save returned
    assert gate.entered.wait(60) and [folder.name for _, folder in ckpt._writer._pending.writes] == ["optim"]
    assert not (staging / "optim" / ".metadata").exists()  # still held at the gate
    gate.open()
    assert ckpt.finalize() == path and manifest.verify_manifest(path).ok
    assert (path / "optim" / ".metadata").is_file()


def test_abandon_does_not_wait_unbounded_for_a_write_that_never_ends(env, tmp_path, monkeypatch):
    """A failing run whose peer died: the background write would block until the collective timeout."""
    from concurrent.futures import Future

    from automodel_ckpt.checkpoint import checkpointer as checkpointer_module
    from automodel_ckpt.checkpoint.save import overlap

    ckpt = make_checkpointer(env, tmp_path, is_async=True)
    stager = ckpt._writer._host_stager()
    never = Future()  # a write stuck in a collective with a dead rank
    ckpt._writer._pending = overlap.PendingSave("epoch_0_step_1", tmp_path / "staging", False, [(never, tmp_path)])
    monkeypatch.setattr(checkpointer_module, "ABANDON_WAIT_SECONDS", 0.0)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (ckpt.finalize(failed=True), done.set()), daemon=True)
    worker.start()
    assert done.wait(60), "abandon() waited on a write that never ends"
    assert not ckpt.stats.in_flight
    assert ckpt._writer._stager is stager  # its buffers are not released under a write that may still run
    never.set_result(None)


@pytest.fixture
def capture_gate(monkeypatch):
    """Holds the background copy of the live state (``StagedSave.capture``) until ``open()``; records the order
    in which captures end and optimizer steps run in ``events``."""
    g = Gate()
    g.events = []
    capture = sharded.StagedSave.capture

    def gated(self):
        g.entered.set()
        assert g.event.wait(120), "test gate never opened"
        capture(self)
        g.events.append(f"captured {self.key.split(':')[0]}")

    monkeypatch.setattr(sharded.StagedSave, "capture", gated)
    return g


@pytest.mark.parametrize("fmt", FORMATS)
def test_contended_fence_keeps_the_checkpoint_at_its_step(env, tmp_path, capture_gate, fmt):
    """The next optimizer step is ready before the snapshot is taken: it waits at the fence, and the async
    checkpoint is bitwise the sync checkpoint of the same step."""
    sync_state = State()
    sync_state.step()
    sync_ckpt = make_checkpointer(env, tmp_path / "sync", is_async=False, fmt=fmt)
    sync_path = sync_ckpt.save(sync_state.states(), info(1))

    state = State()
    state.step()
    at_save = state.snapshot()
    ckpt = make_checkpointer(env, tmp_path / "async", is_async=True, fmt=fmt)
    state.optimizer.register_step_post_hook(lambda *_: capture_gate.events.append("optimizer step"))
    reached = threading.Event()
    fence = ckpt._writer.fence
    ckpt._writer.fence = lambda: (reached.set(), fence())[1]  # the step pre-hook calls the writer's fence
    path = ckpt.save(state.states(), info(1))  # returns with the copy held at the gate
    assert capture_gate.entered.wait(60)
    stepper = threading.Thread(target=state.step, daemon=True)  # the next step: forward, backward, optimizer.step
    stepper.start()
    assert reached.wait(60)  # the optimizer step is at the fence...
    assert stepper.is_alive() and capture_gate.events == []
    assert all(torch.equal(at_save[k], v) for k, v in state.snapshot().items())  # ...and has changed nothing
    capture_gate.open()
    stepper.join(60)
    assert not stepper.is_alive()
    assert capture_gate.events == ["captured model", "captured optim", "optimizer step"]
    assert any(not torch.equal(at_save[k], v) for k, v in state.snapshot().items())
    assert ckpt.finalize() == path and manifest.verify_manifest(path).ok
    assert comparable(path) == comparable(sync_path)
    restored = State(seed=7)
    ckpt.load(restored.states(), path)
    assert all(torch.equal(at_save[k], v) for k, v in restored.snapshot().items())
    assert restored.counter.n == 1 and restored.cursor.n == 10  # small states: taken when save() was called


def test_small_states_are_captured_when_save_is_called(env, tmp_path, capture_gate):
    """The scheduler-like state, step counts and learning rates change after save() returns; the checkpoint
    keeps their values at the save."""
    state = State()
    state.step()
    ckpt = make_checkpointer(env, tmp_path / "ck", is_async=True)
    path = ckpt.save(state.states(), info(1))
    assert capture_gate.entered.wait(60)
    state.counter.n = 99  # a global state object
    state.optimizer.param_groups[0]["lr"] = 123.0  # what an LR scheduler does
    capture_gate.open()
    ckpt.finalize()
    restored = State(seed=7)
    ckpt.load(restored.states(), path)
    assert restored.counter.n == 1 and restored.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)


def test_fence_is_free_without_a_save_in_flight_and_hooks_go_with_finalize(env, tmp_path):
    state = State()
    ckpt = make_checkpointer(env, tmp_path / "ck", is_async=True)
    ckpt.fence()  # nothing in flight: returns at once
    state.step()
    ckpt.save(state.states(), info(1))
    assert len(state.optimizer._optimizer_step_pre_hooks) == 1
    ckpt.save(state.states(), info(1 + 1))  # the same optimizer is fenced once
    assert len(state.optimizer._optimizer_step_pre_hooks) == 1
    ckpt.finalize()
    assert not state.optimizer._optimizer_step_pre_hooks


def test_background_threads_defaults_and_priority(monkeypatch):
    import os

    from automodel_ckpt.checkpoint.save import overlap

    assert overlap.default_write_threads(cpu_count=2, local_ranks=2) == 1  # a small host: one writer thread
    assert overlap.default_write_threads(cpu_count=96, local_ranks=8) == overlap.WRITE_THREADS_MAX
    assert overlap.default_write_threads(cpu_count=4, local_ranks=1) == 3
    if not hasattr(os, "getpriority"):
        pytest.skip("no per-thread priorities here")
    seen = []

    def probe():
        overlap.lower_priority(5)
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        child = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        child.start()
        child.join()

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    worker = threading.Thread(target=probe)
    worker.start()
    worker.join()
    assert seen == [min(19, before + 5)] * 2  # the thread and the writer threads it starts
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # training's thread untouched


def test_idle_background_threads_run_under_sched_idle_and_their_writers_too():
    """``async_nice: idle`` (the default): the save's threads only take the cores training leaves idle. At niceness
    10 they still slowed training 2.7% within the runs, against 1.5% (docs/benchmarks.md)."""
    import os

    from automodel_ckpt.checkpoint.save import overlap
    from automodel_ckpt.errors import ConfigError

    assert CheckpointConfig(checkpoint_dir="/tmp/x").async_nice == "idle"
    for bad in ("fast", 20, -1, True, 2.5):
        with pytest.raises(ConfigError, match="expected idle or a niceness between 0 and 19"):
            CheckpointConfig(checkpoint_dir="/tmp/x", async_nice=bad)
    if not hasattr(os, "SCHED_IDLE"):
        pytest.skip("no SCHED_IDLE here (Linux only)")
    seen = []

    def probe():
        overlap.lower_priority("idle")
        seen.append(os.sched_getscheduler(0))
        child = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
        child.start()
        child.join()

    worker = threading.Thread(target=probe)
    worker.start()
    worker.join()
    assert seen == [os.SCHED_IDLE] * 2  # the thread and the writer threads it starts
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # training's thread untouched


def test_the_save_process_groups_transport_threads_run_under_sched_idle_and_training_s_do_not(process_group):
    """The background save's collectives travel on its own gloo group, whose threads (the TCP loop, the work
    queue's) are made on the training thread: they are lowered too, and the training group's are not."""
    import os
    from pathlib import Path

    import torch.distributed as dist

    from automodel_ckpt.checkpoint.save import overlap

    if not hasattr(os, "SCHED_IDLE") or not Path("/proc/self/task").is_dir():
        pytest.skip("no SCHED_IDLE or /proc here (Linux only)")

    def policies() -> dict[str, int]:  # thread id -> scheduling policy (the 41st field of its stat)
        return {t.name: int((t / "stat").read_text().rsplit(")", 1)[1].split()[38])
                for t in Path("/proc/self/task").iterdir()}

    before = policies()
    group = overlap.threads_lowered(lambda: dist.new_group(backend="gloo"), "idle")
    made = {tid: policy for tid, policy in policies().items() if tid not in before}
    assert made and set(made.values()) == {os.SCHED_IDLE}  # the group's threads
    assert policies()[str(threading.get_native_id())] == os.SCHED_OTHER  # the thread that made it untouched
    dist.barrier(group=group)  # the lowered group still carries collectives
    dist.destroy_process_group(group)


def test_async_save_meets_no_collective_and_reserves_its_folder_in_the_background(env, tmp_path, capture_gate,
                                                                                    monkeypatch):
    """save() returns without a collective on the training thread (no rank waits for another there); the staging
    folder is reserved by the background thread after the copy, and a reservation that fails (the checkpoint
    exists already) is raised by the next wait, on every rank, with nothing published."""
    from automodel_ckpt.distributed import env as collectives  # what checkpoint.collective's steps call

    state = State()
    state.step()
    root = tmp_path / "ck"
    ckpt = make_checkpointer(env, root, is_async=True)
    on_training_thread = []
    broadcast = collectives.broadcast_object
    monkeypatch.setattr(collectives, "broadcast_object", lambda obj, *a, **k: (
        on_training_thread.append(threading.current_thread() is threading.main_thread()), broadcast(obj, *a, **k))[1])
    path = ckpt.save(state.states(), info(1))
    assert capture_gate.entered.wait(60)
    assert not any(on_training_thread) and not list(root.glob(".staging-*"))  # nothing reserved yet
    capture_gate.open()
    assert ckpt.finalize() == path and manifest.verify_manifest(path).ok
    assert on_training_thread and not any(on_training_thread)  # reserve, seal and publish: in the background

    ckpt = make_checkpointer(env, root, is_async=True)  # the same step again: its folder exists
    state.step()
    ckpt.save(state.states(), info(1))
    with pytest.raises(CheckpointError, match="already exists and is never overwritten"):
        ckpt.finalize()
    assert read_pointer(root, layout.LATEST) == path.name and manifest.verify_manifest(path).ok
    assert not list(root.glob(".staging-*"))


def test_staging_buffers_dropped_give_their_pinned_memory_back(monkeypatch):
    """On an accelerator the staging buffers are pinned, and torch's host caching allocator keeps freed pinned
    blocks: buffers replaced (a state whose structure changed) or closed are given back before new ones are made."""
    released: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("S", (), {"synchronize": lambda self: None})())
    monkeypatch.setattr(torch.accelerator.memory, "empty_host_cache", lambda: released.append(1))
    stager = sharded.HostStager()
    stager.stage("optim", {"lr": 0.1, "w": torch.ones(3)})
    stager.stage("optim", {"lr": 0.1, "w": torch.ones(3)})  # same structure: the same buffers, nothing released
    assert released == []
    stager.stage("optim", {"lr": 0.1, "w": torch.ones(3), "exp_avg": torch.zeros(3)})  # moments appeared
    assert released == [1]
    stager.close()
    assert released == [1, 1]
