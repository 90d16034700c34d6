"""Recipes as input: secrets never leave memory, alias bombs fail fast, bad values are one line before training."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from automodel_ckpt.checkpoint import CheckpointConfig
from automodel_ckpt.ondisk.fingerprint import first_difference, run_fingerprint
from automodel_ckpt.cli import main
from automodel_ckpt.config.loader import load_config, load_yaml, to_yaml
from automodel_ckpt.redact import REDACTED, is_secret_key, redacted
from automodel_ckpt.config.schema import RecipeConfig
from automodel_ckpt.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]
RECIPE = str(REPO / "recipes" / "tiny_llama_sft.yaml")
ENV_SECRET = "env-secret-Zq81xT"  # distinctive values: grep for them
INLINE_KEY = "AKIA-inline-Kk27pW"
HF_TOKEN = "hf_token-Mm93vB"


def _one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


# ----------------------------------------------------------------------------------------- secrets

@pytest.mark.parametrize("name", [
    "key", "secret", "token", "password", "passwd", "passphrase", "credentials", "api_key", "apiKey", "API-KEY",
    "access_key", "aws_secret_access_key", "aws_access_key_id", "aws_session_token", "hf_token", "HF_TOKEN",
    "auth_token", "use_auth_token", "client_secret", "private_key", "db_password", "sas_token", "storage.key",
])
def test_a_key_that_names_a_secret_is_secret(name):
    assert is_secret_key(name)


@pytest.mark.parametrize("name", [
    "pad_token", "eos_token", "image_token_id", "max_tokens", "max_new_tokens", "tokenizer", "best_metric_key",
    "monitor", "keep_steps", "seq_length", "checkpoint_dir", "endpoint_url", "sort_keys", "monkey", "author",
])
def test_ordinary_keys_are_not_secret(name):
    assert not is_secret_key(name)


def test_redacted_hides_storage_options_secret_keys_and_url_passwords_and_keeps_the_shape():
    cfg = {"checkpoint": {"checkpoint_dir": "s3://b/run", "storage_options": {
               "key": INLINE_KEY, "endpoint_url": "http://10.0.0.1:8333", "client_kwargs": {"region_name": "x"}}},
           "dataset": {"path": "https://alice:pa55-Wq@example.org/d.json", "token": HF_TOKEN, "split": "train",
                       "credentials": {"user": "bob", "expires": 3}},
           "model": {"pad_token": "<pad>", "hf_token": None}}
    out = redacted(OmegaConf.create(cfg))
    assert out["checkpoint"]["storage_options"] == {
        "key": REDACTED, "endpoint_url": REDACTED, "client_kwargs": {"region_name": REDACTED}}
    assert out["checkpoint"]["checkpoint_dir"] == "s3://b/run"
    assert out["dataset"] == {"path": f"https://alice:{REDACTED}@example.org/d.json", "token": REDACTED,
                              "split": "train", "credentials": {"user": REDACTED, "expires": REDACTED}}
    assert out["model"] == {"pad_token": "<pad>", "hf_token": None}  # unset stays visibly unset
    assert cfg["dataset"]["token"] == HF_TOKEN  # the live config is untouched


def _s3_overrides() -> list[str]:
    return ["--checkpoint.checkpoint_dir", "s3://bucket/run", "--checkpoint.storage_options.key", INLINE_KEY,
            "--checkpoint.storage_options.secret", "${oc.env:CKPT_TEST_S3_SECRET}"]


def test_dry_run_and_config_yaml_show_no_secret_even_from_an_env_interpolation(capsys, monkeypatch):
    monkeypatch.setenv("CKPT_TEST_S3_SECRET", ENV_SECRET)
    assert main([RECIPE, "--dry-run", *_s3_overrides()]) == 0
    out = capsys.readouterr()
    assert ENV_SECRET not in out.out + out.err and INLINE_KEY not in out.out + out.err
    assert f"key: {REDACTED}" in out.out and f"secret: {REDACTED}" in out.out
    cfg = load_config(RECIPE, _s3_overrides(), RecipeConfig)
    assert cfg.checkpoint.storage_options.secret == ENV_SECRET  # the live config keeps what the run needs
    text = to_yaml(cfg)  # what each checkpoint's config.yaml holds
    assert ENV_SECRET not in text and INLINE_KEY not in text and "CKPT_TEST_S3_SECRET" not in text


def test_an_error_about_a_secret_value_does_not_show_it(capsys):
    msg = _one_error_line(capsys, [RECIPE, "--dry-run", "--checkpoint.storage_options", INLINE_KEY])
    assert "checkpoint.storage_options: expected" in msg and INLINE_KEY not in msg and REDACTED in msg


def test_reprs_show_no_storage_options():
    ckpt = CheckpointConfig(storage_options={"key": INLINE_KEY, "secret": ENV_SECRET})
    assert INLINE_KEY not in repr(ckpt) and ENV_SECRET not in repr(ckpt)
    from automodel_ckpt.checkpoint.objectstore.store import ObjectStore

    store = ObjectStore("s3://bucket/run", {"key": INLINE_KEY, "secret": ENV_SECRET,
                                            "endpoint_url": "http://127.0.0.1:9"})
    assert INLINE_KEY not in repr(store) and ENV_SECRET not in repr(store)


def test_the_fingerprint_does_not_depend_on_a_secret_and_a_rotated_token_resumes():
    model = torch.nn.Linear(3, 2)

    def fingerprint(token: str) -> dict:
        recipe = {"dataset": {"path": "org/data", "token": token}, "data.seq_length": 16}
        return run_fingerprint(model, recipe=recipe)

    saved, rotated = fingerprint(HF_TOKEN), fingerprint("hf_rotated-Yy55")
    assert saved == rotated and HF_TOKEN not in repr(saved)  # metadata.json never holds it
    assert first_difference(saved, rotated) is None  # resume accepts the rotated credential
    old = {**saved, "recipe": {"dataset": {"path": "org/data", "token": HF_TOKEN}, "data.seq_length": 16}}
    assert first_difference(old, rotated) is None  # a checkpoint written before redaction resumes too
    other = run_fingerprint(model, recipe={"dataset": {"path": "org/other", "token": HF_TOKEN}, "data.seq_length": 16})
    assert "dataset" in (first_difference(saved, other) or "")  # what is not a secret still counts


# ------------------------------------------------------------------------------------------ aliases

def test_an_alias_bomb_fails_fast_with_one_line_naming_the_file(tmp_path, capsys):
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, 10):  # 9 levels of 9 aliases: 9**10 strings once expanded, from a 0.5 KB file
        lines.append(f"l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * 9) + "]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\nmodel:\n  layers: *l9\n")
    with pytest.raises(ConfigError, match=r"bomb\.yaml:\d+: YAML aliases expand this recipe by more than 10000"):
        load_yaml(bomb)
    assert "YAML aliases" in _one_error_line(capsys, [str(bomb)])
    (tmp_path / "loop.yaml").write_text("model: &m\n  inner: *m\n")
    with pytest.raises(ConfigError, match=r"loop\.yaml:\d+: a YAML alias refers to its own anchor"):
        load_yaml(tmp_path / "loop.yaml")


def test_a_recipe_with_a_few_anchors_and_aliases_still_loads(tmp_path):
    recipe = tmp_path / "anchors.yaml"
    recipe.write_text(Path(RECIPE).read_text() + (
        "\nvalidation_dataset: &val\n  _target_: automodel_ckpt.data.builtin.builtin_task_dataset\n"
        "  num_samples: 64\n  split: heldout\n"
        "training: &train\n  max_grad_norm: 0.5\n"))
    big = tmp_path / "merge.yaml"
    big.write_text("base: &base {a: 1, b: [1, 2, 3]}\nx: {<<: *base, c: 3}\ny: [*base, *base]\n")
    assert load_yaml(big)["x"] == {"a": 1, "b": [1, 2, 3], "c": 3}
    cfg = load_config(recipe, [], RecipeConfig)
    assert cfg.validation_dataset.num_samples == 64 and cfg.training.max_grad_norm == 0.5


# --------------------------------------------------------------------------- bad command-line values

@pytest.mark.parametrize("key,value,expected", [
    ("optimizer.lr", "abc", "optimizer.lr: expected float for torch.optim.AdamW, got 'abc' (str)"),
    ("dataset.num_samples", "abc", "dataset.num_samples: expected int for "
                                   "automodel_ckpt.data.builtin.builtin_task_dataset, got 'abc' (str)"),
    ("optimizer.betas", "[0.9, x]", "optimizer.betas: expected a list of 2 (float, float)"),
    ("lr_scheduler.warmup_steps", "ten", "lr_scheduler.warmup_steps: expected int"),
])
def test_a_wrong_type_for_a_target_argument_is_one_line_before_training(capsys, key, value, expected):
    assert expected in _one_error_line(capsys, [RECIPE, "--dry-run", f"--{key}", value])


def test_a_misspelt_target_argument_is_caught_by_dry_run(capsys):
    msg = _one_error_line(capsys, [RECIPE, "--dry-run", "--dataset.num_sample", "5"])
    assert "unknown key 'dataset.num_sample'" in msg and "did you mean 'dataset.num_samples'" in msg


def test_values_of_the_right_type_pass(capsys):
    assert main([RECIPE, "--dry-run", "--optimizer.lr", "1e-4", "--optimizer.foreach", "null",
                 "--dataset.num_samples", "64", "--optimizer.betas", "[0.8, 0.9]"]) == 0


@pytest.mark.parametrize("argv", [[RECIPE, "--nproc-per-node=0"], [RECIPE, "--nproc-per-node", "-1"],
                                  ["--nproc-per-node=0", RECIPE]])
def test_nproc_per_node_below_one_is_one_line_about_the_launcher_option(capsys, argv):
    msg = _one_error_line(capsys, [*argv, "--dry-run"])
    assert msg.startswith("error: --nproc-per-node: expected at least 1, got ") and "unknown key" not in msg


def test_a_launcher_flag_after_the_recipe_is_the_launcher_flag(capsys):
    assert main([RECIPE, "--nproc-per-node=2", "--dry-run", "--step_scheduler.max_steps", "3"]) == 0
    assert "valid for 2 process(es)" in capsys.readouterr().err


def test_max_restarts_reaches_torchs_agent(capsys):
    from automodel_ckpt.launch import parse_launch_args, torchrun_args

    opts, recipe, rest = parse_launch_args(["--max-restarts", "2", RECIPE, "--step_scheduler.max_steps", "3"])
    assert opts.max_restarts == 2 and opts.needs_agent and rest == ["--step_scheduler.max_steps", "3"]
    args = torchrun_args(opts, recipe, rest)
    assert args[args.index("--max-restarts") + 1] == "2"
    msg = _one_error_line(capsys, ["--max-restarts=-1", RECIPE, "--dry-run"])
    assert msg == "error: --max-restarts: expected 0 or more, got -1"


def test_start_method_is_fork_on_linux_and_exec_on_request(capsys):
    from automodel_ckpt.launch import parse_launch_args

    opts, _, rest = parse_launch_args(["--nproc-per-node", "2", RECIPE, "--start-method=exec", "--a.b", "1"])
    assert opts.start_method == "exec" and rest == ["--a.b", "1"]
    gpu = any(os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd"))
    expected = "fork" if sys.platform.startswith("linux") and not gpu else "exec"
    assert parse_launch_args([RECIPE])[0].start_method == expected
    msg = _one_error_line(capsys, ["--start-method", "spawn", RECIPE, "--dry-run"])
    assert msg == "error: --start-method: expected one of fork, exec, got 'spawn'"


def test_the_launcher_finds_its_forked_workers_by_its_own_command_line():
    import multiprocessing

    from automodel_ckpt.launch import worker_pids

    ctx = multiprocessing.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_wait_for, args=(ready, done))
    child.start()
    try:
        assert ready.wait(60)
        assert child.pid in worker_pids(os.getpid())
    finally:
        done.set()
        child.join(60)


def _wait_for(ready, done) -> None:
    ready.set()
    done.wait(60)


def test_torch_s_line_about_a_worker_that_ended_on_our_one_line_error_is_dropped():
    """A worker that exited with one of our errors' codes printed its ``error:`` line: torch's agent adds nothing
    (``failed (exitcode: 3) ...``); a crash, a signal or another exit code keeps torch's line (a forked worker's
    without the agent's own traceback). The ranks still running when one failed end without a line each."""
    import logging

    from automodel_ckpt.launch import ELASTIC_LOGGERS, quiet_failed_worker_logs

    quiet_failed_worker_logs()
    quiet_failed_worker_logs()  # once: not twice the filter
    kept: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record)

    for name in ELASTIC_LOGGERS:
        logger = logging.getLogger(name)
        assert len(logger.filters) == len(set(map(id, logger.filters)))
        handler, level = Keep(), logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            for code in (2, 3, 4, 1, -9, -15, 137, 5):  # exec'd workers
                logger.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", code, 0, 123, "python")
            try:
                raise RuntimeError("the agent's own wait")
            except RuntimeError:  # forked workers: logged with the traceback of the agent's wait
                for code in (3, -11):
                    logger.exception("failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s (start_method: %s)",
                                     code, 1, 124, "forked_worker", "fork")
            logger.warning("Terminating process %s via signal SIGTERM", 6396)  # a rank ended because another failed
            logger.warning("Received %s death signal, shutting down workers", "SIGTERM")  # other records: kept
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        assert [r.args[0] for r in kept if str(r.msg).startswith("failed")] == [1, -9, -15, 137, 5, -11], name
        assert all(r.exc_info is None for r in kept) and "death signal" in kept[-1].getMessage()
        assert not any("Terminating" in r.getMessage() for r in kept)
        kept.clear()


# ------------------------------------------------------------------------------------- sequence length

def _prepare(tmp_path: Path, seq_length: int):
    from automodel_ckpt.data.pipeline import prepare_data
    from automodel_ckpt.models.tiny import build_tokenizer

    cfg = load_config(RECIPE, ["--dataset.num_samples", "300", "--data.val_size", "20", "--data.seq_length",
                               str(seq_length), "--data.cache_dir", str(tmp_path)], RecipeConfig)
    return prepare_data(cfg, build_tokenizer())


def test_a_seq_length_that_leaves_no_token_with_a_loss_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^data\.seq_length: 2 tokens leave no token with a loss in the 280 "
                                          r"training examples \(280 cut short\); --data\.seq_length \d+ keeps 95%"):
        _prepare(tmp_path, 2)


def test_many_truncated_examples_warn_with_the_seq_length_that_keeps_95_percent_whole(tmp_path):
    cut = _prepare(tmp_path, 9)
    m = re.search(r"^data\.seq_length 9 cuts (\d+) of 280 training examples \(\d+%\) short; "
                  r"--data\.seq_length (\d+) keeps 95% of them whole$", cut.warning or "")
    assert m, cut.warning
    suggested = int(m[2])
    whole = _prepare(tmp_path, suggested)
    assert whole.warning is None and whole.train.totals()["truncated"] <= 0.05 * 280
    assert _prepare(tmp_path, suggested - 1).train.totals()["truncated"] > 0.05 * 280  # the smallest such length


def test_an_error_every_rank_meets_reads_as_one_line(tmp_path, monkeypatch, capsys):
    """Under the launcher, rank 0 prints its error line and every rank leaves its own in the launcher's folder; the
    launcher then prints another rank's line only where no lower rank left the same one."""
    from automodel_ckpt.cli.common import report
    from automodel_ckpt.launch import ERRORS_FOLDER, other_ranks_errors

    monkeypatch.setenv(ERRORS_FOLDER, str(tmp_path))
    for rank, message in ((0, "error: refused"), (1, "error: refused"), (2, "error: rank 2's own shard is torn"),
                          (3, "error: rank 2's own shard is torn"), (10, "error: refused")):
        monkeypatch.setenv("RANK", str(rank))
        report(message)
    assert capsys.readouterr().err == "error: refused\n"  # rank 0's, at once; the others wait for the launcher
    assert other_ranks_errors(str(tmp_path)) == ["[rank 2] error: rank 2's own shard is torn"]
    # a node without rank 0: its lowest rank's line, once
    (tmp_path / "rank-0").unlink()
    assert other_ranks_errors(str(tmp_path)) == ["[rank 1] error: refused", "[rank 2] error: rank 2's own shard is torn"]
    # without the launcher's folder (a verb, or the folder gone): straight to the stream, marked with the rank
    monkeypatch.setenv(ERRORS_FOLDER, str(tmp_path / "gone"))
    monkeypatch.setenv("RANK", "1")
    report("error: refused")
    assert capsys.readouterr().err == "[rank 1] error: refused\n"


def test_the_launcher_names_the_rank_an_error_came_from_whichever_rank_exits_first(tmp_path, monkeypatch):
    """A rank raising another rank's failure (``distributed.collective``) leaves where it came from: the launcher
    names that rank even when the rank that only met it again exits first."""
    from automodel_ckpt.cli import run
    from automodel_ckpt.distributed.collective import _failure
    from automodel_ckpt.errors import UserError
    from automodel_ckpt.launch import ERRORS_FOLDER, failure_origin

    monkeypatch.setenv(ERRORS_FOLDER, str(tmp_path))
    received = _failure("data preparation", 2, "ValueError: bad row", None)
    assert received.failed_rank == 2

    def raising(error):
        def verb(argv):
            raise error
        return verb

    monkeypatch.setenv("RANK", "1")
    assert run(raising(received), []) == received.exit_code
    monkeypatch.setenv("RANK", "3")
    assert run(raising(UserError("its own")), []) == UserError.exit_code
    assert failure_origin(str(tmp_path), 1) == 2  # rank 1 exited first with rank 2's failure
    assert failure_origin(str(tmp_path), 3) == 3  # its own error
    monkeypatch.setenv("RANK", "2")
    assert run(raising(UserError("its own")), []) == UserError.exit_code
    assert failure_origin(str(tmp_path), 3) == 2  # the same error met by ranks 2 and 3: the lowest names it
    assert failure_origin(str(tmp_path / "gone"), 1) == 1
