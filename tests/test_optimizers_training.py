"""Client optimizers (issue 45) training the demo SDXL UNet on 2 CPU ranks at ZeRO-2.

One run per optimizer holds every claim about it: the loss falls, a resume from the middle
checkpoint ends bit for bit where the run did. Prodigy also runs on one rank, with the same d
and loss curve (its d-estimate summed over the ranks); schedule-free's export and checkpoint
hold its evaluation weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import trainkit as tk
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

STEPS, SAVED = 6, 3
# ZT_OPTIMIZER -> the optimizer section normalize writes (learning rates people use on them)
SECTIONS: dict[str, dict[str, Any]] = {
    "prodigy": {"lr": 1.0, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                "d_coef": 1.0, "safeguard_warmup": True, "use_bias_correction": False},
    "adamw_schedulefree": {"lr": 2e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                           "weight_decay": 0.01, "warmup_steps": 2},
    "adamw8bit": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
    "adafactor": {"lr": 1e-3, "weight_decay": 0.01, "clip_threshold": 1.0, "decay_rate": -0.8},
}  # fmt: skip


def client_config(name: str, *, world: int) -> dict[str, Any]:
    config = tk.ds_config(2, world=world, steps=STEPS, lr=SECTIONS[name]["lr"])
    config["optimizer"] = {"type": name, "params": dict(SECTIONS[name])}
    config["zero_allow_untested_optimizer"] = True
    if name == "adamw_schedulefree":  # flat: its warm-up is the optimizer's
        config["scheduler"]["params"] |= {"warmup_min_lr": SECTIONS[name]["lr"],
                                          "warmup_num_steps": 1}  # fmt: skip
    return config


def run(tmp: Path, demo: Path, cache: Path, name: str, *, world: int = 2,
        output: Path | None = None) -> Path:  # fmt: skip
    tmp.mkdir(parents=True, exist_ok=True)
    output = output or tmp / "output"
    job = tk.write_job(tmp / "job.json", model=demo / "model",
                       deepspeed=client_config(name, world=world), world=world)  # fmt: skip
    env = tk.settings_env(
        model=demo / "model", data=demo / "data", output=output, cache=cache, max_steps=STEPS,
        log_every_steps=1, checkpoint_every_steps=SAVED, optimizer=name, seed=7,
    )  # fmt: skip
    proc = tk.run_ranks(tmp, env, job_file=job, world=world)
    tk.assert_ok(proc, tmp, world=world)
    (tmp / "log.txt").write_text(proc.stdout + proc.stderr)
    return output


def resumed(tmp: Path, demo: Path, cache: Path, name: str, output: Path) -> Path:
    again = tmp / "again"
    (again / "checkpoints").mkdir(parents=True)
    saved = output / "checkpoints" / f"step-{SAVED}"
    shutil.copytree(saved, again / "checkpoints" / saved.name)
    return run(tmp / "resume", demo, cache, name, output=again)


def final_weights(output: Path) -> dict[str, torch.Tensor]:
    return load_file(output / "final" / "unet" / "diffusion_pytorch_model.safetensors")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The demo's latents and text states, encoded by the first run and reused by the rest
    (every optimizer trains on the same model, data and resolution)."""
    return tmp_path_factory.mktemp("features")


@pytest.mark.parametrize("name", list(SECTIONS))
def test_client_optimizer_trains_and_resumes_bit_exact(name, demo_dir, cache, tmp_path) -> None:
    output = run(tmp_path / "first", demo_dir, cache, name)
    log = (tmp_path / "first" / "log.txt").read_text()
    assert f"optimizer: {name}" in log and "steps one shard of it per rank (ZeRO-2)" in log
    losses = [s["loss"] for s in tk.read_steps(output)]
    assert len(losses) == STEPS
    assert sum(losses[-2:]) < sum(losses[:2]), losses  # the loss falls
    again = resumed(tmp_path, demo_dir, cache, name, output)
    assert "resumed from" in (tmp_path / "resume" / "log.txt").read_text()
    assert [s["loss"] for s in tk.read_steps(again)] == losses[SAVED:]
    final, final_again = final_weights(output), final_weights(again)
    assert final.keys() == final_again.keys()
    assert all(torch.equal(final[k], final_again[k]) for k in final)
    if name == "adamw_schedulefree":
        evaluation_weights_saved_and_exported(output, final)
    resumes_only_as_saved(output / "checkpoints" / f"step-{SAVED}", name)


def resumes_only_as_saved(saved: Path, name: str) -> None:
    """The manifest names the optimizer; another optimizer, world size or stage is one line
    (the universal checkpoint carries Adam's moments only), checked before DeepSpeed loads."""
    from zerotuner.errors import ConfigError
    from zerotuner.train.optimizer import check_resume
    from zerotuner.weights.checkpoint import read_manifest

    assert (read_manifest(saved) or {})["optimizer"] == name
    check_resume(saved, name, world=2, zero_stage=1)  # ZeRO-1 and 2 share a layout
    other = "AdamW" if name != "AdamW" else "prodigy"
    for kind, world, stage, says in ((other, 2, 2, f"holds {name}'s optimizer state"),
                                     (name, 1, 2, "resumes only on that layout"),
                                     (name, 2, 3, "resumes only on that layout")):  # fmt: skip
        with pytest.raises(ConfigError, match=says) as refused:
            check_resume(saved, kind, world=world, zero_stage=stage)
        assert "\n" not in str(refused.value)


def evaluation_weights_saved_and_exported(output: Path, final: dict[str, torch.Tensor]) -> None:
    """The last checkpoint was saved in eval mode (its module and fp32 masters hold x, the
    weights schedule-free evaluates) and the export holds the same x: equal up to the
    rounding of one switch back to y and out again (~1e-10 here)."""
    saved = output / "checkpoints" / f"step-{STEPS}"
    optim = torch.load(saved / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    groups = optim["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    assert [g["train_mode"] for g in groups] == [False] * len(groups)
    module = torch.load(saved / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert all(torch.allclose(final[k], module[k], rtol=0, atol=1e-7) for k in final)
