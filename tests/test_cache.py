"""The feature cache and the per-family conditioning, in one process with the real tiny models
(no DeepSpeed): keys, invalidation, round trips, SD 1.x/2.x/SDXL inputs and the loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zerotuner.data.buckets import assign_buckets
from zerotuner.data.dataset import Dataset
from zerotuner.data.loading import load_example
from zerotuner.data.scan import scan
from zerotuner.demo.parts import LATENT_SCALE
from zerotuner.errors import ConfigError
from zerotuner.families import ddpm, get
from zerotuner.families.unet import time_ids
from zerotuner.train import loop, model
from zerotuner.train.feature_cache import CacheItem, FeatureCache, component_key


def items_for(dataset: Dataset, buckets) -> list[CacheItem]:
    bucket_of = {i: size for size, ix in buckets.items() for i in ix}

    def loader(item, bucket):
        def load(flip: bool):
            ex = load_example(item, bucket, flip=flip)
            ids = time_ids(ex.original_size, ex.crop_top_left, ex.target_size)
            return torch.from_numpy(ex.pixels), ids

        return load

    return [
        CacheItem(
            name=item.path.name,
            content=item.digest,
            caption=item.caption,
            bucket=bucket_of[i],
            load=loader(item, bucket_of[i]),
        )
        for i, item in enumerate(dataset.items)
    ]


@pytest.fixture(scope="module")
def sdxl(demo_dir: Path):
    source = demo_dir / "model"
    components = model.load_components(source, "sdxl", gradient_checkpointing=False)
    dataset = scan(demo_dir / "data")
    buckets = assign_buckets(dataset.items, 64, multiple=8)
    return source, components, items_for(dataset, buckets)[:6]


def test_keys_follow_content_bucket_model_and_caption(sdxl, tmp_path: Path) -> None:
    source, _, items = sdxl
    vae_key = component_key(source, ["vae"])
    cache = FeatureCache(tmp_path, vae_key=vae_key, text_key="t", flip=False)
    item = items[0]
    same = CacheItem(item.name, item.content, item.caption, item.bucket, item.load)
    assert cache.latent_path(same) == cache.latent_path(item)
    changed = [
        CacheItem(item.name, "other-bytes", item.caption, item.bucket, item.load),
        CacheItem(item.name, item.content, item.caption, (128, 64), item.load),
        CacheItem("elsewhere.png", item.content, item.caption, item.bucket, item.load),
    ]
    assert all(cache.latent_path(c) != cache.latent_path(item) for c in changed)
    other_model = FeatureCache(tmp_path, vae_key="different", text_key="t", flip=False)
    assert other_model.latent_path(item) != cache.latent_path(item)
    flipping = FeatureCache(tmp_path, vae_key=vae_key, text_key="t", flip=True)
    assert flipping.latent_path(item) != cache.latent_path(item)
    # the caption keys the text entry only
    recaptioned = CacheItem(item.name, item.content, "a new caption", item.bucket, item.load)
    assert cache.latent_path(recaptioned) == cache.latent_path(item)
    assert cache.text_path("a new caption") != cache.text_path(item.caption)


def test_component_key_changes_with_the_vae_weights(demo_dir: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(demo_dir / "model", copy)
    before = component_key(copy, ["vae"])
    text = component_key(copy, ["text_encoder", "tokenizer"])
    weights = copy / "vae" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes() + b"\0")
    assert component_key(copy, ["vae"]) != before
    assert component_key(copy, ["text_encoder", "tokenizer"]) == text


def test_encode_once_then_load_batches(sdxl, tmp_path: Path) -> None:
    source, components, items = sdxl
    conditioning = get("sdxl")
    cache = FeatureCache(tmp_path, vae_key="v", text_key="t", flip=True)
    missing, texts = cache.missing(items)
    assert missing == list(range(len(items))) and texts
    cache.encode_latents(
        [items[i] for i in missing], lambda px: conditioning.encode_latents(components.vae, px)
    )
    cache.encode_texts(texts, lambda caps: conditioning.encode_text(components, caps))
    assert cache.missing(items) == ([], [])

    same_bucket = [it for it in items if it.bucket == items[0].bucket][:2]
    batch = cache.load_batch(same_bucket, torch.Generator().manual_seed(0))
    w, h = same_bucket[0].bucket
    scale = LATENT_SCALE
    assert batch["latents"].shape == (len(same_bucket), 4, h // scale, w // scale)
    assert batch["prompt_embeds"].shape[:2] == (len(same_bucket), 77)
    assert batch["pooled_prompt_embeds"].shape == (len(same_bucket), 32)
    assert batch["time_ids"].shape == (len(same_bucket), 6)
    # the random mirror is decided by the generator: the same seed gives the same batch
    again = cache.load_batch(same_bucket, torch.Generator().manual_seed(0))
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    # a cached latent is what the VAE gives for that image
    pixels, _ = same_bucket[0].load(False)
    direct = conditioning.encode_latents(components.vae, pixels[None])[0]
    flips = [
        cache.load_batch([same_bucket[0]], torch.Generator().manual_seed(s))["latents"][0]
        for s in range(8)
    ]
    assert any(torch.allclose(f, direct, atol=1e-5) for f in flips)


@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_family_conditioning_drives_the_unet(family, request) -> None:
    fixture = {"sd1": "sd1_demo_dir", "sd2": "sd2_demo_dir", "sdxl": "demo_dir"}[family]
    source = request.getfixturevalue(fixture) / "model"
    components = model.load_components(source, family, gradient_checkpointing=True)
    conditioning = get(family)
    text = conditioning.encode_text(components, ["a red circle", "a blue square"])
    batch = dict(text, latents=torch.randn(2, 4, 16, 16))
    if family == "sdxl":
        batch["time_ids"] = torch.stack([time_ids((64, 64), (0, 0), (64, 64))] * 2)
    kind = ddpm.prediction_type(components.scheduler)
    assert kind == ("epsilon" if family == "sd1" else "v_prediction")  # see demo._scheduler
    for snr_gamma in (None, 5.0):
        loss = ddpm.diffusion_loss(
            components.denoiser,
            components.scheduler,
            batch["latents"],
            conditioning.model_kwargs(batch, torch.float32),
            config=ddpm.LossConfig(kind, snr_gamma, noise_offset=0.05),
            generator=torch.Generator().manual_seed(0),
            dtype=torch.float32,
        )
        assert loss.ndim == 0 and torch.isfinite(loss)
        loss.backward()
    assert any(p.grad is not None for p in components.denoiser.parameters())


def test_prediction_type_setting_overrides_the_scheduler(sd2_demo_dir: Path) -> None:
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler.from_pretrained(sd2_demo_dir / "model", subfolder="scheduler")
    assert ddpm.prediction_type(scheduler, "epsilon") == "epsilon"
    scheduler.register_to_config(prediction_type="sample")
    with pytest.raises(ConfigError, match="ZT_PREDICTION_TYPE"):
        ddpm.prediction_type(scheduler)


def test_step_noise_is_reproducible_per_step_and_rank() -> None:
    a = torch.randn(4, generator=loop.step_generator(42, 7, 0, 1))
    b = torch.randn(4, generator=loop.step_generator(42, 7, 0, 1))
    c = torch.randn(4, generator=loop.step_generator(42, 7, 0, 0))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_model_errors_name_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ZT_MODEL=/no/such/model: no such folder"):
        model.fetch_model("/no/such/model", cache_dir=tmp_path)
    # the tests run with HF_HUB_OFFLINE=1 (conftest): an uncached hub id cannot be fetched
    with pytest.raises(ConfigError, match="ZT_MODEL=someone/not-cached"):
        model.fetch_model("someone/not-cached", cache_dir=tmp_path)


def test_frozen_parts_load_on_a_nodes_first_rank_and_leave_before_the_engine(
    demo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """caching.fill: only a node's first rank loads the VAE and text encoders (the node's share
    of the cache); once it returns nothing holds them any more."""
    import weakref

    from zerotuner import families
    from zerotuner.launch import distributed
    from zerotuner.settings.schema import Settings
    from zerotuner.train import caching

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's view: 2 nodes of 2 ranks
    for local, rank, expected in ((0, 0, (0, 2)), (1, 1, None), (0, 2, (1, 2)), (1, 3, None)):
        monkeypatch.setenv("LOCAL_RANK", str(local))
        assert distributed.node_leader(rank, 4) == expected

    s = Settings(
        model=str(demo_dir / "model"), data_dir=demo_dir / "data", cache_dir=tmp_path / "cache",
        resolution=64,
    )  # fmt: skip
    components = model.load_components(
        demo_dir / "model", "sdxl", gradient_checkpointing=False, with_frozen=False
    )
    conditioning = families.get("sdxl").configured(s)
    dataset = scan(s.data_dir, log_skipped=False)
    buckets = assign_buckets(dataset.items, 64, multiple=8)
    loaded: list[weakref.ref] = []
    real_load = model.load_frozen

    def load_frozen(c, **kw):
        real_load(c, **kw)
        loaded.extend(weakref.ref(m) for m in (c.vae, *c.text_encoders))

    monkeypatch.setattr(model, "load_frozen", load_frozen)

    def fill(rank: int, local_world: int) -> caching.feature_cache.CacheStats:
        monkeypatch.setenv("LOCAL_RANK", str(rank % local_world))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
        return caching.fill(
            s, demo_dir / "model", components, conditioning, dataset, buckets, rank=rank,
            world=local_world, device=torch.device("cpu"), dtype=torch.float32,
        )[2]  # fmt: skip

    assert fill(1, 2).latents_encoded == 0 and loaded == []  # a second local rank loads nothing
    stats = fill(0, 1)
    assert stats.latents_encoded == len(dataset) > 0 and len(loaded) == 3  # VAE + 2 encoders
    assert components.vae is None and components.text_encoders == []
    assert all(ref() is None for ref in loaded)  # released: nothing refers to them
