"""Client optimizers (ZT_OPTIMIZER, issue 45) on the bench UNet, ZeRO-2 on 2 CPU ranks.

Each optimizer's DeepSpeed config is the one zerotuner's preflight writes for it; the bare loop
(`bench/bare.py`, which builds a client optimizer as the product does) runs it. Per optimizer:
the bytes of state each rank's optimizer holds per parameter of its shard, against the
planner's table (`preflight/optimizers.state_bytes`), and the steady seconds per step against
AdamW's in the same round (rounds interleave the optimizers, so a busy machine moves one round,
not one optimizer). Timings are this machine's CPU ranks: the optimizer step is a larger part
of a CPU step than of a GPU one, and bitsandbytes' CPU kernels are not its CUDA ones.
"""

from __future__ import annotations

from typing import Any

from bench import runs
from bench.suites import Bench, median, preflight_for, steady

NAMES = ("AdamW", "prodigy", "adamw_schedulefree", "adamw8bit", "adafactor")


def optimizers(b: Bench, rounds: int = 2) -> list[dict[str, Any]]:
    from zerotuner.preflight.optimizers import state_bytes

    configs = {}
    for name in NAMES:
        pre, _ = preflight_for(b, zero_stage=2, offload_optimizer="none", optimizer=name)
        configs[name] = pre.normalized.config
    seconds: dict[str, list[float]] = {n: [] for n in NAMES}
    ratios: dict[str, list[float]] = {n: [] for n in NAMES}
    state: dict[str, float] = {}
    for i in range(rounds):
        this_round = {}
        for name in NAMES:
            run = runs.run_bare(b.work(f"optimizer-{name}-{i}"), b.model, configs[name],
                                steps=b.steps)  # fmt: skip
            this_round[name] = median(steady(run.rank0["step_seconds"], b.warmup))
            seconds[name].append(this_round[name])
            shard = run.rank0["trainable_params"] / run.rank0["world_size"]
            state[name] = run.rank0["optimizer_state_bytes"] / shard
        for name in NAMES:
            ratios[name].append(this_round[name] / this_round["AdamW"])
    return [
        {
            "optimizer": name,
            "state_bytes_per_param": state[name],
            "planned_state_bytes_per_param": state_bytes(name, zero_stage=2),
            "step_seconds": median(seconds[name]),
            "step_time_vs_adamw": median(ratios[name]),
            "step_time_vs_adamw_rounds": ratios[name],
        }
        for name in NAMES
    ]


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The report's section (bench/report.py)."""
    out = [
        "## Optimizers (ZT_OPTIMIZER): state bytes per parameter and step time, ZeRO-2, 2 ranks",
        "",
        "| optimizer | state bytes per parameter: measured | planned | s/step | vs AdamW |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['optimizer']} | {r['state_bytes_per_param']:.3f} | "
            f"{r['planned_state_bytes_per_param']:.3f} | {r['step_seconds']:.2f} | "
            f"{r['step_time_vs_adamw']:.2f} |"
        )
    return [*out, "", " ".join(__doc__.split("\n\n")[1].split()), ""]
