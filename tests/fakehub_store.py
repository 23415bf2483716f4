"""The repos behind the fake hub (tests/fakehub.py): one folder per commit and a HEAD file.

`<root>/<owner>/<name>/<commit>/` holds the files of that commit; files a commit does not change
are hard links to its parent's, and no file is ever written in place, so every commit stays
readable at its id (as pinned downloads expect). A commit is staged in a new folder and becomes
`main` only when `HEAD` is replaced by a rename: a commit that fails or is killed midway leaves
the previous one in place, as on the Hub. A folder served as-is (FakeHub's `repos`) is its repo's
first commit, `SHA`, and is never written to.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path, PurePosixPath

SHA = "0123456789abcdef0123456789abcdef01234567"  # the commit of a served folder
# what the Hub commits into a new repo (abridged): a fresh repo is never empty there either
GITATTRIBUTES = b"".join(
    b"%s filter=lfs diff=lfs merge=lfs -text\n" % pattern
    for pattern in (b"*.bin", b"*.safetensors")
)


class Refused(Exception):
    """An error answer: HTTP status, the Hub's X-Error-Code (what the client maps to exceptions)."""

    def __init__(self, status: int, code: str, message: str, *, headers: dict | None = None,
                 body: dict | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers, self.body = headers or {}, {"error": message} | (body or {})


def git_blob_id(data: bytes) -> str:
    """The id git (and the Hub's tree, and the client's unchanged-file check) gives a file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def inside(folder: Path, path: str) -> Path:
    """`path` (repo-relative, posix) under `folder`; a path that would leave it is refused."""
    parts = PurePosixPath(path).parts
    if not parts or path.startswith("/") or ".." in parts:
        raise Refused(400, "", f"invalid path in repo: {path!r}")
    return folder.joinpath(*parts)


class Store:
    def __init__(self, root: Path, served: dict[str, Path]) -> None:
        self.root, self.served = root, served
        self._lock = threading.Lock()  # one commit at a time, as a branch takes them
        self._blob_ids: dict[tuple, str] = {}  # (inode, mtime, size) -> id: snapshots never change

    def exists(self, repo: str) -> bool:
        return repo in self.served or (self.root / repo / "HEAD").is_file()

    def private(self, repo: str) -> bool:
        meta = self.root / repo / "repo.json"
        return meta.is_file() and json.loads(meta.read_text())["private"]

    def create(self, repo: str, *, private: bool) -> bool:
        """A new repo whose first commit holds .gitattributes; False if it exists already."""
        with self._lock:
            if self.exists(repo):
                return False
            first = self.root / repo / os.urandom(20).hex()
            first.mkdir(parents=True)
            (first / ".gitattributes").write_bytes(GITATTRIBUTES)
            (self.root / repo / "repo.json").write_text(json.dumps({"private": private}))
            _replace(self.root / repo / "HEAD", first.name)
        return True

    def snapshot(self, repo: str, revision: str) -> tuple[str, Path]:
        """(commit id, folder) of `main` or a commit id; 404 if the repo or revision isn't there."""
        if not self.exists(repo):
            raise Refused(404, "RepoNotFound", f"repository {repo} not found")
        head = self.root / repo / "HEAD"
        sha = (head.read_text() if head.is_file() else SHA) if revision == "main" else revision
        if sha == SHA and repo in self.served:  # still SHA after commits were made on top of it
            return sha, self.served[repo]
        is_id = len(sha) == 40 and all(c in "0123456789abcdef" for c in sha)
        if is_id and (self.root / repo / sha).is_dir():
            return sha, self.root / repo / sha
        raise Refused(404, "RevisionNotFound", f"revision {revision} not found in {repo}")

    def blob_id(self, file: Path) -> str:
        st = file.stat()
        key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        if key not in self._blob_ids:
            self._blob_ids[key] = git_blob_id(file.read_bytes())
        return self._blob_ids[key]

    def describe(self, folder: Path, path: Path) -> dict:
        """A tree entry as the Hub lists it: files with size and blob id, folders with an id."""
        rel = path.relative_to(folder).as_posix()
        if path.is_dir():  # a stand-in id: nothing here reads folders' git tree ids
            return {"type": "directory", "path": rel, "oid": hashlib.sha1(rel.encode()).hexdigest()}
        size = path.stat().st_size
        return {"type": "file", "path": rel, "size": size, "oid": self.blob_id(path)}

    def tree(self, folder: Path, path: str, *, recursive: bool) -> list[dict]:
        base = inside(folder, path) if path else folder
        if not base.is_dir():
            raise Refused(404, "EntryNotFound", f"{path} is not a folder of this revision")
        found = base.rglob("*") if recursive else base.iterdir()
        return [self.describe(folder, p) for p in sorted(found)]

    def commit(
        self, repo: str, revision: str, lines: list[dict], *, fail: Callable[[], bool]
    ) -> str:
        """Apply a commit's NDJSON lines (header, then operations) to `main`; its new id.

        When `fail()` says so, the commit's files are written in full, then the swap is skipped and
        a 500 is answered: what a hub dying mid-commit looks like from outside.
        """
        if not lines or lines[0].get("key") != "header":
            raise Refused(400, "", "a commit starts with its header line")
        if revision != "main":
            raise Refused(404, "RevisionNotFound", f"commits go to main here, not {revision}")
        with self._lock:
            parent, base = self.snapshot(repo, revision)
            expected = lines[0]["value"].get("parentCommit")
            if expected not in (None, parent):
                raise Refused(412, "", f"parentCommit {expected} is not the head of main {parent}")
            (self.root / repo).mkdir(parents=True, exist_ok=True)
            stage = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.root / repo))
            try:
                shutil.copytree(base, stage, dirs_exist_ok=True, copy_function=_link_or_copy)
                for line in lines[1:]:
                    _apply(stage, line["key"], line["value"])
                _prune_empty_folders(stage)  # git has no empty folders
                if fail():
                    raise Refused(500, "", "the commit failed before it was applied (fail_commits)")
                sha = os.urandom(20).hex()
                stage.rename(self.root / repo / sha)
                _replace(self.root / repo / "HEAD", sha)  # the swap: main is the new commit
            except OSError as error:  # e.g. a file where the commit needs a folder
                raise Refused(400, "", f"cannot apply the commit: {error}") from None
            finally:
                shutil.rmtree(stage, ignore_errors=True)
        return sha


def _apply(stage: Path, key: str, value: dict) -> None:
    target = inside(stage, value["path"])
    if key == "file":
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(
            missing_ok=True
        )  # it may be a hard link to the parent's copy: never write through
        target.write_bytes(base64.b64decode(value["content"]))
    elif key == "deletedFile":
        if not target.is_file():
            raise Refused(
                404, "EntryNotFound", f"A file with this name doesn't exist: {value['path']}"
            )
        target.unlink()
    elif key == "deletedFolder":
        if not target.is_dir():
            raise Refused(
                404, "EntryNotFound", f"A folder with this name doesn't exist: {value['path']}"
            )
        shutil.rmtree(target)
    else:  # lfsFile: preupload never answers "lfs" here, so the client never sends one
        raise Refused(400, "", f"commit operation {key!r} is not supported by this fake hub")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem
        shutil.copy2(src, dst)


def _prune_empty_folders(root: Path) -> None:
    for folder, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):
        if folder != str(root) and not os.listdir(folder):
            os.rmdir(folder)


def _replace(path: Path, text: str) -> None:
    """Write `text` to `path` by a rename, so readers see the old or the new content, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(text)
    os.replace(tmp, path)
