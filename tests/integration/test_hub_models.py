"""Hub ids: downloaded once per node (safetensors only) from a real HTTP server speaking the Hub's protocol; offline,
gated and pickle-only repos fail in one line; `--dry-run` says where the model lies."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import REPO, ckpt_train, env_for, losses
from tests.integration.hub_server import HubServer

REPO_ID = "acme/tiny-llama"
HUB_MODEL = ["--model.pretrained_model_name_or_path", REPO_ID, "--model.embedded", "null"]
SHORT = ["--step_scheduler.max_steps", "2", "--step_scheduler.global_batch_size", "8",
         "--step_scheduler.local_batch_size", "4", "--data.val_size", "0", "--dataset.num_samples", "64",
         "--checkpoint.enabled", "false"]


@pytest.fixture(scope="module")
def hub(assets: Path, tmp_path_factory: pytest.TempPathFactory):
    """The embedded tiny base as a Hub repo (with pickled weights beside it that must never be fetched), a gated
    repo and a repo with pickles only."""
    root = tmp_path_factory.mktemp("hub")
    repo = root / "tiny-llama"
    shutil.copytree(assets / "tiny_llama_base", repo)
    (repo / "pytorch_model.bin").write_bytes(b"a pickle: never fetched")
    (repo / "training_args.pt").write_bytes(b"a pickle: never fetched")
    pickles = root / "pickles"
    pickles.mkdir()
    shutil.copy(repo / "config.json", pickles / "config.json")
    (pickles / "pytorch_model.bin").write_bytes(b"a pickle")
    server = HubServer({REPO_ID: repo, "acme/gated": repo, "acme/pickles": pickles}, gated=("acme/gated",)).start()
    yield server
    server.stop()


def _hub_env(hub: HubServer, home: Path, offline: bool = False) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1" if offline else "0",
            "HF_HUB_DISABLE_TELEMETRY": "1"}


def _expected_files(hub: HubServer) -> set[str]:
    return {f.name for f in hub.repos[REPO_ID].iterdir() if f.suffix not in (".bin", ".pt")}


def test_a_hub_id_is_downloaded_once_and_trains_on_two_processes(hub, assets, tmp_path):
    home = tmp_path / "hf"
    result = ckpt_train(tmp_path, assets, *HUB_MODEL, *SHORT, nproc=2, env=_hub_env(hub, home))
    fetched = hub.downloads(REPO_ID)
    assert set(fetched) == _expected_files(hub) and set(fetched.values()) == {1}, fetched
    assert not [p for _, p in hub.requests if p.endswith((".bin", ".pt"))]
    assert result.output.count(f"Downloading {REPO_ID}") == 1
    assert len(losses(tmp_path / "checkpoints")) == 2
    snapshot = next((home / "hub" / "models--acme--tiny-llama" / "snapshots").iterdir())
    assert {f.name for f in snapshot.iterdir()} == _expected_files(hub)


def test_processes_started_without_the_launcher_download_once_between_them(hub, tmp_path):
    """Workers started by torchrun or srun directly: the first to take the cache's lock downloads, the other waits."""
    before = hub.downloads("acme/gated")  # same files, its own counter; un-gate it for this test
    hub.gated.discard("acme/gated")
    try:
        code = "from automodel_ckpt.models.hub import model_folder; print(model_folder('acme/gated'))"
        env = env_for(tmp_path, _hub_env(hub, tmp_path / "hf")) | {"PYTHONPATH": str(REPO)}
        procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        hub.gated.add("acme/gated")
    assert all(p.returncode == 0 for p in procs), outs
    folders = [out.splitlines()[-1] for out, _ in outs]
    assert folders[0] == folders[1] and "snapshots" in folders[0]  # both read the same snapshot
    assert sum("Downloading acme/gated" in out for out, _ in outs) == 1
    fetched = hub.downloads("acme/gated") - before
    assert set(fetched) == _expected_files(hub) and set(fetched.values()) == {1}, fetched


def test_offline_fails_in_one_line_naming_the_fetch_command(hub, assets, tmp_path):
    result = ckpt_train(tmp_path, assets, *HUB_MODEL, env=_hub_env(hub, tmp_path / "hf", offline=True), check=False)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: model.pretrained_model_name_or_path: '{REPO_ID}' is neither a local folder "
                               "nor in the Hugging Face cache")
    assert f"hf download {REPO_ID} " in lines[0] and "--include '*.safetensors'" in lines[0]
    # The command it names, run where the Hub is reachable, fetches what the run needs: the run is then offline-ready.
    hf = str(Path(sys.executable).parent / "hf")
    command = shlex.split(lines[0].split("with: ", 1)[1].replace("hf ", f"{hf} ", 1))
    subprocess.run(command, env=env_for(tmp_path, _hub_env(hub, tmp_path / "hf")), check=True, capture_output=True,
                   timeout=120)
    status = "from automodel_ckpt.models.hub import model_source; print(model_source(%r).status)" % REPO_ID
    env = env_for(tmp_path, _hub_env(hub, tmp_path / "hf", offline=True)) | {"PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", status], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "cached"


GATED_AND_PICKLES = """
from automodel_ckpt.errors import ConfigError
from automodel_ckpt.models.hub import model_folder
for repo in ("acme/gated", "acme/pickles"):
    try:
        model_folder(repo)
    except ConfigError as exc:
        print(exc)
"""


def test_gated_and_pickle_only_repos_fail_in_one_line(hub, tmp_path):
    env = env_for(tmp_path, _hub_env(hub, tmp_path / "hf")) | {"PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", GATED_AND_PICKLES], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.splitlines()
    assert len(out) == 2, out
    assert "'acme/gated' is gated or private: accept its licence" in out[0] and "set HF_TOKEN" in out[0]
    assert "'acme/pickles' has no safetensors weights" in out[1]
    assert hub.downloads("acme/pickles") == {}
