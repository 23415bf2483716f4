"""ZeRO-3 runs build the UNet inside deepspeed.zero.Init (zerotuner/zero_init.py).

2-rank CPU runs at ZeRO-3 without offload, with CPU offload and with NVMe offload: each built
under zero.Init trains with the very losses of the full-copy path (ZT_ZERO_INIT=false, one run
without offload: the offloads keep the losses, so one reference serves all three) for the same
seed, checkpoints; the NVMe one resumes on 1 rank and exports a folder that loads and
generates. Then a rank's memory: on a UNet big enough to see it (~60M parameters, 240 MB in
fp32), a rank of two adds about half the model to its RSS high-water mark while loading, where
the full copy adds all of it (this file is also the script the ranks run).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trainkit as tk

pytestmark = pytest.mark.slow

STEPS = 3
OFFLOADS = ("none", "cpu", "nvme")  # the optimizer and the parameters both
BUILT = "under zero.Init"  # zero_init.build's log line


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_dir) -> dict[tuple[str, str], tuple[Path, str]]:
    """(offload, path) -> (output folder, log): zero.Init at every offload, the full copy
    without offload (each run costs seconds of start-up; one reference is enough)."""
    cache = tmp_path_factory.mktemp("features")
    out = {}
    for offload, path in [*((o, "zero_init") for o in OFFLOADS), ("none", "full_copy")]:
        tmp = tmp_path_factory.mktemp(f"{offload}-{path}")
        proc, output = tk.train(
            tmp, demo_dir, cache, stage=3, steps=STEPS, offload_optimizer=offload,
            offload_param=offload, zero_init=str(path == "zero_init").lower(), ema=True,
        )  # fmt: skip
        tk.assert_ok(proc, tmp)
        out[offload, path] = output, proc.stdout + proc.stderr
    return out


@pytest.mark.parametrize("offload", OFFLOADS)
def test_zero_init_trains_as_the_full_copy(runs, offload) -> None:
    """Same weights in, same data and noise: the same losses, step by step, as the full copy
    without offload (the partitions hold the same numbers whichever way they were filled,
    wherever they live)."""
    (new, new_log), (old, old_log) = runs[offload, "zero_init"], runs["none", "full_copy"]
    assert BUILT in new_log and BUILT not in old_log
    got, want = tk.read_steps(new), tk.read_steps(old)
    assert [s["step"] for s in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7), (got, want)
    assert got[-1]["loss"] != got[0]["loss"]  # it trained
    assert (new / "checkpoints" / f"step-{STEPS}").is_dir()


def test_a_zero_init_checkpoint_resumes_on_one_rank_and_exports(runs, tmp_path, demo_dir):
    """The NVMe run's checkpoint (with its EMA), one more step on 1 rank (zero.Init at world
    1, the checkpoint converted to universal), and the exports load in diffusers and generate:
    final/ and final-ema/ from the engine, and `zerotuner export` of the 2-rank checkpoint."""
    from diffusers import DiffusionPipeline

    from zerotuner.cli import main

    output, _ = runs["nvme", "zero_init"]
    moved = tmp_path / "output"
    (moved / "checkpoints").mkdir(parents=True)
    step = output / "checkpoints" / f"step-{STEPS}"
    os.symlink(step, moved / "checkpoints" / step.name)  # the resume only reads it
    proc, _ = tk.train(
        tmp_path, demo_dir, tmp_path / "cache", stage=3, steps=STEPS + 1, world=1,
        output=moved, offload_optimizer="nvme", offload_param="nvme", ema=True,
    )  # fmt: skip
    tk.assert_ok(proc, tmp_path, world=1)
    log = proc.stdout + proc.stderr
    assert BUILT in log and "resumed from" in log and "converting once to universal" in log
    assert [s["step"] for s in tk.read_steps(moved)] == [STEPS + 1]
    assert main(["export", str(step), str(tmp_path / "exported")]) == 0
    for folder in (moved / "final", moved / "final-ema", tmp_path / "exported"):
        pipe = DiffusionPipeline.from_pretrained(folder)
        pipe.set_progress_bar_config(disable=True)
        gen = torch.Generator().manual_seed(0)
        image = pipe("a red square", height=64, width=64, num_inference_steps=2, generator=gen)
        assert image.images[0].size == (64, 64), folder


# --- a rank's memory while it loads -----------------------------------------------------------

BIG = {  # ~67M parameters (266 MB fp32), none over 2.7M elements: half the model stands out
    "block_out_channels": [192, 384],
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
    "layers_per_block": 2,
    "cross_attention_dim": 64,
    "transformer_layers_per_block": 2,
    "sample_size": 8,
}


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    from diffusers import UNet2DConditionModel

    root = tmp_path_factory.mktemp("big")
    torch.manual_seed(0)
    UNet2DConditionModel(**BIG).save_pretrained(root / "unet")
    return root


def test_a_rank_never_holds_the_whole_fp32_model_while_loading(big_model, tmp_path) -> None:
    """Each of 2 ranks loads by zero.Init, then (the model still held) by the full copy: the
    first load raises the RSS high-water mark by about half the model (its partition) plus one
    largest tensor, the second by the whole model, which this measurement sees."""
    script = Path(__file__).resolve()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        f"--master_port={tk.free_port()}", str(script), str(big_model), str(tmp_path),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZT_")}
    env |= {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        model, largest = got["model_bytes"], got["largest_bytes"]
        # the partition (half) + the staged tensors (read, gathered) + allocator slack
        assert got["zero_init_rise"] < model / 2 + 3 * largest + 0.15 * model, got
        assert got["full_copy_rise"] > 0.8 * model, got  # the measurement sees a full copy


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank_main(root: Path, out: Path) -> None:
    """One rank of the memory test (run by torchrun from the test above)."""
    import deepspeed
    import torch.distributed as dist
    from diffusers import UNet2DConditionModel  # imported before the measurement starts

    from zerotuner.train.model import load_denoiser

    deepspeed.init_distributed(dist_backend="gloo")
    UNet2DConditionModel.load_config(str(root / "unet"))
    config = tk.ds_config(3, world=dist.get_world_size())
    before = _peak()
    partitioned = load_denoiser(root, gradient_checkpointing=False, deepspeed_config=config)
    middle = _peak()
    os.environ["ZT_ZERO_INIT"] = "false"
    whole = load_denoiser(root, gradient_checkpointing=False, deepspeed_config=config)
    for param in whole.parameters():  # its pages, memory-mapped, count once read (DeepSpeed
        param.sum()  # reads them all to cast and partition the model)
    after = _peak()
    record = {
        "zero_init_rise": middle - before,
        "full_copy_rise": after - middle,
        "model_bytes": 4 * sum(p.numel() for p in whole.parameters()),
        "largest_bytes": 4 * max(p.ds_numel for p in partitioned.parameters()),
    }
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.barrier()


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]), Path(sys.argv[2]))
