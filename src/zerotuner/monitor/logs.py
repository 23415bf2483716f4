"""Readable logs from many ranks: who speaks, in which format, and never a secret.

- Rank 0 logs INFO and up; other ranks WARNING and up, so errors from every rank still show.
  With more than one rank, each line carries the rank. `ZT_LOG_FORMAT=json` writes one JSON
  object per line (ts, level, rank, logger, msg, exc) for log pipelines.
- DeepSpeed, transformers, diffusers and torch install their own handlers; `setup_logging` routes
  them through ours so their lines get the same format, rank filter and masking. Call it after
  importing them (a library imported later brings its handler back).
- `ZT_LOG_LEVEL`: `info` (rank 0 INFO, other ranks WARNING), `debug` or `warning` (every rank).
- A few third-party messages that say nothing about the user's job (`KNOWN_NOISE`, matched by
  logger and message) are logged at DEBUG, where they arise: `demote_known_noise` runs before
  the libraries are imported, so those printed at import time are caught too.
- Every known secret value (HF_TOKEN and friends, plus any passed in) is replaced by `***` in
  the final text of every line, tracebacks included.
- `ProgressSink` (a `records.Sink`, rank 0 only): a tqdm bar on a terminal; otherwise one line
  every N steps with step/max, loss, s/step, samples/s, ETA and device memory.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

from tqdm import tqdm

from zerotuner.launch.records import Sink, StepRecord
from zerotuner.monitor.metrics import MemoryProbe, memory_probe
from zerotuner.settings.urls import hide_credentials

# Environment variables whose values are secrets wherever they appear.
SECRET_ENV_NAMES = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "ZT_HF_TOKEN",
    "ZT_NOTIFY_URL",
    "WANDB_API_KEY",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AZURE_STORAGE_KEY",
    "GOOGLE_APPLICATION_CREDENTIALS_JSON",
)
MIN_SECRET_LENGTH = 4  # masking "a" or "1" everywhere would wreck the log and protect nothing
# torch gives "torch" and "torch.distributed" handlers of their own (glog format) at import.
ADOPTED_LOGGERS = ("DeepSpeed", "transformers", "diffusers", "torch", "torch.distributed")
MASK = "***"
LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}

# Known third-party messages that concern no user's job, by logger and a fragment of the
# message: logged at DEBUG, not at their own level. Every other message keeps its level.
KNOWN_NOISE: dict[str, tuple[str, ...]] = {
    # The engine reads the LR once before the scheduler's first step.
    "DeepSpeed": ("Attempting to get learning rate from scheduler before it has started",),
    # Pipelines name CLIP/Siglip image processors; their PIL versions serve (no torchvision).
    "transformers.utils.import_utils": ("requires torchvision (not installed)",),
    # The CUDA image on a host without a GPU (ZT_DEVICE=cpu): nothing needs the CUDA runtime.
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
    # DeepSpeed's ZeRO collectives call the deprecated name, once per rank; DeepSpeed's to fix.
    # (ZeRO-3 with frozen parameters, as in a LoRA run, reduce-scatters every step)
    "py.warnings": (
        "FutureWarning: `torch.distributed.all_gather_into_tensor` is deprecated",
        "FutureWarning: `torch.distributed.reduce_scatter_tensor` is deprecated",
        # peft's LoRA on a torchao weight (ZT_BASE_PRECISION) cannot merge into it: the export
        # merges into the base read afresh instead
        "TorchaoLoraLinear was instantiated without `get_apply_tensor_subclass`",
    ),
    # Validation samples of a LoRA run load a UNet-only adapter into the whole pipeline.
    "diffusers.loaders.lora_base": ("No LoRA keys associated to CLIPTextModel",),
    # First start of a fresh container: matplotlib builds its font cache for the loss plot.
    "matplotlib.font_manager": ("generated new fontManager",),
    # torchao (ZT_BASE_PRECISION's storage), imported by diffusers whenever installed: kernels
    # built for other Pythons or GPUs than this one, and Triton's absent on a CPU (its
    # weight-only paths need neither), a deprecated registration it makes, and diffusers'
    # loader of torchao checkpoints, unused.
    "torchao": ("Failed to load",),
    "torchao.kernel.intmm": ("Detected no triton",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
    "diffusers.quantizers.torchao.torchao_quantizer": ("Unable to import `torchao` Tensor",),
    # bitsandbytes (ZT_OPTIMIZER=adamw8bit), imported by diffusers whenever installed: its 4-bit
    # CPU matmul kernel comes from the hub's `kernels` package, which 8-bit AdamW does not use
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward",),
}
# Libraries whose DEBUG lines are per-file internals (PNG chunks, font scoring): INFO at most.
CHATTY_LOGGERS = ("PIL", "matplotlib")


def secret_values(
    extra: Iterable[str | None] = (), environ: Mapping[str, str] | None = None
) -> list[str]:
    """Values to mask: the secret environment variables plus `extra`, longest first."""
    environ = os.environ if environ is None else environ
    candidates = {environ.get(name) for name in SECRET_ENV_NAMES} | set(extra)
    found = {s.strip() for s in candidates if s and len(s.strip()) >= MIN_SECRET_LENGTH}
    return sorted(found, key=len, reverse=True)  # a secret containing another masks whole


def mask(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, MASK)
    return hide_credentials(text)  # and any URL's user:password@, whatever variable held it


class _Demote(logging.Filter):
    """Lowers a known message to DEBUG. A logger's filter runs before any handler's level test,
    so the lowered record reaches only a DEBUG log, whatever handlers the library added."""

    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG and any(f in record.getMessage() for f in self.fragments):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            # handlers with no level of their own (basicConfig's, transformers') would pass it
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def demote_known_noise() -> None:
    """Put `KNOWN_NOISE` at DEBUG in this process (idempotent); call before importing the
    libraries that print it."""
    for name, fragments in KNOWN_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Demote) for f in logger.filters):
            logger.addFilter(_Demote(fragments))


def rank_level(log_level: str, rank: int) -> int:
    """The level of one rank's log for ZT_LOG_LEVEL: `info` keeps other ranks at WARNING (their
    errors still show, their progress is rank 0's); `debug` and `warning` apply to every rank."""
    level = LOG_LEVELS[log_level]
    return max(level, logging.WARNING) if log_level == "info" and rank != 0 else level


class TextFormatter(logging.Formatter):
    def __init__(self, *, rank: int, world_size: int, secrets: list[str]) -> None:
        prefix = f"[rank {rank}] " if world_size > 1 else ""
        super().__init__(f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s")
        self.secrets = secrets

    def format(self, record: logging.LogRecord) -> str:
        return mask(super().format(record), self.secrets)


class JsonFormatter(logging.Formatter):
    def __init__(self, *, rank: int, secrets: list[str]) -> None:
        super().__init__()
        self.rank = rank
        self.secrets = secrets

    def format(self, record: logging.LogRecord) -> str:
        ts = dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds")
        line: dict[str, Any] = {
            "ts": ts.replace("+00:00", "Z"),
            "level": record.levelname,
            "rank": self.rank,
            "logger": record.name,
            "msg": mask(record.getMessage(), self.secrets),
        }
        if record.exc_info:
            line["exc"] = mask(self.formatException(record.exc_info), self.secrets)
        return json.dumps(line, ensure_ascii=False)


class _Handler(logging.StreamHandler[TextIO]):
    """Writes through tqdm so a log line does not tear a progress bar on a terminal."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def setup_logging(
    *,
    rank: int = 0,
    world_size: int = 1,
    log_format: str = "text",
    level: int | None = None,
    secrets: Iterable[str | None] = (),
    stream: TextIO | None = None,
) -> logging.Handler:
    """Configure the root logger of this process (replaces its handlers); returns the handler.

    `secrets`: values to mask besides the environment's (e.g. settings.hf_token's value).
    """
    if log_format not in ("text", "json"):
        raise ValueError(f"log_format must be 'text' or 'json', not {log_format!r}")
    if level is None:
        level = logging.INFO if rank == 0 else logging.WARNING
    values = secret_values(secrets)
    handler = _Handler(stream or sys.stderr)
    handler.setLevel(level)  # filters adopted loggers too, whatever their own level
    if log_format == "json":
        handler.setFormatter(JsonFormatter(rank=rank, secrets=values))
    else:
        handler.setFormatter(TextFormatter(rank=rank, world_size=world_size, secrets=values))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name in ADOPTED_LOGGERS:
        library = logging.getLogger(name)
        for old in list(library.handlers):
            library.removeHandler(old)
        library.propagate = True
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(max(level, logging.INFO))
    quiet_http_logs()
    demote_known_noise()
    logging.captureWarnings(True)
    return handler


def quiet_http_logs() -> None:
    """The hub client's HTTP libraries log one INFO line per request: warnings only."""
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.WARNING)


def format_duration(seconds: float) -> str:
    """`1:02:03`, or `2d 3:04:05` past a day."""
    seconds = max(0, round(seconds))
    days, rest = divmod(seconds, 86400)
    text = str(dt.timedelta(seconds=rest))
    return f"{days}d {text}" if days else text


def format_memory(probe: MemoryProbe) -> str:
    mem = probe.sample()
    name = "vram" if mem.gpu_uuid else "rss"
    total = f"/{mem.total / 2**30:.1f}" if mem.total else ""
    return f"{name} {mem.allocated / 2**30:.1f}{total} GiB (peak {mem.peak / 2**30:.1f})"


class ProgressSink(Sink):
    """Training progress for people: a bar on a terminal, periodic lines in a log file.

    Active on rank 0 only (other ranks get a silent sink). s/step is the mean step time over the
    last interval; the ETA uses wall-clock time per step over that interval, so checkpoints and
    data waits are counted.
    """

    def __init__(
        self,
        rank: int,
        *,
        max_steps: int,
        every_steps: int = 10,
        start_step: int = 0,
        device: Any = "cpu",
        probe: MemoryProbe | None = None,
        stream: TextIO | None = None,
        tty: bool | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self.enabled = rank == 0
        if not self.enabled:
            return
        self.max_steps = max_steps
        self.every_steps = max(1, every_steps)
        self._log = logger or logging.getLogger("zerotuner.progress")
        self._probe = probe or memory_probe(device)
        self._stream = stream or sys.stderr
        if tty is None:
            tty = hasattr(self._stream, "isatty") and self._stream.isatty()
        self._bar = (
            tqdm(
                total=max_steps,
                initial=start_step,
                unit="step",
                dynamic_ncols=True,
                file=self._stream,
            )
            if tty
            else None
        )
        self._phase = ""
        self._started = time.time()
        self._window: list[StepRecord] = []
        self._window_start: float | None = None  # wall time the window's first step began
        self._steps_done = 0
        self._finished = True

    def on_phase(self, phase: str) -> None:
        if not self.enabled or phase == self._phase:
            return
        self._phase = phase
        if phase not in ("training", "checkpointing"):  # checkpoints get their own line
            self._log.info("phase: %s", phase)

    def on_step(self, record: StepRecord) -> None:
        if not self.enabled:
            return
        self._steps_done += 1
        if self._window_start is None:
            self._window_start = record.timestamp - record.step_seconds
        self._window.append(record)
        if self._bar is not None:
            self._bar.update(record.step - self._bar.n)
            rate = record.samples / record.step_seconds if record.step_seconds > 0 else 0.0
            self._bar.set_postfix_str(
                f"loss {record.loss:.4f}, {rate:.1f} samples/s, {format_memory(self._probe)}",
                refresh=False,
            )
            return
        if record.step % self.every_steps == 0 or record.step >= self.max_steps:
            self._log.info("%s", self.progress_line())
            self._window = []
            self._window_start = record.timestamp

    def progress_line(self) -> str:
        window = self._window
        last = window[-1]
        busy = sum(r.step_seconds for r in window)
        per_step = busy / len(window)
        samples_per_second = sum(r.samples for r in window) / busy if busy > 0 else 0.0
        wall_per_step = (last.timestamp - (self._window_start or last.timestamp)) / len(window)
        eta = max(0, self.max_steps - last.step) * max(wall_per_step, per_step)
        grad = f" | grad norm {last.grad_norm:.3g}" if last.grad_norm is not None else ""
        return (
            f"step {last.step}/{self.max_steps} ({100 * last.step / self.max_steps:.1f}%)"
            f" | loss {last.loss:.4f} | lr {last.lr:.3g}{grad} | {per_step:.2f} s/step"
            f" | {samples_per_second:.1f} samples/s | ETA {format_duration(eta)}"
            f" | {format_memory(self._probe)}"
        )

    def on_checkpoint(self, step: int, seconds: float) -> None:
        if self.enabled:
            self._log.info("checkpoint at step %d committed in %.1f s", step, seconds)

    def on_eval(self, step: int, loss: float) -> None:
        if self.enabled:
            self._log.info("held-out loss at step %d: %.6g", step, loss)

    def unfinished(self) -> None:
        """The run ends without finishing (a failure, a stop): the summary says so."""
        if self.enabled:
            self._finished = False

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elapsed = format_duration(time.time() - self._started)
        if self._finished:
            self._log.info("%d steps in %s", self._steps_done, elapsed)
        else:
            self._log.info("stopped unfinished after %d steps in %s", self._steps_done, elapsed)
