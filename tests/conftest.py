"""Shared test setup: a clean environment and the demo models, written once per session.

The environment is fixed at import time (before any test module imports torch or DeepSpeed),
so the ranks that tests launch as subprocesses inherit it too.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A developer's shell must not change what the tests see: settings come only from the tests.
for _name in [n for n in os.environ if n.upper().startswith("ZT_")]:
    del os.environ[_name]
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no GPU here: DeepSpeed's CPU accelerator, gloo
# DeepSpeed JIT-compiles cpu_adam / async_io once; keep them between sessions.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download; fail fast if code tries


@pytest.fixture(autouse=True)
def _restore_root_logger():
    """A test that runs the CLI in-process points the root logger at pytest's capture stream,
    which is closed after that test: later tests would log into it ("--- Logging error ---")."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _write(tmp_path_factory: pytest.TempPathFactory, family: str) -> Path:
    from zerotuner.demo.pipelines import write_demo

    root = tmp_path_factory.mktemp(f"demo-{family}")
    write_demo(root, family=family)
    return root


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `zerotuner demo` output (tiny SDXL): `demo_dir / "model"`, `demo_dir / "data"`.

    Shared by the whole session: treat it as read-only (copy what you change).
    """
    return _write(tmp_path_factory, "sdxl")


@pytest.fixture(scope="session")
def sd1_demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SD 1.x-architecture pipeline and the demo data (read-only)."""
    return _write(tmp_path_factory, "sd1")


@pytest.fixture(scope="session")
def sd2_demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SD 2.x-architecture pipeline (v-prediction, 1024-wide text states) (read-only)."""
    return _write(tmp_path_factory, "sd2")


@pytest.fixture(scope="session")
def flow_demo_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny SD3 and Flux.1 pipelines (demo_flow.py) with the demo data, by family (read-only)."""
    return {family: _write(tmp_path_factory, family) for family in ("sd3", "flux")}


@pytest.fixture(scope="session")
def family_demo_dir(tmp_path_factory: pytest.TempPathFactory):
    """`family_demo_dir(family)`: the demo of a newer family (chroma, zimage), written once per
    session on first use (read-only)."""
    written: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in written:
            written[family] = _write(tmp_path_factory, family)
        return written[family]

    return get


@pytest.fixture
def demo_job_env(monkeypatch, demo_dir, tmp_path):
    """The demo job on two CPU ranks for an in-process `zerotuner` command, every folder of its
    own under tmp_path; returns the monkeypatch to change more settings with."""
    env = {
        "ZT_MODEL": str(demo_dir / "model"),
        "ZT_DATA_DIR": str(demo_dir / "data"),
        "ZT_OUTPUT_DIR": str(tmp_path / "output"),
        "ZT_OFFLOAD_DIR": str(tmp_path / "offload"),
        "ZT_CACHE_DIR": str(tmp_path / "cache"),
        "ZT_DEVICE": "cpu",
        "ZT_NUM_PROCESSES": "2",
        "ZT_METRICS_PORT": "0",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return monkeypatch
