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
    from zerotuner.demo import write_demo

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
