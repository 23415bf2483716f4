"""What `check`, `plan`, `config` and `train` say about the job's folders and precision.

The commands run in-process through `cli.main`, on the demo model and data, on the CPU.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.request
from pathlib import Path

import pytest

from zerotuner import cli


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- precision: the setting's `no` reads as fp32 ------------------------------------------------


def test_plan_and_check_say_fp32_not_a_bare_no(demo_job_env, capsys):
    demo_job_env.setenv("ZT_MIXED_PRECISION", "no")
    code, out, err = run(capsys, "plan")
    assert code == 0, err
    (job,) = [line for line in out.splitlines() if line.startswith("job:")]
    assert job.endswith("world size 2, fp32"), job
    code, out, err = run(capsys, "check")
    assert code == 0, out + err
    (line,) = [line for line in out.splitlines() if " deepspeed config " in line]
    assert line.endswith(", fp32)"), line
    code, out, err = run(capsys, "config", "--explain")
    assert code == 0, err
    assert "info: precision: fp32" in err and "mixed precision: no" not in err


# --- NVMe offload: the user's nvme_path is the offload dir ------------------------------------


@pytest.fixture
def train_until_launch(monkeypatch):
    """`zerotuner train` in this process up to the launch of the ranks, which is recorded
    instead: what the job file says, and what /metrics serves while the ranks would run."""
    import logging

    import zerotuner.commands.train as train_command

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    launched: list[dict] = []

    class Recorded:
        """The ranks `train` starts, recording the job they are released with: the job file
        and, while it is written, the metrics endpoint."""

        def __init__(self, topology, hardware, *, job_file, status_dir, grace_seconds):
            self.job_file = job_file

        def release(self):
            seen = {"job": json.loads(Path(self.job_file).read_text())}
            port = os.environ.get("ZT_METRICS_PORT", "0")
            if port != "0":
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                    seen["metrics"] = r.read().decode()
            launched.append(seen)

        def wait(self):
            return 0

        def cancel(self):
            pass

    monkeypatch.setattr(train_command, "start_ranks", Recorded)
    yield launched
    root.handlers[:] = handlers  # train configures the root logger of its process
    root.setLevel(level)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nvme_config(tmp_path: Path, **paths: str) -> Path:
    zero: dict = {"stage": 3}
    for key, path in paths.items():
        zero[key] = {"device": "nvme", "nvme_path": path}
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": zero}))
    return config


def metric(text: str, name: str) -> float | None:
    found = [line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")]
    return float(found[0]) if found else None


def test_a_real_nvme_path_is_the_offload_dir_config_check_and_train_use(
    demo_job_env, capsys, tmp_path, train_until_launch
):
    swap = tmp_path / "fastdisk" / "swap"
    stale = swap / "zero_stage_3" / "fp32params" / "rank0" / "0_param.tensor.swp"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x" * 4096)
    mine = swap / "notes.bin"  # the user's own file in their folder: never touched
    mine.write_bytes(os.urandom(2 << 20))
    demo_job_env.setenv("ZT_DEEPSPEED_CONFIG", str(nvme_config(tmp_path, offload_param=str(swap))))
    demo_job_env.delenv("ZT_OFFLOAD_DIR", raising=False)

    code, out, err = run(capsys, "config", "--explain")
    assert code == 0, err
    assert json.loads(out)["zero_optimization"]["offload_param"]["nvme_path"] == str(swap)
    assert "/offload" not in err and "change: zero_optimization.offload_param.nvme_path" not in err
    assert f"info: ZT_OFFLOAD_DIR={swap} from zero_optimization.offload_param.nvme_path" in err

    code, out, err = run(capsys, "check")
    assert code == 0, out + err
    line = next(line for line in out.splitlines() if line[5:].startswith("offload "))
    assert line.startswith("OK") and f"{swap}: " in line and "O_DIRECT ok" in line, line
    assert stale.exists()  # check cleans nothing

    demo_job_env.setenv("ZT_METRICS_HOST", "127.0.0.1")
    demo_job_env.setenv("ZT_METRICS_PORT", str(free_port()))
    code, out, err = run(capsys, "train")
    assert code == 0, err
    (seen,) = train_until_launch
    assert seen["job"]["deepspeed"]["zero_optimization"]["offload_param"]["nvme_path"] == str(swap)
    assert not stale.exists() and not (swap / "zero_stage_3").exists()  # cleaned for the ranks
    assert mine.exists()
    assert metric(seen["metrics"], "zerotuner_offload_dir_used_bytes") >= 2 << 20


@pytest.mark.parametrize("command", ["config", "check", "train"])
def test_an_explicit_offload_dir_other_than_the_nvme_path_is_exit_2_naming_both(
    demo_job_env, capsys, tmp_path, train_until_launch, command
):
    swap, offload = tmp_path / "swap", tmp_path / "offload"
    demo_job_env.setenv("ZT_DEEPSPEED_CONFIG", str(nvme_config(tmp_path, offload_param=str(swap))))
    demo_job_env.setenv("ZT_OFFLOAD_DIR", str(offload))
    code, out, err = run(capsys, command)
    assert code == 2, out + err
    expected = (
        f"ZT_OFFLOAD_DIR={offload} and zero_optimization.offload_param.nvme_path in "
        f"ZT_DEEPSPEED_CONFIG={tmp_path / 'ds.json'} ({swap}) name different NVMe offload folders"
    )
    lines = [line for line in (out + err).splitlines() if expected in line]
    assert len(lines) == 1, out + err
    assert not train_until_launch and not swap.exists() and not offload.exists()


def test_the_same_folder_in_both_places_is_fine(demo_job_env, capsys, tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    (tmp_path / "link").symlink_to(swap)
    demo_job_env.setenv("ZT_DEEPSPEED_CONFIG", str(nvme_config(tmp_path, offload_param=f"{swap}/")))
    demo_job_env.setenv("ZT_OFFLOAD_DIR", str(tmp_path / "link"))
    code, out, err = run(capsys, "config")
    assert code == 0, err
    assert "nvme_path" not in err  # nothing to report: one folder


def test_two_different_nvme_paths_are_refused_with_one_line(demo_job_env, capsys, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    config = nvme_config(tmp_path, offload_optimizer=str(a), offload_param=str(b))
    demo_job_env.setenv("ZT_DEEPSPEED_CONFIG", str(config))
    code, out, err = run(capsys, "config")
    assert (code, out) == (2, "")
    (line,) = err.splitlines()
    assert f"offload_optimizer.nvme_path in ZT_DEEPSPEED_CONFIG={config} is {a}" in line
    assert f"offload_param.nvme_path in ZT_DEEPSPEED_CONFIG={config} is {b}" in line
    assert "give both the same path" in line


def test_the_seed_placeholder_leaves_the_offload_dir_setting_in_charge(
    demo_job_env, capsys, tmp_path
):
    config = nvme_config(tmp_path, offload_param="/path/to/nvme")
    demo_job_env.setenv("ZT_DEEPSPEED_CONFIG", str(config))
    demo_job_env.setenv("ZT_OFFLOAD_DIR", str(tmp_path / "offload"))
    code, out, err = run(capsys, "config", "--explain")
    assert code == 0, err
    nvme = json.loads(out)["zero_optimization"]["offload_param"]["nvme_path"]
    assert nvme == str(tmp_path / "offload")
    assert "nvme_path placeholder '/path/to/nvme'" in err


# --- folders: nothing the job writes may sit in the training data (nor the data in them) -------


def tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.lstat().st_size for p in sorted(root.rglob("*"))}


OVERLAPS = {  # name: (settings relative to tmp_path, the line's start)
    "output is data": ({"ZT_OUTPUT_DIR": "data"}, "ZT_OUTPUT_DIR={t}/data is ZT_DATA_DIR={t}/data"),
    "output in data": (
        {"ZT_OUTPUT_DIR": "data/run"},
        "ZT_OUTPUT_DIR={t}/data/run is inside ZT_DATA_DIR={t}/data",
    ),
    "data in output": (
        {"ZT_OUTPUT_DIR": "."},
        "ZT_OUTPUT_DIR={t} holds ZT_DATA_DIR={t}/data",
    ),
    "cache in data": (
        {"ZT_CACHE_DIR": "data/.cache"},
        "ZT_CACHE_DIR={t}/data/.cache is inside ZT_DATA_DIR={t}/data",
    ),
    "offload in data": (
        {"ZT_OFFLOAD_DIR": "data/swap"},
        "ZT_OFFLOAD_DIR={t}/data/swap is inside ZT_DATA_DIR={t}/data",
    ),
    "output through a symlink": (
        {"ZT_OUTPUT_DIR": "link/out"},
        "ZT_OUTPUT_DIR={t}/link/out (-> {t}/data/out) is inside ZT_DATA_DIR={t}/data",
    ),
    "relative output in data": (
        {"ZT_OUTPUT_DIR": "./data/../data/out"},
        "ZT_OUTPUT_DIR=data/../data/out (-> {t}/data/out) is inside ZT_DATA_DIR={t}/data",
    ),
}


@pytest.fixture
def overlapping(demo_job_env, demo_dir, tmp_path, request):
    """The demo data copied to tmp_path/data, and folders set as the case says."""
    import shutil

    env, line = OVERLAPS[request.param]
    shutil.copytree(demo_dir / "data", tmp_path / "data")
    (tmp_path / "link").symlink_to(tmp_path / "data")
    demo_job_env.chdir(tmp_path)
    demo_job_env.setenv("ZT_DATA_DIR", str(tmp_path / "data"))
    demo_job_env.setenv("ZT_OUTPUT_DIR", str(tmp_path / "output"))
    demo_job_env.setenv("ZT_OFFLOAD_DIR", str(tmp_path / "offload"))
    for key, value in env.items():
        demo_job_env.setenv(key, value if value.startswith("./") else str(tmp_path / value))
    return line.format(t=tmp_path), tree(tmp_path)


@pytest.mark.parametrize("overlapping", list(OVERLAPS), indirect=True)
def test_check_refuses_folders_overlapping_the_data_with_one_line(overlapping, capsys, tmp_path):
    expected, before = overlapping
    code, out, err = run(capsys, "check")
    assert code == 2, out + err
    (line,) = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert line.startswith("FAIL folders") and expected in line, line
    assert line.endswith("; give each its own folder")
    assert tree(tmp_path) == before  # nothing created, cleaned or written


@pytest.mark.parametrize("overlapping", ["output in data", "data in output"], indirect=True)
def test_train_refuses_them_before_launching_and_touches_nothing(
    overlapping, capsys, tmp_path, train_until_launch
):
    expected, before = overlapping
    code, out, err = run(capsys, "train")
    assert code == 2, out + err
    (line,) = [line for line in err.splitlines() if "ZT_DATA_DIR" in line]
    assert line.startswith("zerotuner: error: ") and expected in line
    assert not train_until_launch
    assert tree(tmp_path) == before


def test_neighbouring_folders_and_data_inside_the_cache_are_fine(demo_job_env, capsys, tmp_path):
    demo_job_env.setenv("ZT_OUTPUT_DIR", str(tmp_path / "data-output"))  # a prefix is not a parent
    demo_job_env.setenv(
        "ZT_CACHE_DIR", "/"
    )  # the cache may hold the data: nothing there is deleted
    code, out, err = run(capsys, "check")
    line = next(line for line in out.splitlines() if line[5:].startswith("folders "))
    assert line.startswith("OK"), out + err
