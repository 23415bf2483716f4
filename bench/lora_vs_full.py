"""LoRA vs full training on the same model, data, machine and ZeRO stage: speed, memory per
rank against the plan, and what lands on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import runs
from bench.suites import Bench, intervals, median, preflight_for, steady, tensor_parts

LORA_COMBOS = ((0, "none", "none"), (2, "none", "none"), (3, "none", "none"), (2, "cpu", "none"))
LORA_RANK = 16  # ZT_LORA_RANK's default, on the default targets (attention)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def lora_vs_full(b: Bench) -> list[dict[str, Any]]:
    """The same model, data and stage, training the whole UNet or a LoRA adapter (rank 16,
    attention): `zerotuner train`'s s/step, its checkpoint and output sizes, and the bare
    loop's in-step peak of tensor bytes per rank (bench.peak) against the plan row.
    Smoke: LoRA at ZeRO-2 only (the full side is the overhead suite's)."""
    rows = []
    combos = LORA_COMBOS if not b.smoke else LORA_COMBOS[1:2]
    for stage, opt, param in combos:
        for kind in ("full", "lora") if not b.smoke else ("lora",):
            settings: dict[str, Any] = {
                "zero_stage": stage, "offload_optimizer": opt, "offload_param": param,
            }  # fmt: skip
            if kind == "lora":
                settings |= {"training_type": "lora", "lora_rank": LORA_RANK}
            name = f"{kind}-z{stage}-{opt}-{param}"
            pre, _ = preflight_for(b, **settings)
            row: dict[str, Any] = {
                "training_type": kind, "zero_stage": stage, "offload_optimizer": opt,
                "offload_param": param,
                "trainable_params": pre.plan.inputs.trainable_params,
                "frozen_params": pre.plan.inputs.frozen_params,
            }  # fmt: skip
            try:
                work = b.work(f"lora-vs-full-{name}")
                env = runs.zt_env(work, b.model, b.data, steps=b.steps, **settings)
                product = runs.run_product(work, env)
                bare = runs.run_bare(
                    b.work(f"lora-vs-full-bare-{name}"), b.model, pre.normalized.config,
                    steps=3, lora_rank=LORA_RANK if kind == "lora" else 0,
                )  # fmt: skip
            except RuntimeError as error:  # keep the other rows; say what failed
                rows.append(row | {"error": str(error)})
                continue
            output = Path(env["ZT_OUTPUT_DIR"])
            final = output / "final"
            parts = tensor_parts(pre.plan.choice.parts)
            predicted = sum(parts.values())
            peaks = [r["memory"]["peak_bytes"] for r in bare.ranks]
            row |= {
                "bare_trainable_params": bare.rank0["trainable_params"],
                "step_s": median(steady(intervals(product.steps), b.warmup)),
                # 3 steps, the 2nd under the peak tracker: not a speed, kept for the record
                "bare_step_seconds": bare.rank0["step_seconds"],
                "step_intervals_s": intervals(product.steps),
                "checkpoint_bytes": dir_bytes(output / "checkpoints" / f"step-{b.steps}"),
                # what a user ships: the adapter file, or the trained UNet's folder
                "output_bytes": (final / "pytorch_lora_weights.safetensors").stat().st_size
                if kind == "lora" else dir_bytes(final / "unet"),
                "predicted_bytes_per_rank": predicted,
                "measured_peak_bytes_per_rank": peaks,
                "error_percent": 100 * (predicted - max(peaks)) / max(peaks),
                "peak_phase": [r["memory"]["peak_phase"] for r in bare.ranks],
                "predicted_parts": parts,
            }  # fmt: skip
            rows.append(row)
    return rows
