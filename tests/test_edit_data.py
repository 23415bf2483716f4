"""Paired data for edit models (issue 43): a target with its control images beside it
(`foo.control.png`), named in metadata.jsonl or in a dataset's `control_dir`; controls cropped
and flipped with their target and cached as latents in its entry; a target without usable
controls skipped with why; controls on a text-to-image family, or a missing `control_dir`, one
line and exit 2. Milliseconds each on `scan`, `load_example` and the real `zerotuner check`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from zerotuner.data.buckets import dataset_buckets
from zerotuner.data.files import LINK_OUT
from zerotuner.data.loading import load_example
from zerotuner.data.scan import scan, scan_sources
from zerotuner.errors import ConfigError
from zerotuner.settings.datasets import DatasetSource
from zerotuner.settings.schema import Settings
from zerotuner.train import caching
from zerotuner.train.feature_cache import FeatureCache

RED, BLUE = (220, 30, 30), (40, 70, 220)


def _png(path: Path, size=(32, 32), colour=RED) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def _halves(path: Path, size: tuple[int, int]) -> Path:
    """Red on the left, blue on the right: a flip or a crop shows."""
    image = Image.new("RGB", size, RED)
    image.paste(BLUE, (size[0] // 2, 0, size[0], size[1]))
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def _reasons(dataset) -> dict[str, str]:
    return {path.relative_to(dataset.root).as_posix(): why for path, why in dataset.skipped}


def test_controls_are_found_beside_in_metadata_and_in_a_control_dir(tmp_path: Path) -> None:
    data, inputs = tmp_path / "data", tmp_path / "inputs"
    _png(data / "a.png"), _png(data / "a.control.png", colour=BLUE)
    _png(data / "b.png"), _png(data / "sources" / "b-before.png", colour=BLUE)
    (data / "metadata.jsonl").write_text(
        json.dumps({"file_name": "b.png", "text": "make it red", "control": "sources/b-before.png"})
        + "\n"
    )
    _png(data / "sub" / "c.jpg"), _png(inputs / "sub" / "c.png", colour=BLUE)
    _png(data / "d.png")  # no control anywhere
    _png(data / "orphan.control.png")
    _png(data / "e.png"), _png(data / "e.control.png"), _png(data / "e.control_1.png")

    dataset = scan(data, log_skipped=False, control_count=1, control_dir=inputs)
    controls = {item.name: [p.relative_to(tmp_path).as_posix() for p in item.controls]
                for item in dataset.items}  # fmt: skip
    assert controls == {"a.png": ["data/a.control.png"], "b.png": ["data/sources/b-before.png"],
                        "sub/c.jpg": ["inputs/sub/c.png"]}  # fmt: skip
    assert _reasons(dataset) == {
        "d.png": "without its control image",
        "orphan.control.png": "control images without an image of the same name",
        "e.png": "with 2 control images (the model takes 1)",
    }
    assert "3 images with 1 control image each" in dataset.summary()
    # the cache key holds each control's digest: an edited control is another entry
    before = {item.name: item.content for item in dataset.items}
    _png(data / "a.control.png", colour=(0, 200, 0))
    after = {i.name: i.content for i in scan(data, log_skipped=False, control_count=1,
                                             control_dir=inputs).items}  # fmt: skip
    assert after["a.png"] != before["a.png"] and after["b.png"] == before["b.png"]
    assert before["a.png"].startswith(dataset.items[0].digest + "|")
    # a control_dir inside the data folder: its images are controls, not targets
    inside = scan(data, log_skipped=False, control_count=1, control_dir=data / "sources")
    assert "sources/b-before.png" not in {item.name for item in inside.items}


def test_a_control_is_refused_as_a_target_is(tmp_path: Path, monkeypatch) -> None:
    """Unreadable, truncated, bombed, FIFO, dangling, linked out of the folder, of another
    aspect ratio: the target is skipped with why, the rest trains."""
    data = tmp_path / "data"
    for name in ("garbage", "truncated", "bomb", "fifo", "dangling", "out", "wide", "kept"):
        _png(data / f"{name}.png")
    (data / "garbage.control.png").write_bytes(b"not an image at all")
    whole = _png(tmp_path / "whole.png", size=(32, 32)).read_bytes()
    (data / "truncated.control.png").write_bytes(whole[: len(whole) // 2])
    _png(data / "bomb.control.png", size=(64, 64))  # over twice the lowered pixel limit
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1500)
    os.mkfifo(data / "fifo.control.png")
    (data / "dangling.control.png").symlink_to(tmp_path / "nowhere.png")
    (data / "metadata.jsonl").write_text(
        json.dumps({"file_name": "out.png", "text": "x", "control": "../outside.png"}) + "\n"
    )
    _png(tmp_path / "outside.png")
    _png(data / "wide.control.png", size=(64, 32))
    _png(data / "kept.control.png", size=(16, 16))  # a smaller copy: the same aspect ratio

    dataset = scan(data, log_skipped=False, control_count=1)
    assert [item.name for item in dataset.items] == ["kept.png"]
    reasons = _reasons(dataset)
    assert (
        reasons["garbage.png"] == "its control image is unusable (not an image (unrecognised data))"
    )
    assert reasons["truncated.png"].startswith("its control image is unusable (truncated")
    assert "decompression bomb" in reasons["bomb.png"]
    assert reasons["fifo.png"] == (
        "its control image is unusable (not a regular file (a FIFO, socket or device))"
    )
    assert reasons["dangling.png"].startswith("its control image is unusable (unreadable")
    assert reasons["out.png"] == f"its control image is unusable ({LINK_OUT})"
    assert reasons["wide.png"].startswith("its control image's aspect ratio differs")
    assert (tmp_path / "outside.png").is_file() and (data / "garbage.control.png").is_file()


def test_controls_are_cropped_flipped_and_cached_with_their_target(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _halves(data / "wide.png", (96, 64))
    _halves(data / "wide.control.png", (48, 32))  # half the size, the same picture
    (item,) = scan(data, log_skipped=False, control_count=1).items
    for flip in (False, True):
        example = load_example(item, (64, 64), flip=flip)
        assert example.controls is not None and example.controls.shape == (1, 3, 64, 64)
        # the same crop (the middle 64 of 96 columns) and the same mirror as the target's
        assert np.abs(example.controls[0] - example.pixels).mean() < 0.05
    left = load_example(item, (64, 64), flip=True).controls[0, :, 32, 4]  # type: ignore[index]
    assert left[2] > left[0]  # mirrored: blue on the left

    dataset = scan(data, log_skipped=False, control_count=1)
    buckets = dataset_buckets(dataset, 64, multiple=16)
    features = FeatureCache(tmp_path / "cache", vae_key="v", text_key="t", flip=True)
    items = [caching.feature_cache.CacheItem(
        name=i.name, content=i.content, caption=i.caption, bucket=b,
        load=caching._loader(i, b),
    ) for b, ix in buckets.items() for i in (dataset.items[k] for k in ix)]  # fmt: skip

    def encode(pixels: torch.Tensor) -> torch.Tensor:  # a stand-in VAE: 8x8 average pooling
        return torch.nn.functional.avg_pool2d(pixels, 8)

    features.encode_latents(items, encode)
    batch = features.load_batch(items, torch.Generator().manual_seed(0), texts=False)
    assert batch["control_latents"].shape == (1, 1, *batch["latents"].shape[1:])
    assert torch.allclose(batch["control_latents"][:, 0], batch["latents"], atol=0.05)


def _datasets_file(tmp_path: Path, entries: list[dict]) -> Path:
    path = tmp_path / "datasets.yaml"
    path.write_text(yaml.safe_dump({"datasets": entries}))
    return path


def test_controls_on_a_text_to_image_family_are_one_line_exit_2(demo_job_env, tmp_path, capsys):
    from zerotuner.cli import main

    data = tmp_path / "data"
    _png(data / "a.png", size=(64, 64)), _png(data / "a.control.png", size=(64, 64))
    demo_job_env.setenv("ZT_DATA_DIR", str(data))
    assert main(["check"]) == 2
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if "control images" in x]
    assert f"ZT_DATA_DIR={data}: control images (a.control.png) train an edit model" in line
    assert (
        "(fluxkontext, qwenimageedit, qwenimageeditplus, flux2, flux2klein)" in line
        and "Traceback" not in out
    )
    with pytest.raises(ConfigError, match="this model's family takes none"):
        scan(data, log_skipped=False)

    path = _datasets_file(tmp_path, [{"path": str(data), "control_dir": str(data)}])
    demo_job_env.setenv("ZT_DATASETS_FILE", str(path))
    assert main(["check"]) == 2
    out = capsys.readouterr().out
    assert f"ZT_DATASETS_FILE={path}: datasets[0].control_dir={data}: control images" in out


def test_a_control_dir_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _png(data / "a.png")
    source = DatasetSource(path=str(data), control_dir=str(tmp_path / "nowhere"))
    file = tmp_path / "datasets.yaml"
    with pytest.raises(ConfigError) as error:
        scan_sources([source], tmp_path / "cache", datasets_file=file, control_count=1)
    text = str(error.value)
    assert "\n" not in text and text.startswith(
        f"ZT_DATASETS_FILE={file}: datasets[0].control_dir={tmp_path / 'nowhere'}: no such "
        "directory; point it at a folder of control images named as their targets"
    )
    assert (data / "a.png").is_file()


def test_validation_images_give_a_prompt_several_references(demo_dir, tmp_path, capsys) -> None:
    """ZT_VALIDATION_IMAGES as a JSON list: an entry that is a list is one prompt's references
    (Qwen-Image-Edit Plus, FLUX.2), read in its order; more than the model takes for one prompt,
    or a list of anything but paths, is one line."""
    from pydantic import ValidationError

    from zerotuner.data.dataset import Dataset
    from zerotuner.train import validation_inputs

    data = demo_dir / "data"
    first, second, third = sorted(p.name for p in data.glob("*.png"))[:3]
    settings = Settings(data_dir=str(data), validation_prompts=["a", "b"],
                        validation_images=json.dumps([[first, second], third]))  # fmt: skip
    assert settings.validation_image_paths == [[data / first, data / second], [data / third]]
    empty = Dataset(tmp_path, [], [])
    references, alone = validation_inputs.chosen(settings, "control image", empty, [], most=3)
    assert [r.size for r in references] == [Image.open(data / n).size for n in (first, second)]
    assert not isinstance(alone, list) and alone.mode == "RGB"
    with pytest.raises(ConfigError) as refused:
        validation_inputs.chosen(settings, "control image", empty, [], most=1)
    assert "2 images for one prompt" in str(refused.value) and "\n" not in str(refused.value)
    for bad in ('[["a.png", 3]]', '["a.png", {"b": 1}]', "[[]]"):
        with pytest.raises(ValidationError, match="a list whose entries are a path"):
            Settings(validation_images=bad)
