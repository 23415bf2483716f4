"""FLUX.1 Kontext [dev] (issue 43): the tiny demo (real diffusers/transformers classes, edit
pairs: a shape and the same shape recoloured) is a FluxKontextPipeline that edits an input
image, told apart by model_index.json and its hub id; on 2 CPU ranks it trains in full at
ZeRO-3 (CPU offload) and resumes on 1 rank, and as LoRA at ZeRO-3: the held-out edit loss
falls, the export and the adapter edit an input image through FluxKontextPipeline. The demo as
its printed command trains it (300 steps) repaints shapes it never saw nearer their targets
than the base does. A target without its control image is listed with the skipped files by the
real `zerotuner check`; the planner counts the reference's tokens and latents.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import trainkit as tk
from PIL import Image
from test_flow_training import (
    PROMPT,
    STEPS,
    TOKENS,
    resumes_on_one_rank_at_zero_2,
    run,
    saved_run,
)

from zerotuner import families
from zerotuner.data.loading import load_example
from zerotuner.data.scan import scan
from zerotuner.settings.schema import Settings
from zerotuner.train import model

FAMILY, PIPELINE = "fluxkontext", "FluxKontextPipeline"
# ZT_RESOLUTION as the job's: Kontext's samples are sized by area (max_area), 1024^2 without it
FULL = {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu", "resolution": 64}
LORA = {"stage": 3, "offload_optimizer": "none", "offload_param": "none", "resolution": 64,
        "training_type": "lora", "lora_rank": 4, "lora_alpha": 4, "lr": 3e-2}  # fmt: skip


@pytest.fixture(scope="module")
def demo(family_demo_dir) -> Path:
    return family_demo_dir(FAMILY)


def edit(pipe, control: Image.Image) -> np.ndarray:
    """The pipeline's edit of `control` as PROMPT asks, at the demo's size."""
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        image=control, prompt=PROMPT, num_inference_steps=2, height=64, width=64,
        output_type="np", max_sequence_length=TOKENS, max_area=64 * 64, _auto_resize=False,
        generator=torch.Generator().manual_seed(0),
    ).images[0]  # fmt: skip


def edit_loss(demo: Path, transformer, draws: int = 4) -> float:
    """The family's training loss of `transformer` on 16 demo pairs with fixed draws: the
    controls' latents beside the noisy targets', as the cache and the objective see them."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    kind = dataclasses.replace(families.get(FAMILY), max_sequence_length=TOKENS)
    items = scan(demo / "data", log_skipped=False, control_count=1).items[:16]
    examples = [load_example(item, (64, 64)) for item in items]
    pixels = torch.stack([torch.from_numpy(e.pixels) for e in examples])
    controls = torch.stack([torch.from_numpy(e.controls) for e in examples])  # type: ignore[arg-type]
    parts = model.Components(
        family=FAMILY, source=Path(), denoiser=None, scheduler=None,
        text_encoders=[pipe.text_encoder, pipe.text_encoder_2],
        tokenizers=[pipe.tokenizer, pipe.tokenizer_2],
    )  # fmt: skip
    batch = kind.encode_text(parts, [item.caption for item in items])
    batch["control_latents"] = kind.encode_latents(pipe.vae, controls.flatten(0, 1)).unflatten(
        0, controls.shape[:2]
    )
    kwargs = kind.model_kwargs(batch, torch.float32)
    objective = kind.objective(Settings(), pipe.scheduler, transformer.config)
    latents = kind.encode_latents(pipe.vae, pixels)
    with torch.no_grad():
        losses = [
            objective.loss(transformer.eval(), latents, kwargs,
                           generator=torch.Generator().manual_seed(d), dtype=torch.float32)
            for d in range(draws)
        ]  # fmt: skip
    return float(sum(losses)) / draws


def a_control(demo: Path) -> Image.Image:
    (path,) = sorted((demo / "data").glob("000-*.control.png"))
    return Image.open(path).convert("RGB").resize((64, 64))


def test_the_demo_is_a_kontext_pipeline_that_edits_and_is_detected(demo, tmp_path) -> None:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    assert type(pipe).__name__ == PIPELINE
    out = edit(pipe, a_control(demo))
    assert out.shape == (64, 64, 3) and np.isfinite(out).all()
    assert families.detect_family(demo / "model") == FAMILY
    assert families.resolve_family("black-forest-labs/FLUX.1-Kontext-dev") == FAMILY
    # a bare transformer is FLUX.1's class and config: it reads as Flux.1
    shutil.copytree(demo / "model" / "transformer", tmp_path / "bare" / "transformer")
    assert families.detect_family(tmp_path / "bare") == "flux"
    kind = families.get(FAMILY)
    assert type(kind.objective(Settings(), pipe.scheduler, pipe.transformer.config)).__name__ == (
        "KontextObjective"
    )
    # every demo target has its control: the shape repainted, nothing else
    pairs = scan(demo / "data", log_skipped=False, control_count=1)
    assert len(pairs) == 64 and not pairs.skipped


def test_check_lists_a_target_without_its_control(demo, monkeypatch, tmp_path, capsys) -> None:

    data = tmp_path / "data"
    shutil.copytree(demo / "data", data)
    (lonely,) = data.glob("000-*.control.png")
    lonely.unlink()
    out = tk.check_output(monkeypatch, capsys, demo / "model", data, tmp_path)
    assert "63 images with 1 control image each" in out
    (line,) = [x for x in out.splitlines() if "without its control image" in x]
    assert "skipped 1 file, without its control image: 000-" in line


@pytest.fixture(scope="module")
def full_run(demo, tmp_path_factory):
    # the sample edits a control image of the data, named relative to ZT_DATA_DIR
    (given,) = sorted((demo / "data").glob("001-*.control.png"))
    return saved_run(tmp_path_factory, demo, FAMILY, validation_images=given.name, **FULL)


@pytest.mark.slow
def test_full_fine_tuning_at_zero_3_learns_the_edit_and_exports(demo, full_run) -> None:
    """ZeRO-3, optimizer and parameters on the CPU: every step logged, the held-out edit loss
    falls, final/ is a FluxKontextPipeline that edits an input image."""
    from diffusers import DiffusionPipeline

    output, log = full_run
    assert [s["step"] for s in tk.read_steps(output)] == list(range(1, STEPS + 1))
    assert "64 images with 1 control image each" in log and "reference tokens" in log
    base = DiffusionPipeline.from_pretrained(demo / "model")
    final = DiffusionPipeline.from_pretrained(output / "final")
    assert type(final).__name__ == PIPELINE
    assert edit_loss(demo, final.transformer) < 0.97 * edit_loss(demo, base.transformer)
    control = a_control(demo)
    assert np.abs(edit(final, control) - edit(base, control)).max() > 1e-3
    (sample,) = (output / "samples" / f"step-{STEPS}").glob("*.png")
    assert Image.open(sample).size == (64, 64)  # max_area: the run's resolution
    # ZT_VALIDATION_IMAGES's image is what the samples edit: shown above base and trained
    (given,) = sorted((demo / "data").glob("001-*.control.png"))
    shown = Image.open(output / "samples" / "inputs" / sample.name).convert("RGB")
    assert np.array_equal(np.asarray(shown), np.asarray(Image.open(given).convert("RGB")))
    grid = Image.open(output / "samples" / "base-vs-trained.png")
    assert grid.height >= 3 * 64  # input, base, trained rows


@pytest.mark.slow
def test_full_checkpoint_resumes_on_one_rank(demo, full_run, tmp_path) -> None:
    output, _ = full_run
    resumes_on_one_rank_at_zero_2(tmp_path, demo, FAMILY, output, PIPELINE)


@pytest.mark.slow
def test_lora_at_zero_3_edits_through_the_pipeline(demo, tmp_path) -> None:
    """A LoRA adapter at ZeRO-3: `transformer.` keys that FluxKontextPipeline loads with
    `load_lora_weights`, lowering the held-out edit loss and changing its edit."""
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    from zerotuner.weights import lora_files

    output = tmp_path / "output"
    run(tmp_path, demo, FAMILY, output=output, checkpoint_every_steps=STEPS, **LORA)
    adapter = load_file(output / "final" / lora_files.ADAPTER_FILE)
    assert adapter and all(k.startswith("transformer.") for k in adapter)
    manifest = json.loads((output / "checkpoints" / f"step-{STEPS}" / "zerotuner.json").read_text())
    assert manifest["family"] == FAMILY
    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    control = a_control(demo)
    before, loss_before = edit(pipe, control), edit_loss(demo, pipe.transformer)
    pipe.load_lora_weights(output / "final")
    assert edit_loss(demo, pipe.transformer) < 0.97 * loss_before
    assert np.abs(edit(pipe, control) - before).max() > 1e-3


def test_the_planner_counts_the_reference_tokens_and_latents() -> None:
    """The reference's tokens lengthen every attention (activations), and its latents sit
    beside the target's in the cache (`check`'s estimate)."""
    from zerotuner.families.registry import REGISTRY
    from zerotuner.families.shapes import transformer_activations
    from zerotuner.train.feature_cache import latent_cache_bytes

    flux, kontext = (transformer_activations(f, REGISTRY[f].builtin_config)
                     for f in ("flux", FAMILY))  # fmt: skip
    image, text = (1024 // 16) ** 2, 512  # 2x2 patches of a 1024 px image's latents; T5
    for plain, edit_model in zip(flux, kontext, strict=True):
        assert edit_model / plain == pytest.approx((2 * image + text) / (image + text), rel=1e-3)
    buckets = {(64, 64): [0, 1, 2], (96, 64): [3]}
    plain = latent_cache_bytes(buckets, channels=16, scale=8, frame_step=None, flip=True)
    assert latent_cache_bytes(buckets, channels=16, scale=8, frame_step=None, flip=True,
                              controls=1) == 2 * plain  # fmt: skip


@pytest.mark.slow
def test_the_demo_learns_the_edit_on_held_out_shapes(demo, tmp_path) -> None:
    """`zerotuner demo --family fluxkontext`'s data, trained as its printed command does
    (demo-flow.yaml: 2 CPU ranks, ZeRO-2) for 300 steps: on shapes it never saw, the trained
    pipeline's edit is nearer its target than the base's, and nearer than the control itself
    (it repaints; it does not copy)."""
    import subprocess

    from diffusers import DiffusionPipeline

    from zerotuner.demo.flux_kontext import write_controls
    from zerotuner.demo.pipelines import write_dataset

    env = tk.entrypoint_env(
        demo, tmp_path, ZT_CONFIG_FILE=str(tk.REPO / "config" / "demo-flow.yaml"),
        ZT_MAX_STEPS="300", ZT_CHECKPOINT_EVERY_STEPS="300", ZT_LOG_EVERY_STEPS="50",
    )  # fmt: skip
    trained = subprocess.run([str(tk.REPO / "entrypoint"), "train"], env=env, cwd=tk.REPO,
                             capture_output=True, text=True, timeout=900)  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-4000:]
    held = write_dataset(tmp_path / "held", seed=7, count=6)
    write_controls(held)
    targets = [p for p in sorted(held.glob("*.png")) if ".control" not in p.name]

    def pixels(path: Path) -> np.ndarray:
        return np.asarray(Image.open(path).convert("RGB").resize((64, 64)), np.float32) / 255

    def error(folder: Path) -> float:
        pipe = DiffusionPipeline.from_pretrained(folder)
        pipe.set_progress_bar_config(disable=True)
        errors = []
        for target in targets:
            control = Image.open(target.with_name(f"{target.stem}.control.png")).convert("RGB")
            out = pipe(
                image=control.resize((64, 64)), prompt=target.with_suffix(".txt").read_text(),
                num_inference_steps=10, height=64, width=64, max_area=64 * 64,
                _auto_resize=False, max_sequence_length=32, output_type="np",
                generator=torch.Generator().manual_seed(0),
            ).images[0]  # fmt: skip
            errors.append(float(((out - pixels(target)) ** 2).mean()))
        return float(np.mean(errors))

    copied = np.mean([((pixels(t.with_name(f"{t.stem}.control.png")) - pixels(t)) ** 2).mean()
                      for t in targets])  # fmt: skip
    base, edited = error(demo / "model"), error(tmp_path / "output" / "final")
    assert edited < 0.5 * base and edited < 0.8 * copied, (base, edited, copied)
