"""The run page on the metrics port: what it reads (steps.jsonl as it grows and is rewritten by
a resume, the newest samples, per-rank metrics over time), that it only reads and serves files
of the samples folder, that /metrics is untouched, and, in chromium, a real 2-rank demo run
whose loss curve and samples appear on it."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from browserkit import chromium
from PIL import Image
from prometheus_client import CollectorRegistry, generate_latest
from test_metrics import scrape
from trainkit import ENTRYPOINT, entrypoint_env

from zerotuner.launch.ranks import free_port
from zerotuner.launch.records import StepRecord
from zerotuner.monitor.metrics import PrometheusSink
from zerotuner.monitor.run_page import RunView, StepsLog, thin
from zerotuner.monitor.server import MetricsServer


def record(step: int, loss: float, at: float) -> str:
    return json.dumps({"step": step, "loss": loss, "lr": 1e-3, "step_seconds": 0.5,
                       "samples": 4, "grad_norm": 1.0, "timestamp": at}) + "\n"  # fmt: skip


def test_steps_are_read_as_they_come_and_again_after_a_resume_rewrites_them(tmp_path):
    path = tmp_path / "steps.jsonl"
    log = StepsLog(path)
    assert log.read() == []  # not written yet
    path.write_text(record(1, 1.0, 10) + record(2, 0.9, 11) + record(3, 0.8, 12)[:20])
    assert [r["step"] for r in log.read()] == [1, 2]  # the line being written waits
    with path.open("a") as file:
        file.write(record(3, 0.8, 12)[20:] + record(4, 0.7, 13))
    assert [r["step"] for r in log.read()] == [1, 2, 3, 4]
    # A resume from step 2's checkpoint keeps lines before step 3 and goes on from there.
    path.write_text(record(1, 1.0, 10) + record(2, 0.9, 11) + record(3, 0.85, 20))
    assert [(r["step"], r["loss"]) for r in log.read()] == [(1, 1.0), (2, 0.9), (3, 0.85)]


def test_thin_keeps_the_first_and_last_points():
    points = list(range(2501))
    kept = thin(points, 1000)
    assert len(kept) <= 1001 and kept[0] == 0 and kept[-1] == 2500
    assert thin(points[:10], 1000) == points[:10]


def write_samples(output: Path) -> None:
    for step in (5, 10):
        folder = output / "samples" / f"step-{step}"
        folder.mkdir(parents=True)
        for i, prompt in enumerate(("a red circle", "a blue square")):
            slug = prompt.replace(" ", "-")
            Image.new("RGB", (8, 8), (step * 20, i * 90, 0)).save(folder / f"{i:02d}-{slug}.png")
        (folder / "prompts.txt").write_text("42\ta red circle\n43\ta blue square\n")
    (output / "samples" / "base").mkdir()
    Image.new("RGB", (8, 8)).save(output / "samples" / "base" / "00-a-red-circle.png")
    (output / "secret.png").write_bytes(b"not a sample")


def test_the_newest_samples_and_only_sample_files_are_served(tmp_path):
    write_samples(tmp_path)
    view = RunView(tmp_path)
    samples = view.state([], "training")["samples"]
    assert samples["step"] == 10
    assert [i["prompt"] for i in samples["images"]] == ["a red circle", "a blue square"]
    first = samples["images"][0]["url"]
    assert first == "/run/samples/step-10/00-a-red-circle.png"
    png = view.sample_image(first.removeprefix("/run/samples/"))
    assert png == (tmp_path / "samples" / "step-10" / "00-a-red-circle.png").read_bytes()
    assert view.sample_image("base/00-a-red-circle.png") is not None
    for escape in ("../secret.png", "step-10/../../secret.png", "step-10/prompts.txt",
                   "/etc/passwd", "step-10/%2e%2e/secret.png", "step-99/00-x.png"):  # fmt: skip
        assert view.sample_image(escape) is None, escape


def test_a_sample_from_an_input_image_links_it(tmp_path):
    """A model that samples from an input image (samples/inputs/NN-slug.png): each sample
    names its input, which is served; a sample without one names none."""
    write_samples(tmp_path)
    (tmp_path / "samples" / "inputs").mkdir()
    Image.new("RGB", (8, 8), "red").save(tmp_path / "samples" / "inputs" / "00-a-red-circle.png")
    view = RunView(tmp_path)
    first, second = view.state([], "training")["samples"]["images"]
    assert first["input"] == "/run/samples/inputs/00-a-red-circle.png" and "input" not in second
    served = view.sample_image(first["input"].removeprefix("/run/samples/"))
    assert served == (tmp_path / "samples" / "inputs" / "00-a-red-circle.png").read_bytes()


class Ranks:
    """Two in-process ranks' registries, collected together as the multiprocess files are."""

    def __init__(self) -> None:
        self.registries = [CollectorRegistry(), CollectorRegistry()]
        self.sinks = [
            PrometheusSink(rank, registry=r, world_size=2, max_steps=10)
            for rank, r in enumerate(self.registries)
        ]

    def collect(self):
        for registry in self.registries:
            yield from registry.collect()

    def step(self, step: int, seconds: tuple[float, float]) -> None:
        for sink, s in zip(self.sinks, seconds, strict=True):
            sink.on_step(StepRecord(step, 1.0 / step, 1e-3, 1.0, s, 4, time.time()))


def get(url: str, method: str = "GET") -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


def test_the_metrics_port_serves_the_run_page_beside_unchanged_metrics(tmp_path):
    ranks = Ranks()
    output = tmp_path / "output"
    write_samples(output)
    (output / "run").mkdir()
    now = time.time()
    (output / "run" / "steps.jsonl").write_text("".join(record(s, 1 / s, now + s) for s in (1, 2)))
    server = MetricsServer("127.0.0.1", 0, source=ranks, output_dir=output, history_interval=None)
    with server:
        server.set_phase("training")
        server.set_plan({"choice": {"zero_stage": 2}, "rows": [], "reasons": ["why"]})
        history = server.run_view.history
        history.add(list(ranks.collect()), 100.0)
        ranks.step(1, (0.5, 0.7))
        ranks.step(2, (0.3, 0.5))
        history.add(list(ranks.collect()), 105.0)

        status, media, body = get(server.url + "/")
        assert status == 200 and media.startswith("text/html") and b"zerotuner" in body
        assert get(server.url + "/static/run.js")[0] == 200
        status, media, body = get(server.url + "/api/run")
        run = json.loads(body)
        assert (run["phase"], run["step"], run["max_steps"]) == ("training", 2, 10)
        assert run["loss"] == [[1, 1.0], [2, 0.5]]
        assert run["eta_seconds"] == pytest.approx(8.0)  # 1 s per step, 8 steps to go
        assert run["plan"]["reasons"] == ["why"]
        assert run["samples"]["step"] == 10
        assert run["ranks"]["0"]["step_seconds"] == [None, pytest.approx(0.4)]
        assert run["ranks"]["1"]["step_seconds"] == [None, pytest.approx(0.6)]
        assert all(m > 0 for r in ("0", "1") for m in run["ranks"][r]["memory_bytes"])
        status, media, body = get(server.url + run["samples"]["images"][0]["url"])
        assert (status, media) == (200, "image/png") and body.startswith(b"\x89PNG")
        assert get(server.url + "/run/samples/../secret.png")[0] == 404
        assert get(server.url + "/run/samples/step-10%2F..%2F..%2Fsecret.png")[0] == 404
        assert get(server.url + "/api/run", "POST")[0] == 405  # read-only
        assert get(server.url + "/static/../metrics_server.py")[0] == 404

        status, text = scrape(server.url)  # /metrics: the exposition, as before
        assert status == 200 and "zerotuner_loss" in text
        expected = generate_latest(server.registry).decode()
        strip = lambda t: [x for x in t.splitlines() if "_created" not in x]  # noqa: E731
        assert strip(text)[:20] == strip(expected)[:20]


def memory_series(page) -> int:
    return page.locator("#memory-chart path[data-series]").count()


@pytest.mark.slow
def test_a_two_rank_demo_run_shows_its_loss_curve_and_samples(demo_dir, tmp_path):
    port = free_port()
    env = entrypoint_env(
        demo_dir, tmp_path, ZT_METRICS_PORT=str(port), ZT_METRICS_HOST="127.0.0.1",
        ZT_MAX_STEPS="200", ZT_CHECKPOINT_EVERY_STEPS="0", ZT_VALIDATION_EVERY_STEPS="6",
        ZT_VALIDATION_INFERENCE_STEPS="2",
        ZT_VALIDATION_PROMPTS='["a red circle on a white background", "a blue square"]',
    )  # fmt: skip
    log = tmp_path / "train.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [ENTRYPOINT, "train"], env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                scrape(url, "/healthz", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        with chromium() as browser:
            page = browser.new_page()
            page.goto(url)
            timeout = 600_000  # ms: the ranks load, cache and train on a shared CPU
            # The loss curve: a line through at least 3 steps.
            page.wait_for_function(
                "(document.querySelector('#loss-chart path[data-series=loss]')"
                "?.getAttribute('d') || '').split('L').length > 3",
                timeout=timeout,
            )
            assert "CPU accelerator" in page.inner_text("#plan-hardware")
            assert page.locator("#plan-table tr.choice").count() == 1
            # The first validation's samples, loaded by the browser.
            page.wait_for_function(
                "[...document.querySelectorAll('#samples img')].filter("
                "i => i.complete && i.naturalWidth > 0).length === 2",
                timeout=timeout,
            )
            captions = page.locator("#samples figcaption").all_inner_texts()
            assert captions == ["a red circle on a white background", "a blue square"]
            assert page.inner_text("#samples-step").startswith("step ")
            # Device memory per rank over time: one line per rank.
            page.wait_for_function(
                "document.querySelectorAll('#memory-chart path[data-series]').length === 2",
                timeout=timeout,
            )
            assert '"zero_optimization"' in page.inner_text("#deepspeed")
            assert page.inner_text("#phase") in ("training", "validating", "checkpointing")
        assert proc.poll() is None, f"the run ended before the page showed it:\n{log.read_text()}"
    finally:
        # Done with it: the ranks (a session of their own) and then the entrypoint.
        if proc.poll() is None:
            tree = psutil.Process(proc.pid).children(recursive=True)
            for child in tree:
                child.kill()
            proc.kill()
            psutil.wait_procs(tree, timeout=60)
        proc.wait(timeout=60)


def test_image_samples_stay_images_on_the_page(tmp_path):
    """An image family's samples (no .mp4 beside them) show as <img>, no <video>."""
    write_samples(tmp_path)
    server = MetricsServer(
        "127.0.0.1", 0, source=CollectorRegistry(), output_dir=tmp_path, history_interval=None
    )
    with server, chromium() as browser:
        assert "video" not in RunView(tmp_path).state([], "training")["samples"]["images"][0]
        page = browser.new_page()
        page.goto(server.url + "/")
        page.wait_for_function(
            "[...document.querySelectorAll('#samples img')].filter("
            "i => i.complete && i.naturalWidth === 8).length === 2",
            timeout=30_000,
        )
        assert page.locator("#samples video").count() == 0
        assert page.locator("#samples figcaption").all_inner_texts() == [
            "a red circle",
            "a blue square",
        ]
