"""The metrics endpoint during a real 2-rank DeepSpeed training run (`./entrypoint train`).

Scraped over HTTP while the ranks train: every DESIGN family present, per-rank device memory,
the step histogram equal to the steps done, /readyz flipping after the first step, /healthz
turning 503 while the ranks are really stopped (SIGSTOP) past the hang timeout, 200 concurrent
scrapes leaving training running, no secret in the exposition, and promtool's approval.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from test_metrics import exposition_problems, promtool_problems, scrape, value
from trainkit import ENTRYPOINT, entrypoint_env, steps_done

from zerotuner.launch.ranks import free_port

SECRET = "hf_MetricsSecret42"
HANG_TIMEOUT = 4


def rank_processes(entrypoint: subprocess.Popen) -> list[psutil.Process]:
    children = psutil.Process(entrypoint.pid).children(recursive=True)
    # torchrun's workers run `-m zerotuner.train.worker`; torch's `pt_elastic` helper shares
    # the cmdline.
    return [
        p
        for p in children
        if "zerotuner.train.worker" in " ".join(p.cmdline()) and p.name() != "pt_elastic"
    ]


def wait_until(predicate, what: str, proc: subprocess.Popen, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        assert proc.poll() is None, f"training ended ({proc.returncode}) before {what}"
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_metrics_during_real_training(demo_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = entrypoint_env(
        demo_dir, tmp_path, ZT_METRICS_PORT=str(port), ZT_METRICS_HOST="127.0.0.1",
        ZT_HANG_TIMEOUT_SECONDS=str(HANG_TIMEOUT), ZT_MAX_STEPS="60",
        ZT_CHECKPOINT_EVERY_STEPS="0", HF_TOKEN=SECRET,
    )  # fmt: skip
    proc = subprocess.Popen(
        [ENTRYPOINT, "train"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        wait_until(lambda: _answers(url), "the endpoint to answer", proc, timeout=120)
        assert scrape(url, "/readyz")[0] == 503 or steps_done(tmp_path), "ready before a step"
        wait_until(lambda: scrape(url, "/readyz")[0] == 200, "/readyz 200", proc)
        assert steps_done(tmp_path), "/readyz turned 200 before any step finished"

        # 200 concurrent scrapes while the ranks keep training.
        before = len(steps_done(tmp_path))
        with ThreadPoolExecutor(max_workers=32) as pool:
            codes = list(pool.map(lambda _: scrape(url)[0], range(200)))
        assert codes == [200] * 200
        wait_until(lambda: len(steps_done(tmp_path)) > before + 2, "steps after scrapes", proc)

        # A real hang: stop both ranks, so steps really cease.
        ranks = rank_processes(proc)
        assert len(ranks) == 2
        try:
            text, problems = stopped_where_steps_agree(ranks, url, tmp_path)
            assert problems == []
            assert promtool_problems(text) == []
            assert value(text, "zerotuner_device_memory_allocated_bytes", rank="1") > 0
            wait_until(lambda: scrape(url, "/healthz")[0] == 503, "/healthz 503", proc,
                       timeout=HANG_TIMEOUT + 30)  # fmt: skip
        finally:
            for rank in ranks:
                rank.send_signal(signal.SIGCONT)
        wait_until(lambda: scrape(url, "/healthz")[0] == 200, "/healthz back to 200", proc)
        out = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, out[-3000:]
        assert SECRET not in out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def stopped_where_steps_agree(
    ranks: list[psutil.Process], url: str, out: Path, tries: int = 5
) -> tuple[str, list[str]]:
    """SIGSTOP the ranks at a moment where each rank's step counters can equal steps.jsonl.

    Each step updates a rank's metrics before rank 0 appends its line to steps.jsonl, so a stop
    can fall between the two and leave the counters one step ahead; the ranks are then let go
    briefly and stopped again. Returns the exposition and its problems at the last stop (the
    ranks are left stopped).
    """
    for attempt in range(tries):
        for rank in ranks:
            rank.send_signal(signal.SIGSTOP)
        time.sleep(1.0)  # let a step that was being written land
        done = len(steps_done(out))
        text = scrape(url)[1]
        problems = exposition_problems(text, ranks=[0, 1], steps={0: done, 1: done},
                                       secrets=[SECRET])  # fmt: skip
        if not problems or attempt == tries - 1:
            return text, problems
        for rank in ranks:
            rank.send_signal(signal.SIGCONT)
        time.sleep(0.5)
    raise AssertionError("unreachable")


def _answers(url: str) -> bool:
    try:
        return scrape(url, "/healthz", timeout=2)[0] in (200, 503)
    except OSError:
        return False
