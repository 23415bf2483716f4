"""The node's metrics endpoint, served by the entrypoint: /metrics, /healthz, /readyz, and the
read-only run page at / (its data at /api/run; see `zerotuner.monitor.run_page`).

The entrypoint starts `MetricsServer` first thing and stops it last, so Prometheus sees the
probing and download phases and the export. Ranks write their values to the multiprocess
directory (see `zerotuner.monitor.metrics` for why); the server merges those files at every
scrape with what only the entrypoint knows: the node phase, `zerotuner_info`, the offload
volume's usage.

Health, as Kubernetes probes read it:
- /readyz: 503 until the first training step finished on this node, 200 from then on.
- /healthz: 200 before the first step (downloads and latent caching can take an hour; guard
  that with the Job's activeDeadlineSeconds, not the liveness probe); after it, 503 once no step
  finished for `ZT_HANG_TIMEOUT_SECONDS` while the node is in a step-loop phase (training,
  checkpointing, validating); 200 again in exporting/done/failed, when no more steps come.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, TypedDict, cast
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from zerotuner import __version__, web
from zerotuner.errors import EnvironmentUnfit
from zerotuner.monitor.http_limits import ConnectionLimits, StrictRequests
from zerotuner.monitor.metrics import METRICS, MULTIPROC_DIR_ENV, PHASE_ENTERED, PHASES
from zerotuner.monitor.run_page import RunView

log = logging.getLogger(__name__)

STEP_LOOP_PHASES = ("training", "checkpointing", "validating")
INFO_LABELS = METRICS["zerotuner_info"].labels


def prepare_metrics_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """Create (or empty) the node-local directory ranks write their metric files to.

    Call in the entrypoint before launching ranks: it also exports PROMETHEUS_MULTIPROC_DIR so
    the ranks inherit it. Only `*.db` files are removed: stale ones would add an old run's
    counts. `None` makes a fresh temporary directory. Never point it at a shared volume.
    """
    folder = Path(path) if path is not None else Path(tempfile.mkdtemp(prefix="zt-metrics-"))
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.db"):
        stale.unlink(missing_ok=True)
    os.environ[MULTIPROC_DIR_ENV] = str(folder)
    return folder


@dataclass(frozen=True)
class NodeStatus:
    phase: str
    last_step_timestamp: float | None  # newest over this node's ranks; None before a step


def healthz(status: NodeStatus, *, now: float, hang_timeout_seconds: float) -> tuple[bool, str]:
    """Liveness: False only when steps stopped for longer than the timeout mid-training."""
    if status.last_step_timestamp is None:
        return True, f"ok: phase {status.phase}, no step finished yet"
    idle = now - status.last_step_timestamp
    if status.phase in STEP_LOOP_PHASES and idle > hang_timeout_seconds:
        return False, (
            f"hung: no step finished for {idle:.0f} s in phase {status.phase} "
            f"(ZT_HANG_TIMEOUT_SECONDS={hang_timeout_seconds:g})"
        )
    return True, f"ok: phase {status.phase}, last step {idle:.1f} s ago"


def readyz(status: NodeStatus) -> tuple[bool, str]:
    if status.last_step_timestamp is None:
        return False, f"not ready: phase {status.phase}, no step finished yet"
    return True, f"ready: phase {status.phase}"


def current_phase(entered: dict[str, float]) -> str:
    """The phase entered last by any process of the node."""
    return max(entered.items(), key=lambda item: item[1])[0] if entered else "starting"


class _DirUsage:
    """Bytes under a directory and free on its filesystem, cached briefly.

    NVMe swap folders hold thousands of files: walk them at most every `max_age` seconds, not
    once per scrape (a burst of scrapes would otherwise walk them in parallel).
    """

    def __init__(self, path: Path, max_age: float = 10.0) -> None:
        self.path = path
        self._max_age = max_age
        self._lock = threading.Lock()
        self._at = -float("inf")
        self._value: tuple[int, int, int] | None = None

    def read(self) -> tuple[int, int, int] | None:
        """(used, free, size) in bytes. A directory not made yet holds 0 bytes; free and size
        are then its nearest existing parent's (where it will be created)."""
        with self._lock:
            if time.monotonic() - self._at > self._max_age:
                self._value = self._measure()
                self._at = time.monotonic()
            return self._value

    def _measure(self) -> tuple[int, int, int] | None:
        existing = next((p for p in (self.path, *self.path.parents) if p.is_dir()), None)
        if existing is None:
            return None
        usage = shutil.disk_usage(existing)
        used = _allocated_bytes(self.path) if existing == self.path else 0
        return used, usage.free, usage.total


def _allocated_bytes(root: Path) -> int:
    total = 0
    for folder, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512  # sparse-aware
            except OSError:
                continue  # deleted between listing and stat
    return total


class NodeCollector:
    """Rank metrics from `source` plus the entrypoint's own: phase, info, offload volume."""

    def __init__(
        self,
        source: Any,
        *,
        offload_dir: str | os.PathLike[str] | None = None,
        health: Callable[[NodeStatus], bool] | None = None,
    ) -> None:
        self._source = source  # MultiProcessCollector or an in-process CollectorRegistry
        self._lock = threading.Lock()
        self._entered: dict[str, float] = {"starting": time.time()}
        self._info = dict.fromkeys(INFO_LABELS, "unknown") | {"version": __version__}
        self._offload = _DirUsage(Path(offload_dir)) if offload_dir else None
        self._health = health or (lambda status: True)

    def set_phase(self, phase: str) -> None:
        with self._lock:
            self._entered[phase] = time.time()

    def set_info(self, **labels: Any) -> None:
        unknown = set(labels) - set(INFO_LABELS)
        if unknown:
            raise ValueError(f"unknown zerotuner_info labels: {sorted(unknown)}")
        with self._lock:
            self._info |= {k: str(v) for k, v in labels.items()}

    def set_job(self, job: Any) -> None:
        """Fill `zerotuner_info` from a `zerotuner.launch.job.Job`."""
        self.set_info(
            zero_stage=job.zero_stage,
            offload_optimizer=job.offload_optimizer,
            offload_param=job.offload_param,
            world_size=job.world_size,
            model_family=job.family,
            precision=job.mixed_precision,
        )

    def snapshot(self) -> tuple[list[Metric], NodeStatus]:
        """Read the ranks' families once; derive the node status from them."""
        families: list[Metric] = []
        with self._lock:
            entered = dict(self._entered)
        last_step: float | None = None
        for family in self._source.collect():
            if family.name == PHASE_ENTERED:
                for sample in family.samples:
                    phase = sample.labels.get("phase", "")
                    entered[phase] = max(entered.get(phase, 0.0), sample.value)
                continue
            if family.name == "zerotuner_last_step_timestamp_seconds":
                for sample in family.samples:
                    if sample.value > 0:
                        last_step = max(last_step or 0.0, sample.value)
            families.append(family)
        return families, NodeStatus(current_phase(entered), last_step)

    def collect(self) -> Iterable[Metric]:
        families, status = self.snapshot()
        yield from families
        phase = _family("zerotuner_phase")
        for name in (*PHASES, *sorted({status.phase} - set(PHASES))):
            phase.add_metric([name], 1.0 if name == status.phase else 0.0)
        yield phase
        with self._lock:
            info_labels = dict(self._info)
        info = _family("zerotuner_info")
        info.add_metric([info_labels[k] for k in INFO_LABELS], 1.0)
        yield info
        yield _family("zerotuner_healthy", value=float(self._health(status)))
        yield from self._offload_families()

    def _offload_families(self) -> Iterable[Metric]:
        usage = self._offload.read() if self._offload else None
        names = ("used", "free", "size")
        for name, value in zip(names, usage or (None, None, None), strict=True):
            family = _family(f"zerotuner_offload_dir_{name}_bytes")
            if value is not None:
                family.add_metric([], float(value))
            yield family


def _family(name: str, value: float | None = None) -> GaugeMetricFamily:
    """A node-made series as CATALOG declares it."""
    spec = METRICS[name]
    if value is not None:
        return GaugeMetricFamily(name, spec.help, value=value)
    return GaugeMetricFamily(name, spec.help, labels=list(spec.labels))


PROBES = ("/healthz", "/readyz")
RANGE = re.compile(r"bytes=(\d*)-(\d*)")
BEYOND = 1 << 63  # a position past any file: a 5000-digit one is not parsed (int() refuses it)
CHUNK = 1 << 16  # bytes a sample file is streamed in


def _position(digits: str) -> int:
    return int(digits) if len(digits) <= 18 else BEYOND


def ranged(
    size: int, header: str | None, if_range: str | None = None
) -> tuple[str, list[tuple[str, str]], tuple[int, int]]:
    """A sample file's answer to a request with `Range: bytes=...` (RFC 9110 14): (status,
    headers, the [start, stop) bytes to send). Chromium's media player asks for `bytes=0-`;
    answered 200 it still plays a small clip through and loops it, but it cannot seek
    (`seekable` stays empty and a seek lands on 0: the controls' scrubber does nothing);
    answered 206 it seeks (tests/test_video_samples.py). One range is served (first-last,
    first-, -suffix); several ranges, another unit, a malformed header or an If-Range (this
    server gives no validators) get the whole file, 200, as the RFC allows; a range past the
    end gets 416."""
    whole = ("200 OK", [("Accept-Ranges", "bytes")], (0, size))
    match = RANGE.fullmatch((header or "").strip())
    if match is None or if_range or match.groups() == ("", ""):
        return whole
    first, last = match.groups()
    if first:
        start, end = _position(first), min(_position(last), size - 1) if last else size - 1
        if last and _position(last) < start:
            return whole  # invalid: ignored
    else:  # the last `last` bytes
        start, end = max(0, size - _position(last)), size - 1
        if _position(last) == 0:
            start = size  # unsatisfiable
    if start >= size:
        return "416 Range Not Satisfiable", [("Content-Range", f"bytes */{size}")], (0, 0)
    return (
        "206 Partial Content",
        [("Accept-Ranges", "bytes"), ("Content-Range", f"bytes {start}-{end}/{size}")],
        (start, end + 1),
    )


def _stream(file: BinaryIO, start: int, stop: int) -> Iterator[bytes]:
    """[start, stop) of an open file, CHUNK bytes at a time; closed when the answer ends (wsgiref
    closes the iterator whether the client read it all or went away)."""
    with file:
        file.seek(start)
        while start < stop and (chunk := file.read(min(CHUNK, stop - start))):
            start += len(chunk)
            yield chunk


class _Server(ConnectionLimits, WSGIServer):
    """Bounded (see `zerotuner.monitor.http_limits`); the probes get through a storm of
    connections."""


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Limits(TypedDict):
    """`ConnectionLimits`' keyword arguments."""

    idle_timeout: float
    request_timeout: float
    max_connections: int
    priority_paths: tuple[str, ...]


class _Answer(ServerHandler):
    """wsgiref's handler, minus its tracebacks on stderr (the training log): a client that
    stops reading or hangs up mid-answer (a timeout, a reset) is its own doing, one debug line;
    anything else is a bug of the page, one error line, its traceback at debug level."""

    # Set by wsgiref as it answers (typeshed leaves them out).
    environ: dict[str, Any]
    headers_sent: bool
    request_handler: WSGIRequestHandler  # its close() logs the request through it

    def handle_error(self) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            log.debug("run page: a client went away: %r", error)
            return
        log.error("run page: %s failed: %s: %s", self.environ.get("PATH_INFO", "")[:200],
                  type(error).__name__, error)  # fmt: skip
        log.debug("run page: the failure's traceback", exc_info=True)
        if not self.headers_sent:
            self.result = self.error_output(self.environ, self.start_response)
            self.finish_response()


class _QuietHandler(StrictRequests, WSGIRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape would drown the training log

    def handle(self) -> None:
        """wsgiref's `handle`, with `_Answer` in place of its ServerHandler."""
        self.raw_requestline = self.rfile.readline(65537)
        if len(self.raw_requestline) > 65536:
            self.requestline = self.request_version = self.command = ""
            self.send_error(414)
            return
        if not self.parse_request():  # an error status was sent
            return
        # wsgiref only writes and flushes: the socket's BufferedIOBase serves as IO[bytes].
        handler = _Answer(self.rfile, cast(IO[bytes], self.wfile), self.get_stderr(),
                          self.get_environ(), multithread=False)  # fmt: skip
        handler.request_handler = self
        app = self.server.get_app()
        assert app is not None  # MetricsServer.start sets it before serving
        handler.run(app)


def _not_found(start_response: Callable[..., Any]) -> list[bytes]:
    start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
    return [b"not found: try /, /metrics, /healthz or /readyz\n"]


class MetricsServer:
    """The HTTP endpoint, in a background thread of the entrypoint process.

    Connections are bounded (`zerotuner.monitor.http_limits`): a read or write waits at most
    `idle_timeout` s, a connection lives at most `request_timeout` s, and at most
    `max_connections` are served at once; beyond that /healthz and /readyz still get through
    (a liveness probe must not restart training because scrapers hold the port), the rest 503.
    """

    def __init__(
        self,
        host: str = "0.0.0.0",
        port: int = 9464,
        *,
        hang_timeout_seconds: float = 1800,
        multiproc_dir: str | os.PathLike[str] | None = None,
        offload_dir: str | os.PathLike[str] | None = None,
        source: Any = None,
        clock: Callable[[], float] = time.time,
        output_dir: str | os.PathLike[str] | None = None,
        history_interval: float | None = 5.0,
        idle_timeout: float = 5.0,
        request_timeout: float = 30.0,
        max_connections: int = 64,
    ) -> None:
        if source is None:
            folder = multiproc_dir or os.environ.get(MULTIPROC_DIR_ENV)
            if not folder:
                raise ValueError("MetricsServer needs multiproc_dir (see prepare_metrics_dir)")
            source = MultiProcessCollector(None, path=str(folder))
        self.host, self._port = host, port
        self.hang_timeout_seconds = hang_timeout_seconds
        self._clock = clock
        self.collector = NodeCollector(
            source, offload_dir=offload_dir, health=lambda status: self._healthz(status)[0]
        )
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self._metrics_app = make_wsgi_app(self.registry)
        self._limits = _Limits(
            idle_timeout=idle_timeout,
            request_timeout=request_timeout,
            max_connections=max_connections,
            priority_paths=PROBES,
        )
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        # The run page: OUTPUT/run records, and per-rank metrics sampled every few seconds.
        self.run_view = RunView(Path(output_dir) if output_dir is not None else None)
        self._history_interval = history_interval
        self._stopping = threading.Event()
        self._sampler: threading.Thread | None = None

    # -- what the entrypoint reports -----------------------------------------------------------
    def set_phase(self, phase: str) -> None:
        self.collector.set_phase(phase)

    def set_job(self, job: Any) -> None:
        self.collector.set_job(job)
        if dataclasses.is_dataclass(job) and not isinstance(job, type):
            self.run_view.job = dataclasses.asdict(job)

    def set_plan(self, plan: dict[str, Any]) -> None:
        """The plan `train` chose by (`plan --json`'s shape), for the run page."""
        self.run_view.plan = plan

    def set_info(self, **labels: Any) -> None:
        self.collector.set_info(**labels)

    # -- health --------------------------------------------------------------------------------
    def status(self) -> NodeStatus:
        return self.collector.snapshot()[1]

    def _healthz(self, status: NodeStatus) -> tuple[bool, str]:
        return healthz(status, now=self._clock(), hang_timeout_seconds=self.hang_timeout_seconds)

    def healthz(self) -> tuple[bool, str]:
        return self._healthz(self.status())

    def readyz(self) -> tuple[bool, str]:
        return readyz(self.status())

    # -- HTTP ----------------------------------------------------------------------------------
    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b"read-only: GET /, /metrics, /healthz or /readyz\n"]
        if path in PROBES:
            ok, text = self.healthz() if path == "/healthz" else self.readyz()
            status = "200 OK" if ok else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
            return [text.encode() + b"\n"]
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if path.startswith("/run/samples/"):
            return self._sample(path.removeprefix("/run/samples/"), environ, start_response)
        found = self._run_page(path)
        if found is not None:
            body, media = found
            start_response("200 OK", [("Content-Type", media), ("Cache-Control", "no-store")])
            return [body]
        return _not_found(start_response)

    def _sample(
        self, relative: str, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        """A sample PNG or MP4, the bytes a <video> asks for (see `ranged`) streamed from disk."""
        found = self.run_view.sample_path(relative)
        try:
            file = found[0].open("rb") if found is not None else None
        except OSError:  # removed since (a checkpoint's retention), or unreadable
            file = None
        if found is None or file is None:
            return _not_found(start_response)
        size = os.fstat(file.fileno()).st_size
        status, extra, (start, stop) = ranged(
            size, environ.get("HTTP_RANGE"), environ.get("HTTP_IF_RANGE")
        )
        headers = [("Content-Type", found[1]), ("Cache-Control", "no-store"),
                   ("X-Content-Type-Options", "nosniff"), *extra]  # fmt: skip
        if status.startswith("416"):
            file.close()
            body = f"range not satisfiable: the file has {size} bytes\n".encode()
            start_response(status, [*extra, ("Content-Type", "text/plain; charset=utf-8"),
                                    ("Content-Length", str(len(body)))])  # fmt: skip
            return [body]
        start_response(status, [*headers, ("Content-Length", str(stop - start))])
        if environ.get("REQUEST_METHOD") == "HEAD":
            file.close()
            return []
        return _stream(file, start, stop)

    def _run_page(self, path: str) -> tuple[bytes, str] | None:
        """The run page's files and data (read-only: GET and HEAD only reach here)."""
        if path in ("/", "/index.html"):
            return web.asset("run.html")
        if path.startswith("/static/"):
            return web.asset(path.removeprefix("/static/"))
        if path == "/api/run":
            families, status = self.collector.snapshot()
            state = self.run_view.state(families, status.phase)
            return json.dumps(state).encode(), "application/json"
        return None

    def _sample_history(self) -> None:
        """The server thread's sampler: per-rank step time and memory, for the run page."""
        assert self._history_interval is not None
        while not self._stopping.wait(self._history_interval):
            try:
                families, _ = self.collector.snapshot()
                self.run_view.history.add(families, time.time())
            except Exception:  # noqa: BLE001 - a rank mid-write; the next sample reads it
                continue

    def start(self) -> MetricsServer:
        server_class = _Server6 if ":" in self.host else _Server  # an IPv6 address such as "::"
        try:
            self._httpd = server_class((self.host, self._port), _QuietHandler, **self._limits)
        except OSError as exc:
            raise EnvironmentUnfit(
                f"ZT_METRICS_PORT={self._port}: cannot listen on {self.host}:{self._port} "
                f"({exc.strerror}); choose a free port, or 0 to disable the endpoint"
            ) from None
        self._httpd.set_app(self._app)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="zerotuner-metrics", daemon=True
        )
        self._thread.start()
        if self._history_interval:
            self._stopping.clear()
            self._sampler = threading.Thread(
                target=self._sample_history, name="zerotuner-run-page", daemon=True
            )
            self._sampler.start()
        return self

    @property
    def port(self) -> int:
        return self._httpd.server_address[1] if self._httpd else self._port

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        self._stopping.set()
        if self._sampler is not None:
            self._sampler.join()
            self._sampler = None
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
