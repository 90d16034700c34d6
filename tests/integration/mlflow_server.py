"""A real ``mlflow server`` on loopback for the tracking tests: found, started on a free port, stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.integration.harness import REPO, free_port, kill_job

START_TIMEOUT_S = 300  # a cold start imports flask, sqlalchemy and runs the store's migrations (slow under load)
SERVER_VENV = REPO / ".venv" / "mlflow-server"  # where tools/setup.sh installs the full mlflow, apart


def server_executable() -> str | None:
    """An ``mlflow`` command that has ``mlflow server``: AUTOMODEL_CKPT_MLFLOW_SERVER, the full mlflow that
    tools/setup.sh installs beside the test environment (it pins an older pyarrow, so it is kept apart), or this
    environment's own when it has the full package."""
    given = os.environ.get("AUTOMODEL_CKPT_MLFLOW_SERVER")
    if given:
        return given
    apart = SERVER_VENV / "bin" / "mlflow"
    if apart.is_file():
        return str(apart)
    here = Path(sys.executable).parent / "mlflow"
    done = subprocess.run([sys.executable, "-c", "import flask, mlflow.server"], capture_output=True)
    return str(here) if done.returncode == 0 and here.is_file() else None


class MlflowServer:
    """``mlflow server`` with a SQLite store in ``folder``; ``start`` again reopens the same store (same port)."""

    def __init__(self, executable: str, folder: Path) -> None:
        self.executable, self.folder = executable, Path(folder)
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = self.folder / "server.log"

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        cmd = [self.executable, "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
               "--backend-store-uri", f"sqlite:///{self.folder / 'store.db'}",
               "--artifacts-destination", str(self.folder / "artifacts")]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        # no job runner: it and its task consumers (15 processes importing all of mlflow at each start, a minute and
        # a half of CPU over the suite) serve MLflow's GenAI jobs, not tracking; and they outlive a SIGKILLed server
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"mlflow server exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    healthy = answer.status == 200
                if healthy:  # up; then one call that opens its store (the first one pays for that, not a run's)
                    search = f"{self.uri}/api/2.0/mlflow/experiments/search?max_results=1"
                    with urllib.request.urlopen(search, timeout=max(2.0, deadline - time.monotonic())) as answer:
                        if answer.status == 200:
                            return
            except OSError:
                time.sleep(0.2)
        self.kill()
        raise AssertionError(f"mlflow server did not answer within {START_TIMEOUT_S} s: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL the server and its workers (a crash, not a shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            kill_job(self.proc)
        self.proc = None

    def stop(self) -> None:
        """As ``kill``: a graceful stop waits up to half a minute for clients' idle keep-alive connections to close,
        and the test server's store is thrown away anyway."""
        self.kill()


MISSING = ("needs `mlflow server` (the full mlflow package): run tools/setup.sh, which installs it in "
           ".venv/mlflow-server, or set AUTOMODEL_CKPT_MLFLOW_SERVER to an mlflow executable")
