"""SD3 and Flux.1 under DeepSpeed on 2 CPU ranks (real torchrun, real diffusers transformers):
flow matching trains at ZeRO-2 and ZeRO-3 (CPU and NVMe offload), checkpoints, samples with the
family's pipeline, exports a folder that DiffusionPipeline loads and generates with, and
resumes on one rank at another stage."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import trainkit as tk

from zerotuner import families
from zerotuner.data.loading import load_example
from zerotuner.data.scan import scan
from zerotuner.settings.schema import Settings
from zerotuner.train import model
from zerotuner.weights.checkpoint import read_manifest

STEPS, SAVED = 10, 5
TOKENS = 16  # ZT_MAX_SEQUENCE_LENGTH: the demo captions are 8 words
PROMPT = "a red circle on a white background"
# SD3: ZeRO-2 with the optimizer on the CPU and an EMA; Flux: ZeRO-3 with everything on NVMe.
RUNS = {
    "sd3": {"stage": 2, "offload_optimizer": "cpu", "offload_param": "none", "ema": True},
    "flux": {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme", "ema": False},
}
RESUME_STAGE = {"sd3": 3, "flux": 2}
# Each family at the stage its run above does not use, with the other offload.
OTHER = {
    "sd3": {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme",
            "gradient_checkpointing": True},
    "flux": {"stage": 2, "offload_optimizer": "cpu", "offload_param": "none"},
}  # fmt: skip


def run(tmp: Path, demo: Path, family: str, *, stage: int, world: int = 2, output: Path,
        lr: float = 3e-3, offload_optimizer="none", offload_param="none",
        gradient_checkpointing=False, offload_activations="none", param_buffer=1_000_000,
        cache: Path | None = None, **settings) -> str:  # fmt: skip
    """`family`'s demo trained on `world` CPU ranks at `stage`; the ranks' log.
    `offload_activations`: the job's (the plan's ZT_OFFLOAD_ACTIVATIONS); `param_buffer`: the
    offloaded parameters' buffer (HunyuanVideo 1.5's ByT5 projection is 2048 wide even tiny);
    `cache`: the feature cache (default: beside `tmp`, the session's for a test's tmp_path)."""
    config = tk.ds_config(
        stage, world=world, steps=STEPS, lr=lr, offload_optimizer=offload_optimizer,
        offload_param=offload_param, nvme_dir=tmp / "nvme", param_buffer=param_buffer,
    )  # fmt: skip
    job = tk.write_job(tmp / "job.json", model=demo / "model", deepspeed=config, family=family,
                       world=world, gradient_checkpointing=gradient_checkpointing,
                       offload_activations=offload_activations)  # fmt: skip
    env = tk.settings_env(
        model=demo / "model", data=demo / "data", output=output,
        cache=cache or tmp.parent / "cache",
        max_steps=STEPS, log_every_steps=1, max_sequence_length=TOKENS, **settings,
    )  # fmt: skip
    proc = tk.run_ranks(tmp, env, job_file=job, world=world)
    tk.assert_ok(proc, tmp, world=world)
    return proc.stdout + proc.stderr


def saved_run(tmp_path_factory, demo: Path, family: str, **how) -> tuple[Path, str]:
    """`family`'s demo trained as `run` trains it (`how`: its stage, offload, settings),
    committing a checkpoint at SAVED and sampling PROMPT, in a folder of its own under the
    session's: (its output folder, the ranks' log). A module's full run, shared by its tests;
    its feature cache is the session's, which `run` gives a test's own runs (LoRA, resume):
    each item is encoded once, as on a volume that keeps ZT_CACHE_DIR."""
    tmp = tmp_path_factory.mktemp(f"run-{family}") / "run"
    tmp.mkdir()
    log = run(
        tmp, demo, family, output=tmp / "output", checkpoint_every_steps=SAVED,
        validation_prompts=[PROMPT], validation_inference_steps=2,
        cache=tmp_path_factory.getbasetemp() / "cache", **how,
    )  # fmt: skip
    return tmp / "output", log


@pytest.fixture(scope="session", params=["sd3", "flux"])
def flow_run(request, flow_demo_dirs, tmp_path_factory):
    family = request.param
    demo = flow_demo_dirs[family]
    return family, demo, *saved_run(tmp_path_factory, demo, family, **RUNS[family])


def pipeline_parts(pipe, family: str, kind, **parts) -> model.Components:
    """A loaded pipeline's text encoders and tokenizers (those `kind` encodes with) as the
    trainer's Components; `parts`: the other fields (source, scheduler, vae)."""
    return model.Components(**{
        "family": family, "source": Path(), "denoiser": None, "scheduler": None,
        "text_encoders": [getattr(pipe, e) for e, _ in kind.text_subfolders],
        "tokenizers": [getattr(pipe, t) for _, t in kind.text_subfolders], **parts,
    })  # fmt: skip


def held_out_loss(demo: Path, family: str, transformer, draws: int = 4) -> float:
    """The family's training loss of `transformer` on 16 demo images with fixed draws."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    kind = families.get(family).configured(Settings(), demo / "model")  # as the ranks read it
    kind = dataclasses.replace(kind, max_sequence_length=TOKENS)
    items = scan(demo / "data", log_skipped=False).items[:16]
    pixels = torch.stack(
        [torch.from_numpy(load_example(i, (64, 64), flip=False).pixels) for i in items]
    )
    parts = pipeline_parts(pipe, family, kind, source=demo / "model", scheduler=pipe.scheduler,
                           vae=pipe.vae)  # fmt: skip
    text = kind.encode_text(parts, [item.caption for item in items])
    kwargs = kind.model_kwargs(text, torch.float32)
    objective = kind.objective(Settings(), pipe.scheduler, transformer.config)
    return mean_loss(objective, transformer, kind.encode_latents(pipe.vae, pixels), kwargs, draws)


def mean_loss(objective, transformer, latents, kwargs, draws: int) -> float:
    """`objective`'s loss of `transformer` (in eval mode) on `latents`, averaged over `draws`
    fixed draws (seeds 0, 1, ...)."""
    with torch.no_grad():
        losses = [
            objective.loss(transformer.eval(), latents, kwargs,
                           generator=torch.Generator().manual_seed(d), dtype=torch.float32)
            for d in range(draws)
        ]  # fmt: skip
    return float(sum(losses)) / draws


def rendered_side(pipe) -> int:
    """The side of an image asked at 64 px: HiDreamImagePipeline renders any size at its
    default area (128 latent cells a side, 512 px with the demo's VAE)."""
    if type(pipe).__name__ == "HiDreamImagePipeline":
        return pipe.default_sample_size * pipe.vae_scale_factor
    return 64


def assert_trained_and_generates(demo: Path, family: str, folder: Path):
    """`folder` is the family's pipeline, its transformer has a lower held-out loss than the
    base's, and it generates an image; returns the pipeline."""
    import numpy as np
    from diffusers import DiffusionPipeline

    base = DiffusionPipeline.from_pretrained(demo / "model")
    pipe = DiffusionPipeline.from_pretrained(folder)
    assert type(pipe) is type(base)
    before = held_out_loss(demo, family, base.transformer)
    assert held_out_loss(demo, family, pipe.transformer) < 0.97 * before
    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        prompt=PROMPT, num_inference_steps=2, height=64, width=64, output_type="np",
        max_sequence_length=TOKENS, generator=torch.Generator().manual_seed(0),
    ).images[0]  # fmt: skip
    side = rendered_side(pipe)
    assert image.shape == (side, side, 3) and np.isfinite(image).all()
    return pipe


@pytest.mark.slow
def test_flow_families_train_sample_and_export(flow_run) -> None:
    """The loss on held-out draws falls; samples come from the family's pipeline; final/ is a
    pipeline folder that loads and generates; the checkpoint says what it is."""

    family, demo, output, log = flow_run
    assert [s["step"] for s in tk.read_steps(output)] == list(range(1, STEPS + 1))
    assert "flow matching (sigmas logit_normal(0, 1)" in log
    final = assert_trained_and_generates(demo, family, output / "final")
    (sample,) = (output / "samples" / f"step-{STEPS}").glob("*.png")
    assert sample.stat().st_size > 0 and (output / "samples" / "base-vs-trained.png").is_file()
    manifest = read_manifest(output / "checkpoints" / f"step-{SAVED}")
    assert (manifest["family"], manifest["zero_stage"]) == (family, RUNS[family]["stage"])
    if RUNS[family]["ema"]:
        assert_ema_differs(output, final)


def assert_ema_differs(output: Path, final) -> None:
    """final-ema/ is a pipeline whose transformer is not final/'s (`final`, loaded)."""
    from diffusers import DiffusionPipeline

    ema = DiffusionPipeline.from_pretrained(output / "final-ema").transformer
    assert any(
        not torch.equal(a, b)
        for a, b in zip(ema.parameters(), final.transformer.parameters(), strict=True)
    )


@pytest.mark.slow
def test_flow_families_resume_on_one_rank_at_another_stage(flow_run, tmp_path) -> None:
    """From the step-5 checkpoint, 1 rank at the other ZeRO stage (the universal checkpoint)
    trains steps 6-10 and exports."""
    family, demo, output, _ = flow_run
    stopped = tmp_path / "output"
    (stopped / "checkpoints").mkdir(parents=True)
    shutil.copytree(output / "checkpoints" / f"step-{SAVED}",
                    stopped / "checkpoints" / f"step-{SAVED}")  # fmt: skip
    log = run(tmp_path, demo, family, stage=RESUME_STAGE[family], world=1, output=stopped,
              checkpoint_every_steps=0)  # fmt: skip
    assert "converting once to universal" in log
    assert [s["step"] for s in tk.read_steps(stopped)] == list(range(SAVED + 1, STEPS + 1))
    assert (stopped / "final" / "transformer" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_flow_families_at_the_other_stage_train_and_export(family, flow_demo_dirs, tmp_path):
    """SD3 at ZeRO-3 with NVMe offload and gradient checkpointing, Flux at ZeRO-2 with the
    optimizer on the CPU: the held-out loss falls, and `zerotuner export` turns the checkpoint
    into a folder the family's own pipeline loads and generates with."""
    from zerotuner.cli import main

    demo, output = flow_demo_dirs[family], tmp_path / "output"
    run(tmp_path, demo, family, output=output, checkpoint_every_steps=STEPS, **OTHER[family])
    checkpoint = output / "checkpoints" / f"step-{STEPS}"
    assert read_manifest(checkpoint)["zero_stage"] == OTHER[family]["stage"]
    assert main(["export", str(checkpoint), str(tmp_path / "exported")]) == 0
    assert_trained_and_generates(demo, family, tmp_path / "exported")


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_text_conditioning_is_the_pipelines_own(flow_demo_dirs, family) -> None:
    """What the cache holds for a caption is what the family's pipeline computes for it."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(flow_demo_dirs[family] / "model")
    kind = dataclasses.replace(families.get(family), max_sequence_length=TOKENS)
    parts = pipeline_parts(pipe, family, kind)
    captions = [PROMPT, "a blue square on a black background"]
    ours = kind.encode_text(parts, captions)
    if family == "sd3":
        embeds, _, pooled, _ = pipe.encode_prompt(
            captions, None, None, do_classifier_free_guidance=False, max_sequence_length=TOKENS
        )
    else:
        embeds, pooled, _ = pipe.encode_prompt(captions, None, max_sequence_length=TOKENS)
    assert ours["prompt_embeds"].dtype == torch.bfloat16  # 16-bit on disk
    torch.testing.assert_close(ours["prompt_embeds"], embeds.to(torch.bfloat16))
    torch.testing.assert_close(ours["pooled_prompt_embeds"], pooled.to(torch.bfloat16))


@pytest.mark.slow
@pytest.mark.parametrize(("family", "stage"), [("sd3", 3), ("flux", 2)])
def test_lora_on_a_flow_transformer(flow_demo_dirs, tmp_path, family, stage) -> None:
    """A LoRA adapter on the transformer (gathered under ZeRO-3; Flux's with gradient
    checkpointing; each family at the stage its full run does not use): the file loads into
    the family's pipeline and changes its images; the merged pipeline renders the same images;
    `export` of the checkpoint writes the same adapter."""
    import numpy as np
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    from zerotuner.weights import lora_files
    from zerotuner.weights.export import export_checkpoint

    demo, output = flow_demo_dirs[family], tmp_path / "output"
    run(tmp_path, demo, family, stage=stage, output=output, checkpoint_every_steps=SAVED,
        training_type="lora", lora_rank=4, lora_alpha=2, lora_merge=True,
        gradient_checkpointing=family == "flux")  # fmt: skip
    final = output / "final"
    adapter = load_file(final / lora_files.ADAPTER_FILE)
    assert adapter and all(k.startswith("transformer.") for k in adapter)
    assert not (final / lora_files.KOHYA_FILE).exists()  # no kohya names for transformers
    exported = load_file(
        export_checkpoint(output / "checkpoints" / f"step-{STEPS}", tmp_path / "exported")
        / lora_files.ADAPTER_FILE
    )
    assert exported.keys() == adapter.keys()
    assert all(torch.equal(exported[k], adapter[k]) for k in adapter)

    def image(pipe) -> np.ndarray:
        pipe.set_progress_bar_config(disable=True)
        return pipe(
            prompt=PROMPT, num_inference_steps=2, height=64, width=64, output_type="np",
            max_sequence_length=TOKENS, generator=torch.Generator().manual_seed(0),
        ).images[0]  # fmt: skip

    base = DiffusionPipeline.from_pretrained(demo / "model")
    before = image(base)
    base.load_lora_weights(final)
    adapted = image(base)
    merged = image(DiffusionPipeline.from_pretrained(final / lora_files.MERGED))
    assert np.abs(adapted - before).max() > 1e-3, "the adapter changes nothing"
    assert np.abs(merged - adapted).max() < 1e-3


def resumes_on_one_rank_at_zero_2(
    tmp_path: Path, demo: Path, family: str, output: Path, pipeline: str
) -> None:
    """A full run's step-SAVED checkpoint, alone in a new output folder, trains on to STEPS on
    1 rank at ZeRO-2 (converted once to a universal checkpoint), EMA included, and exports
    `pipeline` folders. It reads the full run's feature cache (`saved_run`'s: the session's),
    as a restart on the same volume does."""
    stopped = tmp_path / "output"
    (stopped / "checkpoints").mkdir(parents=True)
    shutil.copytree(output / "checkpoints" / f"step-{SAVED}",
                    stopped / "checkpoints" / f"step-{SAVED}")  # fmt: skip
    log = run(tmp_path, demo, family, stage=2, world=1, output=stopped, ema=True,
              checkpoint_every_steps=0)  # fmt: skip
    assert "converting once to universal" in log
    assert [s["step"] for s in tk.read_steps(stopped)] == list(range(SAVED + 1, STEPS + 1))
    for folder in ("final", "final-ema"):
        index = json.loads((stopped / folder / "model_index.json").read_text())
        assert index["_class_name"] == pipeline
        assert (stopped / folder / "transformer" / "config.json").is_file()
