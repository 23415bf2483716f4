"""The training recipes (issue 31): caption dropout, the caption template, the minimum image
size and no-upscale buckets, each shown on the real data and caching path by its effect on
what the model is given; `check` and one short 2-rank run show them wired in."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import trainkit as tk
from PIL import Image
from safetensors.torch import load_file

from zerotuner import families
from zerotuner.data.buckets import assign_buckets, bucket_sizes, native_bucket, nearest_bucket
from zerotuner.data.captions import caption_dropped
from zerotuner.data.loading import load_example
from zerotuner.data.notes import recipe_notes, upscale_warning
from zerotuner.data.order import Position, iterate_batches
from zerotuner.data.scan import scan
from zerotuner.errors import ConfigError
from zerotuner.settings.schema import Settings, load_settings
from zerotuner.train import caching, model

DROPOUT = 0.1
TEMPLATE = "sks {caption}"
EPOCHS = 5  # x 64 demo images: 320 samples


def _png(path: Path, size: tuple[int, int], seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


# --- caption dropout and the template, through the feature cache -----------------------------


@pytest.fixture(scope="module")
def filled(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The demo data cached as `train` caches it, with a template and 10% caption dropout."""
    s = Settings(
        model=str(demo_dir / "model"), data_dir=demo_dir / "data", resolution=64, seed=7,
        cache_dir=tmp_path_factory.mktemp("recipes-cache"), caption_template=TEMPLATE,
        caption_dropout=DROPOUT,
    )  # fmt: skip
    components = model.load_components(
        demo_dir / "model", "sdxl", gradient_checkpointing=False, with_frozen=False
    )
    conditioning = families.get("sdxl").configured(s)
    dataset = scan(s.data_dir, log_skipped=False, caption_template=s.caption_template)
    buckets = assign_buckets(dataset.items, 64, multiple=8)
    features, items, stats = caching.fill(
        s, demo_dir / "model", components, conditioning, dataset, buckets, rank=0, world=1,
        device=torch.device("cpu"), dtype=torch.float32,
    )  # fmt: skip
    return s, dataset, buckets, features, items, stats


def _seen(filled, world: int, start: Position, samples: int) -> dict[tuple[int, int], bool]:
    """(epoch, item) -> whether the text embedding the model was given is the empty caption's,
    read from the batches every rank loads, as the worker loads them."""
    s, dataset, buckets, features, items, _ = filled
    empty = load_file(features.text_path(""))["prompt_embeds"]
    seen: dict[tuple[int, int], bool] = {}
    for rank in range(world):
        batches = iterate_batches(
            dataset, buckets, micro_batch=4, rank=rank, world_size=world, seed=s.seed,
            start=start,
        )  # fmt: skip
        for _ in range(samples // 4 // world):
            indices, position = next(batches)
            keys = (indices, position.epoch)
            given = caching.batch_items(items, keys, seed=s.seed, caption_dropout=DROPOUT)
            batch = features.load_batch(given, torch.Generator().manual_seed(0))
            for row, index in enumerate(indices):
                dropped = torch.equal(batch["prompt_embeds"][row], empty)
                own = load_file(features.text_path(items[index].caption))["prompt_embeds"]
                assert dropped or torch.equal(batch["prompt_embeds"][row], own)
                mine = load_file(features.latent_path(items[index]))["latents"]
                assert torch.equal(batch["latents"][row], mine)  # the image is unchanged
                assert seen.setdefault((position.epoch, index), dropped) == dropped
    return seen


def test_caption_dropout_gives_the_empty_caption_to_a_tenth_of_each_epoch(filled) -> None:
    s, dataset, _, features, items, stats = filled
    # the template is applied where captions are read, so the cache holds the templated text
    assert all(item.caption.startswith("sks a ") for item in items)
    captions = {item.caption for item in items}
    assert all(features.text_path(c).is_file() for c in captions)
    assert features.text_path("").is_file()  # the empty caption: encoded once, with the rest
    assert stats.texts_encoded == len(captions) + 1
    empty = load_file(features.text_path(""))["prompt_embeds"]
    own = load_file(features.text_path(items[0].caption))["prompt_embeds"]
    assert not torch.equal(empty, own)

    seen = _seen(filled, world=1, start=Position(), samples=EPOCHS * len(dataset))
    assert len(seen) == EPOCHS * len(dataset)  # every (epoch, image) once
    fraction = sum(seen.values()) / len(seen)
    print(f"caption dropout {DROPOUT}: {fraction:.3f} of {len(seen)} samples empty")
    assert abs(fraction - DROPOUT) < 3 * math.sqrt(DROPOUT * (1 - DROPOUT) / len(seen))
    for epoch in range(EPOCHS):  # each epoch draws anew
        per_epoch = [d for (e, _), d in seen.items() if e == epoch]
        assert 0 < sum(per_epoch) < len(per_epoch) / 4
    dropped = [{i for (e, i), d in seen.items() if d and e == epoch} for epoch in range(2)]
    assert dropped[0] != dropped[1]

    # the same samples drop on two ranks, and after a resume in the middle of an epoch
    assert _seen(filled, world=2, start=Position(), samples=len(seen)) == seen
    resumed = _seen(filled, world=2, start=Position(2, 6), samples=len(dataset) * 2)
    assert resumed and all(seen[key] == value for key, value in resumed.items())
    assert min(e for e, _ in resumed) == 2


def test_dropout_is_a_pure_function_of_seed_epoch_and_item() -> None:
    draws = [caption_dropped(42, 0, i, 0.25) for i in range(4000)]
    assert abs(sum(draws) / len(draws) - 0.25) < 0.03
    assert draws == [caption_dropped(42, 0, i, 0.25) for i in range(4000)]
    assert draws != [caption_dropped(43, 0, i, 0.25) for i in range(4000)]
    assert not any(caption_dropped(42, 0, i, 0.0) for i in range(100))
    assert all(caption_dropped(42, 0, i, 1.0) for i in range(100))


def test_the_template_wraps_every_caption_and_must_hold_one_slot(tmp_path: Path) -> None:
    _png(tmp_path / "a.png", (32, 32))
    (tmp_path / "a.txt").write_text(" a red circle \n")
    _png(tmp_path / "0001.png", (32, 32), seed=1)  # no caption at all: the template alone
    _png(tmp_path / "b.png", (32, 32), seed=2)
    (tmp_path / "b.txt").write_text("{not a slot}")
    scanned = scan(tmp_path, caption_template="{caption}, in {sks} style")
    captions = {item.path.name: item.caption for item in scanned.items}
    assert captions == {
        "a.png": "a red circle, in {sks} style",  # other braces are text
        "0001.png": ", in {sks} style",
        "b.png": "{not a slot}, in {sks} style",
    }
    assert scan(tmp_path, caption_template="sks {caption}").items[0].caption == "sks"

    for bad in ("sks", "sks {caption} and {caption}", "{Caption}"):
        with pytest.raises(ConfigError) as error:
            load_settings({"ZT_CAPTION_TEMPLATE": bad})
        (line,) = error.value.problems
        assert line.startswith(f"ZT_CAPTION_TEMPLATE='{bad}': expected text with {{caption}}")
    assert load_settings({"ZT_CAPTION_TEMPLATE": " sks {caption} "}).caption_template == (
        "sks {caption}"
    )
    for name, bad in (("ZT_CAPTION_DROPOUT", "1.5"), ("ZT_CAPTION_DROPOUT", "-0.1"),
                      ("ZT_MIN_IMAGE_SIZE", "-1"), ("ZT_UPSCALE", "sometimes")):  # fmt: skip
        with pytest.raises(ConfigError) as error:
            load_settings({name: bad})
        assert error.value.problems[0].startswith(f"{name}='{bad}': expected")


def test_a_bad_template_is_exit_2_naming_the_setting(monkeypatch, capsys) -> None:
    from zerotuner.cli import main

    monkeypatch.setenv("ZT_CAPTION_TEMPLATE", "a photo of sks")
    assert main(["config"]) == 2
    err = capsys.readouterr().err
    assert "ZT_CAPTION_TEMPLATE='a photo of sks': expected text with {caption} exactly once" in err


# --- the minimum image size and buckets without upscaling ---------------------------------------


def test_min_image_size_leaves_small_images_out_with_the_skip_summary(tmp_path: Path) -> None:
    for i in range(4):
        _png(tmp_path / f"small-{i}.png", (48, 80), seed=i)
    _png(tmp_path / "edge.png", (64, 300))
    _png(tmp_path / "large.png", (128, 96))
    dataset = scan(tmp_path, min_image_size=64)
    assert sorted(item.path.name for item in dataset.items) == ["edge.png", "large.png"]
    assert dataset.warnings() == [
        "skipped 4 files, smaller than ZT_MIN_IMAGE_SIZE=64 px on the short side (48x80): "
        "small-0.png, small-1.png, small-2.png and 1 more"
    ]
    assert recipe_notes(dataset, 64, min_image_size=64) == ["4 images under 64 px left out"]
    with pytest.raises(ConfigError) as error:
        scan(tmp_path, min_image_size=1000)
    assert "no usable images; 6 file(s) skipped" in error.value.problems[0]
    assert "smaller than ZT_MIN_IMAGE_SIZE=1000 px" in error.value.problems[1]


def test_no_upscale_buckets_keep_small_images_at_their_own_size(tmp_path: Path) -> None:
    sizes = {"big": (1024, 1024), "small": (300, 200), "exact": (256, 200), "strip": (2000, 200),
             "tiny": (40, 40)}  # fmt: skip
    for name, size in sizes.items():
        _png(tmp_path / f"{name}.png", size)
    dataset = scan(tmp_path)
    bucket = {}
    for upscale in (True, False):
        groups = assign_buckets(dataset.items, 512, multiple=64, upscale=upscale)
        bucket[upscale] = {dataset.items[i].path.stem: s for s, ix in groups.items() for i in ix}
    assert bucket[False]["big"] == bucket[True]["big"] == (512, 512)  # covers its bucket
    assert bucket[False]["small"] == (256, 192)  # its own size, rounded down to the step
    assert bucket[False]["exact"] == (256, 192)
    assert bucket[False]["strip"] == (768, 192)  # the long side cut to 4x the short one
    assert bucket[False]["tiny"] == (64, 64)  # one step: the one enlargement left
    for name, (w, h) in bucket[True].items():  # today's buckets: about 512**2 pixels each
        assert w * h > 0.8 * 512 * 512, name

    # what the model sees: the image's own pixels, center-cropped, not resampled
    exact = next(item for item in dataset.items if item.path.stem == "exact")
    example = load_example(exact, bucket[False]["exact"])
    original = np.asarray(Image.open(exact.path), dtype=np.float32) / 127.5 - 1.0
    assert example.pixels.shape == (3, 192, 256)
    assert np.array_equal(example.pixels, original[4:196].transpose(2, 0, 1))
    enlarged = load_example(exact, bucket[True]["exact"])
    assert enlarged.pixels.shape[1] * enlarged.pixels.shape[2] > 4 * 192 * 256

    line = upscale_warning(dataset, 512, upscale=True)
    assert line and line.startswith("4 of 5 images are smaller than 512 px and will be upscaled")
    line = upscale_warning(dataset, 512, upscale=False)
    assert line and line.startswith("1 of 5 images have a side below the bucket step 64 px")
    assert "ZT_MIN_IMAGE_SIZE=64" in line
    notes = recipe_notes(dataset, 512, upscale=False)
    assert notes == ["4 images not upscaled (trained at their own size)"]


@pytest.mark.parametrize("size", [(w, h) for w in (10, 63, 64, 100, 333, 700, 5000)
                                  for h in (10, 64, 200, 511, 900)])  # fmt: skip
def test_native_buckets_never_enlarge_beyond_a_step_or_exceed_the_area(size) -> None:
    for resolution, multiple in ((512, 64), (64, 8), (1024, 64)):
        sizes = bucket_sizes(resolution, multiple=multiple)
        bucket = native_bucket(
            size, nearest_bucket(size, sizes), resolution=resolution, multiple=multiple
        )
        w, h = bucket
        assert w % multiple == 0 and h % multiple == 0 and w * h <= resolution**2
        assert max(w, h) <= 4 * min(w, h)
        assert w <= max(size[0], multiple) or bucket in sizes
        assert h <= max(size[1], multiple) or bucket in sizes


# --- check and one run --------------------------------------------------------------------------


def test_check_reports_the_recipes(demo_job_env, tmp_path: Path, capsys) -> None:
    from zerotuner.cli import main

    folder = tmp_path / "data"
    for i in range(3):
        _png(folder / f"small-{i}.png", (40, 40), seed=i)
    _png(folder / "mid.png", (96, 80), seed=9)
    (folder / "mid.txt").write_text("a mid picture")
    _png(folder / "large.png", (256, 256), seed=10)
    demo_job_env.setenv("ZT_DATA_DIR", str(folder))
    demo_job_env.setenv("ZT_RESOLUTION", "128")
    demo_job_env.setenv("ZT_CAPTION_TEMPLATE", "sks {caption}")
    demo_job_env.setenv("ZT_CAPTION_DROPOUT", "0.1")
    demo_job_env.setenv("ZT_MIN_IMAGE_SIZE", "64")
    demo_job_env.setenv("ZT_UPSCALE", "false")
    demo_job_env.setenv("ZT_TIMESTEP_RANGE", "0.5-1")
    main(["check"])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if " dataset " in line]
    assert lines[0] == (
        f"OK   dataset          2 images in {folder}; captions as 'sks {{caption}}'; 10% of "
        "samples an epoch on the empty caption; 3 images under 64 px left out; 1 image not "
        "upscaled (trained at its own size); noise schedule 0.5-1 only"
    ), out
    assert lines[1] == (
        "WARN dataset          skipped 3 files, smaller than ZT_MIN_IMAGE_SIZE=64 px on the "
        "short side (40x40): small-0.png, small-1.png, small-2.png"
    )
    assert len(lines) == 2  # no upscaling to warn about


@pytest.mark.slow
def test_a_run_trains_with_the_recipes(demo_dir: Path, tmp_path: Path) -> None:
    """Two CPU ranks, 3 steps: the empty caption is cached beside the templated ones, the
    recipes are logged, the small demo images train in a bucket of their own size, and the
    objective takes the timestep range."""
    config = tk.ds_config(0, steps=3)
    job = tk.write_job(tmp_path / "job.json", model=demo_dir / "model", deepspeed=config,
                       resolution=128)  # fmt: skip
    env = tk.settings_env(
        model=demo_dir / "model", data=demo_dir / "data", output=tmp_path / "output",
        cache=tmp_path / "cache", max_steps=3, checkpoint_every_steps=0, log_every_steps=1,
        caption_template="{caption}, sks style", caption_dropout=0.5, upscale="false",
        timestep_range="0.0-0.5",
    )  # fmt: skip
    proc = tk.run_ranks(tmp_path, env, job_file=job)
    tk.assert_ok(proc, tmp_path)
    log = proc.stdout + proc.stderr
    assert "dataset recipes: captions as '{caption}, sks style'; 50% of samples an epoch" in log
    assert "64 images not upscaled (trained at their own size)" in log
    assert "will be upscaled" not in log
    assert "prediction, timesteps 0-0.5 of the schedule" in log
    run = tmp_path / "output" / "run"
    buckets = tk.read_json(run / "dataset.json")["buckets"]
    assert set(buckets) == {"96x96", "144x96", "96x144"}  # the demo images' own sizes
    captions = {p.read_text() for p in (demo_dir / "data").glob("*.txt")}
    assert tk.read_json(run / "cache.json")["texts_encoded"] == len(captions) + 1
    assert len(tk.read_steps(tmp_path / "output")) == 3


# --- the timestep / sigma range -------------------------------------------------------------------


def _timesteps_seen(objective, latents: torch.Tensor, *, flow: bool) -> torch.Tensor:
    """The timesteps a stand-in denoiser is called with for one batch (flow: sigma x 1000)."""
    from types import SimpleNamespace

    seen = []

    def denoiser(*args, **kwargs):
        noisy = kwargs.get("hidden_states", args[0] if args else None)
        seen.append(kwargs["timestep"] if flow else args[1])
        return SimpleNamespace(sample=torch.zeros_like(noisy))

    objective.loss(
        denoiser, latents, {}, generator=torch.Generator().manual_seed(0), dtype=torch.float32
    )
    return seen[0].float()


@pytest.mark.parametrize("span,low,high", [("0.0-0.5", 0, 500), ("0.5-1", 500, 1000),
                                           (None, 0, 1000)])  # fmt: skip
def test_timestep_range_limits_the_noise_levels_the_model_is_trained_at(span, low, high) -> None:
    from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

    s = load_settings({"ZT_TIMESTEP_RANGE": span} if span else {})
    latents = torch.randn(512, 4, 2, 2)
    sdxl = families.get("sdxl").configured(s)
    ddpm_objective = sdxl.objective(s, DDPMScheduler(num_train_timesteps=1000), None)
    t = _timesteps_seen(ddpm_objective, latents, flow=False)
    assert low <= t.min() < low + 50 and high - 50 <= t.max() < high
    sd3 = families.get("sd3").configured(s)
    flow_objective = sd3.objective(s, FlowMatchEulerDiscreteScheduler(shift=3.0), {})
    sigmas = _timesteps_seen(flow_objective, latents, flow=True) / 1000
    assert low / 1000 <= sigmas.min() and sigmas.max() <= high / 1000
    assert sigmas.max() - sigmas.min() > (high - low) / 1000 / 2  # spread over the range
    if span:
        assert "timesteps" in ddpm_objective.describe() and "sigmas in" in flow_objective.describe()


def test_timestep_range_must_be_two_ordered_fractions() -> None:
    assert load_settings({"ZT_TIMESTEP_RANGE": " 0 - .5 "}).timestep_range == "0-0.5"
    for bad in ("0.5", "0.5-0.2", "0-1.5", "a-b", "0.2-0.2", "-1-0"):
        with pytest.raises(ConfigError) as error:
            load_settings({"ZT_TIMESTEP_RANGE": bad})
        (line,) = error.value.problems
        assert line.startswith(f"ZT_TIMESTEP_RANGE='{bad}': expected two fractions"), line
