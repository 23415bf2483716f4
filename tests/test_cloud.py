"""Cloud GPU rentals: the RunPod template, the vast.ai and Lambda launch scripts, and the RunPod
start script run for real (exit code passed through, root dropped, keep-alive, SIGTERM).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from test_deploy import METRICS_PORT, REPO, run

from zerotuner.errors import EXIT_CONFIG


def test_runpod_template_exposes_metrics_and_persists_to_the_volume() -> None:
    template = json.loads((REPO / "config/cloud/runpod/template.json").read_text())
    assert template["volumeMountPath"] == "/workspace"
    assert f"{METRICS_PORT}/http" in template["ports"]
    assert template["imageName"].endswith(":runpod")  # the root-start variant (see Dockerfile)
    assert template["env"]["HF_HOME"].startswith(template["env"]["ZT_CACHE_DIR"])
    vast = (REPO / "config/cloud/vastai/create-instance.sh").read_text()
    assert f"-p {METRICS_PORT}:{METRICS_PORT}" in vast and "--args train" in vast


def test_docker_run_script_sets_what_training_needs() -> None:
    words = shlex.split((REPO / "config/cloud/lambda/run.sh").read_text(), comments=True)
    for flag in ("--gpus", "--shm-size", "--stop-timeout"):
        assert flag in words
    assert "memlock=-1" in words
    assert f"{METRICS_PORT}:{METRICS_PORT}" in words


# --- the RunPod start script, run for real ----------------------------------------------------

FAKE_ENTRYPOINT = """#!/bin/sh
# Stands in for /app/entrypoint: records who ran it, then behaves as told.
id -u > "$MARKS/uid"
trap 'echo term > "$MARKS/signal"; exit 143' TERM
case "$1" in
  fail) exit 2 ;;
  done) exit 0 ;;
  wait) echo started > "$MARKS/started"; while :; do sleep 1; done ;;
esac
"""


def _wait_for(path: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


@pytest.fixture
def runpod_root():
    # A world-traversable folder: as root the script drops to uid 1000 before running it.
    with tempfile.TemporaryDirectory() as root:
        root_path = Path(root)
        root_path.chmod(0o777)
        entry = root_path / "entrypoint"
        entry.write_text(FAKE_ENTRYPOINT)
        entry.chmod(0o755)
        marks = root_path / "marks"
        marks.mkdir(mode=0o777)
        marks.chmod(0o777)
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("ZT_")},
            "ZEROTUNER_ENTRYPOINT": str(entry),
            "MARKS": str(marks),
            "ZT_OUTPUT_DIR": f"{root}/workspace/output",
            "ZT_OFFLOAD_DIR": f"{root}/workspace/offload",
            "ZT_CACHE_DIR": f"{root}/workspace/cache",
            "HF_HOME": f"{root}/workspace/cache/huggingface",
            "TORCH_EXTENSIONS_DIR": f"{root}/workspace/cache/torch_extensions",
        }
        yield root_path, marks, env


START = REPO / "config/cloud/runpod/start.sh"


def test_runpod_start_passes_the_exit_code_and_drops_root(runpod_root) -> None:
    root, marks, env = runpod_root
    result = run("sh", START, "fail", env=env)
    assert result.returncode == EXIT_CONFIG, result.stderr
    if os.geteuid() == 0:
        assert (marks / "uid").read_text().strip() == "1000"
        for folder in ("output", "offload", "cache", "cache/huggingface"):
            assert (root / "workspace" / folder).stat().st_uid == 1000


def test_runpod_keep_alive_stays_up_then_stops_on_sigterm(runpod_root) -> None:
    _, marks, env = runpod_root
    proc = subprocess.Popen(
        ["sh", str(START), "done"],
        env={**env, "ZEROTUNER_KEEP_ALIVE": "1"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()  # printed once zerotuner exited and the pod stays up
        assert "stays up" in line and proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0  # zerotuner's own status
    finally:
        proc.kill()


def test_runpod_keep_alive_forwards_sigterm_to_a_running_zerotuner(runpod_root) -> None:
    _, marks, env = runpod_root
    proc = subprocess.Popen(["sh", str(START), "wait"], env={**env, "ZEROTUNER_KEEP_ALIVE": "1"})
    try:
        _wait_for(marks / "started")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
        assert (marks / "signal").read_text().strip() == "term"
    finally:
        proc.kill()


# --- the NVIDIA driver floor in the rental files ----------------------------------------------


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def _default_image_cuda() -> str:
    """The default image's CUDA, major.0: the floor the rental filters must ask for."""
    text = (REPO / "Dockerfile").read_text()
    major = text.split("ARG CUDA_VERSION=", 1)[1].split(".", 1)[0]
    return f"{major}.0"


@pytest.mark.parametrize("image_cuda", [None, "12.0"])
def test_vast_search_asks_for_a_driver_that_runs_the_image(tmp_path, image_cuda) -> None:
    _stub(tmp_path, "vastai", 'printf "%s\\n" "$@" > "$ARGS"')
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "ARGS": str(tmp_path / "a")}
    if image_cuda:
        env["IMAGE_CUDA"] = image_cuda
    script = REPO / "config/cloud/vastai/search-offers.sh"
    result = run("sh", script, "gpu_name=RTX_4090 num_gpus=1", env=env)
    assert result.returncode == 0, result.stderr
    verb, what, query, *_ = (tmp_path / "a").read_text().splitlines()
    assert (verb, what) == ("search", "offers")
    assert f"cuda_vers>={image_cuda or _default_image_cuda()}" in query.split()
    assert "gpu_name=RTX_4090" in query.split()
    assert "search-offers.sh" in (REPO / "config/cloud/vastai/create-instance.sh").read_text()


def test_runpod_pods_are_limited_to_hosts_whose_driver_runs_the_image() -> None:
    pod = json.loads((REPO / "config/cloud/runpod/pod.json").read_text())
    allowed = pod["allowedCudaVersions"]  # RunPod's list of host CUDA versions (not a minimum)
    floor = tuple(int(p) for p in _default_image_cuda().split("."))
    assert _default_image_cuda() in allowed
    assert all(tuple(int(p) for p in v.split(".")) >= floor for v in allowed)
    template = json.loads((REPO / "config/cloud/runpod/template.json").read_text())
    assert "driver >= 580" in template["readme"] and "pod.json" in template["readme"]


@pytest.mark.parametrize(
    ("driver", "min_driver", "runs"),
    [("550.54.15", None, False), ("580.65.06", None, True), ("580", None, True),
     ("575.57.08", None, False), ("550.54.15", "525.60.13", True), (None, None, True)],
)  # fmt: skip
def test_lambda_script_checks_the_driver_before_docker(tmp_path, driver, min_driver, runs) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "docker", 'echo "$@" > "$MARKS/docker"')
    if driver:
        _stub(bin_dir, "nvidia-smi", f"echo {driver}")
    else:  # no nvidia-smi: nothing to read, the container's own check decides
        _stub(bin_dir, "nvidia-smi", "exit 127")
    env = {
        **os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MARKS": str(tmp_path),
        "ROOT": str(tmp_path / "root"), "OFFLOAD": str(tmp_path / "offload"),
    }  # fmt: skip
    if min_driver:
        env["MIN_DRIVER"] = min_driver
    result = run("sh", REPO / "config/cloud/lambda/run.sh", cwd=REPO, env=env)
    if runs:
        assert result.returncode == 0, result.stderr
        assert (tmp_path / "docker").read_text().split()[-2:] == ["zerotuner:latest", "train"]
    else:
        assert result.returncode == 3 and not (tmp_path / "docker").exists()
        [line] = result.stderr.strip().splitlines()
        assert f"NVIDIA driver {driver} is older than 580" in line


def test_vast_instances_get_the_push_remote_and_its_credentials(tmp_path) -> None:
    _stub(tmp_path, "vastai", 'printf "%s\\n" "$@" > "$ARGS"')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "HF_", "ZT_"))}
    env.update(PATH=f"{tmp_path}:{os.environ['PATH']}", ARGS=str(tmp_path / "a"))
    env.update(ZT_PUSH_TO="s3://bucket/run", AWS_ACCESS_KEY_ID="AKIA", AWS_SECRET_ACCESS_KEY="s")
    script = REPO / "config/cloud/vastai/create-instance.sh"
    result = run("sh", script, "12345", env=env)
    assert result.returncode == 0, result.stderr
    args = (tmp_path / "a").read_text().splitlines()
    options = args[args.index("--env") + 1].split()
    for setting in ("ZT_PUSH_TO=s3://bucket/run", "AWS_ACCESS_KEY_ID=AKIA",
                    "AWS_SECRET_ACCESS_KEY=s"):  # fmt: skip
        assert options[options.index(setting) - 1] == "-e"
    assert not any(o.startswith("HF_TOKEN") for o in options)  # unset: not passed
