"""A local stand-in for the Hugging Face Hub (`HF_ENDPOINT=hub.url`): download from it, push to it.

Nothing can reach the real hub here; this lets huggingface_hub's own download and upload code run
for real against loopback. It speaks the part of the Hub's HTTP API that code uses:

- dataset repos (`datasets/<owner>/<name>` in `repos`) under `/api/datasets/` and
  `/datasets/<repo>/resolve/` as models are under `/api/models/` and `/<repo>/resolve/`;
- `GET /api/models/<repo>` and `/api/models/<repo>/revision/<rev>`: the commit id and files
  (`repo_info`, `model_info`, `snapshot_download`);
- `HEAD`/`GET /<repo>/resolve/<rev>/<file>`: a file, with the X-Repo-Commit and ETag headers;
- `GET /api/models/<repo>/tree/<rev>[/<path>]?recursive=`: path, type, size, oid (`list_repo_tree`,
  `list_repo_files`); `POST .../paths-info/<rev>` (`get_paths_info`);
- `POST /api/repos/create` (409 when it exists: `create_repo(exist_ok=True)` handles it);
- `POST /api/models/<repo>/preupload/<rev>`: "regular" for every file, so contents come inline
  (base64) in the commit: no LFS, no Xet; with the blob id of a file already there, so the client
  skips unchanged files as it does on the Hub;
- `POST /api/models/<repo>/commit/<rev>`: the NDJSON commit (files, deleted files and folders),
  applied to `main` all at once (tests/fakehub_store.py), answering commitUrl and commitOid;
- `POST /api/validate-yaml` (uploading a README.md), `GET /api/whoami-v2`.

Each commit gets a new id, and earlier commits stay readable at theirs. A served folder (`repos`)
is its repo's first commit, `SHA`; repos made by `create_repo` start with a .gitattributes, as on
the Hub. With `token`, any request without it is 401 (what a private repo looks like to a wrong
token). A repo that does not exist is 404 RepoNotFound. Switches for failure paths:
`hub.read_only = True` refuses writes (403); `hub.fail_commits = True` fails every commit with a
500 after writing its files but before `main` moves (`= n`: the next n commits; upload_folder
retries a 500 with backoff for ~25 s, create_commit and upload_file do not). `hub.requests`
records (method, path) so tests can see what was fetched. A client in the test's own process
needs `hub.use_in_this_process(monkeypatch)`; a subprocess needs HF_ENDPOINT=hub.url.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from fakehub_store import SHA, Refused, Store, inside

__all__ = ["SHA", "FakeHub"]

Answer = tuple[int, bytes, dict]


class FakeHub:
    """`FakeHub(repos, token=..., storage=..., port=...)`, used as a context manager.

    `repos` maps ids to folders served read-only as their first commit; uploads go under
    `storage` (a temporary folder by default, removed on exit; pass one to keep repos across a
    restart of the hub, with the same `port`).
    """

    def __init__(self, repos: dict[str, Path] | None = None, *, token: str | None = None,
                 storage: Path | None = None, port: int = 0) -> None:  # fmt: skip
        self.token = token
        self.read_only = False  # True: every write is 403
        self.fail_commits: bool | int = False  # True: every commit is 500; n: the next n are
        self.requests: list[tuple[str, str]] = []
        self._tmp = None if storage else tempfile.TemporaryDirectory(prefix="fakehub-")
        self.store = Store(Path(storage or self._tmp.name), dict(repos or {}))
        self._fail_lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._handle(self)

            do_GET = do_POST = do_HEAD

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self._tmp:
            self._tmp.cleanup()

    # --- for tests ------------------------------------------------------------------------------

    def create_repo(self, repo_id: str, *, private: bool = True) -> None:
        """An empty writable repo (its one file .gitattributes), as `HfApi.create_repo` makes."""
        self.store.create(repo_id, private=private)

    def folder(self, repo_id: str, revision: str = "main") -> Path:
        """The folder holding a revision's files (read it, never write it)."""
        return self.store.snapshot(repo_id, revision)[1]

    def head(self, repo_id: str) -> str:
        """The commit id `main` is at."""
        return self.store.snapshot(repo_id, "main")[0]

    def use_in_this_process(self, monkeypatch) -> None:  # noqa: ANN001 (pytest's fixture)
        """Point huggingface_hub in this process here, online, as HF_ENDPOINT=hub.url and
        HF_HUB_OFFLINE=0 do for a new one (the client reads them at import; conftest sets
        offline). Some client paths build URLs from these, not from HfApi(endpoint=...)."""
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", self.url)
        template = self.url + "/{repo_id}/resolve/{revision}/{filename}"
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)

    def fetched(self, method: str = "GET") -> list[str]:
        """Files downloaded (by repo-relative path), in order."""
        return [p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p in self.requests
                if m == method and "/resolve/" in p]  # fmt: skip

    # --- HTTP -----------------------------------------------------------------------------------

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        url = urlparse(req.path)
        self.requests.append((req.command, unquote(url.path)))
        # read the body before any answer: closing on an unread upload resets the client's socket
        body = req.rfile.read(int(req.headers.get("Content-Length") or 0))
        try:
            if self.token and req.headers.get("Authorization") != f"Bearer {self.token}":
                raise Refused(401, "RepoNotFound", "invalid or missing token")
            # split before unquoting: a revision or tree path arrives quoted, "/" as %2F
            parts = [unquote(p) for p in url.path.split("/")[1:]]
            status, data, headers = self._route(req.command, parts, parse_qs(url.query), body)
        except Refused as error:
            status, data = error.status, json.dumps(error.body).encode()
            headers = {"Content-Type": "application/json", "X-Error-Message": error.message}
            headers |= ({"X-Error-Code": error.code} if error.code else {}) | error.headers
        req.send_response(status)
        for key, value in headers.items():
            req.send_header(key, value)
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(data)

    def _route(self, method: str, parts: list[str], query: dict, body: bytes) -> Answer:
        read = method in ("GET", "HEAD")
        match parts:
            case [owner, name, "resolve", revision, *file] if read and file:
                return self._resolve(f"{owner}/{name}", revision, "/".join(file))
            case ["datasets", owner, name, "resolve", revision, *file] if read and file:
                return self._resolve(f"datasets/{owner}/{name}", revision, "/".join(file))
            case ["api", "datasets", owner, name] if read:
                return self._info(f"datasets/{owner}/{name}", "main", query)
            case ["api", "datasets", owner, name, action, revision, *rest]:
                return self._repo_api(
                    method, action, f"datasets/{owner}/{name}", revision, rest, query, body
                )
            case ["api", "whoami-v2"] if read:
                role = "read" if self.read_only else "write"
                return _json(
                    {"type": "user", "name": "user", "auth": {"accessToken": {"role": role}}}
                )
            case ["api", "validate-yaml"] if method == "POST":
                return _json({"errors": [], "warnings": []})
            case ["api", "repos", "create"] if method == "POST":
                return self._create(json.loads(body))
            case ["api", "models", owner, name] if read:
                return self._info(f"{owner}/{name}", "main", query)
            case ["api", "models", owner, name, action, revision, *rest]:
                return self._repo_api(
                    method, action, f"{owner}/{name}", revision, rest, query, body
                )
        raise Refused(404, "", f"{method} /{'/'.join(parts)} is not an endpoint of this fake hub")

    def _repo_api(self, method: str, action: str, repo: str, revision: str, rest: list[str],
                  query: dict, body: bytes) -> Answer:  # fmt: skip
        if method in ("GET", "HEAD") and action == "revision" and not rest:
            return self._info(repo, revision, query)
        if method == "GET" and action == "tree":
            recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
            folder = self.store.snapshot(repo, revision)[1]
            return _json(self.store.tree(folder, "/".join(rest), recursive=recursive))
        if method == "POST" and action == "paths-info":
            folder = self.store.snapshot(repo, revision)[1]
            paths = parse_qs(body.decode()).get("paths", [])
            found = [inside(folder, p) for p in paths]
            return _json([self.store.describe(folder, p) for p in found if p.exists()])
        if method == "POST" and action == "preupload":
            return self._preupload(repo, revision, json.loads(body))
        if method == "POST" and action == "commit":
            return self._commit(repo, revision, body)
        raise Refused(404, "", f"{method} {action} is not an endpoint of this fake hub")

    # --- endpoints ------------------------------------------------------------------------------

    def _resolve(self, repo: str, revision: str, file: str) -> Answer:
        sha, folder = self.store.snapshot(repo, revision)
        path = inside(folder, file)
        if not path.is_file():
            raise Refused(404, "EntryNotFound", f"{file} not found", headers={"X-Repo-Commit": sha})
        data = path.read_bytes()
        etag = hashlib.sha256(data).hexdigest()
        return 200, data, {"X-Repo-Commit": sha, "ETag": f'"{etag}"'}

    def _info(self, repo: str, revision: str, query: dict) -> Answer:
        sha, folder = self.store.snapshot(repo, revision)
        files = [e for e in self.store.tree(folder, "", recursive=True) if e["type"] == "file"]
        blobs = query.get("blobs", ["false"])[0].lower() == "true"  # files_metadata=True
        siblings = [
            {"rfilename": e["path"]} | ({"size": e["size"], "blobId": e["oid"]} if blobs else {})
            for e in files
        ]
        return _json({"id": repo, "sha": sha, "private": self.store.private(repo),
                      "siblings": siblings})  # fmt: skip

    def _check_writable(self) -> None:
        if self.read_only:
            raise Refused(403, "", "this token cannot write (hub.read_only)")

    def _create(self, payload: dict) -> Answer:
        self._check_writable()
        if payload.get("type", "model") != "model":
            raise Refused(400, "", "this fake hub holds model repos only")
        repo = f"{payload.get('organization') or 'user'}/{payload['name']}"
        url = f"{self.url}/{repo}"
        if not self.store.create(repo, private=payload.get("visibility") == "private"):
            # the Hub's 409 names the repo: create_repo(exist_ok=True) returns that url
            raise Refused(409, "", "You already created this model repo", body={"url": url})
        return _json({"url": url, "name": repo, "id": repo})

    def _preupload(self, repo: str, revision: str, payload: dict) -> Answer:
        self._check_writable()
        folder = self.store.snapshot(repo, revision)[1]
        answers = []
        for file in payload["files"]:
            there = inside(folder, file["path"])
            oid = self.store.blob_id(there) if there.is_file() else None
            answers.append({"path": file["path"], "uploadMode": "regular", "shouldIgnore": False,
                            "oid": oid})  # fmt: skip
        return _json({"files": answers})

    def _commit(self, repo: str, revision: str, body: bytes) -> Answer:
        self._check_writable()
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        sha = self.store.commit(repo, revision, lines, fail=self._take_failure)
        url = f"{self.url}/{repo}/commit/{sha}"
        return _json({"success": True, "commitOid": sha, "commitUrl": url, "pullRequestUrl": None})

    def _take_failure(self) -> bool:
        with self._fail_lock:
            if self.fail_commits is True:
                return True
            if self.fail_commits:  # a count
                self.fail_commits -= 1
                return True
            return False


def _json(value: object) -> Answer:
    return 200, json.dumps(value).encode(), {"Content-Type": "application/json"}
