"""``ckpt-train report`` (the page's panels, its default place, ``logging.report``'s writer) and ``ckpt-train env``."""

from __future__ import annotations

import json
import time
import warnings

from automodel_ckpt.cli import main
from automodel_ckpt.report import LiveReport, render
from automodel_ckpt.tracking import RunObserver

PANELS = ("Curves", "Eval scores", "Checkpoints", "Data", "Cost", "Algorithm", "Lineage")


def _run(tmp_path, stages=None):
    run = tmp_path / "run"
    for step in (2, 4):
        meta = {"step": step, "epoch": 0, "val_loss": 1.0 / step} | ({"stages": stages} if stages else {})
        (run / f"epoch_0_step_{step}").mkdir(parents=True)
        (run / f"epoch_0_step_{step}" / "metadata.json").write_text(json.dumps(meta))
    (run / "training.jsonl").write_text("".join(json.dumps({"step": s, "loss": 2.0 / s, "lr": 0.1, "grad_norm": 1.0})
                                                + "\n" for s in range(1, 5)))
    return run


def test_a_panel_without_data_says_so_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    text = render(tmp_path / "empty")
    for panel in PANELS:
        assert f"<h2>{panel}</h2>" in text
    assert text.count('class="none"') >= len(PANELS)
    assert "<script" not in text and "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_stage_boundaries_are_marked_on_the_curves(tmp_path):
    stages = [{"name": "main", "first_step": 1, "samples": 0, "changed": []},
              {"name": "anneal", "first_step": 3, "samples": 8, "changed": ["optimizer.lr"]}]
    text = render(_run(tmp_path, stages))
    assert "stage anneal from step 3" in text and "anneal: from step 3 (after 8 samples): optimizer.lr" in text


def test_the_verb_writes_into_the_run_folder_by_default_and_a_missing_folder_is_one_line(tmp_path, capsys):
    run = _run(tmp_path)
    assert main(["report", str(run)]) == 0
    assert (run / "report.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert main(["report", str(tmp_path / "nowhere")]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: run folder") and "not found" in err


def test_logging_report_rewrites_the_page_at_each_checkpoint_off_the_training_thread(tmp_path):
    run = _run(tmp_path)
    observer = RunObserver({}, run, is_main=True, config_yaml="")
    live = LiveReport(run)
    observer.on_checkpoint = live.request
    observer.start(4, None)
    observer.save(lambda: run / "epoch_0_step_4", 4, lambda: None)  # a save's record: the page is due
    deadline = time.monotonic() + 20
    while not (run / "report.html").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "epoch_0_step_4" in (run / "report.html").read_text(encoding="utf-8")
    assert live._thread.name == "ckpt-report" and live._thread.daemon
    live.close()
    assert not live._thread.is_alive()


def test_a_page_that_cannot_be_written_is_one_warning_and_the_writer_goes_on(tmp_path):
    live = LiveReport(tmp_path / "gone")  # no run folder: every write fails
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        live.request()
        time.sleep(0.3)
        assert live._thread.is_alive()  # survived
        live.close()
    assert any("logging.report" in str(w.message) and "not written" in str(w.message) for w in seen)


def test_env_names_versions_devices_paths_and_redacts_secrets(monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_verysecret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-verysecret")
    monkeypatch.setenv("MASTER_ADDR", "node7")
    monkeypatch.setenv("HF_ENDPOINT", "https://user:pw-verysecret@hub.example")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for name in ("automodel-ckpt", "torch", "transformers", "peft", "vllm", "lm-eval"):
        assert f"- {name}: " in out
    assert "- devices: " in out and "- Hugging Face cache: " in out and "- assets: " in out
    assert "MASTER_ADDR=node7" in out and "HF_TOKEN=<redacted>" in out and "AWS_SECRET_ACCESS_KEY=<redacted>" in out
    assert "verysecret" not in out and "HF_ENDPOINT=https://user:<redacted>@hub.example" in out
    assert main(["env", "--no-such-flag"]) == 2
