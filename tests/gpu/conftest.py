"""The GPU acceptance suite's pytest wiring: when it runs, and the report it writes.

Tests marked `gpu` run only under `make test-gpu` (`--gpu-report DIR`) on a machine where torch
sees a CUDA GPU; anywhere else they are skipped at collection with the reason, before torch is
imported (`make test` collects them in milliseconds). Every check records what held and what
did not through the `check` fixture; pytest's outcome and error are added to it here, and the
session's end writes DIR/gpu-report.json and .md (report.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from gpureport import CheckResult, write_report

RESULTS: dict[str, CheckResult] = {}
STATE: dict[str, object] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--gpu-report", metavar="DIR", default=None,
        help="run the GPU acceptance suite (tests marked gpu) and write its report to DIR",
    )  # fmt: skip


def _report_dir(config: pytest.Config) -> Path | None:
    try:
        value = config.getoption("gpu_report")
    except ValueError:  # option not registered: this conftest was not an initial one
        return None
    return Path(value) if value else None


def cuda_absent_reason() -> str | None:
    """Why the GPU checks cannot run here, or None when torch sees a CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU build)"
        return f"CUDA is absent: torch {torch.__version__} (CUDA {built}) sees no GPU"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    folder = _report_dir(config)
    if folder is None:
        reason = "GPU acceptance suite: run by `make test-gpu` on a CUDA machine, not `make test`"
    else:
        reason = cuda_absent_reason()
        STATE["skip_reason"] = reason
    for item in gpu_items:
        RESULTS[item.nodeid] = CheckResult(name=_name(item), nodeid=item.nodeid)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def _name(item: pytest.Item) -> str:
    doc = getattr(item.function, "__doc__", None) or ""
    title = doc.strip().splitlines()[0].rstrip(".") if doc.strip() else item.name
    param = getattr(getattr(item, "callspec", None), "id", None)
    return f"{title} [{param}]" if param else title


@pytest.fixture
def check(request: pytest.FixtureRequest) -> CheckResult:
    """This test's entry in the report; `check.expect(cond, text)` records a line, and the test
    fails at its end when any line did not hold (after recording them all)."""
    result = RESULTS.setdefault(
        request.node.nodeid, CheckResult(name=_name(request.node), nodeid=request.node.nodeid)
    )
    yield result
    if result.failed:
        pytest.fail("did not hold: " + "; ".join(result.failed), pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    result = RESULTS.get(item.nodeid)
    if result is None:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        result.seconds += report.duration
        if report.skipped:
            result.outcome = "skipped"
            result.set_error(str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else "")
        elif report.failed:
            result.outcome = "failed" if report.when == "call" else "error"
            result.set_error(report.longreprtext)
        else:
            result.outcome = "passed"
    elif report.when == "teardown" and report.failed:  # the check fixture's verdict
        result.outcome = "failed"
        if not result.error:  # keep what the test recorded (a run's log tail says why)
            result.set_error(report.longreprtext)


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    """Rewrite the report after each check: a suite cut short by the lease's time limit still
    leaves every check that finished on disk."""
    if nodeid in RESULTS and STATE.get("config") is not None and not STATE.get("skip_reason"):
        _write(STATE["config"], final=False)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _write(session.config, final=True)


def _write(config: pytest.Config, final: bool) -> None:
    folder = _report_dir(config)
    if folder is None or not RESULTS:
        return
    skip = STATE.get("skip_reason")
    note = f"Not run on a GPU: {skip}." if skip else ""
    if os.environ.get("GPU_SUITE_NOTE"):
        note = f"{os.environ['GPU_SUITE_NOTE']} {note}".strip()
    if "environment" not in STATE:
        STATE["environment"] = environment() if not skip else {"skipped": skip}
    env = dict(STATE["environment"])
    env["suite seconds"] = round(time.time() - STATE.get("started", time.time()), 1)
    if not final:
        env["unfinished"] = "the suite was still running when this was written"
    json_path, md_path = write_report(list(RESULTS.values()), folder, env, note=note)
    if final:
        print(f"\nGPU report: {json_path} and {md_path}")


def pytest_sessionstart(session: pytest.Session) -> None:
    STATE["started"] = time.time()
    STATE["config"] = session.config


def environment() -> dict[str, object]:
    """The machine and versions the report was made with."""
    import platform
    from importlib import metadata

    import torch

    env: dict[str, object] = {"host": platform.node(), "python": platform.python_version()}
    env["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
    for name in ("deepspeed", "diffusers", "transformers", "peft", "zerotuner"):
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name] = "missing"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = (
            f"{props.name}, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}"
        )
        try:
            import pynvml

            pynvml.nvmlInit()
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception as error:  # noqa: BLE001 - the report says why
            env["driver"] = f"NVML: {error}"
    env["cpus"] = os.cpu_count()
    return env
