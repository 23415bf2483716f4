"""Take the docs' screenshots of the builder page and the run page (docs/*.png).

    .venv/bin/python docs/screenshots.py [builder] [run]   # after `make setup`; minutes on a CPU

Debian's chromium (apt-packages.txt) driven by Playwright. The builder plans SDXL LoRA for one
24 GiB GPU; the run page watches the tiny demo on 2 CPU ranks until its first samples are in.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from playwright.sync_api import sync_playwright

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
CHROMIUM = "/usr/bin/chromium"


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZT_", "HF_"))}
    env |= {"HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    return env | extra


def wait_for_line(log: Path, pattern: str, proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, log.read_text())
        if match:
            return match.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)
    raise SystemExit(f"timed out waiting for {pattern!r} in {log}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        tree = psutil.Process(proc.pid).children(recursive=True)
        for child in tree:
            child.kill()
        proc.kill()
        psutil.wait_procs(tree, timeout=60)
    proc.wait(timeout=60)


def builder_page(browser, tmp: Path) -> None:
    log = tmp / "builder.log"
    with log.open("w") as out:
        command = [sys.executable, "-m", "zerotuner", "builder", "--port", "0", "--templates",
                   str(tmp / "templates")]  # fmt: skip
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment())
    try:
        url = wait_for_line(log, r"builder on (http://\S+?)/? ", proc, 180)
        page = browser.new_page(viewport={"width": 1440, "height": 1250})
        page.goto(url)
        page.wait_for_function("document.body.dataset.evaluations >= 1")
        values = {
            "#f-ZT_RESOLUTION": "1024", "#f-ZT_TRAIN_BATCH_SIZE": "8",
            "#f-hw-gpus": "1", "#f-hw-gpu_memory": "24GiB", "#f-hw-host_memory": "64GiB",
            "#f-ds-betas": "0.9, 0.99",
        }  # fmt: skip
        for selector, value in values.items():
            page.fill(selector, value)
        page.select_option("#f-ZT_TRAINING_TYPE", "lora")
        page.select_option("#f-ZT_LR_SCHEDULER", "cosine")
        page.wait_for_timeout(300)
        page.wait_for_function("document.body.dataset.pending === '0'")
        page.evaluate("document.activeElement.blur(); window.scrollTo(0, 0)")
        page.screenshot(path=DOCS / "builder.png")
    finally:
        stop(proc)


def run_page(browser, tmp: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "zerotuner", "demo", str(tmp / "demo")], check=True,
        env=environment(), capture_output=True,
    )  # fmt: skip
    port = "19464"
    env = environment(
        ZT_DEVICE="cpu", ZT_MODEL=str(tmp / "demo" / "model"),
        ZT_DATA_DIR=str(tmp / "demo" / "data"), ZT_OUTPUT_DIR=str(tmp / "output"),
        ZT_CACHE_DIR=str(tmp / "cache"), ZT_OFFLOAD_DIR=str(tmp / "offload"),
        ZT_CONFIG_FILE=str(REPO / "config" / "demo.yaml"), ZT_METRICS_PORT=port,
        ZT_METRICS_HOST="127.0.0.1", ZT_VALIDATION_EVERY_STEPS="500", ZT_CHECKPOINT_EVERY_STEPS="0",
    )  # fmt: skip
    log = tmp / "train.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(REPO / "entrypoint"), "train"], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    try:
        wait_for_line(log, r"(metrics on)", proc, 180)
        page = browser.new_page(viewport={"width": 1440, "height": 1250})
        page.goto(f"http://127.0.0.1:{port}/")
        page.wait_for_function(
            "[...document.querySelectorAll('#samples img')].filter("
            "i => i.complete && i.naturalWidth > 0).length >= 3",
            timeout=900_000,
        )
        page.wait_for_timeout(12_000)  # a few more steps and memory samples on the charts
        page.screenshot(path=DOCS / "run-page.png")
    finally:
        stop(proc)


def main(pages: list[str]) -> None:
    """`pages`: builder and/or run (default both)."""
    with tempfile.TemporaryDirectory(prefix="zt-screenshots-") as folder, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM)
        if "builder" in pages:
            builder_page(browser, Path(folder))
            print(f"wrote {DOCS / 'builder.png'}")
        if "run" in pages:
            run_page(browser, Path(folder))
            print(f"wrote {DOCS / 'run-page.png'}")
        browser.close()


if __name__ == "__main__":
    main(sys.argv[1:] or ["builder", "run"])
