"""Run by tests/test_optimizers.py under torchrun on CPU ranks (gloo): a small MLP trained at
ZeRO-2 with the client optimizers zerotuner builds (zerotuner.train.optimizer.take), each
rank on its share of one global batch, so that 1 and 2 ranks step the same averaged gradient.
Rank 0 prints `RESULT <json>`.

    prodigy [--unreduced] [--zero3]   d and the loss at each step (--unreduced: each rank's
                            own d; --zero3: ZeRO-3 instead of ZeRO-2)
    reference               prodigyopt's own Prodigy, unsharded, no DeepSpeed, on the batch
    schedulefree            the module's weights in and out of eval_weights, and z, y, x
"""

from __future__ import annotations

import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist

from zerotuner.train import optimizer as client

STEPS, GLOBAL_BATCH = 8, 8


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
        torch.nn.Linear(64, 4),
    )  # fmt: skip


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=gen)
    return x, (x[:, :4] * 2).sin()


def engine(kind: str, params: dict, world: int, stage: int = 2) -> tuple[object, torch.nn.Module]:
    net = model()
    trainable = list(net.parameters())
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        # ZeRO-3 as normalize writes it for Prodigy: one sub-group per rank
        "zero_optimization": {"stage": stage, **({"sub_group_size": 10**12} if stage == 3 else {})},
        "zero_allow_untested_optimizer": True,
        "optimizer": {"type": kind, "params": params},
    }
    built = client.take(config, trainable, zero_stage=stage)
    ds, _, _, _ = deepspeed.initialize(model=net, model_parameters=trainable, optimizer=built,
                                       config=config)  # fmt: skip
    return ds, net


def train_steps(ds, world: int, rank: int, steps: int = STEPS) -> list[float]:
    return [train_step(ds, world, rank, step) for step in range(steps)]


PRODIGY = {"lr": 1.0, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "d_coef": 1.0,
           "safeguard_warmup": False, "use_bias_correction": False}  # fmt: skip


def prodigy(world: int, rank: int, unreduced: bool, stage: int) -> dict:
    ds, _ = engine("prodigy", PRODIGY, world, stage)
    base = ds.basic_optimizer
    if unreduced:
        base.reduce_device = None  # what each rank would estimate from its shard alone
    ds_per_step, losses = [], []
    for step in range(STEPS):
        losses.append(train_step(ds, world, rank, step))
        d = torch.tensor([base.param_groups[0]["d"]], dtype=torch.float64)
        gathered = [torch.zeros_like(d) for _ in range(world)]
        dist.all_gather(gathered, d)
        ds_per_step.append([g.item() for g in gathered])
    return {"d": ds_per_step, "loss": losses}


def train_step(ds, world: int, rank: int, step: int) -> float:
    """One step on this rank's share of the global batch; the global batch's loss."""
    share = GLOBAL_BATCH // world
    x, y = batch(step)
    x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
    loss = torch.nn.functional.mse_loss(ds(x), y)
    ds.backward(loss)
    ds.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / world


def reference() -> dict:
    from prodigyopt import Prodigy

    net = model()
    opt = Prodigy(net.parameters(), **{**PRODIGY, "betas": tuple(PRODIGY["betas"])})
    d, losses = [], []
    for step in range(STEPS):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        d.append(opt.param_groups[0]["d"])
        losses.append(loss.item())
    return {"d": d, "loss": losses}


def schedulefree(world: int, rank: int) -> dict:
    params = {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
              "warmup_steps": 0}  # fmt: skip
    ds, net = engine("adamw_schedulefree", params, world)
    train_steps(ds, world, rank)
    base = ds.basic_optimizer
    beta1 = base.param_groups[0]["betas"][0]

    def flat() -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in net.parameters()]).clone()

    def gathered(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.zeros_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    y = flat()
    z = gathered(base.state[base.param_groups[0]["params"][0]]["z"])[: y.numel()]
    with client.eval_weights(ds, "the test"):
        inside = flat()
        master = gathered(base.param_groups[0]["params"][0].detach())[: y.numel()]
    after = flat()
    x = (y - (1 - beta1) * z) / beta1  # y = (1 - beta1) z + beta1 x (schedule-free's y)
    return {
        "module_is_eval_x": torch.allclose(inside, x, rtol=1e-4, atol=1e-6),
        "module_equals_fp32_master": torch.equal(inside, master),
        "eval_differs_from_train": (inside - y).abs().max().item(),
        "train_weights_back": (after - y).abs().max().item(),
    }


def main() -> None:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mode = sys.argv[1]
    if mode == "prodigy":
        result = prodigy(world, rank, "--unreduced" in sys.argv, 3 if "--zero3" in sys.argv else 2)
    elif mode == "reference":
        result = reference()
    else:
        result = schedulefree(world, rank)
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # a finished gloo group's teardown has aborted processes (worker.main)


if __name__ == "__main__":
    main()
