"""Pushing a run's outputs to its remote (`ZT_PUSH_TO`) and resuming from there.

The pusher is a thread of the entrypoint on node 0, not of the ranks: it watches
`OUTPUT/checkpoints/latest` and uploads each newly committed checkpoint while training goes on.
The remote keeps the local layout, and its own `checkpoints/latest` moves only after every file
of that checkpoint is up and its size checked, so a torn upload is never the remote's latest.
Old remote checkpoints follow `ZT_CHECKPOINTS_KEEP`, deleted only after the new pointer is
written. When the ranks are done, the final export, `run/` records and a model card follow.

A fresh machine with no committed checkpoint in its output downloads the remote's latest (its
manifest's sha256s checked) before the ranks start, and the run resumes from it.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from zerotuner.publish.remote import RemoteError, Store, open_store
from zerotuner.settings.schema import Settings
from zerotuner.weights import checkpoint

if TYPE_CHECKING:
    from prometheus_client.core import Metric

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints/"
# The series the entrypoint's /metrics gains with a remote (pinned in test_public_names).
METRICS = ("zerotuner_push_bytes_total", "zerotuner_push_seconds_total",
           "zerotuner_push_failures_total", "zerotuner_push_last_step")  # fmt: skip
POLL_SECONDS = 2.0
BACKOFF_SECONDS = (2.0, 5.0, 15.0, 30.0, 60.0)  # then 60 s between tries, training goes on


@dataclass
class PushStats:
    """What the metrics report: zerotuner_push_* (read by the entrypoint's metrics server)."""

    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0
    last_step: int = -1  # the remote's latest committed checkpoint; -1 = none yet
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def open_remote(settings: Settings) -> Store:
    assert settings.push_to is not None
    token = settings.hf_token.get_secret_value() if settings.hf_token else None
    return open_store(settings.push_to, hf_token=token, secrets_dir=settings.secrets_dir)


def _local_files(folder: Path, key_prefix: str) -> list[tuple[Path, str]]:
    return [(p, f"{key_prefix}{p.relative_to(folder).as_posix()}")
            for p in sorted(folder.rglob("*")) if p.is_file()]  # fmt: skip


def remote_checkpoints(store: Store) -> dict[str, dict[str, int]]:
    """step-N -> {key: size} for every checkpoint folder on the remote (committed or not)."""
    found: dict[str, dict[str, int]] = {}
    for key, size in store.list(CHECKPOINTS).items():
        parts = key.split("/")
        if len(parts) > 2 and checkpoint.STEP_DIR.match(parts[1]):
            found.setdefault(parts[1], {})[key] = size
    return found


def _step(tag: str) -> int:
    return int(tag.split("-", 1)[1])


class Pusher:
    def __init__(self, store: Store, output_dir: Path, *, keep: int) -> None:
        self.store, self.output_dir, self.keep = store, output_dir, keep
        self.stats = PushStats()
        self._pushed: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._busy = threading.Lock()  # one upload at a time: the thread's or finish()'s
        self._retry_at = 0.0
        self._tries = 0

    # --- the background thread ---------------------------------------------------------------

    def start(self) -> Pusher:
        """Watch in the background; the checkpoint the remote already names is not pushed again
        (this machine resumed from it, or pushed it before a restart)."""
        try:
            pointer = self.store.read_text(f"{CHECKPOINTS}{checkpoint.LATEST}")
        except RemoteError:
            pointer = None
        self._pushed = pointer.strip() if pointer else None
        self._mark_remote_latest()
        self._thread = threading.Thread(target=self._watch, name="zerotuner-push", daemon=True)
        self._thread.start()
        return self

    def _mark_remote_latest(self) -> None:
        """Tell the ranks' rotation what is safe on the remote (checkpoint.REMOTE_LATEST)."""
        root = checkpoint.checkpoints_dir(self.output_dir)
        root.mkdir(parents=True, exist_ok=True)
        checkpoint.write_atomic(root / checkpoint.REMOTE_LATEST, self._pushed or "none")

    def _watch(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            if time.monotonic() >= self._retry_at:
                self.push_latest_checkpoint()

    def _local_latest(self) -> Path | None:
        root = checkpoint.checkpoints_dir(self.output_dir)
        pointer = root / checkpoint.LATEST
        tag = pointer.read_text().strip() if pointer.is_file() else None
        if tag and checkpoint.read_manifest(root / tag) is not None:
            return root / tag
        return None

    def push_latest_checkpoint(self) -> bool:
        """Upload the newest committed local checkpoint unless the remote has it. False when it
        failed (retried later with backoff); a checkpoint rotated away meanwhile is skipped."""
        with self._busy:
            folder = self._local_latest()
            if folder is None or folder.name == self._pushed:
                return True
            try:
                self._push_checkpoint(folder)
            except FileNotFoundError:
                log.info("push: %s was replaced locally while uploading; pushing the newer one",
                         folder.name)  # fmt: skip
                return True
            except RemoteError as error:
                self._failed(f"checkpoint {folder.name}", error)
                return False
            self._tries, self._retry_at = 0, 0.0
            return True

    def _failed(self, what: str, error: RemoteError) -> None:
        with self.stats.lock:
            self.stats.failures += 1
        wait = BACKOFF_SECONDS[min(self._tries, len(BACKOFF_SECONDS) - 1)]
        self._tries += 1
        self._retry_at = time.monotonic() + wait
        log.warning("push of %s to %s failed (%s); training goes on, next try in %.0f s",
                    what, self.store.url, error, wait)  # fmt: skip

    def _upload(self, files: list[tuple[Path, str]], message: str) -> None:
        started = time.monotonic()
        self.store.upload(files, message)
        with self.stats.lock:
            self.stats.bytes += sum(p.stat().st_size for p, _ in files)
            self.stats.seconds += time.monotonic() - started

    def _push_checkpoint(self, folder: Path) -> None:
        tag = folder.name
        # the manifest last: a remote folder without one was never committed
        files = sorted(_local_files(folder, f"{CHECKPOINTS}{tag}/"),
                       key=lambda f: f[0].name == checkpoint.MANIFEST)  # fmt: skip
        expected = {key: path.stat().st_size for path, key in files}
        log.info("push: uploading checkpoint %s (%d files, %.1f MB) to %s", tag, len(files),
                 sum(expected.values()) / 1e6, self.store.url)  # fmt: skip
        self._upload(files, f"zerotuner: checkpoint {tag}")
        there = self.store.list(f"{CHECKPOINTS}{tag}/")
        wrong = [k for k, size in expected.items() if there.get(k) != size]
        if wrong:
            raise RemoteError(f"{len(wrong)} file(s) of {tag} missing or short there: {wrong[0]}")
        self.store.write_text(f"{CHECKPOINTS}{checkpoint.LATEST}", tag)
        self._pushed = tag
        self._mark_remote_latest()
        with self.stats.lock:
            self.stats.last_step = _step(tag)
        log.info("push: checkpoint %s is the remote's latest", tag)
        self._rotate(tag)

    def _rotate(self, current: str) -> None:
        """Remote checkpoints beyond ZT_CHECKPOINTS_KEEP go (the newest stay, `current` too)."""
        if self.keep <= 0:
            return
        tags = sorted(remote_checkpoints(self.store), key=_step, reverse=True)
        keep = set(tags[: self.keep]) | {current}
        # the best evaluated step an early stop exports stays, as it does locally
        local = checkpoint.checkpoints_dir(self.output_dir) / current
        if (pinned := (checkpoint.read_manifest(local) or {}).get("keep_step")) is not None:
            keep.add(f"step-{pinned}")
        for tag in tags:
            if tag not in keep and _step(tag) < _step(current):
                self.store.delete(f"{CHECKPOINTS}{tag}/")
                log.info("push: removed old remote checkpoint %s", tag)

    # --- the end of a run ----------------------------------------------------------------------

    def finish(self, *, succeeded: bool, timeout: float, card: str | None = None) -> bool:
        """Stop watching; push the newest checkpoint and, after a successful run, the final
        export, `run/` and the model card. At most `timeout` seconds; True when all went up."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(timeout, 0.0))
        deadline = time.monotonic() + timeout
        folder = self._local_latest()
        if folder is not None and folder.name != self._pushed:
            log.info("push: waiting up to %.0f s for the upload of checkpoint %s", timeout,
                     folder.name)  # fmt: skip
        done = self._finish_in(deadline, succeeded, card)
        if not done:
            log.warning("push: not everything reached %s in time; the local output has it all",
                        self.store.url)  # fmt: skip
        return done

    def _finish_in(self, deadline: float, succeeded: bool, card: str | None) -> bool:
        result: list[bool] = []

        def work() -> None:
            ok = self.push_latest_checkpoint()
            if ok and succeeded:
                ok = self._push_outputs(card)
            result.append(ok)

        worker = threading.Thread(target=work, name="zerotuner-push-final", daemon=True)
        worker.start()
        worker.join(timeout=max(deadline - time.monotonic(), 0.0))
        return bool(result and result[0])

    def _push_outputs(self, card: str | None) -> bool:
        files: list[tuple[Path, str]] = []
        for name in ("final", "final-ema", "run", "samples"):
            folder = self.output_dir / name
            if folder.is_dir():
                files += _local_files(folder, f"{name}/")
        try:
            if files:
                self._upload(files, "zerotuner: final export and run records")
            if card is not None:
                self.store.write_text("README.md", card)
        except RemoteError as error:
            self._failed("the final export", error)
            return False
        log.info("push: final export, run records and model card are on %s", self.store.url)
        return True


class PushCollector:
    """zerotuner_push_* for the entrypoint's /metrics."""

    def __init__(self, stats: PushStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:  # prometheus_client's collector protocol
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from zerotuner.monitor.metrics import METRICS

        with self.stats.lock:
            values = {
                "zerotuner_push_bytes": self.stats.bytes,
                "zerotuner_push_seconds": self.stats.seconds,
                "zerotuner_push_failures": self.stats.failures,
                "zerotuner_push_last_step": self.stats.last_step,
            }
        for name, value in values.items():
            spec = METRICS[name]
            kind = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            yield kind(name, spec.help, value=value)


# --- resuming from the remote -----------------------------------------------------------------


def fetch_latest(store: Store, output_dir: Path) -> str | None:
    """Download the remote's latest committed checkpoint into an output that has none.

    The remote pointer's checkpoint first, then older ones: each is downloaded into a
    temporary folder, verified against its manifest (sizes and sha256s) and only then renamed
    into place with a local `latest`. Returns the tag, or None when the remote has nothing.
    """
    root = checkpoint.checkpoints_dir(output_dir)
    if checkpoint.committed_checkpoints(root):
        return None  # the local output wins: it is at least as new as what it pushed
    pointer = store.read_text(f"{CHECKPOINTS}{checkpoint.LATEST}")
    if pointer is None:
        return None
    remote = remote_checkpoints(store)
    newest_first = sorted((t for t in remote if _step(t) <= _step(pointer.strip())),
                          key=_step, reverse=True)  # fmt: skip
    for tag in newest_first:
        problem = _download(store, tag, remote[tag], root)
        if problem is None:
            checkpoint.write_atomic(root / checkpoint.LATEST, tag)
            log.info("resume: checkpoint %s downloaded from %s and verified", tag, store.url)
            return tag
        log.warning("resume: remote checkpoint %s is unusable (%s); trying the one before",
                    tag, problem)  # fmt: skip
    return None


def _download(store: Store, tag: str, keys: dict[str, int], root: Path) -> str | None:
    if f"{CHECKPOINTS}{tag}/{checkpoint.MANIFEST}" not in keys:
        return "no manifest: never committed"
    staging = root / f".{tag}.download"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    total = sum(keys.values())
    log.info("resume: downloading checkpoint %s (%d files, %.1f MB) from %s", tag, len(keys),
             total / 1e6, store.url)  # fmt: skip
    for key in keys:
        target = staging / key[len(f"{CHECKPOINTS}{tag}/") :]
        target.parent.mkdir(parents=True, exist_ok=True)
        store.download(key, target)
    problem = checkpoint.verify(staging)
    if problem is not None:
        shutil.rmtree(staging, ignore_errors=True)
        return problem
    staging.rename(root / tag)
    return None
