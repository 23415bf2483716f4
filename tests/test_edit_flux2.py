"""FLUX.2 with reference images (issue 43): one checkpoint for text-to-image and editing, so a
run whose data have control images trains with them (0 to 4 a target for [klein], 0 to 6 for
[dev]) and a run whose data have none is the text-to-image run of tests/test_new_families.py.
The objective packs the references as Flux2KleinPipeline does (the same tokens in the same
order, ids t = 10 + 10 i); the tiny [klein] demo's data with flux_kontext.py's recolouring
controls trains in full at ZeRO-3 on 2 CPU ranks (its samples edit an input image through the
pipeline; its checkpoint resumes on 1 rank) and as LoRA at ZeRO-3: the held-out edit loss falls,
the adapter loads with `load_lora_weights` and changes the pipeline's edit. The planner counts
the reference tokens of a run that has them, as the data's file names tell; mixed counts and
controls on a text-to-image family are one line, exit 2.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trainkit as tk
from PIL import Image
from test_edit_qwen_image import pairs
from test_flow_training import (
    PROMPT,
    STEPS,
    TOKENS,
    mean_loss,
    pipeline_parts,
    resumes_on_one_rank_at_zero_2,
    run,
    saved_run,
)

from zerotuner import families
from zerotuner.data.scan import listed_references, scan, scan_sources
from zerotuner.errors import ConfigError
from zerotuner.settings.datasets import DatasetSource
from zerotuner.settings.schema import Settings

FAMILY, PIPELINE = "flux2klein", "Flux2KleinPipeline"
COUNTS = families.REGISTRY[FAMILY].control_counts
FULL = {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu", "resolution": 64}
# FLUX.2's LoRA targets and rate as tests/test_new_families.py trains the tiny [klein]
TARGETS = "attention,to_qkv_mlp_proj,single_transformer_blocks.0.attn.to_out"
LORA = {"stage": 3, "resolution": 64, "training_type": "lora", "lora_rank": 4, "lora_alpha": 4,
        "lr": 5e-2, "lora_targets": TARGETS}  # fmt: skip


@pytest.fixture(scope="module")
def demo(family_demo_dir) -> Path:
    """`zerotuner demo --family flux2klein`: the text-to-image demo (read-only)."""
    return family_demo_dir(FAMILY)


@pytest.fixture(scope="module")
def paired(demo, tmp_path_factory) -> Path:
    """The demo's model and its images each with flux_kontext.py's control: the shape in the
    colour before the caption's (read-only)."""
    from zerotuner.demo.flux_kontext import write_controls

    root = tmp_path_factory.mktemp("flux2klein-edit")
    shutil.copytree(demo / "model", root / "model")
    shutil.copytree(demo / "data", root / "data")
    assert len(write_controls(root / "data")) == 64
    return root


def first_inputs(transformer, call: Callable[[], Any]) -> dict[str, Any]:
    """The keyword arguments of the transformer's first forward while `call` runs."""
    seen: list[dict[str, Any]] = []

    def record(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        seen.append(dict(kwargs))

    handle = transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        call()
    finally:
        handle.remove()
    return seen[0]


def load(folder: Path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def edit(pipe, images: Image.Image | list[Image.Image], steps: int = 2, **how) -> Any:
    """The pipeline's edit of `images` as PROMPT asks, at the demo's size."""
    return pipe(
        image=images, prompt=PROMPT, num_inference_steps=steps, height=64, width=64,
        max_sequence_length=TOKENS, generator=torch.Generator().manual_seed(0),
        **{"output_type": "np", **how},
    ).images[0]  # fmt: skip


def a_control_path(paired: Path) -> Path:
    (path,) = sorted((paired / "data").glob("000-*.control.png"))
    return path


def a_control(paired: Path) -> Image.Image:
    return Image.open(a_control_path(paired)).convert("RGB")


@pytest.mark.parametrize("count", [1, 2])
def test_the_references_are_packed_as_the_pipeline_packs_them(demo, count) -> None:
    """The objective's transformer input for a target with `count` references equals
    Flux2KleinPipeline's with `image=[...]`: the noisy tokens, then each reference's (encoded
    by the VAE's mode, normalised by its batch norm), ids (0, h, w, 0) then (10 + 10 i, h, w,
    0); the text's ids; the timestep."""
    pipe = load(demo / "model")
    images = [Image.open(p).convert("RGB").resize((64, 64))
              for p in sorted((demo / "data").glob("*.png"))[:count]]  # fmt: skip
    seen = first_inputs(pipe.transformer, lambda: edit(pipe, images, steps=1, output_type="latent"))
    kind = families.get(FAMILY)
    objective = kind.objective(Settings(), pipe.scheduler, pipe.transformer.config)
    pixels = torch.cat([pipe.image_processor.preprocess(i, height=64, width=64, resize_mode="crop")
                        for i in images])  # fmt: skip
    references = kind.encode_latents(pipe.vae, pixels).unsqueeze(0)  # (1, count, C, h, w)
    side = 64 // pipe.vae_scale_factor
    noisy = objective.unpack(seen["hidden_states"][:, : (side // 2) ** 2], side, side)
    kwargs = {"encoder_hidden_states": seen["encoder_hidden_states"], "control_latents": references}
    ours = first_inputs(pipe.transformer, lambda: objective.predict(
        pipe.transformer, noisy, seen["timestep"], kwargs, device=torch.device("cpu"),
        dtype=torch.float32))  # fmt: skip
    assert torch.equal(ours["img_ids"], seen["img_ids"])
    assert ours["img_ids"].shape[1] == (1 + count) * (side // 2) ** 2
    assert sorted(set(ours["img_ids"][0, :, 0].tolist())) == [0, *range(10, 10 * count + 1, 10)]
    torch.testing.assert_close(ours["hidden_states"], seen["hidden_states"])
    assert torch.equal(ours["txt_ids"], seen["txt_ids"])
    torch.testing.assert_close(ours["timestep"], seen["timestep"])


def test_flux2_takes_0_to_n_references_and_a_text_to_image_family_none(paired, tmp_path) -> None:
    """[dev] takes 0 to 6 references, [klein] 0 to 4 (BFL's numbers), one count a run: the
    demo's data train without (its samples from prompts alone, its export the base's class),
    the paired data with one each; a mix is one line; a text-to-image family refuses them."""
    from zerotuner.families.flux2 import reference_ids

    dev, klein = families.REGISTRY["flux2"], families.REGISTRY[FAMILY]
    assert (list(dev.control_counts), list(klein.control_counts)) == ([*range(7)], [*range(5)])
    assert dev.optional_controls and not families.REGISTRY["fluxkontext"].optional_controls
    assert list(families.REGISTRY["fluxkontext"].control_counts) == [1]
    assert (klein.run_sample_input(0), klein.run_sample_input(1)) == ("", "control image")
    assert families.REGISTRY["fluxkontext"].run_sample_input(1) == "control image"
    assert (dev.exported_class, families.REGISTRY["fluxkontext"].exported_class) == (
        "", "FluxKontextPipeline")  # fmt: skip
    # [dev]'s ids are the same static method's: three references on a 2 x 2 grid each
    from diffusers import Flux2Pipeline

    grids = [torch.empty(1, 1, 2, 2)] * 3
    assert torch.equal(reference_ids(3, 4, 4), Flux2Pipeline._prepare_image_ids(grids))

    def counts(folder: Path) -> set[int]:
        return {
            len(i.controls) for i in scan(folder, log_skipped=False, control_count=COUNTS).items
        }

    data, plain = paired / "data", tmp_path / "plain"
    shutil.copytree(data, plain, ignore=shutil.ignore_patterns("*.control.png"))
    assert (counts(data), counts(plain)) == ({1}, {0})
    (lonely,) = plain.glob("000-*.png")
    shutil.copy(a_control_path(paired), lonely.with_name(f"{lonely.stem}.control.png"))
    with pytest.raises(ConfigError) as mixed:
        scan_sources([DatasetSource(path=str(plain))], tmp_path / "cache", control_count=COUNTS)
    assert "\n" not in str(mixed.value) and "0 control images" in str(mixed.value)
    assert "1 control image:" in str(mixed.value)
    with pytest.raises(ConfigError) as refused:
        scan(data, log_skipped=False, control_count=families.REGISTRY["flux"].control_counts)
    assert "\n" not in str(refused.value) and "flux2, flux2klein)" in str(refused.value)


def test_the_planner_counts_the_reference_tokens_of_a_run_that_has_them(
    demo, paired, tmp_path, monkeypatch, capsys
) -> None:
    """Text-to-image data: the plan of before (no reference tokens); paired data, as their file
    names tell: one reference's tokens more in every attention, and `check` says so."""
    from zerotuner.families.shapes import model_shape, transformer_activations

    config = families.REGISTRY[FAMILY].builtin_config
    plain = transformer_activations(FAMILY, config)
    assert plain == transformer_activations(FAMILY, config, 0)
    assert model_shape(FAMILY) == model_shape(FAMILY, controls=0)
    image, text = (1024 // 16) ** 2, 512  # 2x2 patches of a 1024 px image's latents; Qwen3
    for count in (1, 4):
        for without, edit_model in zip(plain, transformer_activations(FAMILY, config, count),
                                       strict=True):  # fmt: skip
            ratio = ((1 + count) * image + text) / (image + text)
            assert edit_model / without == pytest.approx(ratio, rel=1e-3)
    sources = [DatasetSource(path=str(paired / "data"))]
    assert listed_references(sources, tmp_path) == 1
    assert listed_references([DatasetSource(path=str(demo / "data"))], tmp_path) == 0
    assert listed_references([DatasetSource(path=str(tmp_path / "nowhere"))], tmp_path) is None
    out = tk.check_output(monkeypatch, capsys, paired / "model", paired / "data", tmp_path)
    assert "64 images with 1 control image each" in out
    assert "planned with 1 reference image(s) a target" in out


def edit_loss(paired: Path, transformer, draws: int = 4) -> float:
    """The training loss of `transformer` on 16 demo pairs with fixed draws: the controls'
    latents beside the noisy targets', as the cache and the objective see them."""
    pipe = load(paired / "model")
    kind = dataclasses.replace(families.get(FAMILY), max_sequence_length=TOKENS)
    captions, pixels, controls = pairs(paired, count=16, family=FAMILY)
    batch = kind.encode_text(pipeline_parts(pipe, FAMILY, kind), captions)
    batch["control_latents"] = kind.encode_latents(pipe.vae, controls.flatten(0, 1)).unflatten(
        0, controls.shape[:2]
    )
    objective = kind.objective(Settings(), pipe.scheduler, transformer.config)
    latents = kind.encode_latents(pipe.vae, pixels)
    return mean_loss(
        objective, transformer, latents, kind.model_kwargs(batch, torch.float32), draws
    )


@pytest.fixture(scope="module")
def full_run(paired, tmp_path_factory):
    """ZeRO-3 on 2 ranks, sampling from the data's first target's reference."""
    return saved_run(tmp_path_factory, paired, FAMILY, **FULL)


@pytest.mark.slow
def test_full_fine_tuning_at_zero_3_learns_the_edit_and_exports(paired, full_run) -> None:
    """Every step logged, the held-out edit loss falls, final/ is a Flux2KleinPipeline whose
    edit of an input image differs from the base's; the samples edit the first target's
    control image, shown above the base's and the trained model's."""
    output, log = full_run
    assert [s["step"] for s in tk.read_steps(output)] == list(range(1, STEPS + 1))
    assert "64 images with 1 control image each" in log
    base, final = load(paired / "model"), load(output / "final")
    assert type(final).__name__ == PIPELINE
    assert edit_loss(paired, final.transformer) < 0.97 * edit_loss(paired, base.transformer)
    control = a_control(paired)
    assert np.abs(edit(final, control) - edit(base, control)).max() > 1e-3
    (sample,) = (output / "samples" / f"step-{STEPS}").glob("*.png")
    assert Image.open(sample).size == (64, 64)
    shown = Image.open(output / "samples" / "inputs" / sample.name).convert("RGB")
    assert np.array_equal(np.asarray(shown), np.asarray(control))
    assert Image.open(output / "samples" / "base-vs-trained.png").height >= 3 * 64


@pytest.mark.slow
def test_full_checkpoint_resumes_on_one_rank(paired, full_run, tmp_path) -> None:
    output, _ = full_run
    resumes_on_one_rank_at_zero_2(tmp_path, paired, FAMILY, output, PIPELINE)


@pytest.mark.slow
def test_lora_at_zero_3_edits_through_the_pipeline(paired, tmp_path) -> None:
    """A LoRA adapter at ZeRO-3 trained with references: `transformer.` keys that
    Flux2KleinPipeline loads with `load_lora_weights`, lowering the held-out edit loss and
    changing its edit of an input image. Its sample edits the two references
    ZT_VALIDATION_IMAGES gives its prompt (a JSON list's list), shown side by side."""
    from safetensors.torch import load_file

    from zerotuner.weights import lora_files

    output = tmp_path / "output"
    references = [a_control_path(paired).name, sorted((paired / "data").glob("*.png"))[0].name]
    run(tmp_path, paired, FAMILY, output=output, checkpoint_every_steps=STEPS,
        validation_prompts=[PROMPT], validation_images=json.dumps([references]),
        **LORA)  # fmt: skip
    (sample,) = (output / "samples" / f"step-{STEPS}").glob("*.png")
    shown = Image.open(output / "samples" / "inputs" / sample.name)
    first, second = (Image.open(paired / "data" / name) for name in references)
    wide = round(second.width * first.height / second.height)  # at the first one's height
    assert shown.size == (first.width + wide, first.height)  # both references, side by side
    adapter = load_file(output / "final" / lora_files.ADAPTER_FILE)
    assert adapter and all(k.startswith("transformer.") for k in adapter)
    manifest = json.loads((output / "checkpoints" / f"step-{STEPS}" / "zerotuner.json").read_text())
    assert manifest["family"] == FAMILY
    pipe = load(paired / "model")
    control = a_control(paired)
    before, loss_before = edit(pipe, control), edit_loss(paired, pipe.transformer)
    pipe.load_lora_weights(output / "final")
    assert edit_loss(paired, pipe.transformer) < 0.97 * loss_before
    assert np.abs(edit(pipe, control) - before).max() > 1e-3
