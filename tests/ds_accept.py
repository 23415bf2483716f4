"""Run under torchrun: normalize each case, then hand the result to a real DeepSpeed engine.

Each case is (name, settings kwargs, raw DeepSpeed dict, decisions). For every case the rank
builds a small real model, calls `deepspeed.initialize` with the normalized config and runs
two optimizer steps. Prints `OK name` or `FAIL name: reason` on rank 0; exits 1 on any failure.
"""

from __future__ import annotations

import json
import sys
import traceback

import deepspeed
import torch
import torch.distributed as dist

from zerotuner.families import ModelShape
from zerotuner.launch.distributed import exit_process
from zerotuner.machine.hardware import cpu_only
from zerotuner.preflight.deepspeed_config import Decisions, normalize
from zerotuner.settings.schema import Settings


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def shape_of(model: torch.nn.Module) -> ModelShape:
    sizes = [p.numel() for p in model.parameters()]
    return ModelShape("sd1", sum(sizes), max(sizes), 0, 512, "test model")


def run_case(case: dict, world: int) -> None:
    torch.manual_seed(0)
    model = Small()
    settings = Settings(**case["settings"])
    result = normalize(
        case.get("base", {}),
        settings=settings,
        hardware=cpu_only(),
        shape=shape_of(model),
        world_size=world,
        decisions=Decisions(**case["decisions"]),
    )
    cfg = result.config
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    dtype = torch.bfloat16 if result.mixed_precision == "bf16" else torch.float32
    for _ in range(2 * cfg["gradient_accumulation_steps"]):
        x = torch.randn(cfg["train_micro_batch_size_per_gpu"], 16, dtype=dtype)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    assert engine.global_steps == 2, engine.global_steps
    engine.destroy()


def main() -> int:
    with open(sys.argv[1]) as file:
        cases = json.load(file)
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    failed = 0
    for case in cases:
        try:
            run_case(case, world)
            outcome = f"OK {case['name']}"
        except Exception as exc:  # report every case, then fail the run
            failed += 1
            detail = traceback.format_exc(limit=3).replace("\n", " | ")
            outcome = f"FAIL {case['name']}: {exc!r} {detail}"
        dist.barrier()
        if rank == 0:
            print(outcome, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    exit_process(main())  # as a rank does: the interpreter's teardown can abort a done run
