"""End-to-end training: torchrun, 2 CPU ranks, real DeepSpeed (ZeRO 0-3, CPU and NVMe offload)
and the tiny demo SDXL. Runs share one feature cache, so only the first one encodes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trainkit as tk
from lorakit import held_out_loss, plain_pipeline
from PIL import Image
from safetensors.torch import load_file

from zerotuner.weights.checkpoint import read_manifest
from zerotuner.weights.export import export_checkpoint

pytestmark = pytest.mark.slow

STEPS = 16  # the ZeRO-2 run: enough for the loss to fall visibly
SHORT = 3  # every other configuration: train, checkpoint (at 2 and 3), export
PROMPT = "a red circle on a white background"
UNET_FILE = "unet/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("feature-cache")


def train(
    tmp: Path, demo: Path, cache: Path, *, stage: int, steps: int, data: Path | None = None,
    output: Path | None = None, world: int = 2, offload_optimizer: str = "none",
    offload_param: str = "none", family: str = "sdxl", **settings,
) -> tuple[subprocess.CompletedProcess[str], Path]:  # fmt: skip
    output = output or tmp / "output"
    checkpointing = settings.pop("gradient_checkpointing", False)  # Job decisions
    precision = settings.pop("mixed_precision", "no")
    config = tk.ds_config(
        stage, world=world, steps=steps, offload_optimizer=offload_optimizer,
        offload_param=offload_param, nvme_dir=tmp / "nvme", precision=precision,
    )  # fmt: skip
    job = tk.write_job(
        tmp / "job.json", model=demo / "model", deepspeed=config, world=world, family=family,
        gradient_checkpointing=checkpointing, mixed_precision=precision,
    )  # fmt: skip
    env = tk.settings_env(
        model=demo / "model", data=data or demo / "data", output=output, cache=cache,
        max_steps=steps, validation_inference_steps=2, log_every_steps=1, **settings,
    )  # fmt: skip
    proc = tk.run_ranks(tmp, env, job_file=job, world=world)
    return proc, output


def assert_ok(proc: subprocess.CompletedProcess[str], tmp: Path, world: int = 2) -> None:
    codes = {rank: s["exit_code"] for rank, s in tk.statuses(tmp).items()}
    assert proc.returncode == 0 and codes == dict.fromkeys(range(world), 0), (
        f"rc={proc.returncode} statuses={codes}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )


def unet_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / UNET_FILE)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def generate(folder: Path) -> Image.Image:
    """Load an exported folder the way a user would and render one small image."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    gen = torch.Generator().manual_seed(0)
    image = pipe(PROMPT, height=64, width=64, num_inference_steps=2, generator=gen).images[0]
    assert image.size == (64, 64)
    return image


@pytest.fixture(scope="module")
def zero2(tmp_path_factory, demo_dir: Path, shared_cache: Path):
    tmp = tmp_path_factory.mktemp("zero2")
    proc, output = train(
        tmp, demo_dir, shared_cache, stage=2, steps=STEPS, checkpoint_every_steps=8,
        validation_prompts=[PROMPT], ema="true",
    )  # fmt: skip
    assert_ok(proc, tmp)
    return tmp, output, proc


def test_zero2_trains_checkpoints_samples_and_exports(zero2, demo_dir: Path) -> None:
    _, output, proc = zero2
    steps = tk.read_steps(output)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["samples"] == 4 and s["step_seconds"] > 0 for s in steps)
    assert {"step", "loss", "lr", "step_seconds", "samples", "grad_norm"} <= steps[0].keys()
    assert steps[-1]["lr"] == pytest.approx(1e-3)  # WarmupLR reached its peak
    assert (output / "run" / "deepspeed.json").is_file()
    assert (output / "run" / "loss.png").stat().st_size > 0
    assert list((output / "samples" / f"step-{STEPS}").glob("*.png"))
    assert (output / "samples" / "base-vs-trained.png").stat().st_size > 0  # base vs trained
    checkpoints = output / "checkpoints"
    assert (checkpoints / "latest").read_text() == f"step-{STEPS}"
    for step in (8, STEPS):
        manifest = read_manifest(checkpoints / f"step-{step}")
        assert manifest["step"] == step and manifest["zero_stage"] == 2
        assert manifest["world_size"] == 2
    # the run's export and a checkpoint consolidated afterwards agree, and both load
    final = unet_weights(output / "final")
    base = load_file(demo_dir / "model" / UNET_FILE)
    assert any(not torch.equal(final[k], base[k]) for k in final), "the UNet did not train"
    generate(output / "final")
    # the `zerotuner export` command, as a user runs it
    out = output.parent / "exported"
    cli = subprocess.run(
        [sys.executable, "-m", "zerotuner", "export", str(checkpoints / f"step-{STEPS}"), str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert_same_weights(unet_weights(out), final)


def test_the_log_holds_back_third_party_notices(zero2) -> None:
    """Each rank's log of a normal run (validation included) has none of the notices that say
    nothing about the job (they are DEBUG lines: ZT_LOG_LEVEL=debug)."""
    log = zero2[2].stdout + zero2[2].stderr
    assert "DeepSpeed engine ready" in log and "samples: 1 image(s)" in log
    notices = ("Attempting to get learning rate", "requires torchvision", "all_gather_into_tensor",
               "No CUDA runtime is found", "fontManager", "built successfully")  # fmt: skip
    for notice in notices:
        assert notice not in log, notice


def test_loss_falls_on_demo_data(zero2, demo_dir: Path) -> None:
    """The trained UNet's loss on the demo images, with the same noise and timesteps, is below
    the base's (the per-step loss of a v-prediction run swings too much over 16 steps)."""
    from diffusers import DiffusionPipeline

    base = held_out_loss(plain_pipeline(demo_dir), demo_dir)
    trained = held_out_loss(DiffusionPipeline.from_pretrained(zero2[1] / "final"), demo_dir)
    assert trained < 0.8 * base, (base, trained)


def test_resume_continues_at_next_step_with_same_weights(zero2, tmp_path, demo_dir, shared_cache):
    """A run stopped after its step-8 checkpoint and restarted ends exactly where the
    uninterrupted run did: weights, optimizer, LR schedule, EMA, data order and noise resume.
    The restart also finds every latent in the cache and never runs the VAE."""
    _, full, _ = zero2
    stopped = tmp_path / "output"
    (stopped / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step-8", stopped / "checkpoints" / "step-8")
    (stopped / "checkpoints" / "latest").write_text("step-8")
    (stopped / "run").mkdir()
    # the stopped run had logged two steps past its checkpoint: those are redone
    lines = (full / "run" / "steps.jsonl").read_text().splitlines()[:10]
    (stopped / "run" / "steps.jsonl").write_text("\n".join(lines) + "\n")

    proc, output = train(
        tmp_path, demo_dir, shared_cache, stage=2, steps=STEPS, output=stopped,
        checkpoint_every_steps=8, ema="true",
    )  # fmt: skip
    assert_ok(proc, tmp_path)
    assert "resumed from" in proc.stderr + proc.stdout
    steps, expected = tk.read_steps(output), tk.read_steps(full)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert [s["loss"] for s in steps[8:]] == [s["loss"] for s in expected[8:]]
    assert_same_weights(unet_weights(output / "final"), unet_weights(full / "final"))
    assert_same_weights(unet_weights(output / "final-ema"), unet_weights(full / "final-ema"))
    cache = tk.read_json(output / "run" / "cache.json")
    assert cache["latents_encoded"] == 0 and cache["latents_reused"] == 64
    assert cache["texts_encoded"] == 0


CONFIGS = {  # SD 1.x and 2.x train here too, each with validation samples
    "zero0-sd1": dict(stage=0, family="sd1", validation_prompts=[PROMPT]),
    "zero1-cpu-offload-bf16-sd2": dict(
        stage=1,
        offload_optimizer="cpu",
        mixed_precision="bf16",
        family="sd2",
        validation_prompts=[PROMPT],
    ),  # fmt: skip
    "zero3-ema-samples-checkpointing": dict(
        stage=3, ema="true", validation_prompts=[PROMPT], gradient_checkpointing=True
    ),
    "zero3-nvme": dict(stage=3, offload_optimizer="nvme", offload_param="nvme"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_stage_trains_checkpoints_and_exports(name, tmp_path, request, shared_cache, zero2):
    config = dict(CONFIGS[name])
    family = config.get("family", "sdxl")
    demo_dir = request.getfixturevalue("demo_dir" if family == "sdxl" else f"{family}_demo_dir")
    proc, output = train(
        tmp_path, demo_dir, shared_cache, steps=SHORT, checkpoint_every_steps=2, **config
    )
    assert_ok(proc, tmp_path)
    assert [s["step"] for s in tk.read_steps(output)] == [1, 2, 3]
    deepspeed = tk.read_json(output / "run" / "deepspeed.json")
    assert deepspeed["zero_optimization"]["stage"] == config["stage"]
    for step in (2, SHORT):
        assert (
            read_manifest(output / "checkpoints" / f"step-{step}")["zero_stage"] == config["stage"]
        )
    exported = export_checkpoint(output / "checkpoints" / f"step-{SHORT}", tmp_path / "exported")
    assert_same_weights(unet_weights(exported), unet_weights(output / "final"))
    generate(exported)
    if config.get("validation_prompts"):
        assert list((output / "samples" / f"step-{SHORT}").glob("*.png"))
    if config.get("ema"):
        ema, final = unet_weights(output / "final-ema"), unet_weights(output / "final")
        assert any(not torch.equal(ema[k], final[k]) for k in ema)
        ema_export = export_checkpoint(
            output / "checkpoints" / f"step-{SHORT}", tmp_path / "ema", ema=True
        )
        assert_same_weights(unet_weights(ema_export), ema)
    if "nvme" in name:
        assert any((tmp_path / "nvme").rglob("*")), "nothing was swapped to the NVMe dir"


def test_changed_image_and_broken_files(tmp_path, demo_dir, shared_cache, zero2) -> None:
    """Only the changed image is re-encoded; corrupt, truncated and non-image files are skipped
    and listed, and training goes on with the good ones."""
    data = tmp_path / "data"
    data.mkdir()
    images = sorted((demo_dir / "data").glob("*.png"))[:8]
    for image in images:
        shutil.copy2(image, data / image.name)
        shutil.copy2(image.with_suffix(".txt"), data / image.with_suffix(".txt").name)
    changed = data / images[0].name
    Image.new("RGB", Image.open(changed).size, (0, 200, 0)).save(changed)
    (data / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    good = images[1].read_bytes()
    (data / "truncated.png").write_bytes(good[: len(good) // 2])
    (data / "notes.bin").write_bytes(b"not an image")

    proc, output = train(tmp_path, demo_dir, shared_cache, stage=2, steps=2, data=data)
    assert_ok(proc, tmp_path)
    cache = tk.read_json(output / "run" / "cache.json")
    assert (cache["latents_encoded"], cache["latents_reused"]) == (1, 7)
    dataset = tk.read_json(output / "run" / "dataset.json")
    assert dataset["images"] == 8
    skipped = {Path(path).name for path, _ in dataset["skipped"]}
    assert skipped == {"corrupt.png", "truncated.png", "notes.bin"}
    assert "truncated.png" in proc.stderr + proc.stdout


def test_empty_dataset_exits_2(tmp_path, demo_dir, shared_cache) -> None:
    (tmp_path / "empty").mkdir()
    proc, _ = train(
        tmp_path, demo_dir, shared_cache, stage=0, steps=1, data=tmp_path / "empty", world=1
    )
    assert proc.returncode != 0
    assert tk.statuses(tmp_path)[0]["exit_code"] == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("zerotuner: error:")]
    assert len(errors) == 1 and "ZT_DATA_DIR" in errors[0] and "no usable images" in errors[0]
    # the rank printed no traceback (torchrun's own report of a failed child follows it; the
    # entrypoint maps the rank status to the exit code)
    assert "zerotuner/worker.py" not in proc.stderr


def test_sigterm_commits_a_checkpoint_and_exits_143(tmp_path, demo_dir, shared_cache, zero2):
    """torchrun forwards SIGTERM; the ranks agree at the next step boundary, commit a
    checkpoint of that step and exit 143, so a restart resumes at the next step."""
    output = tmp_path / "output"
    config = tk.ds_config(2, steps=500)
    job = tk.write_job(tmp_path / "job.json", model=demo_dir / "model", deepspeed=config)
    env = tk.settings_env(
        model=demo_dir / "model", data=demo_dir / "data", output=output, cache=shared_cache,
        max_steps=500, checkpoint_every_steps=0,
    )  # fmt: skip
    tk.sigterm_ranks_after_steps(tmp_path, env, job, output)
    last = tk.read_steps(output)[-1]["step"]
    assert 2 <= last < 500
    assert (output / "checkpoints" / "latest").read_text() == f"step-{last}"
    assert read_manifest(output / "checkpoints" / f"step-{last}")["step"] == last
