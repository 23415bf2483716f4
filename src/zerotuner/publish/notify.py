"""Notifications (`ZT_NOTIFY_URL`): a run's start, its committed checkpoints and samples, its
finish and every failure, told to a chat webhook or any service apprise speaks.

They are sent by threads of the entrypoint on node 0, never by a rank, so a training step never
waits on a network: a watcher notices new checkpoints (`checkpoints/`) and samples
(`samples/step-N/`) as the pusher does, and each target has a sender thread and a bounded
queue of its own, so a hanging endpoint holds back nobody else's events. Each delivery try has
a timeout (`ZT_NOTIFY_TIMEOUT_SECONDS`) and is retried after `BACKOFF_SECONDS`, then given up
with one warning; a full queue drops an event with a warning. At exit the queues get one
timeout more to drain: a dead endpoint delays the exit by that much and never changes its code.

URLs are anything apprise takes (discord://, slack://, ntfy://, tgram://, mailto://, json://,
...; https://github.com/caronc/apprise/wiki), and the webhook URLs Discord and Slack hand out,
as given. Any other http(s) URL gets a JSON POST: apprise's json:// payload, whose `title` names
the event ("zerotuner: checkpoint"), `message` says it in a line, `type` is info, success or
failure, and `attachments` carries sample images (base64). A URL is a secret: logs name a target
by its service and position ("Discord #1"), never by its URL.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from zerotuner.errors import EXIT_MEANINGS, EXIT_OK, ConfigError
from zerotuner.settings.schema import env_name

log = logging.getLogger(__name__)

NAME = env_name("notify_url")
POLL_SECONDS = 2.0  # how often the watcher looks for new checkpoints and samples
BACKOFF_SECONDS = (2.0, 10.0)  # pauses between the tries of one delivery
QUEUE_SIZE = 64  # events waiting to be sent; more are dropped with a warning
IMAGES_PER_EVENT = 4  # sample images attached to one samples event
SAMPLE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")

# Several URLs: separated by whitespace, or by a comma that starts another URL (an apprise URL
# may hold commas of its own: ?to=a,b).
_SEPARATOR = re.compile(r"\s+|,(?=\s*[A-Za-z][A-Za-z0-9+.-]*://)")


@dataclass(frozen=True)
class Event:
    kind: str  # start, checkpoint, samples, finish, failure
    message: str
    level: str = "info"  # info, success or failure (apprise's notify types)
    images: tuple[Path, ...] = ()

    @property
    def title(self) -> str:
        return f"zerotuner: {self.kind}"


def outcome(code: int, line: str, output_dir: Path) -> Event:
    """The last event of a run: its finish, or its failure with the code and its one line."""
    if code == EXIT_OK:
        return Event("finish", f"finished; the trained pipeline is in {output_dir / 'final'}",
                     level="success")  # fmt: skip
    meaning = EXIT_MEANINGS.get(code, "failed")
    return Event("failure", f"exit {code}: {meaning}" + (f": {line}" if line else ""),
                 level="failure")  # fmt: skip


@dataclass
class Target:
    name: str  # "Discord #1": how logs name it
    plugin: Any  # apprise's NotifyBase for the URL


def _plugin(url: str) -> Any:
    import apprise

    own = logging.getLogger("apprise")
    level = own.level
    own.setLevel(logging.CRITICAL)  # its "Unparseable URL" for a plain http(s) webhook: tried next
    try:
        plugin = apprise.Apprise.instantiate(url)
    finally:
        own.setLevel(level)
    if plugin is None and url.lower().startswith(("http://", "https://")):
        parts = urlsplit(url)
        if parts.hostname:  # a webhook of one's own: a JSON POST to it
            plugin = apprise.Apprise.instantiate(("jsons" if parts.scheme == "https" else "json")
                                                 + url[len(parts.scheme):])  # fmt: skip
    return plugin


def split_urls(value: str) -> list[str]:
    return [u.strip() for u in _SEPARATOR.split(value) if u and u.strip()]


def targets(value: str, *, timeout_seconds: float) -> list[Target]:
    """The notification targets of a ZT_NOTIFY_URL value; ConfigError for one no notifier takes
    (named by position: the value is a secret)."""
    found = []
    urls = split_urls(value)
    for position, url in enumerate(urls, 1):
        plugin = _plugin(url)
        if plugin is None:
            which = f"entry {position} of {len(urls)}" if len(urls) > 1 else "the value"
            raise ConfigError(
                f"{NAME}: {which} is no URL a notifier takes (not shown: it is a secret); give a "
                "Discord or Slack webhook URL, an http(s) URL for a JSON POST, or an apprise URL "
                "such as ntfy://topic (https://github.com/caronc/apprise/wiki)"
            )
        # apprise's own defaults are 4 s each; one delivery try is bounded by the setting
        plugin.socket_connect_timeout = plugin.socket_read_timeout = timeout_seconds
        found.append(Target(f"{plugin.service_name} #{position}", plugin))
    return found


def secret_parts(value: str | None) -> list[str]:
    """What of a ZT_NOTIFY_URL value to mask in logs: each URL, and its user, password, path
    segments and query values (apprise may log a URL rebuilt from them, e.g. a Discord token)."""
    parts: list[str] = []
    for url in split_urls(value or ""):
        parts.append(url)
        split = urlsplit(url)
        pieces = [split.username, split.password, *split.path.split("/")]
        pieces += [v for _, _, v in (q.partition("=") for q in split.query.split("&"))]
        parts += [p for p in pieces if p and len(p) >= 8]
    return parts


class _Sender:
    """One target's queue and thread: a hanging endpoint holds back its own events only."""

    def __init__(self, target: Target, backoff_seconds: tuple[float, ...]) -> None:
        self.target = target
        self.backoff_seconds = backoff_seconds
        self.queue: queue.Queue[Event | None] = queue.Queue(QUEUE_SIZE)
        self.deadline: float | None = None  # set at close: no retry waits past it
        self.delivered: list[str] = []  # event kinds, in order
        self.thread = threading.Thread(target=self._run, name=f"notify {target.name}",
                                       daemon=True)  # fmt: skip

    def put(self, event: Event | None) -> None:
        try:
            self.queue.put_nowait(event)
        except queue.Full:
            log.warning("notification %s to %s dropped: %d are waiting to be sent",
                        event.kind if event else "end", self.target.name, QUEUE_SIZE)  # fmt: skip

    def _run(self) -> None:
        while (event := self.queue.get()) is not None:
            self._deliver(event)

    def _deliver(self, event: Event) -> None:
        tries = 1 + len(self.backoff_seconds)
        for attempt in range(tries):
            if self._send_once(event):
                self.delivered.append(event.kind)
                return
            if attempt == tries - 1:
                break
            pause = self.backoff_seconds[attempt]
            if self.deadline is not None and time.monotonic() + pause > self.deadline:
                break
            time.sleep(pause)
        log.warning("notification %s to %s not delivered after %d tries; the run goes on",
                    event.kind, self.target.name, attempt + 1)  # fmt: skip

    def _send_once(self, event: Event) -> bool:
        import apprise

        attach = apprise.AppriseAttachment([str(p) for p in event.images]) if event.images else None
        plugin = self.target.plugin
        try:
            return bool(plugin.notify(body=event.message, title=event.title,
                                      notify_type=event.level, attach=attach))  # fmt: skip
        except Exception as error:  # a plugin's bug must not end the run: a failed delivery
            log.debug("notification %s to %s: %s", event.kind, self.target.name,
                      type(error).__name__)  # fmt: skip
            return False


@dataclass
class _Seen:
    """What the watcher has told about: committed checkpoint steps and sample folders."""

    checkpoints: set[int] = field(default_factory=set)
    samples: set[str] = field(default_factory=set)
    settling: dict[str, tuple[str, ...]] = field(default_factory=dict)  # folder -> its files


class Notifier:
    """A run's events to its targets, each on a thread of its own (see the module)."""

    def __init__(
        self, targets: list[Target], output_dir: Path, *, timeout_seconds: float,
        backoff_seconds: Iterable[float] = BACKOFF_SECONDS,
    ) -> None:  # fmt: skip
        self.output_dir = output_dir
        self.timeout_seconds = timeout_seconds
        self.senders = [_Sender(t, tuple(backoff_seconds)) for t in targets]
        self._stop_watching = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="notify watcher", daemon=True)
        self._seen = _Seen()
        self._started = self._finished = False

    def start(self) -> Notifier:
        """Node 0, once its ranks are started: from now on the run's events are sent."""
        self._scan(announce=False)  # what an earlier run left is no news
        for sender in self.senders:
            sender.thread.start()
        self._started = True
        log.info("notifications to %s", ", ".join(s.target.name for s in self.senders))
        return self

    def watch(self) -> None:
        """From now on, tell about each new checkpoint and samples folder (the ranks run)."""
        self._watcher.start()

    def send(self, event: Event) -> None:
        """Queue an event for every target; never blocks (a full queue drops it, saying so)."""
        for sender in self.senders:
            sender.put(event)

    def finish(self, code: int, line: str = "") -> None:
        """What the watcher has not told yet, the run's outcome, then one timeout at most to
        deliver it all. Once; nothing when never started (not node 0, or the run ended before
        its ranks were started)."""
        if self._finished or not self._started:
            return
        self._finished = True
        self._stop_watching.set()
        if self._watcher.is_alive():
            self._watcher.join()
        self._scan(announce=True, final=True)
        self.send(outcome(code, line, self.output_dir))
        deadline = time.monotonic() + self.timeout_seconds
        for sender in self.senders:
            sender.deadline = deadline
            sender.put(None)
        for sender in self.senders:
            sender.thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if sender.thread.is_alive():
                log.warning("notifications to %s still unsent %.0f s after the run ended: given "
                            "up", sender.target.name, self.timeout_seconds)  # fmt: skip

    # --- the watcher -----------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop_watching.wait(POLL_SECONDS):
            try:
                self._scan(announce=True)
            except OSError as error:  # an output folder being rotated: the next poll sees it
                log.debug("notify watcher: %s", error)

    def _scan(self, *, announce: bool, final: bool = False) -> None:
        for step in sorted(self._committed_steps() - self._seen.checkpoints):
            self._seen.checkpoints.add(step)
            if announce:
                self.send(Event("checkpoint", f"checkpoint at step {step} committed in "
                                f"{self.output_dir}"))  # fmt: skip
        for folder in self._sample_folders():
            if folder.name in self._seen.samples:
                continue
            files = tuple(sorted(p.name for p in folder.iterdir()))
            # told once it stopped changing for a poll (its images are written one by one), or
            # at the end
            settled = final or self._seen.settling.get(folder.name) == files
            self._seen.settling[folder.name] = files
            if announce and not (settled and files):
                continue
            self._seen.samples.add(folder.name)
            if announce:
                images = tuple(folder / f for f in files if f.lower().endswith(SAMPLE_SUFFIXES))
                self.send(Event("samples", f"samples at {folder.name.replace('-', ' ')}: "
                                f"{len(images)} image(s) in {folder}",
                                images=images[:IMAGES_PER_EVENT]))  # fmt: skip

    def _committed_steps(self) -> set[int]:
        # imported here, not at the top: weights.checkpoint imports torch, and the entrypoint
        # validates ZT_NOTIFY_URL (targets) before it starts the ranks
        from zerotuner.weights.checkpoint import checkpoints_dir, committed_checkpoints, step_of

        return {step_of(p) for p in committed_checkpoints(checkpoints_dir(self.output_dir))}

    def _sample_folders(self) -> list[Path]:
        from zerotuner.weights.checkpoint import STEP_DIR, step_of  # samples/step-N, as checkpoints

        root = self.output_dir / "samples"
        if not root.is_dir():
            return []
        return sorted((p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)),
                      key=step_of)  # fmt: skip
