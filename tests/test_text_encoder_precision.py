"""ZT_TEXT_ENCODER_PRECISION: the demo's captions cached by text encoders stored in fp8 (real
tiny SDXL encoders, torchao) are close to the full-precision ones, under their own cache key,
and the full-precision entries stay as they were; text encoders that train refuse it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zerotuner import families
from zerotuner.data.buckets import assign_buckets
from zerotuner.data.scan import scan
from zerotuner.errors import ConfigError
from zerotuner.settings.schema import Settings
from zerotuner.train import caching, model
from zerotuner.weights import lora


def _fill(demo_dir: Path, cache: Path, precision: str):
    s = Settings(
        model=str(demo_dir / "model"), data_dir=demo_dir / "data", cache_dir=cache,
        resolution=64, text_encoder_precision=precision,
    )  # fmt: skip
    components = model.load_components(
        demo_dir / "model", "sdxl", gradient_checkpointing=False, with_frozen=False
    )
    dataset = scan(s.data_dir, log_skipped=False)
    features, items, stats = caching.fill(
        s, demo_dir / "model", components, families.get("sdxl").configured(s), dataset,
        assign_buckets(dataset.items, 64, multiple=8), rank=0, world=1,
        device=torch.device("cpu"), dtype=torch.float32,
    )  # fmt: skip
    paths = {caption: features.text_path(caption) for caption in {i.caption for i in items}}
    return features, paths, stats


def test_fp8_encoders_cache_close_captions_apart(
    demo_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    full, full_paths, _ = _fill(demo_dir, cache, "auto")
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in full_paths.values()}
    with caplog.at_level(logging.INFO):
        low, low_paths, stats = _fill(demo_dir, cache, "fp8")
    assert low.text_key == f"{full.text_key}:text-fp8"
    # every caption encoded again, every image's latents reused
    assert stats.texts_encoded == len(low_paths) > 0 and stats.latents_encoded == 0
    assert caplog.text.count("stored at fp8: ") == 2  # both CLIP encoders, one line each
    assert "text encoder 1 (CLIPTextModel) stored at fp8: " in caplog.text
    errors = []
    for caption, path in low_paths.items():
        assert path != full_paths[caption] and path.is_file()
        ours, theirs = load_file(path), load_file(full_paths[caption])
        assert ours.keys() == theirs.keys()
        for name, tensor in ours.items():
            reference = theirs[name]
            error = (tensor - reference).norm() / reference.norm()
            errors.append(float(error))
            assert 0 < error < 0.1, (caption, name, float(error))
    print(f"fp8 text encoders: relative error of cached embeddings up to {max(errors):.4f}")
    # the full-precision entries are untouched
    assert before == {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in full_paths.values()}


def test_text_encoders_that_train_refuse_a_low_precision(demo_dir: Path) -> None:
    s = Settings(
        model=str(demo_dir / "model"), data_dir=demo_dir / "data", training_type="lora",
        lora_text_encoder=True, text_encoder_precision="int8",
    )  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        lora.check_settings(s)
    message = str(refused.value)
    assert "\n" not in message
    assert "ZT_TEXT_ENCODER_PRECISION=int8 with ZT_LORA_TEXT_ENCODER=true" in message
    lora.check_settings(s.model_copy(update={"text_encoder_precision": "auto"}))
