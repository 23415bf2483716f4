"""Prometheus metrics, rank side: the metric catalog, device-memory probes, PrometheusSink.

How every rank's numbers reach the node's one endpoint: prometheus-client MULTIPROCESS MODE.
The entrypoint (one per node) wipes a node-local directory and exports it as
`PROMETHEUS_MULTIPROC_DIR` before launching torchrun (`metrics_server.prepare_metrics_dir`);
each rank inherits it, so every metric value it sets lands in an mmap file of its own; the
entrypoint's `MetricsServer` merges those files at scrape time. Chosen over collecting to
rank 0 because:
- the endpoint must live from the entrypoint's first second (probing, downloading) to its last
  (exporting), and must keep answering - and report a hang - while the ranks are stuck: a
  server inside a rank dies or freezes with it;
- collecting to rank 0 needs a collective (or a side channel) per step inside the loop; mmap
  writes cost microseconds and no synchronisation;
- one endpoint per node falls out of it: a node's ranks share a directory, Prometheus scrapes
  every node.
The cost: each gauge needs an aggregation mode. Every rank-side series carries a `rank` label
and uses `mostrecent`, so no `pid` label leaks out and a restarted rank's new value wins;
counters and histograms are summed over processes (a torchrun restart keeps counting up).
The directory must be emptied before launch (stale counters would be added) and must be
node-local, never a shared volume.

Per-rank convention: every series is this rank's share, so `sum()` over ranks and nodes gives
the job's totals (`samples_total`, throughput). Device memory per rank:
- CUDA: allocated/reserved/peak from `torch.cuda.memory_allocated/memory_reserved/
  max_memory_allocated`; total and `used` (CUDA contexts included, the driver's own reserve
  not) from NVML for the rank's GPU, matched by UUID (NVML ignores CUDA_VISIBLE_DEVICES); label
  `gpu_uuid` ("GPU-...") joins DCGM's `UUID`.
- CPU (DeepSpeed's CPU accelerator, whose own `memory_allocated` is the process RSS): allocated
  = reserved = the rank's resident set size, peak = the kernel's maximum RSS of the process
  (`getrusage`), total = the container's memory limit (cgroup), else the host's RAM.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from zerotuner.launch.records import Sink, StepRecord

log = logging.getLogger(__name__)

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600, float("inf"))
CHECKPOINT_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, float("inf"))


@dataclass(frozen=True)
class MetricSpec:
    """One series of /metrics: the catalog below is the one list the collectors build from,
    the pin test reads, docs/operations.md's table is generated from and the Grafana dashboard
    and alert rules are checked against."""

    name: str
    kind: str  # counter | gauge | histogram
    help: str
    # rank: each rank writes it (multiprocess files); node: the entrypoint's server makes it
    # (phase, health, offload volume); push: the pusher's (with ZT_PUSH_TO only)
    where: str = "rank"
    labels: tuple[str, ...] = ("rank",)  # `gpu_uuid` joins `rank` on CUDA: `device`
    device: bool = False  # a device-memory series: labelled by rank and, on CUDA, gpu_uuid
    cuda_only: bool = False
    contract: bool = False  # the public contract: renaming it breaks dashboards and alerts
    buckets: tuple[float, ...] = ()  # a histogram's
    attr: str = ""  # the rank-side object's attribute in _RankMetrics


def _rank(name: str, kind: str, help: str, attr: str, **more: Any) -> MetricSpec:
    return MetricSpec(name, kind, help, attr=attr, **more)


def _node(name: str, kind: str, help: str, labels: tuple[str, ...] = (), **more: Any) -> MetricSpec:
    return MetricSpec(name, kind, help, where="node", labels=labels, **more)


CATALOG: tuple[MetricSpec, ...] = (
    _rank("zerotuner_step_duration_seconds", "histogram",
          "Wall time of one optimizer step (all its micro-batches).", "step_seconds",
          contract=True, buckets=STEP_BUCKETS),
    _rank("zerotuner_steps_total", "counter", "Optimizer steps finished in this run.", "steps",
          contract=True),
    _rank("zerotuner_samples_total", "counter",
          "Training samples this rank processed in this run.", "samples", contract=True),
    _rank("zerotuner_loss", "gauge", "Training loss of the last step on this rank.", "loss",
          contract=True),
    _rank("zerotuner_learning_rate", "gauge", "Learning rate of the last step.", "lr",
          contract=True),
    _rank("zerotuner_device_memory_allocated_bytes", "gauge",
          "Device memory held by tensors (CUDA allocator; CPU: process RSS).", "mem_allocated",
          device=True, contract=True),
    _rank("zerotuner_device_memory_reserved_bytes", "gauge",
          "Device memory reserved by the caching allocator (CPU: process RSS).", "mem_reserved",
          device=True, contract=True),
    _rank("zerotuner_device_memory_peak_bytes", "gauge",
          "Peak device memory allocated (CPU: peak process RSS).", "mem_peak", device=True,
          contract=True),
    _rank("zerotuner_device_memory_total_bytes", "gauge",
          "Device memory capacity (NVML; CPU: container memory limit or host RAM).", "mem_total",
          device=True, contract=True),
    _rank("zerotuner_host_memory_rss_bytes", "gauge", "Resident host memory of the rank.", "rss",
          contract=True),
    _node("zerotuner_offload_dir_used_bytes", "gauge",
          "Bytes allocated under the offload directory.", contract=True),
    _node("zerotuner_offload_dir_free_bytes", "gauge",
          "Bytes free on the offload directory's volume.", contract=True),
    _rank("zerotuner_checkpoint_duration_seconds", "histogram",
          "Wall time to save and commit a checkpoint.", "checkpoint_seconds", contract=True,
          buckets=CHECKPOINT_BUCKETS),
    _rank("zerotuner_last_checkpoint_step", "gauge",
          "Step of the last committed checkpoint (0: none).", "last_checkpoint_step",
          contract=True),
    _rank("zerotuner_last_step_timestamp_seconds", "gauge", "Unix time the last step finished.",
          "last_step", contract=True),
    _rank("zerotuner_dataset_skipped_files_total", "counter",
          "Dataset files skipped (unreadable, no caption, too small).", "skipped", contract=True),
    _node("zerotuner_info", "gauge", "The run's configuration (value 1).",
          labels=("version", "zero_stage", "offload_optimizer", "offload_param", "world_size",
                  "model_family", "precision"), contract=True),
    _rank("zerotuner_eval_loss", "gauge",
          "Held-out loss of the last evaluation (ZT_EVAL_*): the same on every rank.",
          "eval_loss"),
    _rank("zerotuner_gradient_norm", "gauge", "Gradient norm before clipping.", "grad_norm"),
    _rank("zerotuner_throughput_samples_per_second", "gauge",
          "This rank's samples per second over the last step; sum over ranks for the job.",
          "throughput"),
    _rank("zerotuner_global_step", "gauge", "Optimizer steps done, resumes included.",
          "global_step"),
    _rank("zerotuner_max_steps", "gauge", "Optimizer steps the run trains to.", "max_steps"),
    _rank("zerotuner_last_checkpoint_timestamp_seconds", "gauge",
          "Unix time the last checkpoint was committed.", "last_checkpoint_time"),
    _rank("zerotuner_device_memory_used_bytes", "gauge",
          "Whole-GPU memory in use per NVML (all processes, CUDA context included).", "mem_used",
          device=True, cuda_only=True),
    _node("zerotuner_offload_dir_size_bytes", "gauge", "Size of the offload directory's volume."),
    _node("zerotuner_phase", "gauge", "1 for the phase the node is in, 0 for the others.",
          labels=("phase",)),
    _node("zerotuner_healthy", "gauge", "1 while /healthz answers 200."),
    _rank("zerotuner_nonfinite_steps_total", "counter",
          "Optimizer steps skipped because the loss or gradient norm was non-finite "
          "(the weights did not change).", "nonfinite"),
    MetricSpec("zerotuner_push_bytes", "counter", "Bytes uploaded to ZT_PUSH_TO.", "push", ()),
    MetricSpec("zerotuner_push_seconds", "counter", "Seconds spent uploading.", "push", ()),
    MetricSpec("zerotuner_push_failures", "counter", "Failed uploads (each retried).", "push", ()),
    MetricSpec("zerotuner_push_last_step", "gauge",
               "Step of the remote's latest checkpoint (-1: none yet).", "push", ()),
)  # fmt: skip
METRICS = {spec.name: spec for spec in CATALOG}
# The public contract (docs/operations.md's metrics table).
DESIGN_METRICS = tuple(m.name for m in CATALOG if m.contract)
# Served on top of the contract by every run (the pusher's only with ZT_PUSH_TO).
EXTRA_METRICS = tuple(m.name for m in CATALOG if not m.contract and m.where != "push")


# Node phases, in the order a run goes through them; `zerotuner_phase{phase}` is 1 for one.
PHASES = (
    "starting",
    "probing",
    "downloading",
    "loading",
    "caching",
    "training",
    "checkpointing",
    "validating",
    "exporting",
    "done",
    "failed",
)
# Written by every process that changes phase, merged by the server, never exposed.
PHASE_ENTERED = "zerotuner_internal_phase_entered_timestamp_seconds"


@dataclass(frozen=True)
class DeviceMemory:
    """One sample of a rank's device memory, in bytes."""

    allocated: int
    reserved: int
    peak: int
    total: int | None
    used: int | None = None  # whole-GPU usage from NVML (CUDA only)
    gpu_uuid: str | None = None  # "GPU-..." on CUDA, None on CPU


class MemoryProbe(Protocol):
    @property
    def gpu_uuid(self) -> str | None: ...  # read only: a probe's may be narrower (CPU: None)

    def sample(self) -> DeviceMemory: ...


def container_memory_limit() -> int:
    """The cgroup memory limit when one is set (v2, then v1), else the host's RAM."""
    total = psutil.virtual_memory().total
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return min(total, int(text))  # v1 reports ~2**63 for "no limit"
    return total


class CpuMemoryProbe:
    """What DeepSpeed's CPU accelerator can measure: the process's resident memory."""

    gpu_uuid = None

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._total = container_memory_limit()

    def sample(self) -> DeviceMemory:
        rss = self._process.memory_info().rss
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        return DeviceMemory(allocated=rss, reserved=rss, peak=max(peak, rss), total=self._total)


class CudaMemoryProbe:
    """torch's caching-allocator counters for one GPU, plus NVML's view of the whole device."""

    def __init__(self, device_index: int) -> None:
        import torch

        self._cuda = torch.cuda
        self._index = device_index
        props = torch.cuda.get_device_properties(device_index)
        uuid = str(props.uuid)
        self.gpu_uuid = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"  # NVML's form
        self._total = int(props.total_memory)
        self._nvml = _nvml_handle(self.gpu_uuid)

    def sample(self) -> DeviceMemory:
        total, used = self._total, None
        if self._nvml is not None:
            total, used = nvml_memory(self._nvml)
        # Host-side allocator counters: no device synchronisation.
        return DeviceMemory(
            allocated=self._cuda.memory_allocated(self._index),
            reserved=self._cuda.memory_reserved(self._index),
            peak=self._cuda.max_memory_allocated(self._index),
            total=total,
            used=used,
            gpu_uuid=self.gpu_uuid,
        )


def nvml_memory(handle: Any) -> tuple[int, int]:
    """(total, used) bytes of a GPU as CUDA counts them. NVML's v1 numbers also count the memory
    the driver reserves for itself in both (0.6 GiB on an H200: `used` read 37 % above
    cudaMemGetInfo's with 1.6 GiB in use); v2 reports it apart, so it is left out here."""
    import pynvml

    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        return int(info.total) - int(info.reserved), int(info.used)
    except pynvml.NVMLError:  # a driver without the v2 call
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.total), int(info.used)


def _nvml_handle(gpu_uuid: str) -> Any | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
    except Exception:  # no driver library, or NVML refuses: torch's total still serves
        return None


def memory_probe(device: Any) -> MemoryProbe:
    """The probe for a torch device (`"cpu"`, `"cuda:1"`, `torch.device`)."""
    text = str(device)
    if text.startswith("cuda"):
        index = int(text.split(":", 1)[1]) if ":" in text else 0
        return CudaMemoryProbe(index)
    return CpuMemoryProbe()


def multiprocess_mode_active() -> bool:
    """True when this process writes its metric values to PROMETHEUS_MULTIPROC_DIR.

    prometheus-client picks the value store once, when first imported: the variable must be
    in the environment before that, which it is in ranks launched by the entrypoint.
    """
    from prometheus_client import values

    return bool(getattr(values.ValueClass, "_multiprocess", False))


class PrometheusSink(Sink):
    """A `records.Sink` for one rank: step, loss, memory, checkpoint metrics.

    In a launched rank leave `registry` None: values go to the multiprocess directory and the
    entrypoint serves them. Pass a registry to keep them in-process (tests, one-process runs
    with `MetricsServer(source=registry)`). Without either, the sink does nothing (a launcher
    that is not ours).
    """

    def __init__(
        self,
        rank: int,
        *,
        device: Any = "cpu",
        world_size: int | None = None,
        max_steps: int | None = None,
        registry: CollectorRegistry | None = None,
        probe: MemoryProbe | None = None,
    ) -> None:
        wanted = bool(os.environ.get(MULTIPROC_DIR_ENV))
        self.enabled = registry is not None or (wanted and multiprocess_mode_active())
        if not self.enabled:
            if wanted:
                log.warning(
                    "%s is set but prometheus_client was imported before it: this rank's "
                    "metrics are not exported",
                    MULTIPROC_DIR_ENV,
                )
            return
        self._rank = str(rank)
        self._world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
        self._probe = probe or memory_probe(device)
        self._process = psutil.Process()
        self._m = _RankMetrics(registry, cuda=self._probe.gpu_uuid is not None)
        r = self._rank
        # Created now so each family is visible from the start, at 0.
        self._m.steps.labels(r)
        self._m.samples.labels(r)
        self._m.skipped.labels(r)
        self._m.nonfinite.labels(r)
        self._m.step_seconds.labels(r)
        self._m.checkpoint_seconds.labels(r)
        self._m.last_checkpoint_step.labels(r).set(0)  # 0: no checkpoint in this run yet
        if max_steps is not None:
            self._m.max_steps.labels(r).set(max_steps)
        self.sample_memory()

    def on_phase(self, phase: str) -> None:
        if self.enabled:
            self._m.phase_entered.labels(phase).set(time.time())

    def on_step(self, record: StepRecord) -> None:
        if not self.enabled:
            return
        m, r = self._m, self._rank
        share = record.samples / self._world  # this rank's part of the step's samples
        m.step_seconds.labels(r).observe(record.step_seconds)
        m.steps.labels(r).inc()
        if record.skipped:
            m.nonfinite.labels(r).inc()
        m.samples.labels(r).inc(share)
        m.loss.labels(r).set(record.loss)
        m.lr.labels(r).set(record.lr)
        if record.grad_norm is not None:
            m.grad_norm.labels(r).set(record.grad_norm)
        if record.step_seconds > 0:
            m.throughput.labels(r).set(share / record.step_seconds)
        m.global_step.labels(r).set(record.step)
        self.sample_memory()
        m.last_step.labels(r).set(record.timestamp)  # last: health reads it as "step done"

    def on_checkpoint(self, step: int, seconds: float) -> None:
        if not self.enabled:
            return
        r = self._rank
        self._m.checkpoint_seconds.labels(r).observe(seconds)
        self._m.last_checkpoint_step.labels(r).set(step)
        self._m.last_checkpoint_time.labels(r).set(time.time())

    def on_eval(self, step: int, loss: float) -> None:
        if self.enabled:
            self._m.eval_loss.labels(self._rank).set(loss)

    def on_dataset_skipped(self, count: int) -> None:
        """Dataset files this rank's scanner skipped (unreadable, no caption, too small)."""
        if self.enabled and count:
            self._m.skipped.labels(self._rank).inc(count)

    def sample_memory(self) -> DeviceMemory | None:
        if not self.enabled:
            return None
        mem = self._probe.sample()
        device_labels = (self._rank, mem.gpu_uuid) if mem.gpu_uuid else (self._rank,)
        m = self._m
        m.mem_allocated.labels(*device_labels).set(mem.allocated)
        m.mem_reserved.labels(*device_labels).set(mem.reserved)
        m.mem_peak.labels(*device_labels).set(mem.peak)
        if mem.total is not None:
            m.mem_total.labels(*device_labels).set(mem.total)
        if mem.used is not None and m.mem_used is not None:
            m.mem_used.labels(*device_labels).set(mem.used)
        m.rss.labels(self._rank).set(self._process.memory_info().rss)
        return mem

    def close(self) -> None:
        pass  # values stay in the mmap files: the endpoint keeps serving the final numbers


class _RankMetrics:
    """Every rank-side metric object, built from CATALOG (an attribute per spec's `attr`, each
    declared here). `registry=None` keeps them out of the global registry."""

    step_seconds: Histogram
    checkpoint_seconds: Histogram
    steps: Counter
    samples: Counter
    skipped: Counter
    nonfinite: Counter
    loss: Gauge
    eval_loss: Gauge
    lr: Gauge
    grad_norm: Gauge
    throughput: Gauge
    global_step: Gauge
    max_steps: Gauge
    last_step: Gauge
    last_checkpoint_step: Gauge
    last_checkpoint_time: Gauge
    mem_allocated: Gauge
    mem_reserved: Gauge
    mem_peak: Gauge
    mem_total: Gauge
    mem_used: Gauge | None  # CUDA only
    rss: Gauge

    def __init__(self, registry: CollectorRegistry | None, *, cuda: bool) -> None:
        self.mem_used = None
        for spec in CATALOG:
            if spec.where != "rank" or (spec.cuda_only and not cuda):
                continue
            labels = ("rank", "gpu_uuid") if spec.device and cuda else spec.labels
            if spec.kind == "histogram":
                made: Any = Histogram(spec.name, spec.help, labels, buckets=spec.buckets,
                                      registry=registry)  # fmt: skip
            elif spec.kind == "counter":
                made = Counter(spec.name, spec.help, labels, registry=registry)
            else:
                made = Gauge(spec.name, spec.help, labels, registry=registry,
                             multiprocess_mode="mostrecent")  # fmt: skip
            setattr(self, spec.attr, made)
        self.phase_entered = Gauge(
            PHASE_ENTERED,
            "Internal: when a rank last entered each phase.",
            ("phase",),
            registry=registry,
            multiprocess_mode="mostrecent",
        )
