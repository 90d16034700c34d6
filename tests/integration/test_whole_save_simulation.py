"""The whole save simulated at N ranks (bench_scale.py --simulate-ranks --end-to-end) is the real one, checked at
2 and 4 gloo ranks: the same final plans of both states, the same metadata, the same optimizer ``.metadata``."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_scale.py"


def _tool(*args: str) -> str:
    proc = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout


def _index(file: Path):
    from automodel_ckpt.ondisk.formats.safe_load import load_dcp_metadata

    md = load_dcp_metadata(file)
    storage = {index: vars(info) for index, info in md.storage_data.items()}  # locations and the writer's notes
    return md.state_dict_metadata, md.planner_data, md.version, storage


def test_the_simulated_whole_save_is_a_real_gloo_save(tmp_path):
    """Two and four gloo ranks save a tiny FSDP model and its AdamW state twice (the second from the caches);
    the simulation of the same layout plans the same for each rank and writes the same optimizer index."""
    real, sim = tmp_path / "real", tmp_path / "sim"
    real.mkdir()
    sim.mkdir()
    _tool("--ranks", "2,4", "--reps", "2", "--dump-plans", str(real))
    printed = _tool("--simulate-ranks", "2,4", "--layout", "tiny", "--end-to-end", "--dump-plans", str(sim),
                    "--json", str(tmp_path / "out.json"))
    assert "4 ranks, next:" in printed
    for n in (2, 4):
        for prefix in ("", "optim_"):
            for rank in range(n):
                ours = pickle.loads((sim / f"sim_{prefix}final_{n}_{rank}.pkl").read_bytes())  # this test's files
                theirs = pickle.loads((real / f"{prefix}final_{n}_{rank}.pkl").read_bytes())
                assert ours == theirs and repr(ours) == repr(theirs), (n, prefix, rank)
            ours = dataclasses.replace(pickle.loads((sim / f"sim_{prefix}metadata_{n}.pkl").read_bytes()), version=None)
            theirs = dataclasses.replace(pickle.loads((real / f"{prefix}metadata_{n}.pkl").read_bytes()), version=None)
            assert ours == theirs and repr(ours) == repr(theirs), (n, prefix)
        for which in (real / f"optim_file_{n}.bin", sim / f"sim_optim_file_{n}.bin"):
            which.rename(which.with_name(f"{which.stem}.metadata"))
        assert _index(sim / f"sim_optim_file_{n}.metadata") == _index(real / f"optim_file_{n}.metadata"), n
