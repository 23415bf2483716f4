"""The bare DeepSpeed loop the harness is measured against: `torchrun ... -m bench.bare`.

What a user would write by hand: load the UNet, `deepspeed.initialize` with the very config
zerotuner produced (OUTPUT/run/deepspeed.json), and loop forward / backward / step on batches
already in memory (the same shapes zerotuner's cache yields). Nothing else: no sinks, no
checkpoints, no signal handling, no data loading. With `--lora-rank` the UNet is frozen and
peft's LoRA layers (the config zerotuner's trainer builds) are what the optimizer gets.
Rank 0 writes step times and phase times;
every rank writes the peak of its live tensor bytes within step 2 (bench.peak) and the bytes
of the tensors it holds after the first step (planner accuracy).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import time
import warnings
from pathlib import Path
from typing import Any

STARTED = time.time()


def held_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process (after a gc)."""
    from bench.peak import storage_of

    gc.collect()
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on deprecated torch modules warns
        warnings.simplefilter("ignore")
        found = [s for s in map(storage_of, gc.get_objects()) if s is not None]
    for storage in found:
        if storage.device.type == "meta":
            continue
        ptr = storage.data_ptr()
        if ptr:
            storages[ptr] = max(storages.get(ptr, 0), storage.nbytes())
    return sum(storages.values())


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--lora-rank", type=int, default=0, help="0: train the whole UNet")
    parser.add_argument("--lora-targets", default="attention", help="as ZT_LORA_TARGETS")
    args = parser.parse_args()

    times = {"process_start": STARTED}
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from diffusers import EulerDiscreteScheduler, UNet2DConditionModel

    from bench.peak import PeakTracker

    times["imported"] = time.time()
    from deepspeed.accelerator import get_accelerator

    # gloo on DeepSpeed's CPU accelerator, nccl on CUDA (the GPU acceptance suite runs this too)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = dist.get_rank(), dist.get_world_size()
    times["distributed"] = time.time()

    config = json.loads(args.config.read_text())
    micro = config["train_micro_batch_size_per_gpu"]
    accumulation = config.get("gradient_accumulation_steps", 1)
    config["train_batch_size"] = micro * accumulation * world
    rss_before = rss()
    unet = UNet2DConditionModel.from_pretrained(args.model, subfolder="unet")
    unet.train()
    if args.lora_rank:  # as a user would: freeze the base, add the adapter, train that
        from zerotuner.weights.lora import make_config, parse_targets

        unet.requires_grad_(False)
        unet.add_adapter(make_config({
            "rank": args.lora_rank, "alpha": args.lora_rank,
            "targets": parse_targets(args.lora_targets),
        }))  # fmt: skip
    scheduler = EulerDiscreteScheduler.from_pretrained(args.model, subfolder="scheduler")
    times["model_loaded"] = time.time()
    trainable = [p for p in unet.parameters() if p.requires_grad]
    # a client optimizer (prodigy, ...) built as the product builds it, its section taken out
    from zerotuner.train.optimizer import take

    stage = config.get("zero_optimization", {}).get("stage", 0)
    client = take(config, trainable, zero_stage=stage)
    engine, _, _, _ = deepspeed.initialize(
        model=unet, model_parameters=trainable, optimizer=client, config=config
    )
    times["engine_ready"] = time.time()
    # The load peak: this process's RSS high-water mark from its start until the engine is ready
    engine_ready_peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    # One in-memory batch of the shapes zerotuner's cache produces for this model.
    gen = torch.Generator().manual_seed(rank)
    vae = json.loads((args.model / "vae" / "config.json").read_text())
    side = args.resolution // 2 ** (len(vae["block_out_channels"]) - 1)
    text_dim = unet.config.cross_attention_dim
    pooled = unet.config.projection_class_embeddings_input_dim - 6 * int(
        unet.config.addition_time_embed_dim
    )
    batch = {
        "latents": torch.randn((micro, 4, side, side), generator=gen),
        "prompt_embeds": torch.randn((micro, 77, text_dim), generator=gen),
        "text_embeds": torch.randn((micro, pooled), generator=gen),
        "time_ids": torch.tensor([[args.resolution] * 2 + [0, 0] + [args.resolution] * 2] * micro,
                                 dtype=torch.float32),
    }  # fmt: skip
    # On the engine's device, floats in the dtype it trains in (bf16/fp16 on a GPU)
    dtype = next(engine.module.parameters()).dtype
    batch = {k: v.to(engine.device, dtype if v.is_floating_point() else None)
             for k, v in batch.items()}  # fmt: skip

    step_seconds, memory = [], {}
    for step in range(1, args.steps + 1):
        # Step 2 runs under the peak tracker (step 1 stays a clean time-to-first-step, and
        # every lazily built buffer exists by then); it slows that step, which no timing uses.
        tracker = PeakTracker() if step == min(2, args.steps) else None
        started = time.perf_counter()
        with tracker or contextlib.nullcontext():
            for _ in range(accumulation):
                if tracker is not None:
                    tracker.phase = "forward"
                noise = torch.randn(batch["latents"].shape, generator=gen).to(batch["latents"])
                t = torch.randint(0, scheduler.config.num_train_timesteps, (micro,), generator=gen)
                t = t.to(engine.device)
                noisy = scheduler.add_noise(batch["latents"], noise, t)
                pred = engine(
                    noisy, t, batch["prompt_embeds"],
                    added_cond_kwargs={"text_embeds": batch["text_embeds"],
                                       "time_ids": batch["time_ids"]},
                ).sample  # fmt: skip
                loss = F.mse_loss(pred.float(), noise)
                if tracker is not None:
                    tracker.phase = "backward"
                engine.backward(loss)
                if tracker is not None and "after_backward_bytes" not in memory:
                    # gradients (or their partitions) held, activations freed
                    memory["after_backward_bytes"] = tracker.live
                if tracker is not None:
                    tracker.phase = "step"
                engine.step()
        if tracker is not None:
            memory |= {"peak_bytes": tracker.peak, "peak_phase": tracker.peak_phase,
                       "peak_op": tracker.peak_op, "peak_largest": tracker.peak_largest,
                       "step_start_bytes": tracker.start}  # fmt: skip
        loss.item()
        step_seconds.append(time.perf_counter() - started)
        if step == 1:
            times["first_step"] = time.time()
            del pred, loss, noisy, noise
            memory |= {"tensor_bytes": held_tensor_bytes(), "rss_bytes": rss(),
                       "rss_before_model_bytes": rss_before}  # fmt: skip
    result = {
        "rank": rank,
        "world_size": world,
        "micro_batch": micro,
        "samples_per_step": micro * accumulation * world,
        "trainable_params": sum(p.numel() for p in unet.parameters() if p.requires_grad),
        "step_seconds": step_seconds,
        "times": times,
        "memory": memory,
        "offload_files_bytes": _swap_bytes(config),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "engine_ready_peak_rss_bytes": engine_ready_peak_rss,
        "optimizer_state_bytes": _optimizer_state_bytes(engine),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank-{rank}.json").write_text(json.dumps(result, indent=2))
    dist.barrier()


def _optimizer_state_bytes(engine: Any) -> int:
    """Bytes of the tensors in this rank's torch optimizer's state (its shard at ZeRO >= 1)."""
    import torch

    base = getattr(engine, "basic_optimizer", None) or engine.optimizer
    return sum(
        t.numel() * t.element_size()
        for state in base.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0  # not step counters
    )


def _swap_bytes(config: dict) -> int | None:
    """Bytes of this job's NVMe swap files (all ranks) when something is offloaded there."""
    zero = config.get("zero_optimization", {})
    paths = {
        zero.get(key, {}).get("nvme_path")
        for key in ("offload_optimizer", "offload_param")
        if zero.get(key, {}).get("device") == "nvme"
    } - {None}
    if not paths:
        return None
    total = 0
    for path in paths:
        for root, _, files in os.walk(path):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


if __name__ == "__main__":
    main()
    from zerotuner.launch.distributed import exit_process

    exit_process(0)  # as a rank does: the interpreter's teardown can abort a done run
