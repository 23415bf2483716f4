"""The metrics endpoint, scraped over HTTP while real rank processes train.

The helpers at the top (`scrape`, `exposition_problems`, `promtool_problems`) are meant for
reuse: the end-to-end DeepSpeed test applies the same checks to a full 2-rank run
(`from test_metrics import exposition_problems, promtool_problems, scrape`).

Run as a script, this file is a rank: a small real torch loop that feeds PrometheusSink.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from zerotuner.errors import EnvironmentUnfit
from zerotuner.launch.records import StepRecord
from zerotuner.monitor.metrics import (
    DESIGN_METRICS,
    EXTRA_METRICS,
    PHASES,
    DeviceMemory,
    PrometheusSink,
)
from zerotuner.monitor.server import (
    INFO_LABELS,
    MetricsServer,
    NodeStatus,
    current_phase,
    healthz,
    prepare_metrics_dir,
    readyz,
)

SECRET = "hf_zt_s3cretTokenValue"
DEVICE_FAMILIES = (
    "zerotuner_device_memory_allocated_bytes",
    "zerotuner_device_memory_reserved_bytes",
    "zerotuner_device_memory_peak_bytes",
    "zerotuner_device_memory_total_bytes",
)
ALLOWED_LABELS = {"rank", "gpu_uuid", "le", "phase", *INFO_LABELS}


# --- reusable checks ---------------------------------------------------------------------------
def scrape(base_url: str, path: str = "/metrics", timeout: float = 30) -> tuple[int, str]:
    """(HTTP status, body) of one GET; 5xx answers are returned, not raised."""
    try:
        with urllib.request.urlopen(base_url + path, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def samples_by_name(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def value(text: str, name: str, **labels: str) -> float | None:
    for sample in samples_by_name(text).get(name, []):
        if all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    return None


def exposition_problems(
    text: str,
    *,
    ranks: Iterable[int],
    steps: dict[int, int] | None = None,
    cuda: bool = False,
    secrets: Iterable[str] = (),
) -> list[str]:
    """Everything wrong with a node's exposition, one line each (empty = fine).

    Every DESIGN metric has samples; device memory is labelled per rank (and per GPU on CUDA);
    `steps[rank]` (when given) equals both the step counter and the histogram count; no `pid`
    or unexpected label leaks out; exactly one phase is current; no secret appears.
    """
    problems = []
    samples = samples_by_name(text)
    for name in DESIGN_METRICS:
        if name not in samples and f"{name}_count" not in samples:
            problems.append(f"{name}: no samples")
    for name in DEVICE_FAMILIES:
        for rank in ranks:
            got = [s for s in samples.get(name, []) if s.labels.get("rank") == str(rank)]
            if not got:
                problems.append(f"{name}: no sample for rank {rank}")
            elif cuda and not all(s.labels.get("gpu_uuid", "").startswith("GPU-") for s in got):
                problems.append(f"{name}: rank {rank} has no gpu_uuid label")
    for rank, count in (steps or {}).items():
        for name in ("zerotuner_steps_total", "zerotuner_step_duration_seconds_count"):
            got = value(text, name, rank=str(rank))
            if got != count:
                problems.append(f"{name}{{rank={rank}}} = {got}, expected {count}")
    for name, items in samples.items():
        for sample in items:
            extra = set(sample.labels) - ALLOWED_LABELS
            if extra:
                problems.append(f"{name}: unexpected labels {sorted(extra)}")
                break
    current = [s.labels["phase"] for s in samples.get("zerotuner_phase", []) if s.value == 1]
    if len(current) != 1:
        problems.append(f"zerotuner_phase: {len(current)} current phases {current}")
    problems += [f"secret value #{i} appears" for i, s in enumerate(secrets) if s and s in text]
    return problems


def promtool_problems(text: str) -> list[str]:
    """`promtool check metrics` findings (`make setup` installs promtool: its absence fails)."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make setup` installs it (Debian package prometheus)"
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    lines = (result.stdout + result.stderr).strip().splitlines()
    return lines if result.returncode or lines else []


def wait_for(predicate: Callable[[], object], what: str, timeout: float = 60) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# --- a rank: run as a script --------------------------------------------------------------------
def produce(rank: int, world: int, control: Path) -> None:
    """Train a tiny MLP for real, stepping only while `control/run` exists, until `stop`."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(rank)
    sink = PrometheusSink(rank, device="cpu", world_size=world, max_steps=100_000)
    assert sink.enabled, "multiprocess mode is not active in the rank"
    sink.on_dataset_skipped(rank + 1)
    sink.on_phase("training")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 16)
    y = x.sum(dim=1, keepdim=True)
    idle, step, batch = control / f"idle-{rank}", 0, 8
    while not (control / "stop").exists():
        if not (control / "run").exists():
            if not idle.exists():
                _write(idle, str(step))
            time.sleep(0.02)
            continue
        idle.unlink(missing_ok=True)
        start = time.perf_counter()
        rows = torch.randint(0, len(x), (batch,))
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        record = StepRecord(
            step=step,
            loss=loss.item(),  # CPU tensor: no device sync involved
            lr=optimizer.param_groups[0]["lr"],
            grad_norm=float(grad_norm),
            step_seconds=time.perf_counter() - start,
            samples=batch * world,
            timestamp=time.time(),
        )
        sink.on_step(record)
        if step % 20 == 0:
            sink.on_phase("checkpointing")
            sink.on_checkpoint(step, 0.01)
            sink.on_phase("training")
        _write(control / f"step-{rank}", str(step))
        time.sleep(0.01)  # the CPU is shared: keep the producers gentle
    sink.close()


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


# --- the real multi-process scenario ----------------------------------------------------------
@pytest.mark.slow
def test_endpoint_with_two_real_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    (metrics_dir / "counter_99999.db").write_bytes(b"stale from a previous run")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "unset-by-prepare")
    prepare_metrics_dir(metrics_dir)
    offload = tmp_path / "offload"
    offload.mkdir()
    (offload / "swap.tensor").write_bytes(b"\1" * 1_000_000)
    control = tmp_path / "control"
    control.mkdir()

    server = MetricsServer(
        "127.0.0.1",
        0,
        hang_timeout_seconds=1.5,
        multiproc_dir=metrics_dir,
        offload_dir=offload,
    ).start()
    procs: list[subprocess.Popen] = []
    try:
        url = server.url
        server.set_phase("downloading")
        assert scrape(url, "/readyz")[0] == 503
        assert scrape(url, "/healthz")[0] == 200  # before the first step: alive
        status, text = scrape(url)
        assert status == 200
        assert value(text, "zerotuner_phase", phase="downloading") == 1

        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir), WORLD_SIZE="2")
        env["ZT_HF_TOKEN"] = SECRET
        for rank in range(2):
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, str(rank), "2", str(control)],
                    env=dict(env, RANK=str(rank)),
                )
            )
        wait_for(lambda: all((control / f"idle-{r}").exists() for r in range(2)), "ranks up")
        assert scrape(url, "/readyz")[0] == 503  # ranks are up, no step yet
        text = scrape(url)[1]
        assert value(text, "zerotuner_phase", phase="training") == 1
        assert value(text, "zerotuner_step_duration_seconds_count", rank="1") == 0

        (control / "run").touch()
        wait_for(lambda: scrape(url, "/readyz")[0] == 200, "/readyz to flip to 200")
        wait_for(lambda: all(_read_int(control / f"step-{r}") >= 3 for r in range(2)), "steps")

        # 200 concurrent scrapes while the ranks train.
        before = [_read_int(control / f"step-{r}") for r in range(2)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=200) as pool:
            results = list(pool.map(lambda _: scrape(url), range(200)))
        assert [s for s, _ in results] == [200] * 200
        assert all("zerotuner_steps_total" in body for _, body in results)
        wait_for(
            lambda: all(_read_int(control / f"step-{r}") > before[r] for r in range(2)),
            "the ranks to keep stepping after the scrape burst",
        )
        assert all(p.poll() is None for p in procs)

        # Hold the loop: counts settle, then /healthz reports the hang.
        (control / "run").unlink()
        wait_for(lambda: all((control / f"idle-{r}").exists() for r in range(2)), "ranks idle")
        steps = {r: _read_int(control / f"idle-{r}") for r in range(2)}
        text = scrape(url)[1]
        problems = exposition_problems(text, ranks=[0, 1], steps=steps, secrets=[SECRET])
        assert problems == []
        assert "pid=" not in text
        assert value(text, "zerotuner_dataset_skipped_files_total", rank="1") == 2
        assert value(text, "zerotuner_samples_total", rank="0") == steps[0] * 8
        assert value(text, "zerotuner_offload_dir_used_bytes") >= 1_000_000
        assert value(text, "zerotuner_last_checkpoint_step", rank="0") == steps[0] // 20 * 20
        assert promtool_problems(text) == []

        wait_for(lambda: scrape(url, "/healthz")[0] == 503, "/healthz to report the hang")
        status, body = scrape(url, "/healthz")
        assert "ZT_HANG_TIMEOUT_SECONDS" in body
        assert value(scrape(url)[1], "zerotuner_healthy") == 0
        (control / "run").touch()
        wait_for(lambda: scrape(url, "/healthz")[0] == 200, "/healthz to recover")

        (control / "stop").touch()
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
        server.set_phase("exporting")  # no more steps are expected: healthy however long
        text = scrape(url)[1]
        assert value(text, "zerotuner_phase", phase="exporting") == 1
        assert value(text, "zerotuner_healthy") == 1
        assert value(text, "zerotuner_steps_total", rank="1") >= steps[1]  # survives the ranks
    finally:
        (control / "stop").touch()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        server.stop()


# --- fast in-process checks -------------------------------------------------------------------
class FakeCudaProbe:
    """What CudaMemoryProbe reports on a GPU, fed as data (no GPU here)."""

    gpu_uuid = "GPU-5c1b2a3d-0000-1111-2222-333344445555"

    def sample(self) -> DeviceMemory:
        return DeviceMemory(
            allocated=3 << 30,
            reserved=4 << 30,
            peak=5 << 30,
            total=24 << 30,
            used=6 << 30,
            gpu_uuid=self.gpu_uuid,
        )


def inprocess_exposition(tmp_path: Path, *, cuda: bool = False) -> str:
    """A full exposition from one in-process rank (every family has samples)."""
    registry = CollectorRegistry()
    probe = FakeCudaProbe() if cuda else None
    sink = PrometheusSink(0, registry=registry, world_size=1, max_steps=10, probe=probe)
    sink.on_phase("training")
    sink.on_step(StepRecord(1, 0.25, 1e-4, 0.5, 0.8, 4, time.time()))
    sink.on_checkpoint(1, 2.0)
    (tmp_path / "offload").mkdir(exist_ok=True)
    server = MetricsServer(source=registry, offload_dir=tmp_path / "offload")
    return "".join(
        line + "\n" for line in _generate(server.registry).splitlines() if "_created" not in line
    )


def _generate(registry: CollectorRegistry) -> str:
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()


def test_every_metric_name_is_pinned(tmp_path):
    text = inprocess_exposition(tmp_path, cuda=True)
    names = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in text_string_to_metric_families(text)
    }
    assert names == set(DESIGN_METRICS) | set(EXTRA_METRICS)


def test_cuda_device_memory_carries_gpu_uuid(tmp_path):
    text = inprocess_exposition(tmp_path, cuda=True)
    assert exposition_problems(text, ranks=[0], steps={0: 1}, cuda=True) == []
    uuid = FakeCudaProbe.gpu_uuid
    assert value(text, "zerotuner_device_memory_total_bytes", rank="0", gpu_uuid=uuid) == 24 << 30
    assert value(text, "zerotuner_device_memory_used_bytes", rank="0", gpu_uuid=uuid) == 6 << 30


def test_cpu_device_memory_is_the_process_rss(tmp_path):
    text = inprocess_exposition(tmp_path)
    assert exposition_problems(text, ranks=[0], steps={0: 1}) == []
    assert "gpu_uuid" not in text
    allocated = value(text, "zerotuner_device_memory_allocated_bytes", rank="0")
    peak = value(text, "zerotuner_device_memory_peak_bytes", rank="0")
    total = value(text, "zerotuner_device_memory_total_bytes", rank="0")
    assert 10 << 20 < allocated <= peak < total  # a python with torch holds >10 MiB


def test_promtool_accepts_the_inprocess_exposition(tmp_path):
    assert promtool_problems(inprocess_exposition(tmp_path, cuda=True)) == []


def test_exposition_problems_can_fail(tmp_path):
    text = inprocess_exposition(tmp_path)
    problems = exposition_problems(text, ranks=[0, 1], steps={0: 2}, cuda=True, secrets=["0.25"])
    joined = "\n".join(problems)
    assert "no sample for rank 1" in joined
    assert "has no gpu_uuid" in joined
    assert "zerotuner_steps_total{rank=0} = 1.0, expected 2" in joined
    assert "secret value #0 appears" in joined


@pytest.mark.parametrize(
    ("status", "now", "ok", "words"),
    [
        (NodeStatus("downloading", None), 1e9, True, "no step"),
        (NodeStatus("training", 100.0), 150.0, True, "ok"),
        (NodeStatus("training", 100.0), 161.0, False, "hung"),
        (NodeStatus("checkpointing", 100.0), 161.0, False, "hung"),
        (NodeStatus("exporting", 100.0), 1e9, True, "ok"),
    ],
)
def test_healthz_turns_503_only_after_a_stall_in_the_loop(status, now, ok, words):
    got, text = healthz(status, now=now, hang_timeout_seconds=60)
    assert got is ok
    assert words in text


def test_readyz_waits_for_the_first_step():
    assert readyz(NodeStatus("caching", None))[0] is False
    assert readyz(NodeStatus("done", 5.0))[0] is True


def test_the_latest_phase_wins():
    assert current_phase({}) == "starting"
    assert current_phase({"probing": 1.0, "training": 3.0, "checkpointing": 2.0}) == "training"


def test_phase_gauge_has_one_current_phase(tmp_path):
    registry = CollectorRegistry()
    server = MetricsServer(source=registry)
    server.set_phase("probing")
    text = _generate(server.registry)
    assert [p for p in PHASES if value(text, "zerotuner_phase", phase=p) == 1] == ["probing"]
    server.set_phase("my-new-phase")  # a phase this module does not know is shown, not lost
    assert value(_generate(server.registry), "zerotuner_phase", phase="my-new-phase") == 1


def test_info_labels_come_from_the_job():
    from zerotuner.launch.job import Job

    job = Job(
        family="sdxl",
        model="m",
        resolution=1024,
        zero_stage=2,
        offload_optimizer="cpu",
        offload_param="none",
        gradient_checkpointing=True,
        mixed_precision="bf16",
        device="cuda",
        world_size=8,
    )
    server = MetricsServer(source=CollectorRegistry())
    server.set_job(job)
    labels = samples_by_name(_generate(server.registry))["zerotuner_info"][0].labels
    assert labels["zero_stage"] == "2"
    assert labels["world_size"] == "8"
    assert labels["model_family"] == "sdxl"
    assert labels["precision"] == "bf16"
    with pytest.raises(ValueError, match="hf_token"):
        server.set_info(hf_token="x")


def test_prepare_metrics_dir_wipes_only_metric_files(tmp_path, monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    (tmp_path / "gauge_mostrecent_1.db").write_bytes(b"old")
    (tmp_path / "notes.txt").write_text("keep")
    assert prepare_metrics_dir(tmp_path) == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(tmp_path)


def test_a_busy_port_is_an_environment_error():
    with MetricsServer("127.0.0.1", 0, source=CollectorRegistry()) as first:
        with pytest.raises(EnvironmentUnfit, match=f"ZT_METRICS_PORT={first.port}") as caught:
            MetricsServer("127.0.0.1", first.port, source=CollectorRegistry()).start()
        assert caught.value.exit_code == 3
        assert scrape(first.url, "/nope")[0] == 404


def test_without_a_metrics_dir_the_sink_does_nothing(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    sink = PrometheusSink(0)
    assert sink.enabled is False
    sink.on_step(StepRecord(1, 0.1, 1e-4, None, 0.1, 1, time.time()))  # no error, no effect


def test_a_metrics_dir_set_too_late_is_reported(tmp_path, monkeypatch, caplog):
    # This pytest process imported prometheus_client without the variable: like a rank whose
    # launcher exported it too late. The sink says so instead of silently exporting nothing.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    with caplog.at_level("WARNING"):
        sink = PrometheusSink(0)
    assert sink.enabled is False
    assert "imported before it" in caplog.text


if __name__ == "__main__":
    produce(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))


def test_the_dashboard_and_alert_rules_query_only_catalogued_series():
    """config/monitoring's Grafana dashboard and Prometheus rules read series the catalog
    declares (a histogram's _bucket/_sum/_count included), and the dashboard shows the
    contract's step time, loss and memory."""
    import re

    from zerotuner.monitor.metrics import CATALOG, METRICS

    root = Path(__file__).resolve().parents[1] / "config" / "monitoring"
    texts = [p.read_text() for p in [*root.rglob("*.json"), *root.rglob("*.yml")]]
    used = set(re.findall(r"zerotuner_[a-z0-9_]+", "\n".join(texts)))
    suffixes = ("_bucket", "_sum", "_count")
    unknown = {
        name for name in used
        if name not in METRICS
        and not (name.endswith(suffixes) and METRICS.get(name.rsplit("_", 1)[0], CATALOG[0]).kind
                 == "histogram" and name.rsplit("_", 1)[0] in METRICS)
    }  # fmt: skip
    assert not unknown, f"queried but not in the catalog: {sorted(unknown)}"
    assert {"zerotuner_step_duration_seconds_bucket", "zerotuner_loss",
            "zerotuner_device_memory_allocated_bytes"} <= used  # fmt: skip


def test_every_rank_side_series_is_a_declared_attribute_of_the_rank_metrics():
    from zerotuner.monitor.metrics import CATALOG, _RankMetrics

    rank_side = {spec.attr for spec in CATALOG if spec.where == "rank"}
    assert rank_side == set(_RankMetrics.__annotations__)
    made = _RankMetrics(CollectorRegistry(), cuda=True)
    assert all(getattr(made, name) is not None for name in rank_side)
