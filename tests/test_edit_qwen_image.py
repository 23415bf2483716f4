"""Qwen-Image-Edit (issue 43): the tiny demo (real diffusers/transformers classes, edit pairs: a
shape and the same shape recoloured) is a QwenImageEditPipeline that edits an input image, its
processor built from the folder's files without torchvision, told apart by model_index.json and
its hub id (the Plus pipeline another family's); the captions' cached states are the
pipeline's own encode_prompt with the control image; on 2 CPU ranks it trains in full at ZeRO-3
and resumes on 1 rank, and as LoRA at ZeRO-3: the held-out edit loss falls, the export and the
adapter edit an input image through QwenImageEditPipeline.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import trainkit as tk
from PIL import Image
from test_edit_flux_kontext import a_control
from test_flow_training import PROMPT, SAVED, STEPS, TOKENS, resumes_on_one_rank_at_zero_2, run

from zerotuner import families
from zerotuner.data.loading import load_example
from zerotuner.data.scan import scan
from zerotuner.settings.schema import Settings

FAMILY, PIPELINE = "qwenimageedit", "QwenImageEditPipeline"
FULL = {"stage": 3, "offload_optimizer": "cpu", "offload_param": "none", "resolution": 64}
LORA = {"stage": 3, "resolution": 64, "training_type": "lora", "lora_rank": 4, "lora_alpha": 4,
        "lr": 3e-2}  # fmt: skip


@pytest.fixture(scope="module")
def demo(family_demo_dir) -> Path:
    return family_demo_dir(FAMILY)


def load(folder: Path, family: str = FAMILY):
    """The pipeline folder through QwenImageEditPipeline (`family`'s: its Plus), its processor
    built without torchvision (transformers' own loader of it needs torchvision)."""
    pipe = families.get(family).open_pipeline(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def edit(pipe, control: Image.Image) -> np.ndarray:
    """The pipeline's edit of `control` as PROMPT asks, at the demo's size."""
    return pipe(
        image=control, prompt=PROMPT, num_inference_steps=2, height=64, width=64,
        output_type="np", generator=torch.Generator().manual_seed(0),
    ).images[0]  # fmt: skip


def pairs(
    demo: Path, count: int = 8, family: str = FAMILY
) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """The first `count` demo pairs as the cache loads them: captions, targets (batch, 3, 64,
    64) and controls (batch, controls, 3, 64, 64) in [-1, 1]."""
    counts = families.REGISTRY[family].control_counts
    items = scan(demo / "data", log_skipped=False, control_count=counts).items[:count]
    examples = [load_example(item, (64, 64)) for item in items]
    pixels = torch.stack([torch.from_numpy(e.pixels) for e in examples])
    controls = torch.stack([torch.from_numpy(e.controls) for e in examples])  # type: ignore[arg-type]
    return [item.caption for item in items], pixels, controls


@functools.cache
def samples_differ(base: Path, trained: Path) -> bool:
    """Whether a run's sample of the trained model differs from its base's (same prompt,
    input and seed)."""
    pixels = [np.asarray(Image.open(p).convert("RGB"), dtype=np.int16) for p in (base, trained)]
    return bool(np.abs(pixels[0] - pixels[1]).max() > 0)


def edit_batch(demo: Path, family: str = FAMILY) -> tuple[dict, torch.Tensor, object]:
    """8 demo pairs as the cache holds them (the captions read with their controls, the
    controls' latents), their targets' latents and the scheduler: encoded once."""
    pipe = load(demo / "model", family)
    kind = dataclasses.replace(families.get(family), max_sequence_length=TOKENS)
    captions, pixels, controls = pairs(demo, family=family)
    batch = kind.encode_item_captions([pipe.text_encoder], [pipe.processor], captions, controls)
    batch["control_latents"] = kind.encode_latents(pipe.vae, controls.flatten(0, 1)).unflatten(
        0, controls.shape[:2]
    )
    return (
        kind.model_kwargs(batch, torch.float32),
        kind.encode_latents(pipe.vae, pixels),
        (pipe.scheduler),
    )


def edit_loss(demo: Path, transformer, draws: int = 4, family: str = FAMILY) -> float:
    """The family's training loss of `transformer` on 8 demo pairs with fixed draws."""
    kwargs, latents, scheduler = edit_batch(demo, family)
    objective = families.get(family).objective(Settings(), scheduler, transformer.config)
    with torch.no_grad():
        losses = [
            objective.loss(transformer.eval(), latents, kwargs,
                           generator=torch.Generator().manual_seed(d), dtype=torch.float32)
            for d in range(draws)
        ]  # fmt: skip
    return float(sum(losses)) / draws


@pytest.fixture(scope="module")
def base_edit(demo) -> np.ndarray:
    """The demo pipeline's edit of a control image, drawn once for the module's tests (the
    pipeline reads its input at 1024^2 in area: ~15 s on the CPU)."""
    return edit(load(demo / "model"), a_control(demo))


def test_the_demo_is_an_edit_pipeline_that_edits_and_is_detected(demo, base_edit, tmp_path) -> None:
    from diffusers import DiffusionPipeline

    # transformers' own loader of its Qwen2VLProcessor builds a video processor: torchvision
    with pytest.raises(OSError, match="video processor"):
        DiffusionPipeline.from_pretrained(demo / "model")
    pipe = load(demo / "model")
    assert type(pipe).__name__ == PIPELINE
    assert base_edit.shape == (64, 64, 3) and np.isfinite(base_edit).all()
    index = json.loads((demo / "model" / "model_index.json").read_text())
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]  # as the hub's says
    assert families.detect_family(demo / "model") == FAMILY
    assert families.resolve_family("Qwen/Qwen-Image-Edit") == FAMILY
    assert families.resolve_family("Qwen/Qwen-Image") == "qwenimage"
    # a bare transformer is Qwen-Image's class and config: it reads as Qwen-Image
    shutil.copytree(demo / "model" / "transformer", tmp_path / "bare" / "transformer")
    assert families.detect_family(tmp_path / "bare") == "qwenimage"
    # the Plus pipeline (several references) is a family of its own, tried first
    for hub_id in ("Qwen/Qwen-Image-Edit-2509", "Qwen/Qwen-Image-Edit-2511"):
        assert families.resolve_family(hub_id) == "qwenimageeditplus"
    plus = tmp_path / "plus"
    shutil.copytree(demo / "model", plus, ignore=shutil.ignore_patterns("*.safetensors"))
    (plus / "model_index.json").write_text(
        json.dumps({**index, "_class_name": "QwenImageEditPlusPipeline"})
    )
    assert families.detect_family(plus) == "qwenimageeditplus"
    kind = families.get(FAMILY)
    objective = kind.objective(Settings(), pipe.scheduler, pipe.transformer.config)
    assert type(objective).__name__ == "QwenImageEditObjective"


def test_the_processor_reads_the_hub_layout_without_torchvision(demo, tmp_path) -> None:
    """Qwen/Qwen-Image-Edit's processor/ (its preprocessor_config.json as published, a
    tokenizer) built by load_processor: the pixel values are Qwen2-VL's (bicubic to multiples of
    28 px within min/max_pixels, CLIP's mean and std, 14 px patches two frames deep, grouped by
    2x2 merge), one `<|image_pad|>` per merged patch."""
    from zerotuner.families.qwen_image_edit import TEMPLATE, load_processor

    hub = tmp_path / "processor"
    hub.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / "model" / "processor" / name, hub / name)
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    (hub / "preprocessor_config.json").write_text(json.dumps({
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": mean, "image_processor_type": "Qwen2VLImageProcessor", "image_std": std,
        "max_pixels": 12845056, "merge_size": 2, "min_pixels": 3136, "patch_size": 14,
        "processor_class": "Qwen2VLProcessor", "resample": 3,
        "rescale_factor": 0.00392156862745098, "temporal_patch_size": 2,
    }))  # fmt: skip
    processor = load_processor(tmp_path)
    image = Image.fromarray((np.random.RandomState(0).rand(100, 150, 3) * 255).astype(np.uint8))
    out = processor(text=[TEMPLATE.format(PROMPT)], images=[image], return_tensors="pt")
    height, width = 112, 140  # 100 x 150 rounded to multiples of 28
    pixels = np.asarray(image.resize((width, height), Image.BICUBIC), np.float32) / 255
    pixels = ((pixels - np.array(mean)) / np.array(std)).transpose(2, 0, 1)[None].repeat(2, 0)
    rows, cols = height // 14, width // 14
    patches = pixels.reshape(1, 2, 3, rows // 2, 2, 14, cols // 2, 2, 14)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(rows * cols, -1)
    assert out["image_grid_thw"].tolist() == [[1, rows, cols]]
    np.testing.assert_allclose(out["pixel_values"].numpy(), patches, atol=1e-5)
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert out["input_ids"][0].tolist().count(pad) == rows * cols // 4


def test_cached_caption_states_are_the_pipelines_encode_prompt(demo) -> None:
    """Each caption read with its control image (vision tokens among the states) as
    QwenImageEditPipeline.encode_prompt reads it, padded with a mask; a control changed is
    another state."""
    pipe = load(demo / "model")
    kind = dataclasses.replace(families.get(FAMILY), max_sequence_length=TOKENS)
    captions, _, controls = pairs(demo, count=3)
    cached = kind.encode_item_captions([pipe.text_encoder], [pipe.processor], captions, controls)
    assert cached["prompt_embeds"].dtype == kind.cache_dtype
    for i, caption in enumerate(captions):
        image = Image.fromarray(
            ((controls[i, 0].permute(1, 2, 0) + 1) * 127.5).round().to(torch.uint8).numpy()
        )
        # what QwenImageEditPipeline.__call__ hands encode_prompt: the input at 1024^2 in area
        image = pipe.image_processor.resize(image, 1024, 1024)
        with torch.no_grad():
            states, mask = pipe.encode_prompt(caption, image=image, device=torch.device("cpu"))
        length = states.shape[1]
        assert mask is None or bool(mask.all())
        assert int(cached["text_mask"][i].float().sum()) == length
        torch.testing.assert_close(
            cached["prompt_embeds"][i, :length].float(), states[0].to(kind.cache_dtype).float()
        )
    # the same captions with other controls: other states (the encoder reads the image)
    other = kind.encode_item_captions([pipe.text_encoder], [pipe.processor], captions,
                                      controls.flip(0))  # fmt: skip
    assert not torch.equal(other["prompt_embeds"][0], cached["prompt_embeds"][0])


@pytest.fixture(scope="module")
def full_run(demo, tmp_path_factory):
    """The module's full run; its feature cache is the session's, as saved_run's."""
    tmp = tmp_path_factory.mktemp("full-qwen-edit") / "run"
    tmp.mkdir()
    (given,) = sorted((demo / "data").glob("001-*.control.png"))
    log = run(
        tmp, demo, FAMILY, output=tmp / "output", checkpoint_every_steps=SAVED,
        validation_prompts=[PROMPT], validation_inference_steps=2,
        validation_images=given.name, cache=tmp_path_factory.getbasetemp() / "cache", **FULL,
    )  # fmt: skip
    return tmp / "output", log


@pytest.mark.slow
def test_full_fine_tuning_at_zero_3_learns_the_edit_and_exports(demo, full_run) -> None:
    """ZeRO-3, the optimizer on the CPU: every step logged, the held-out edit loss falls,
    final/ is a QwenImageEditPipeline; the samples, drawn through it at the end, edit
    ZT_VALIDATION_IMAGES's image otherwise than the base does. (Each edit the pipeline draws
    costs ~15 s on the CPU: it reads its input at 1024^2 in area whatever the run's size, so
    the ranks' samples are the full run's edits; the LoRA test edits in this process.)"""
    output, log = full_run
    assert [s["step"] for s in tk.read_steps(output)] == list(range(1, STEPS + 1))
    assert "64 images with 1 control image each" in log and "loss on the target" in log
    assert "read with its control image: cached with its latents" in log
    base, final = load(demo / "model"), load(output / "final")
    assert type(final).__name__ == PIPELINE
    assert edit_loss(demo, final.transformer) < 0.97 * edit_loss(demo, base.transformer)
    (sample,) = (output / "samples" / f"step-{STEPS}").glob("*.png")
    assert samples_differ(output / "samples" / "base" / sample.name, sample)
    (given,) = sorted((demo / "data").glob("001-*.control.png"))
    shown = Image.open(output / "samples" / "inputs" / sample.name).convert("RGB")
    assert np.array_equal(np.asarray(shown), np.asarray(Image.open(given).convert("RGB")))


@pytest.mark.slow
def test_full_checkpoint_resumes_on_one_rank(demo, full_run, tmp_path) -> None:
    output, _ = full_run
    resumes_on_one_rank_at_zero_2(tmp_path, demo, FAMILY, output, PIPELINE)


@pytest.mark.slow
def test_lora_at_zero_3_edits_through_the_pipeline(demo, base_edit, tmp_path) -> None:
    """A LoRA adapter at ZeRO-3: `transformer.` keys that QwenImageEditPipeline loads with
    `load_lora_weights`, lowering the held-out edit loss and changing its edit."""
    from safetensors.torch import load_file

    from zerotuner.weights import lora_files

    output = tmp_path / "output"
    run(tmp_path, demo, FAMILY, output=output, checkpoint_every_steps=STEPS, **LORA)
    adapter = load_file(output / "final" / lora_files.ADAPTER_FILE)
    assert adapter and all(k.startswith("transformer.") for k in adapter)
    manifest = json.loads((output / "checkpoints" / f"step-{STEPS}" / "zerotuner.json").read_text())
    assert manifest["family"] == FAMILY
    pipe = load(demo / "model")
    loss_before = edit_loss(demo, pipe.transformer)
    pipe.load_lora_weights(output / "final")
    assert edit_loss(demo, pipe.transformer) < 0.97 * loss_before
    assert np.abs(edit(pipe, a_control(demo)) - base_edit).max() > 1e-3


def test_check_counts_a_caption_per_image_and_refuses_caption_dropout(
    demo, monkeypatch, tmp_path, capsys
) -> None:
    """The real `zerotuner check`: the text cache holds one caption's states per image (read
    with its control); ZT_CAPTION_DROPOUT is one line, exit 2."""
    from zerotuner.cli import main

    out = tk.check_output(monkeypatch, capsys, demo / "model", demo / "data", tmp_path)
    assert "64 images with 1 control image each" in out and "64 captions x" in out
    monkeypatch.setenv("ZT_CAPTION_DROPOUT", "0.1")
    assert main(["check"]) == 2
    captured = capsys.readouterr()
    (line,) = [x for x in (captured.out + captured.err).splitlines() if "ZT_CAPTION_DROPOUT" in x]
    assert "ZT_CAPTION_DROPOUT=0.1: qwenimageedit's captions are encoded with" in line


def test_the_planner_counts_the_reference_and_its_vision_tokens() -> None:
    """The control's latent tokens lengthen every attention, as Kontext's, and so do its
    Qwen2.5-VL vision tokens among the caption's states."""
    from zerotuner.families.registry import REGISTRY
    from zerotuner.families.shapes import transformer_activations

    plain, edit_model = (transformer_activations(f, REGISTRY[f].builtin_config)
                         for f in ("qwenimage", FAMILY))  # fmt: skip
    image, text, vision = (1024 // 16) ** 2, 512, 37 * 37
    for a, b in zip(plain, edit_model, strict=True):
        assert b / a == pytest.approx((2 * image + text + vision) / (image + text), rel=1e-3)


def test_plan_counts_the_text_cache_per_image(monkeypatch, capsys, tmp_path) -> None:
    """A caption read with its image's control is cached per image (as `check` counts it):
    `plan` prices the text cache per image for this family, per caption for Qwen-Image."""
    from zerotuner.cli import main

    for name, value in (("ZT_DATA_DIR", tmp_path / "data"), ("ZT_OUTPUT_DIR", tmp_path / "out"),
                        ("ZT_CACHE_DIR", tmp_path / "cache")):  # fmt: skip
        monkeypatch.setenv(name, str(value))
    what_if = ["--gpus", "8", "--gpu-memory", "80GiB", "--host-memory", "1TiB"]
    said = {}
    for family in (FAMILY, "qwenimage"):
        assert main(["plan", "--model-family", family, *what_if]) == 0
        (said[family],) = [x for x in capsys.readouterr().out.splitlines() if "text cache" in x]
    assert " MiB per image, " in said[FAMILY] and "ZT_RANDOM_FLIP" in said[FAMILY]
    assert " MiB per caption, " in said["qwenimage"] and "ZT_RANDOM_FLIP" not in said["qwenimage"]
