"""Remote stores for outputs that outlive the machine: `ZT_PUSH_TO=hf://user/repo` or `s3://...`.

A store is a flat namespace of keys ("checkpoints/step-8/zerotuner.json") under the URL's repo
or prefix, with the few operations the pusher and the remote resume need. Both speak through
well-kept clients: boto3 for any S3-compatible service (endpoint, region and credentials from
the standard AWS variables, or `aws_access_key_id` / `aws_secret_access_key` files in the
secrets folder) and huggingface_hub for the Hub (a private model repo, the usual token). A
Hub commit is atomic, so a checkpoint goes up as one commit; S3 objects appear whole, one by one.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import ParamSpec, Protocol, TypeVar

from zerotuner.errors import EnvironmentUnfit
from zerotuner.settings.push_url import SETTING, parse

log = logging.getLogger(__name__)

P = ParamSpec("P")  # a remote call's arguments and its result, for the stores' _call
R = TypeVar("R")


class RemoteError(Exception):
    """A remote operation failed (network, permissions, a missing object): retried or reported."""


class Store(Protocol):
    url: str  # for logs: never holds a credential

    def list(self, prefix: str) -> dict[str, int]:
        """Keys under `prefix` (a folder, ending in /) with their sizes in bytes."""

    def upload(self, files: Sequence[tuple[Path, str]], message: str) -> None:
        """Put local files at keys; on the Hub one commit, on S3 one object after another."""

    def download(self, key: str, path: Path) -> None: ...

    def read_text(self, key: str) -> str | None:
        """The object's text, None when there is no such key."""

    def write_text(self, key: str, text: str) -> None: ...

    def delete(self, prefix: str) -> None:
        """Every key under the folder `prefix`."""


def open_store(url: str, *, hf_token: str | None, secrets_dir: Path) -> Store:
    kind, where, prefix = parse(url)
    if kind == "s3":
        return S3Store(where, prefix, credentials=_aws_secret_files(secrets_dir))
    return HubStore(where, token=hf_token)


def probe(store: Store) -> None:
    """Write, read back and delete a small object: credentials, the bucket/repo and write
    access, before any GPU time is spent. Raises EnvironmentUnfit (exit 3) with one line."""
    key = f".zerotuner-probe/{uuid.uuid4().hex}"
    try:
        store.write_text(key, "zerotuner write probe\n")
        if store.read_text(key) is None:
            raise RemoteError("the probe object written could not be read back")
        store.delete(".zerotuner-probe/")
    except RemoteError as error:
        raise EnvironmentUnfit(f"{SETTING}={store.url}: cannot write there: {error}") from None


def _aws_secret_files(secrets_dir: Path) -> dict[str, str]:
    """Credentials from secret files when the AWS variables do not give them."""
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return {}
    files = {"aws_access_key_id": "aws_access_key_id",
             "aws_secret_access_key": "aws_secret_access_key",
             "aws_session_token": "aws_session_token"}  # fmt: skip
    found = {}
    for name, argument in files.items():
        path = secrets_dir / name
        if path.is_file():
            found[argument] = path.read_text().strip()
    return found


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"


# --- S3 ---------------------------------------------------------------------------------------


class S3Store:
    def __init__(self, bucket: str, prefix: str, *, credentials: dict[str, str]) -> None:
        import boto3
        from botocore.config import Config

        self.bucket, self.prefix = bucket, prefix
        self.url = f"s3://{bucket}/{prefix}"
        # The endpoint, region and keys come from AWS_* variables as for any AWS tool.
        retries = Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=10)
        # A session of its own: boto3's default one caches the first credentials it resolved.
        self.client = boto3.session.Session().client("s3", config=retries, **credentials)

    def _call(self, what: str, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(*args, **kwargs)
        except ClientError as error:
            code = error.response.get("Error", {}).get("Code", "?")
            message = error.response.get("Error", {}).get("Message", "")
            raise RemoteError(f"{what}: {code} ({message})") from None
        except (BotoCoreError, OSError) as error:
            raise RemoteError(f"{what}: {_one_line(error)}") from None

    def list(self, prefix: str) -> dict[str, int]:
        return {key: size for key, (size, _) in self.objects(prefix).items()}

    def objects(self, prefix: str) -> dict[str, tuple[int, str]]:
        """Keys under `prefix` with their size and ETag (an MD5 of the bytes unless the object
        was uploaded in parts: then `md5-parts`), to fetch a dataset and verify it."""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix
        )
        found = {}
        for page in self._call(f"list {prefix}", list, pages):
            for item in page.get("Contents", []):
                key = item["Key"][len(self.prefix) :]
                found[key] = (item["Size"], item.get("ETag", "").strip('"'))
        return found

    def upload(self, files: Sequence[tuple[Path, str]], message: str) -> None:
        for path, key in files:
            # SHA-256 checksum: the service rejects a body that differs from what was read.
            self._call(
                f"upload {key}", self.client.upload_file, str(path), self.bucket,
                self.prefix + key, ExtraArgs={"ChecksumAlgorithm": "SHA256"},
            )  # fmt: skip

    def download(self, key: str, path: Path) -> None:
        self._call(f"download {key}", self.client.download_file, self.bucket,
                   self.prefix + key, str(path))  # fmt: skip

    def read_text(self, key: str) -> str | None:
        try:
            reply = self._call(f"read {key}", self.client.get_object, Bucket=self.bucket,
                               Key=self.prefix + key)  # fmt: skip
        except RemoteError as error:
            if ": NoSuchKey (" in str(error):
                return None
            raise
        return reply["Body"].read().decode()

    def write_text(self, key: str, text: str) -> None:
        self._call(f"write {key}", self.client.put_object, Bucket=self.bucket,
                   Key=self.prefix + key, Body=text.encode())  # fmt: skip

    def delete(self, prefix: str) -> None:
        keys = [self.prefix + key for key in self.list(prefix)]
        for start in range(0, len(keys), 1000):  # the API's limit per request
            chunk = [{"Key": k} for k in keys[start : start + 1000]]
            self._call(f"delete {prefix}", self.client.delete_objects, Bucket=self.bucket,
                       Delete={"Objects": chunk, "Quiet": True})  # fmt: skip


# --- Hugging Face Hub -------------------------------------------------------------------------


class HubStore:
    def __init__(self, repo: str, *, token: str | None) -> None:
        from huggingface_hub import HfApi

        self.repo, self.url = repo, f"hf://{repo}"
        self.api = HfApi(token=token)
        self._created = False

    def _call(self, what: str, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        from huggingface_hub.errors import HfHubHTTPError

        try:
            return fn(*args, **kwargs)
        except HfHubHTTPError as error:
            status = getattr(error.response, "status_code", "?")
            raise RemoteError(f"{what}: HTTP {status} ({_one_line(error)})") from None
        except (OSError, ValueError) as error:
            raise RemoteError(f"{what}: {_one_line(error)}") from None

    def _ensure_repo(self) -> None:
        if not self._created:  # private by default: checkpoints are the user's own
            self._call("create the repo", self.api.create_repo, self.repo, private=True,
                       exist_ok=True)  # fmt: skip
            self._created = True

    def list(self, prefix: str) -> dict[str, int]:
        from huggingface_hub.hf_api import RepoFile

        entries = self.api.list_repo_tree(self.repo, path_in_repo=prefix.rstrip("/") or None,
                                          recursive=True)  # fmt: skip
        try:
            found = self._call(f"list {prefix}", list, entries)
        except RemoteError as error:
            if "HTTP 404" in str(error):  # no such folder (or repo) yet
                return {}
            raise
        return {e.path: e.size for e in found if isinstance(e, RepoFile)}

    def upload(self, files: Sequence[tuple[Path, str]], message: str) -> None:
        from huggingface_hub import CommitOperationAdd

        self._ensure_repo()
        operations = [CommitOperationAdd(path_in_repo=k, path_or_fileobj=str(p)) for p, k in files]
        self._call(message, self.api.create_commit, self.repo, operations=operations,
                   commit_message=message)  # fmt: skip

    def download(self, key: str, path: Path) -> None:
        import tempfile

        from huggingface_hub import hf_hub_download

        with tempfile.TemporaryDirectory(prefix="zerotuner-hub-", dir=path.parent) as tmp:
            local = self._call(f"download {key}", hf_hub_download, self.repo, key,
                               token=self.api.token, local_dir=tmp)  # fmt: skip
            os.replace(local, path)

    def read_text(self, key: str) -> str | None:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="zerotuner-hub-") as tmp:
            try:
                self.download(key, Path(tmp) / "object")
            except RemoteError as error:
                if "HTTP 404" in str(error):
                    return None
                raise
            return (Path(tmp) / "object").read_text()

    def write_text(self, key: str, text: str) -> None:
        from huggingface_hub import CommitOperationAdd

        self._ensure_repo()
        operation = CommitOperationAdd(path_in_repo=key, path_or_fileobj=text.encode())
        self._call(f"write {key}", self.api.create_commit, self.repo, operations=[operation],
                   commit_message=f"zerotuner: {key}")  # fmt: skip

    def delete(self, prefix: str) -> None:
        from huggingface_hub import CommitOperationDelete

        keys: Iterable[str] = self.list(prefix)
        if keys:
            operation = CommitOperationDelete(path_in_repo=prefix)  # a folder: ends in /
            message = f"zerotuner: delete {prefix}"
            self._call(f"delete {prefix}", self.api.create_commit, self.repo,
                       operations=[operation], commit_message=message)  # fmt: skip
