"""A tiny Hugging Face Hub on loopback: serves model repos from local folders the way `snapshot_download` reads them.

Endpoints (those ``huggingface_hub`` uses to fetch a snapshot): ``GET /api/models/{repo}/revision/{rev}`` (the
commit), ``GET /api/models/{repo}/tree/{rev}`` (the file listing) and ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``
(metadata headers, then the bytes). Every request is counted per path; a repo listed in ``gated`` answers 403 with
the Hub's gated-repo error code.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubServer:
    """``repos``: repo id -> folder whose top-level files are the repo's files."""

    def __init__(self, repos: dict[str, Path], gated: tuple[str, ...] = ()) -> None:
        self.repos = {name: Path(folder) for name, folder in repos.items()}
        self.gated = set(gated)
        self.requests: Counter[tuple[str, str]] = Counter()  # (method, path) -> count
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def start(self) -> HubServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def downloads(self, repo: str) -> Counter[str]:
        """How many times each file of ``repo`` was fetched (GET of its bytes)."""
        prefix = f"/{repo}/resolve/"
        return Counter({path[len(prefix):].split("/", 1)[-1]: n for (method, path), n in self.requests.items()
                        if method == "GET" and path.startswith(prefix)})

    def record(self, method: str, path: str) -> None:
        with self._lock:
            self.requests[(method, path)] += 1


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            hub.record(self.command, path)
            for repo, folder in hub.repos.items():
                api = f"/api/models/{repo}/"
                if path.startswith(api):
                    if repo in hub.gated:
                        return self._error(403, "GatedRepo", f"Access to model {repo} is restricted")
                    rest = path[len(api):]
                    if rest.startswith("revision/"):
                        return self._json({"id": repo, "sha": COMMIT,
                                           "siblings": [{"rfilename": f.name} for f in _files(folder)]}, body)
                    if rest.startswith("tree/"):
                        return self._json([{"type": "file", "path": f.name, "size": f.stat().st_size,
                                            "oid": _sha1(f)} for f in _files(folder)], body)
                resolve = f"/{repo}/resolve/"
                if path.startswith(resolve):
                    if repo in hub.gated:
                        return self._error(403, "GatedRepo", f"Access to model {repo} is restricted")
                    name = path[len(resolve):].split("/", 1)[-1]
                    file = folder / name
                    if "/" in name or not file.is_file():
                        return self._error(404, "EntryNotFound", f"{name} not found")
                    data = file.read_bytes()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.send_header("ETag", f'"{_sha1(file)}"')
                    self.send_header("X-Repo-Commit", COMMIT)
                    self.end_headers()
                    if body:
                        self.wfile.write(data)
                    return
            self._error(404, "RepoNotFound", "Repository not found")

        def _json(self, obj: object, body: bool) -> None:
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _error(self, status: int, code: str, message: str) -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler


def _files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.iterdir() if f.is_file())


def _sha1(file: Path) -> str:
    return hashlib.sha1(file.read_bytes()).hexdigest()
