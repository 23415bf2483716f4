"""A local stand-in for the Hugging Face Hub (`HF_ENDPOINT=hub.url`) serving folders as repos.

It speaks the part of the hub's HTTP API huggingface_hub uses to download: the revision info
(`/api/models/<repo>/revision/<rev>`) and `HEAD`/`GET /<repo>/resolve/<rev>/<file>` with the
commit and ETag headers. Nothing can reach the real hub here; this lets the download path run
for real. `hub.requests` records (method, path) so tests can see what was fetched.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

SHA = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, Path], *, token: str | None = None) -> None:
        self.repos, self.token = repos, token
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._serve(self, body=False)

            def do_GET(self) -> None:
                hub._serve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fetched(self, method: str = "GET") -> list[str]:
        """Files downloaded (by repo-relative path), in order."""
        return [p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p in self.requests
                if m == method and "/resolve/" in p]  # fmt: skip

    def _serve(self, req: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(urlparse(req.path).path)
        self.requests.append((req.command, path))
        if self.token and req.headers.get("Authorization") != f"Bearer {self.token}":
            return self._send(req, 401, b"{}", body, {"X-Error-Code": "RepoNotFound"})
        api = path.startswith("/api/models/")
        repo = path[len("/api/models/") :] if api else path.lstrip("/")
        for marker in ("/revision/", "/tree/", "/resolve/"):
            repo, found, rest = repo.partition(marker)
            if found:
                break
        if repo not in self.repos:
            return self._send(req, 404, b"{}", body, {"X-Error-Code": "RepoNotFound"})
        root = self.repos[repo]
        if found == "/resolve/":  # rest = <revision>/<file>
            file = root / rest.split("/", 1)[1]
            if not file.is_file():
                headers = {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": SHA}
                return self._send(req, 404, b"", body, headers)
            data = file.read_bytes()
            etag = hashlib.sha256(data).hexdigest()
            return self._send(req, 200, data, body, {"X-Repo-Commit": SHA, "ETag": f'"{etag}"'})
        files = {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}
        if found == "/tree/":  # the recursive listing snapshot_download filters
            info: object = [
                {"type": "file", "path": name, "size": p.stat().st_size, "oid": SHA}
                for name, p in files.items()
            ]
        else:  # the revision's info: its commit and files
            info = {"id": repo, "sha": SHA, "siblings": [{"rfilename": n} for n in files]}
        headers = {"Content-Type": "application/json"}
        return self._send(req, 200, json.dumps(info).encode(), body, headers)

    @staticmethod
    def _send(req, status: int, data: bytes, body: bool, headers: dict) -> None:
        req.send_response(status)
        for key, value in headers.items():
            req.send_header(key, value)
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if body:
            req.wfile.write(data)
