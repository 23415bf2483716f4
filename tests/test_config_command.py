"""`zerotuner config`: JSON on stdout, changes on stderr, usable before renting GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerotuner.cli import main
from zerotuner.commands import config as _config  # noqa: F401 (imported before any patch)
from zerotuner.machine.hardware import Hardware

REPO = Path(__file__).resolve().parents[1]


def run_config(monkeypatch, capsys, tmp_path, *args, **env):
    monkeypatch.setenv("ZT_CACHE_DIR", str(tmp_path / "cache"))  # nothing downloaded there
    monkeypatch.setenv("ZT_OFFLOAD_DIR", str(tmp_path / "offload"))
    monkeypatch.setenv("ZT_DEVICE", "cpu")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code = main(["config", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_works_without_a_model_from_the_default_familys_builtin_config(
    monkeypatch, capsys, tmp_path
):
    code, out, err = run_config(monkeypatch, capsys, tmp_path, "--explain", ZT_ZERO_STAGE="2")
    assert code == 0
    config = json.loads(out)
    assert config["zero_optimization"]["stage"] == 2
    assert "built-in sdxl config" in err and "guessed from the hub id" in err


def test_a_job_this_machine_cannot_run_still_gets_its_config_and_a_warning(
    monkeypatch, capsys, tmp_path
):
    # Full SDXL on 4 CPU ranks x 2 nodes does not fit this machine's RAM.
    code, out, err = run_config(
        monkeypatch, capsys, tmp_path, ZT_NUM_PROCESSES="4", ZT_NNODES="2",
        ZT_MASTER_ADDR="node0", ZT_RESOLUTION="1024",
    )  # fmt: skip
    assert code == 0
    assert json.loads(out)["train_batch_size"] == 8
    assert "warning: the hardware planned for cannot run it" in err


def test_invalid_settings_exit_2_with_one_line_and_nothing_on_stdout(monkeypatch, capsys, tmp_path):
    code, out, err = run_config(monkeypatch, capsys, tmp_path, ZT_OPTIMIZER="sgd")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "zerotuner: error: optimizer 'sgd' is unknown; valid: AdamW, Adam, Adagrad, Lamb, "
        "Lion, Muon, prodigy, adamw_schedulefree, adamw8bit, adafactor"
    ]


class DataParallel:
    """What DeepSpeedConfig asks a model-parallel unit: the data-parallel world size."""

    def __init__(self, world: int) -> None:
        self.world = world

    def get_data_parallel_world_size(self) -> int:
        return self.world


@pytest.mark.parametrize(
    ("precision", "flags", "half"),
    [("auto", [], "bf16"), ("fp16", [], "fp16"), ("auto", ["--no-bf16"], "fp16")],
)
def test_described_gpus_give_a_cuda_config_deepspeed_accepts_on_this_cpu_machine(
    monkeypatch, capsys, tmp_path, precision, flags, half
):
    from deepspeed.runtime import config as ds_config

    code, out, err = run_config(
        monkeypatch, capsys, tmp_path, "--gpus", "4", "--gpu-memory", "80GiB", "--nodes", "2",
        *flags, ZT_DEVICE="auto", ZT_MIXED_PRECISION=precision,
    )  # fmt: skip
    assert code == 0, err
    config = json.loads(out)
    assert config[half]["enabled"] and not config[{"bf16": "fp16", "fp16": "bf16"}[half]]["enabled"]
    assert config["train_batch_size"] == 8  # 4 GPUs x 2 nodes, no ZT_MASTER_ADDR needed
    assert "for described hardware: 4 x what-if GPU 80.0 GiB" in err
    # DeepSpeed's own parser, checking the batch against a world of 8 (no process group here).
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda: 0)
    parsed = ds_config.DeepSpeedConfig(config, mpu=DataParallel(8))
    assert parsed.world_size == 8 and parsed.train_batch_size == 8
    assert (parsed.float16_config.enabled, parsed.bfloat16_config.enabled) == (
        half == "fp16",
        half == "bf16",
    )


def test_zt_device_contradicting_the_described_gpus_exits_2(monkeypatch, capsys, tmp_path):
    code, out, err = run_config(monkeypatch, capsys, tmp_path, "--gpus", "8", "--gpu-memory", "80")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "zerotuner: error: ZT_DEVICE=cpu contradicts --gpus=8: unset ZT_DEVICE or describe no "
        "GPUs (--gpus 0)"
    ]


def test_cuda_without_a_gpu_exits_2_not_3_with_one_line_naming_the_flags(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZT_")}
    env |= {
        "ZT_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": "", "ZT_CACHE_DIR": str(tmp_path / "cache"),
        "ZT_OFFLOAD_DIR": str(tmp_path / "offload"), "PYTHONPATH": str(REPO / "src"),
    }  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "zerotuner", "config"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("zerotuner: error: ZT_DEVICE=cuda: no CUDA GPU is visible")
    assert line.endswith(
        "`zerotuner config --gpus N --gpu-memory SIZE` (e.g. --gpus 1 --gpu-memory 24GiB)"
    )


def test_a_platform_deepspeed_cannot_run_on_exits_2_not_3(monkeypatch, capsys, tmp_path):
    import zerotuner.machine.probe

    monkeypatch.setattr(zerotuner.machine.probe, "probe", lambda *a, **k: Hardware("mps"))
    code, out, err = run_config(monkeypatch, capsys, tmp_path, ZT_DEVICE="auto")
    assert code == 2 and out == ""
    [line] = err.strip().splitlines()
    assert "Apple MPS detected" in line and "--gpus N --gpu-memory SIZE" in line


def test_several_nodes_need_no_master_address_for_the_config(monkeypatch, capsys, tmp_path):
    code, out, err = run_config(monkeypatch, capsys, tmp_path, ZT_NNODES="2", ZT_NUM_PROCESSES="4")
    assert code == 0, err
    assert json.loads(out)["train_batch_size"] == 8
