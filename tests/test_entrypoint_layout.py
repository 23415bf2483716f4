"""`./entrypoint check` the way the image runs it: the container's folder layout under a temp
root (data, output, offload, cache, config), settings only from ZT_* variables and the mounted
config file, and the exit code passed through the entrypoint's `exec` unchanged."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from zerotuner.errors import EXIT_CONFIG

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # starts the CLI in a fresh process (imports torch, DeepSpeed)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def container_root(tmp_path: Path, demo_dir: Path) -> tuple[Path, dict[str, str]]:
    """/data, /output, /offload, /cache, /config as the image lays them out, under tmp_path."""
    root = tmp_path
    shutil.copytree(demo_dir / "data", root / "data")
    shutil.copytree(demo_dir / "model", root / "cache" / "demo-model")
    for folder in ("output", "offload", "config", "secrets"):
        (root / folder).mkdir()
    (root / "config" / "zerotuner.yaml").write_text(
        "# what a user mounts at /config/zerotuner.yaml\nmax_steps: 2\ncheckpoint_every_steps: 1\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("ZT_")}
    env.update(
        ZT_MODEL=str(root / "cache" / "demo-model"),
        ZT_DATA_DIR=str(root / "data"),
        ZT_OUTPUT_DIR=str(root / "output"),
        ZT_OFFLOAD_DIR=str(root / "offload"),
        ZT_CACHE_DIR=str(root / "cache"),
        ZT_CONFIG_FILE=str(root / "config" / "zerotuner.yaml"),
        ZT_SECRETS_DIR=str(root / "secrets"),
        ZT_DEVICE="cpu",
        ZT_METRICS_PORT=str(_free_port()),
        HF_HOME=str(root / "cache" / "huggingface"),
        HF_HUB_OFFLINE="1",
    )
    return root, env


def entrypoint(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(REPO / "entrypoint"), *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_entrypoint_check_passes_in_the_container_layout(container_root) -> None:
    root, env = container_root
    result = entrypoint("check", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout
    # check validates and trains nothing: no checkpoint appears in /output.
    assert not any((root / "output").rglob("*.pt"))


def test_entrypoint_check_reports_a_misspelt_setting_with_exit_2(container_root) -> None:
    _, env = container_root
    result = entrypoint("check", env={**env, "ZT_MAX_STEPZ": "5"})
    assert result.returncode == EXIT_CONFIG
    # check reports it as the first step of the settings path, in its own FAIL line
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("FAIL")]
    assert line.split()[1] == "settings" and "ZT_MAX_STEPZ" in line and "ZT_MAX_STEPS" in line
