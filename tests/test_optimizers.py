"""Client optimizers (issue 45) without a training run: the settings refused in one line before
the ranks start, what the planner counts per parameter against what each optimizer allocates,
Prodigy's d summed over ZeRO-2 ranks (1 and 2 ranks agree with prodigyopt unsharded), and
schedule-free's evaluation weights in the module (tests/optimizer_ranks.py under torchrun)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trainkit as tk

from zerotuner.preflight.optimizers import CLIENT, STATE_BYTES, canonical_optimizer, state_bytes
from zerotuner.train import optimizer as client

RANKS_SCRIPT = Path(__file__).with_name("optimizer_ranks.py")


# --- refused before the ranks start -------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"ZT_OPTIMIZER": "sgdx"}, "optimizer 'sgdx' is unknown; valid: AdamW, Adam, Adagrad, "
         "Lamb, Lion, Muon, prodigy, adamw_schedulefree, adamw8bit, adafactor"),
        ({"ZT_OPTIMIZER": "AdamW", "ZT_PRODIGY_D_COEF": "2"},
         "ZT_PRODIGY_D_COEF is a prodigy setting, but ZT_OPTIMIZER=AdamW"),
        ({"ZT_OPTIMIZER": "adamw8bit", "ZT_ZERO_STAGE": "3", "ZT_OFFLOAD_OPTIMIZER": "nvme"},
         "ZT_OPTIMIZER=adamw8bit with ZT_OFFLOAD_OPTIMIZER=nvme: DeepSpeed swaps only its own"),
        ({"ZT_OPTIMIZER": "adamw_schedulefree", "ZT_ZERO_STAGE": "3"},
         "ZT_OPTIMIZER=adamw_schedulefree with ZT_ZERO_STAGE=3"),
        ({"ZT_OPTIMIZER": "adamw_schedulefree", "ZT_LR_SCHEDULER": "cosine"},
         "ZT_LR_SCHEDULER=cosine with ZT_OPTIMIZER=adamw_schedulefree"),
    ],
)  # fmt: skip
def test_bad_optimizer_settings_are_one_line_exit_2(demo_job_env, capsys, env, expected):
    from zerotuner.cli import main

    for key, value in env.items():
        demo_job_env.setenv(key, value)
    assert main(["config"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and expected in lines[0], err
    assert "Traceback" not in err


def test_client_optimizer_config_is_what_the_rank_builds(demo_job_env, capsys) -> None:
    """prodigy: lr 1.0 unless set, its knobs in optimizer.params, ZeRO told to accept it; with
    CPU offload, DeepSpeed told to step it in PyTorch (zero_force_ds_cpu_optimizer false)."""
    from zerotuner.cli import main

    demo_job_env.setenv("ZT_OPTIMIZER", "Prodigy")
    demo_job_env.setenv("ZT_PRODIGY_D_COEF", "0.5")
    demo_job_env.setenv("ZT_ZERO_STAGE", "2")
    demo_job_env.setenv("ZT_OFFLOAD_OPTIMIZER", "cpu")
    assert main(["config"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["optimizer"] == {
        "type": "prodigy",
        "params": {"lr": 1.0, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8,
                   "d_coef": 0.5, "safeguard_warmup": False, "use_bias_correction": False},
    }  # fmt: skip
    assert config["zero_allow_untested_optimizer"] is True
    assert config["zero_force_ds_cpu_optimizer"] is False
    built = client.take(dict(config), [torch.nn.Parameter(torch.zeros(3))], zero_stage=2)
    assert isinstance(built, client.ShardedProdigy) and built.param_groups[0]["d_coef"] == 0.5


def test_prodigy_at_zero3_steps_each_partition_once(demo_job_env, capsys) -> None:
    """ZeRO-3 steps the optimizer once per sub-group: one sub-group per rank for Prodigy."""
    from zerotuner.cli import main

    demo_job_env.setenv("ZT_OPTIMIZER", "prodigy")
    demo_job_env.setenv("ZT_ZERO_STAGE", "3")
    assert main(["config"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["zero_optimization"]["sub_group_size"] == 10**12


def test_schedule_free_keeps_deepspeed_lr_flat_and_warms_up_itself(demo_job_env, capsys):
    from zerotuner.cli import main

    demo_job_env.setenv("ZT_OPTIMIZER", "adamw_schedulefree")
    demo_job_env.setenv("ZT_LR_WARMUP_STEPS", "50")
    demo_job_env.setenv("ZT_LEARNING_RATE", "0.002")
    assert main(["config"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["optimizer"]["params"]["warmup_steps"] == 50
    params = config["scheduler"]["params"]
    assert params["warmup_min_lr"] == params["warmup_max_lr"] == 0.002


# --- the planner's table against what each optimizer allocates ----------------------------


def measured_state_bytes(name: str, numel: int = 1 << 16) -> float:
    """Optimizer state bytes per element of one flat fp32 parameter (what DeepSpeed hands the
    optimizer at ZeRO >= 1), after two steps."""
    param = torch.nn.Parameter(torch.randn(numel))
    section = {"type": name, "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
               "weight_decay": 0.0, "d_coef": 1.0, "safeguard_warmup": False,
               "use_bias_correction": False, "warmup_steps": 0, "clip_threshold": 1.0,
               "decay_rate": -0.8}}  # fmt: skip
    optimizer = client.take({"optimizer": section}, [param], zero_stage=0)
    for _ in range(2):
        param.grad = torch.randn(numel)
        optimizer.step()
    state = optimizer.state[param]
    total = sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    return total / numel


@pytest.mark.parametrize("name", CLIENT)
def test_planner_state_bytes_match_the_optimizer(name) -> None:
    measured = measured_state_bytes(name)
    assert math.isclose(measured, state_bytes(name, zero_stage=1), rel_tol=0.02), measured


def test_adafactor_is_factored_only_on_whole_matrices() -> None:
    """ZeRO-0 hands Adafactor the 2-D weights (rows + columns: ~0 bytes each); ZeRO >= 1 a flat
    1-D partition, whose second moment is whole: the planner counts 4 bytes there."""
    weight = torch.nn.Parameter(torch.randn(512, 512))
    optimizer = client.take({"optimizer": {"type": "adafactor", "params": {
        "lr": 1e-3, "weight_decay": 0.0, "clip_threshold": 1.0, "decay_rate": -0.8}}},
        [weight], zero_stage=0)  # fmt: skip
    weight.grad = torch.randn(512, 512)
    optimizer.step()
    state = optimizer.state[weight]
    total = sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    assert total / weight.numel() <= state_bytes("adafactor", zero_stage=0)
    assert STATE_BYTES["adafactor"] == 4 and canonical_optimizer("Adam-8bit")[0] == "adamw8bit"


# --- Prodigy: one algorithm, sharded or not -----------------------------------------------


def test_sharded_prodigy_unsharded_is_prodigyopt_bit_for_bit() -> None:
    from prodigyopt import Prodigy

    torch.manual_seed(0)
    start = [torch.randn(64, 32), torch.randn(32)]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    kwargs = {"lr": 1.0, "weight_decay": 0.01, "safeguard_warmup": True, "d_coef": 2.0}
    a = client.ShardedProdigy(ours, reduce_device=None, **kwargs)
    b = Prodigy(theirs, **kwargs)
    targets = [torch.randn_like(t) for t in start]
    for _ in range(20):  # gradients of a quadratic towards `targets`, from our (equal) weights
        grads = [2 * (p.detach() - t) for p, t in zip(ours, targets, strict=True)]
        for params, opt in ((ours, a), (theirs, b)):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            opt.step()
    assert all(torch.equal(x, y) for x, y in zip(ours, theirs, strict=True))
    assert a.param_groups[0]["d"] == b.param_groups[0]["d"] > 1e-6  # d moved, identically


def ranks(world: int, *args: str) -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
         f"--master_port={tk.free_port()}", str(RANKS_SCRIPT), *args],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert done.returncode == 0 and line, done.stderr[-3000:]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.slow
def test_prodigy_d_and_loss_agree_on_1_and_2_zero2_ranks() -> None:
    """The same global batch on 1 and 2 ranks (ZeRO-2, and ZeRO-3 with the one sub-group
    normalize sets): d (equal on both ranks) and the loss curve match prodigyopt's unsharded
    Prodigy; each rank's d from its own shard alone would not."""
    reference, one, two = ranks(1, "reference"), ranks(1, "prodigy"), ranks(2, "prodigy")
    two_zero3 = ranks(2, "prodigy", "--zero3")
    assert reference["d"][-1] > 2 * reference["d"][0]  # d grew: there is something to agree on
    for run in (one, two, two_zero3):
        assert all(len(set(d)) == 1 for d in run["d"])  # every rank steps with the same d
        d = [per_rank[0] for per_rank in run["d"]]
        assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(d, reference["d"], strict=True))
        pairs = zip(run["loss"], reference["loss"], strict=True)
        assert all(math.isclose(x, y, rel_tol=1e-4) for x, y in pairs)
    alone = ranks(2, "prodigy", "--unreduced")["d"][-1]
    assert not math.isclose(alone[0], alone[1], rel_tol=0.05)  # the reduction is what agrees


@pytest.mark.slow
def test_schedule_free_evaluation_weights_reach_the_module_on_2_ranks() -> None:
    """Inside eval_weights the module (what samples render and export writes) holds x, the
    fp32 masters' evaluation weights gathered from both ranks, not y; after it, y again."""
    result = ranks(2, "schedulefree")
    assert result["module_is_eval_x"] and result["module_equals_fp32_master"]
    assert result["eval_differs_from_train"] > 1e-3
    assert result["train_weights_back"] < 1e-6


# --- the planner counts them --------------------------------------------------------------

PLAN = ["plan", "--model-family", "sdxl", "--resolution", "1024", "--train-batch-size", "1",
        "--gpus", "2", "--gpu-memory", "80GiB", "--host-memory", "512GiB", "--json"]  # fmt: skip


def planned(monkeypatch, capsys, optimizer: str) -> dict:
    from zerotuner.cli import main

    monkeypatch.setenv("ZT_OPTIMIZER", optimizer)
    assert main(PLAN) == 0
    return json.loads(capsys.readouterr().out)


def device_bytes(data: dict, stage: int, offload: str) -> int:
    key = ("zero_stage", "offload_optimizer", "offload_param", "gradient_checkpointing")
    row = next(
        r for r in data["rows"] if tuple(r[k] for k in key) == (stage, offload, "none", True)
    )
    return row["device_bytes"]


def test_plan_counts_each_optimizers_state_and_leaves_out_what_deepspeed_refuses(
    monkeypatch, capsys
) -> None:
    """SDXL's 2.6B UNet at ZeRO-2 on 2 GPUs: each optimizer's device bytes differ from
    AdamW's by its state bytes x the rank's half of the parameters; no client optimizer gets
    an NVMe optimizer row, schedule-free no ZeRO-3 row; `plan` names the bytes."""
    adamw = planned(monkeypatch, capsys, "AdamW")
    params = adamw["inputs"]["trainable_params"]
    for name in CLIENT:
        data = planned(monkeypatch, capsys, name)
        assert data["inputs"]["optimizer"] == name
        assert data["inputs"]["optimizer_state_bytes"] == state_bytes(name, zero_stage=1)
        extra = device_bytes(data, 2, "none") - device_bytes(adamw, 2, "none")
        expected = (state_bytes(name, zero_stage=2) - 8) * params / 2
        assert math.isclose(extra, expected, rel_tol=1e-3, abs_tol=16), (name, extra, expected)
        assert all(r["offload_optimizer"] != "nvme" for r in data["rows"])
        if name == "adamw_schedulefree":
            assert all(r["zero_stage"] != 3 for r in data["rows"])
    from zerotuner.cli import main

    monkeypatch.setenv("ZT_OPTIMIZER", "prodigy")
    assert main([p for p in PLAN if p != "--json"]) == 0
    out = capsys.readouterr().out
    assert "optimizer: prodigy, 16 bytes of state per trained parameter" in out


def test_the_builder_offers_the_client_optimizers_and_their_knobs() -> None:
    from zerotuner.builder import form

    fields = {f["name"]: f for s in form.form_fields() for f in s["fields"]}
    assert set(CLIENT) <= set(fields["ZT_OPTIMIZER"]["choices"])
    assert {"ZT_PRODIGY_D_COEF", "ZT_PRODIGY_SAFEGUARD_WARMUP"} <= form.shown_settings()
    composed = form.compose({"settings": {"ZT_OPTIMIZER": "adafactor"},
                             "deepspeed": {"betas": "[0.9, 0.99]"}})  # fmt: skip
    assert composed.notes == ["betas left out: optimizer adafactor has no such parameter"]
