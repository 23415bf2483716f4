"""The stand-in hub (tests/fakehub.py) takes uploads from huggingface_hub's client as the Hub does.

Every call here is the installed HfApi talking HTTP to the fake hub on loopback: what zerotuner's
push to `hf://user/repo` will do, so its tests can rely on the fake behaving like the Hub.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fakehub import FakeHub
from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    hf_hub_download,
    snapshot_download,
)
from huggingface_hub.errors import (
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
)
from huggingface_hub.hf_api import RepoFile, RepoFolder

REPO = "user/checkpoints"
TOKEN = "hf_fakehub_upload_token"


@pytest.fixture
def hub(monkeypatch):
    with FakeHub(token=TOKEN) as hub:
        hub.use_in_this_process(monkeypatch)
        yield hub


@pytest.fixture
def api(hub) -> HfApi:
    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo(REPO, private=True, exist_ok=True)
    return api


def checkpoint(folder: Path) -> dict[str, bytes]:
    """A small checkpoint-like folder: binary shards in a subfolder, a JSON beside them."""
    files = {"model/shard-0.bin": os.urandom(70_000), "model/shard-1.bin": os.urandom(1),
             "model/opt/state.bin": os.urandom(3_000), "meta.json": b'{"step": 3}\n'}  # fmt: skip
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return files


def files_of(api: HfApi, revision: str | None = None) -> dict[str, int]:
    tree = api.list_repo_tree(REPO, recursive=True, revision=revision)
    return {e.path: e.size for e in tree if isinstance(e, RepoFile)}


def test_create_upload_list_delete_and_download_back(hub, api, tmp_path):
    api.create_repo(REPO, private=True, exist_ok=True)  # exists: a 409 the client lets pass
    with pytest.raises(HfHubHTTPError) as exists:
        api.create_repo(REPO)
    assert exists.value.response.status_code == 409
    first = api.repo_info(REPO)
    assert first.private and [s.rfilename for s in first.siblings] == [".gitattributes"]
    fresh = files_of(api)  # a new repo holds .gitattributes, as on the Hub

    files = checkpoint(tmp_path / "local")
    info = api.upload_folder(repo_id=REPO, folder_path=tmp_path / "local", path_in_repo="step-3")
    api.upload_file(path_or_fileobj=b"step-3\n", path_in_repo="latest", repo_id=REPO)
    uploaded = fresh | {f"step-3/{name}": len(data) for name, data in files.items()}
    assert files_of(api) == uploaded | {"latest": 7}
    assert len({first.sha, info.oid, api.repo_info(REPO).sha}) == 3  # a new id per commit

    top = {e.path: type(e) for e in api.list_repo_tree(REPO, path_in_repo="step-3/model")}
    assert top == {"step-3/model/shard-0.bin": RepoFile, "step-3/model/shard-1.bin": RepoFile,
                   "step-3/model/opt": RepoFolder}  # fmt: skip
    paths = api.get_paths_info(REPO, ["latest", "step-3/model", "nowhere"])
    assert [(type(p), p.path) for p in paths] == [
        (RepoFile, "latest"),
        (RepoFolder, "step-3/model"),
    ]
    assert api.file_exists(REPO, "step-3/meta.json") and not api.file_exists(REPO, "step-3/x")

    got = hf_hub_download(REPO, "step-3/model/shard-0.bin", endpoint=hub.url, token=TOKEN,
                          cache_dir=tmp_path / "cache")  # fmt: skip
    assert Path(got).read_bytes() == files["model/shard-0.bin"]

    drop = [CommitOperationDelete("step-3/meta.json"), CommitOperationDelete("step-3/model/opt/")]
    api.create_commit(REPO, commit_message="drop", operations=drop)
    kept = {".gitattributes", "latest", "step-3/model/shard-0.bin", "step-3/model/shard-1.bin"}
    assert set(api.list_repo_files(REPO)) == kept
    assert files_of(api, revision=info.oid) == uploaded  # an earlier commit reads as it was
    with pytest.raises(RemoteEntryNotFoundError):  # nothing to delete: refused, as on the Hub
        api.delete_file("step-3/meta.json", REPO)


def test_a_file_changed_on_the_hub_is_downloaded_anew(hub, api, tmp_path):
    cache = tmp_path / "cache"
    for text in (b"step-1\n", b"step-2\n"):
        api.upload_file(path_or_fileobj=text, path_in_repo="latest", repo_id=REPO)
        got = hf_hub_download(REPO, "latest", endpoint=hub.url, token=TOKEN, cache_dir=cache)
        assert Path(got).read_bytes() == text
        snapshot = snapshot_download(REPO, endpoint=hub.url, token=TOKEN, cache_dir=cache)
        assert (Path(snapshot) / "latest").read_bytes() == text
    head = hub.head(REPO)  # the same content again: the client skips it (its blob id matches)
    api.upload_file(path_or_fileobj=b"step-2\n", path_in_repo="latest", repo_id=REPO)
    assert hub.head(REPO) == head


def test_a_failed_commit_leaves_the_previous_files(hub, api, tmp_path):
    checkpoint(tmp_path)
    api.upload_folder(repo_id=REPO, folder_path=tmp_path / "model", path_in_repo="step-1")
    before, head = files_of(api), hub.head(REPO)

    hub.fail_commits = True
    operations = [
        CommitOperationAdd("step-2/shard.bin", os.urandom(5000)),
        CommitOperationAdd("latest", b"step-2\n"),
        CommitOperationDelete("step-1/"),
    ]
    with pytest.raises(HfHubHTTPError) as failed:
        api.create_commit(REPO, operations=operations, commit_message="step 2")
    assert failed.value.response.status_code == 500
    assert files_of(api) == before and hub.head(REPO) == head
    assert not api.file_exists(REPO, "latest")

    hub.fail_commits = 1  # the next commit fails, the one after goes through
    with pytest.raises(HfHubHTTPError):
        api.upload_file(path_or_fileobj=b"step-2\n", path_in_repo="latest", repo_id=REPO)
    api.upload_file(path_or_fileobj=b"step-2\n", path_in_repo="latest", repo_id=REPO)
    assert files_of(api) == before | {"latest": 7}


def test_writes_without_the_right_token_or_rights_are_refused(hub, api, tmp_path):
    stranger = HfApi(endpoint=hub.url, token="hf_not_the_token")
    with pytest.raises(HfHubHTTPError) as refused:
        stranger.create_repo("user/other", exist_ok=True)
    assert refused.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError) as refused:
        stranger.upload_file(path_or_fileobj=b"x", path_in_repo="x", repo_id=REPO)
    assert refused.value.response.status_code == 401
    with pytest.raises(RepositoryNotFoundError):  # reading: a private repo looks absent
        stranger.list_repo_files(REPO)
    with pytest.raises(RepositoryNotFoundError):
        api.list_repo_files("user/never-created")

    hub.read_only = True  # a token without write access: the repo exists, writes are 403
    api.create_repo(REPO, private=True, exist_ok=True)
    with pytest.raises(HfHubHTTPError) as forbidden:
        api.upload_file(path_or_fileobj=b"x", path_in_repo="x", repo_id=REPO)
    assert forbidden.value.response.status_code == 403
    assert api.list_repo_files(REPO) == [".gitattributes"]


def test_repos_outlive_a_restart_of_the_hub_on_the_same_storage(tmp_path, monkeypatch):
    with FakeHub(storage=tmp_path / "hub") as hub:
        hub.use_in_this_process(monkeypatch)
        api = HfApi(endpoint=hub.url)
        api.create_repo(REPO, exist_ok=True)
        api.upload_file(path_or_fileobj=b"kept", path_in_repo="a/b.txt", repo_id=REPO)
        head = hub.head(REPO)
    with FakeHub(storage=tmp_path / "hub") as hub:
        hub.use_in_this_process(monkeypatch)
        got = hf_hub_download(REPO, "a/b.txt", endpoint=hub.url, cache_dir=tmp_path / "cache")
        assert Path(got).read_bytes() == b"kept" and hub.head(REPO) == head
