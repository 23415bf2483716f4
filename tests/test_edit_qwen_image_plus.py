"""Qwen-Image-Edit Plus (issue 43): the tiny demo (real diffusers/transformers classes, each
target with two references: the shape to repaint and a swatch of its colour) is a
QwenImageEditPlusPipeline that edits from a list of input images, told apart by model_index.json
and its hub ids (2509, 2511) before plain Qwen-Image-Edit; the captions' cached states are the
pipeline's own encode_prompt with every reference ("Picture 1", "Picture 2"); on 2 CPU ranks it
trains in full at ZeRO-3 and resumes on 1 rank, and as LoRA at ZeRO-3: the held-out edit loss
falls, the export and the adapter edit two input images through QwenImageEditPlusPipeline. One
run takes one count of references: mixed counts, too many and a held-out folder of another
count are one line, exit 2.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import trainkit as tk
from PIL import Image
from test_edit_qwen_image import edit_loss, load, pairs, samples_differ
from test_flow_training import (
    PROMPT,
    STEPS,
    TOKENS,
    resumes_on_one_rank_at_zero_2,
    run,
    saved_run,
)

from zerotuner import families
from zerotuner.settings.schema import Settings

FAMILY, PIPELINE = "qwenimageeditplus", "QwenImageEditPlusPipeline"
FULL = {"stage": 3, "offload_optimizer": "cpu", "offload_param": "none", "resolution": 64}
LORA = {"stage": 3, "resolution": 64, "training_type": "lora", "lora_rank": 4, "lora_alpha": 4,
        "lr": 3e-2}  # fmt: skip


@pytest.fixture(scope="module")
def demo(family_demo_dir) -> Path:
    return family_demo_dir(FAMILY)


def references(demo: Path, side: int | None = 64) -> list[Image.Image]:
    """The first demo target's two references, in order, at `side` px (None: as saved)."""
    first = sorted((demo / "data").glob("000-*.png"))
    images = [Image.open(p).convert("RGB") for p in first if ".control" in p.name]
    return [i.resize((side, side)) for i in images] if side else images


def edit(pipe, images: list[Image.Image]) -> np.ndarray:
    """The pipeline's edit from `images` as PROMPT asks, at the demo's size."""
    return pipe(
        image=images, prompt=PROMPT, num_inference_steps=2, height=64, width=64,
        output_type="np", generator=torch.Generator().manual_seed(0),
    ).images[0]  # fmt: skip


@pytest.fixture(scope="module")
def base_edit(demo) -> np.ndarray:
    """The demo pipeline's edit from the first target's two references, drawn once for the
    module's tests (each reference read at 1024^2 in area: ~25 s on the CPU)."""
    images = references(demo)
    assert len(images) == 2
    return edit(load(demo / "model", FAMILY), images)


def test_the_demo_is_a_plus_pipeline_that_edits_and_is_detected(demo, base_edit, tmp_path) -> None:
    pipe = load(demo / "model", FAMILY)
    assert type(pipe).__name__ == PIPELINE
    assert base_edit.shape == (64, 64, 3) and np.isfinite(base_edit).all()
    assert families.detect_family(demo / "model") == FAMILY
    for hub_id in ("Qwen/Qwen-Image-Edit-2509", "Qwen/Qwen-Image-Edit-2511"):
        assert families.resolve_family(hub_id) == FAMILY
    assert families.resolve_family("Qwen/Qwen-Image-Edit") == "qwenimageedit"
    # a bare transformer is Qwen-Image's class and config: it reads as Qwen-Image
    shutil.copytree(demo / "model" / "transformer", tmp_path / "bare" / "transformer")
    assert families.detect_family(tmp_path / "bare") == "qwenimage"
    spec = families.REGISTRY[FAMILY]
    assert list(spec.control_counts) == [1, 2, 3] and spec.sample_input == "control image"
    assert list(families.REGISTRY["qwenimageedit"].control_counts) == [1]
    objective = families.get(FAMILY).objective(Settings(), pipe.scheduler, pipe.transformer.config)
    assert type(objective).__name__ == "QwenImageEditPlusObjective"


def test_cached_caption_states_are_the_pipelines_encode_prompt(demo) -> None:
    """Each caption read with all its references as QwenImageEditPlusPipeline.encode_prompt
    reads them (each at 384^2 in area, "Picture N" before it), padded with a mask; the
    references in another order are another state."""
    from zerotuner.families.qwen_image_edit_plus import CONDITION_AREA

    pipe = load(demo / "model", FAMILY)
    kind = dataclasses.replace(families.get(FAMILY), max_sequence_length=TOKENS)
    captions, _, controls = pairs(demo, count=2, family=FAMILY)
    assert controls.shape[:2] == (2, 2)
    cached = kind.encode_item_captions([pipe.text_encoder], [pipe.processor], captions, controls)
    side = int(CONDITION_AREA**0.5)
    for i, caption in enumerate(captions):
        images = [
            pipe.image_processor.resize(Image.fromarray(
                ((c.permute(1, 2, 0) + 1) * 127.5).round().to(torch.uint8).numpy()), side, side)
            for c in controls[i]
        ]  # fmt: skip
        with torch.no_grad():
            states, mask = pipe.encode_prompt(caption, image=images, device=torch.device("cpu"))
        length = states.shape[1]
        assert mask is None or bool(mask.all())
        assert int(cached["text_mask"][i].float().count_nonzero()) == length
        torch.testing.assert_close(
            cached["prompt_embeds"][i, :length].float(), states[0].to(kind.cache_dtype).float()
        )
    swapped = kind.encode_item_captions([pipe.text_encoder], [pipe.processor], captions,
                                        controls.flip(1))  # fmt: skip
    assert not torch.equal(swapped["prompt_embeds"][0], cached["prompt_embeds"][0])


@pytest.fixture(scope="module")
def full_run(demo, tmp_path_factory):
    """ZeRO-3 on 2 ranks, sampling from the data's first target's two references."""
    return saved_run(tmp_path_factory, demo, FAMILY, **FULL)


@pytest.mark.slow
def test_full_fine_tuning_at_zero_3_learns_the_edit_and_exports(demo, full_run) -> None:
    """Every step logged, the held-out edit loss falls, final/ is a QwenImageEditPlusPipeline;
    the samples, drawn through it from two input images (the ranks' edits: see
    test_edit_qwen_image's), differ from the base's and show both references side by side."""
    output, log = full_run
    assert [s["step"] for s in tk.read_steps(output)] == list(range(1, STEPS + 1))
    assert "64 images with 2 control images each" in log and "each reference image" in log
    base, final = load(demo / "model", FAMILY), load(output / "final", FAMILY)
    assert type(final).__name__ == PIPELINE
    loss_base = edit_loss(demo, base.transformer, family=FAMILY)
    assert edit_loss(demo, final.transformer, family=FAMILY) < 0.97 * loss_base
    (sample,) = (output / "samples" / f"step-{STEPS}").glob("*.png")
    assert samples_differ(output / "samples" / "base" / sample.name, sample)
    shown = Image.open(output / "samples" / "inputs" / sample.name).convert("RGB")
    first, second = references(demo, side=None)
    assert shown.size == (first.width + second.width, first.height)  # side by side
    assert np.array_equal(np.asarray(shown)[:, first.width :], np.asarray(second))


@pytest.mark.slow
def test_full_checkpoint_resumes_on_one_rank(demo, full_run, tmp_path) -> None:
    output, _ = full_run
    resumes_on_one_rank_at_zero_2(tmp_path, demo, FAMILY, output, PIPELINE)


@pytest.mark.slow
def test_lora_at_zero_3_edits_through_the_pipeline(demo, base_edit, tmp_path) -> None:
    """A LoRA adapter at ZeRO-3 that QwenImageEditPlusPipeline loads with `load_lora_weights`,
    lowering the held-out edit loss and changing its edit of two input images."""
    from safetensors.torch import load_file

    from zerotuner.weights import lora_files

    output = tmp_path / "output"
    run(tmp_path, demo, FAMILY, output=output, checkpoint_every_steps=STEPS, **LORA)
    adapter = load_file(output / "final" / lora_files.ADAPTER_FILE)
    assert adapter and all(k.startswith("transformer.") for k in adapter)
    pipe = load(demo / "model", FAMILY)
    loss_before = edit_loss(demo, pipe.transformer, family=FAMILY)
    pipe.load_lora_weights(output / "final")
    assert edit_loss(demo, pipe.transformer, family=FAMILY) < 0.97 * loss_before
    assert np.abs(edit(pipe, references(demo)) - base_edit).max() > 1e-3


def _data(demo: Path, folder: Path, targets: int = 4) -> Path:
    """The first `targets` demo targets with their captions and references, copied."""
    folder.mkdir(parents=True)
    for path in sorted((demo / "data").iterdir()):
        if int(path.name[:3]) < targets:
            shutil.copy(path, folder / path.name)
    return folder


def _check(monkeypatch, capsys, demo: Path, tmp_path: Path, data: Path, **env: str):
    """The real `zerotuner check` on `data`: its exit code and its lines."""
    from zerotuner.cli import main

    for key, value in {"ZT_MODEL": str(demo / "model"), "ZT_DATA_DIR": str(data),
                       "ZT_OUTPUT_DIR": str(tmp_path / "output"), "ZT_DEVICE": "cpu",
                       "ZT_CACHE_DIR": str(tmp_path / "cache"), "ZT_RESOLUTION": "64",
                       "ZT_OFFLOAD_DIR": str(tmp_path / "offload"), "ZT_NUM_PROCESSES": "1",
                       **env}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    code = main(["check"])
    captured = capsys.readouterr()
    return code, (captured.out + captured.err).splitlines()


def test_check_refuses_mixed_too_many_and_held_out_counts(
    demo, monkeypatch, capsys, tmp_path
) -> None:
    """One count of references per run: targets with 1 and 2, a target with 4 and a held-out
    folder of 1 against training targets of 2 are each one line, exit 2; 1 each trains."""
    data = _data(demo, tmp_path / "data")
    code, lines = _check(monkeypatch, capsys, demo, tmp_path, data)
    assert code == 0 and any("4 images with 2 control images each" in x for x in lines), lines
    # a held-out folder whose targets have one reference each
    held = _data(demo, tmp_path / "held")
    for second in held.glob("*.control_1.png"):
        second.unlink()
    code, lines = _check(monkeypatch, capsys, demo, tmp_path, data, ZT_EVAL_DATA_DIR=str(held))
    (line,) = [x for x in lines if "ZT_EVAL_DATA_DIR" in x]
    assert code == 2 and "its targets have 1 control image (" in line, lines
    assert "the training targets 2 (" in line and "Traceback" not in "\n".join(lines)
    monkeypatch.delenv("ZT_EVAL_DATA_DIR")
    code, lines = _check(monkeypatch, capsys, demo, tmp_path, held)  # 1 each: trains
    assert code == 0 and any("with 1 control image each" in x for x in lines), lines
    # mixed: two targets lose their second reference
    for second in sorted(data.glob("*.control_1.png"))[:2]:
        second.unlink()
    code, lines = _check(monkeypatch, capsys, demo, tmp_path, data)
    (line,) = [x for x in lines if "different numbers of control images" in x]
    assert code == 2 and "(1 control image: " in line and "; 2 control images: " in line
    assert "000-" in line and "002-" in line  # an example of each count
    # too many: a target with 4 references
    many = _data(demo, tmp_path / "many")
    (target,) = [p for p in many.glob("001-*.png") if ".control" not in p.name]
    for n in (2, 3):
        shutil.copy(many / f"{target.stem}.control.png", many / f"{target.stem}.control_{n}.png")
    code, lines = _check(monkeypatch, capsys, demo, tmp_path, many)
    (line,) = [x for x in lines if "has 4 control images" in x]
    assert code == 2 and "the model takes 1 to 3: keep at most 3 per target" in line
    assert target.name in line


def test_the_planner_counts_three_references_and_their_vision_tokens() -> None:
    """The plan is made before the data are read: for the most references, 3, each a
    target's worth of latent tokens and 14 x 14 vision tokens (and its "Picture N" words)."""
    from zerotuner.families.registry import REGISTRY
    from zerotuner.families.shapes import transformer_activations

    plain, plus = (transformer_activations(f, REGISTRY[f].builtin_config)
                   for f in ("qwenimage", FAMILY))  # fmt: skip
    image, text, vision = (1024 // 16) ** 2, 512, 14 * 14 + 5
    for a, b in zip(plain, plus, strict=True):
        assert b / a == pytest.approx((4 * image + text + 3 * vision) / (image + text), rel=1e-3)
