"""Helpers for the browser tests: Debian's chromium driven by Playwright (never a downloaded
browser), and `zerotuner builder` as a real subprocess on a free port."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")  # apt-packages.txt: chromium


@contextlib.contextmanager
def chromium() -> Iterator[object]:
    """A headless chromium (Playwright's Browser)."""
    from playwright.sync_api import sync_playwright

    assert CHROMIUM.is_file(), f"{CHROMIUM} is missing: `make setup` installs Debian's chromium"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
        try:
            yield browser
        finally:
            browser.close()


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without settings, offline, on DeepSpeed's CPU accelerator."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(("ZT_", "HF_"))}
    env |= {"HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    return env | extra


@contextlib.contextmanager
def builder(templates: Path, log: Path, files: Path, **env: str) -> Iterator[str]:
    """`zerotuner builder --port 0` in a subprocess, forms naming files under `files`; yields
    its URL (as it prints it)."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "zerotuner", "builder", "--port", "0", "--templates",
             str(templates), "--files", str(files)],
            stdout=out, stderr=subprocess.STDOUT, env=clean_env(**env), start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            match = re.search(r"builder on (http://\S+?)/? ", log.read_text())
            if match:
                yield match.group(1)
                return
            assert proc.poll() is None, f"the builder exited {proc.returncode}:\n{log.read_text()}"
            time.sleep(0.2)
        raise AssertionError(f"the builder did not start:\n{log.read_text()}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
