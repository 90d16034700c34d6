"""GRPO's vLLM engine, the parts that need no vLLM: the names it takes, where its Python is found, the weights hash
both sides compute, rank 0's errors as every rank raises them, the ``grpo.engine`` keys' checks, and the folders
killed trainers left."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from omegaconf import OmegaConf

from automodel_ckpt.algorithms.grpo import engine
from automodel_ckpt.algorithms.grpo.config import GRPOConfig, check_section
from automodel_ckpt.algorithms.grpo.engine import EngineLost, _answer, _failed, _remove_orphans, engine_name, \
    engine_python
from automodel_ckpt.algorithms.grpo.vllm_server import weights_hash
from automodel_ckpt.errors import ConfigError, TrainingError


def test_names_are_the_checkpoints_and_a_lora_adapters_the_saved_peft_names():
    assert engine_name("model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert engine_name("model.layers.0.self_attn.q_proj.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert engine_name("model.layers.1.mlp.down_proj.lora_B.default.weight") == \
        "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"


def test_the_engines_python_is_the_setting_else_venv_vllm_here_else_in_the_checkout(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="grpo.vllm.python: nowhere/python is not a file"):
        engine_python("nowhere/python")
    python = tmp_path / ".venv-vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    monkeypatch.chdir(tmp_path)
    assert engine_python(None) == tmp_path / ".venv-vllm" / "bin" / "python"
    assert engine_python(".venv-vllm/bin/python") == python.relative_to(tmp_path)  # relative: from here
    python.unlink()
    monkeypatch.setattr(engine, "__file__", str(tmp_path / "a" / "b" / "c" / "engine.py"))  # no checkout's either
    with pytest.raises(ConfigError, match="bash tools/setup.sh --with-vllm"):
        engine_python(None)


def test_the_weights_hash_is_of_names_dtypes_shapes_and_bytes():
    a = [("a", torch.ones(2, 3)), ("b", torch.zeros(4, dtype=torch.int64))]
    assert weights_hash(a) == weights_hash([(n, t.clone()) for n, t in a])
    assert weights_hash(a) != weights_hash([("a", torch.ones(3, 2)), a[1]])
    assert weights_hash(a) != weights_hash([("a", torch.ones(2, 3, dtype=torch.float64)), a[1]])
    assert weights_hash(a) != weights_hash([("c", torch.ones(2, 3)), a[1]])
    changed = torch.ones(2, 3)
    changed[1, 2] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert weights_hash(a) != weights_hash([("a", changed), a[1]])


def test_rank_0s_error_is_raised_alike_on_every_rank_a_lost_engine_as_one():
    with pytest.raises(EngineLost, match="did not answer"):
        _answer(_failed(EngineLost("did not answer")))
    with pytest.raises(TrainingError) as caught:
        _answer(_failed(TrainingError("hash differs")))
    assert not isinstance(caught.value, EngineLost)
    assert _answer({"weight_hash": "ab"}) == {"weight_hash": "ab"}


@pytest.mark.parametrize("change, message", [({"engine": "sglang"}, "grpo.engine: 'sglang' is not one of"),
                                             ({"engine": "vllm", "vllm": {"timeout": 0}}, "grpo.vllm.timeout"),
                                             ({"engine": "vllm", "max_staleness": 9}, "is not 0 .synchronous. to 8"),
                                             ({"engine": "vllm", "max_staleness": -1}, "is not 0 .synchronous. to 8"),
                                             ({"max_staleness": 1}, "needs grpo.engine vllm"),
                                             ({"engine": "vllm", "max_staleness": 1, "beta": 0.04},
                                              "grpo.num_iterations 1 and grpo.beta 0")])
def test_the_engine_keys_are_checked_in_one_line(change, message):
    section = OmegaConf.merge(OmegaConf.structured(GRPOConfig), change)
    with pytest.raises(ConfigError, match=message):
        check_section(section, 8, 1)
    for staleness in (0, 1, 2, 8):
        check_section(OmegaConf.merge(OmegaConf.structured(GRPOConfig), {"engine": "vllm", "max_staleness": staleness}),
                      8, 1)
    assert OmegaConf.structured(GRPOConfig).engine == "transformers"


def test_the_engine_folders_of_trainers_that_are_gone_are_removed(tmp_path):
    """A killed trainer leaves its engine folder (in /dev/shm: a weights file holds memory): the next start removes
    it, and keeps a living trainer's and one being made (no pid yet)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    for name, pid in (("vllm-engine-gone", gone.pid), ("vllm-engine-mine", os.getpid())):
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer.pid").write_text(str(pid))
    (tmp_path / "vllm-engine-making").mkdir()
    _remove_orphans(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vllm-engine-making", "vllm-engine-mine"]


def test_an_engine_that_hangs_is_lost_once_its_request_times_out(tmp_path):
    """A hung engine (it takes the request and never answers) is an ``EngineLost`` after ``grpo.vllm.timeout``, the
    error a dead one gives: the same restart follows (tested with a dead engine in test_grpo_vllm.py)."""
    import socket

    from automodel_ckpt.algorithms.grpo.config import VLLMSettings

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        hung = engine.VLLMEngine(VLLMSettings(url=f"http://127.0.0.1:{server.getsockname()[1]}", timeout=0.5),
                                 is_main=True)
        answer = hung.request([[1, 2]], [7], max_new_tokens=2, temperature=1.0, eos_id=None)
        with pytest.raises(EngineLost, match="did not answer /generate: timed out"):
            _answer(answer)  # what every rank raises (``collect`` broadcasts it first)
