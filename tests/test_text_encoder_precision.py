"""ZT_TEXT_ENCODER_PRECISION: the demo's captions cached by text encoders stored in fp8 (real
tiny SDXL encoders, torchao) are close to the full-precision ones, under their own cache key,
and the full-precision entries stay as they were; text encoders that train refuse it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import trainkit as tk
from safetensors.torch import load_file

from zerotuner import families
from zerotuner.data.buckets import assign_buckets
from zerotuner.data.scan import scan
from zerotuner.settings.schema import Settings
from zerotuner.train import caching, model


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


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"ZT_TEXT_ENCODER_PRECISION": "int8", "ZT_LORA_TEXT_ENCODER": "true"},
         "ZT_TEXT_ENCODER_PRECISION=int8 with ZT_LORA_TEXT_ENCODER=true: text encoders that "
         "train are kept at the run's precision; set ZT_TEXT_ENCODER_PRECISION=auto or unset "
         "ZT_LORA_TEXT_ENCODER"),
        ({"ZT_TEXT_ENCODER_PRECISION": "nf4"},
         "ZT_TEXT_ENCODER_PRECISION='nf4': expected 'auto', 'fp8' or 'int8'"),
    ],
)  # fmt: skip
def test_refusals_are_one_line_and_exit_2(monkeypatch, capsys, tmp_path, env, expected) -> None:
    code, out, err = tk.config_explain(
        monkeypatch, capsys, tmp_path, ZT_TRAINING_TYPE="lora", **env
    )
    assert code == 2 and out == "", err
    assert [line for line in err.splitlines() if line.startswith("zerotuner: error")] == [
        f"zerotuner: error: {expected}"
    ], err
    assert "Traceback" not in err


def test_encoders_that_only_encode_may_be_stored_low(monkeypatch, capsys, tmp_path) -> None:
    code, _, err = tk.config_explain(
        monkeypatch, capsys, tmp_path, ZT_TRAINING_TYPE="lora", ZT_TEXT_ENCODER_PRECISION="fp8"
    )
    assert code == 0, err
