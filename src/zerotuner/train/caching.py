"""The caching phase of one rank: every image's latents and every caption's embeddings
encoded once into the feature cache (cache.py), shared out among the nodes (each node's first
rank encodes), before the engine starts; the frozen VAE and text encoders are released
afterwards. The other ranks wait in a `distributed.PatientBarrier`, as long as the encoding
takes (hours for a large dataset), and rank 0 reports how far its node is, with an ETA.
With ZT_CAPTION_DROPOUT the empty caption is encoded once with the rest; `batch_items` swaps
it in for the samples that drop theirs."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm

from zerotuner import families
from zerotuner.data.buckets import Bucket
from zerotuner.data.captions import caption_dropped
from zerotuner.data.dataset import Dataset, Item
from zerotuner.data.loading import load_example
from zerotuner.families.unet import time_ids
from zerotuner.launch import distributed
from zerotuner.monitor.logs import format_duration
from zerotuner.settings.schema import Settings
from zerotuner.train import feature_cache, model

log = logging.getLogger(__name__)


def fill(
    settings: Settings,
    source: Path,
    components: model.Components,
    conditioning: Any,
    dataset: Dataset,
    buckets: dict[Bucket, list[int]],
    *,
    rank: int,
    world: int,
    device: torch.device,
    dtype: torch.dtype,
    texts: bool = True,
) -> tuple[feature_cache.FeatureCache, list[feature_cache.CacheItem], feature_cache.CacheStats]:
    """Encode what the cache lacks and wait for every rank. One rank per node loads the VAE
    and text encoders and encodes the node's share (a T5-XXL per rank would hold tens of GB of
    host memory on a multi-GPU node); they are released before the engine starts. `texts`
    False: captions are not cached (the text encoders train, see lora_text.py)."""
    text_dirs = [d for pair in conditioning.text_subfolders for d in pair]
    per_item = families.REGISTRY[conditioning.name].captions_per_item
    features = feature_cache.FeatureCache(
        settings.cache_dir,
        vae_key=feature_cache.component_key(source, conditioning.latent_subfolders())
        + conditioning.latent_cache_tag(),
        text_key=text_key(settings, source, text_dirs, conditioning),
        flip=settings.random_flip,
        captions_per_item=per_item,
    )
    bucket_of = {i: size for size, indices in buckets.items() for i in indices}
    items = [
        feature_cache.CacheItem(
            name=item.name,
            content=item.content,
            caption=item.caption,
            bucket=bucket_of[i],
            load=_loader(item, bucket_of[i]),
        )
        for i, item in enumerate(dataset.items)
    ]
    empty = [""] if settings.caption_dropout > 0 else []  # what a dropped caption reads
    latents, captions = features.missing(items, empty)
    if not texts:
        captions = []
    leader = distributed.node_leader(rank, world)  # (node, nodes) on a node's first rank
    my_latents = feature_cache.share(latents, *leader) if leader else []
    my_texts = feature_cache.share(captions, *leader) if leader else []
    with distributed.PatientBarrier("caching") as barrier:
        barrier.wait()  # every rank lists the same missing entries before any rank writes one
        if my_latents or my_texts:
            assert leader is not None  # only a node's first rank has a share
            log.info(
                "caching: this node's first rank loads the VAE and text encoders once for the "
                "node and encodes %d images and %d captions (node %d of %d)",
                len(my_latents), len(my_texts), *leader,
            )  # fmt: skip
            model.load_frozen(
                components, device=device, text_dtype=dtype,
                text_precision=settings.text_encoder_precision,
            )  # fmt: skip
            progress = Progress(len(my_latents), len(my_texts), enabled=rank == 0)

            def encode(pixels: torch.Tensor) -> torch.Tensor:
                return conditioning.encode_latents(components.vae, pixels)

            def conditions(
                pixels: torch.Tensor, captions: list[str], controls: torch.Tensor | None
            ) -> dict[str, torch.Tensor]:
                extra = conditioning.encode_conditions(pixels, encode, components.image_encoder)
                if per_item and controls is not None:  # the text encoder reads the controls
                    extra |= conditioning.encode_item_captions(
                        components.text_encoders, components.tokenizers, captions, controls
                    )
                return extra

            features.encode_latents(
                [items[i] for i in my_latents], encode, progress.images, conditions=conditions
            )
            features.encode_texts(
                my_texts, lambda caps: conditioning.encode_text(components, caps), progress.texts
            )
            progress.close()
        components.drop_frozen()
        if rank == 0 and leader and leader[1] > 1 and (latents or captions):
            log.info("caching: waiting for the other nodes' share (no time limit while they work)")
        barrier.wait()  # every entry is on disk now
    encoded_l, encoded_t = distributed.all_sum([len(my_latents), len(my_texts)])
    unique = len({item.caption for item in items} | set(empty)) if texts and not per_item else 0
    stats = feature_cache.CacheStats(
        latents_encoded=encoded_l,
        latents_reused=len(items) - encoded_l,
        texts_encoded=encoded_t,
        texts_reused=unique - encoded_t,
    )
    return features, items, stats


def text_key(settings: Settings, source: Path, text_dirs: list[str], conditioning: Any) -> str:
    """The captions' cache key: the encoders' files, the family's tag, and their storage when
    it is not the run's (ZT_TEXT_ENCODER_PRECISION: captions encoded in 8 bits are cached
    apart, and the full-precision ones stay valid)."""
    key = feature_cache.component_key(source, text_dirs) + conditioning.text_cache_tag()
    precision = settings.text_encoder_precision
    return key if precision == "auto" else f"{key}:text-{precision}"


class Progress:
    """How far this node's caching is, on rank 0: a bar on a terminal, otherwise a log line
    each tenth of the work (and at least every EVERY_SECONDS), with the rate and an ETA."""

    EVERY_SECONDS = 60.0

    def __init__(
        self, images: int, texts: int, *, enabled: bool, stream: TextIO | None = None
    ) -> None:
        self.total, self.enabled = images + texts, enabled and images + texts > 0
        self.counts = {"images": 0, "captions": 0}
        self.totals = {"images": images, "captions": texts}
        self.started = self.logged = time.monotonic()
        self.tenths = 0
        stream = stream or sys.stderr
        tty = self.enabled and hasattr(stream, "isatty") and stream.isatty()
        self.bar = tqdm(total=self.total, desc="caching", unit="item", file=stream) if tty else None

    def images(self, count: int) -> None:
        self._advance("images", count)

    def texts(self, count: int) -> None:
        self._advance("captions", count)

    def _advance(self, kind: str, count: int) -> None:
        if not self.enabled:
            return
        self.counts[kind] += count
        if self.bar is not None:
            self.bar.update(count)
            return
        done = sum(self.counts.values())
        now = time.monotonic()
        if done * 10 // self.total > self.tenths or now - self.logged > self.EVERY_SECONDS:
            self.tenths, self.logged = done * 10 // self.total, now
            rate = done / max(now - self.started, 1e-9)
            parts = ", ".join(f"{self.counts[k]}/{n} {k}" for k, n in self.totals.items() if n)
            log.info(
                "caching: %d%% (%s) | %.2f items/s | ETA %s",
                100 * done // self.total, parts, rate,
                format_duration((self.total - done) / rate),
            )  # fmt: skip

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.enabled:
            log.info(
                "caching: %d items in %s",
                self.total,
                format_duration(time.monotonic() - self.started),
            )


def batch_items(
    items: list[feature_cache.CacheItem],
    keys: tuple[list[int], int],
    *,
    seed: int,
    caption_dropout: float,
) -> list[feature_cache.CacheItem]:
    """The cache items of one micro-batch, `keys` being its (item indices, epoch): a sample
    that drops its caption this epoch (captions.caption_dropped) reads the empty caption's cached
    embedding instead of its own, its latents unchanged."""
    indices, epoch = keys
    return [
        replace(items[i], caption="")
        if caption_dropped(seed, epoch, i, caption_dropout)
        else items[i]
        for i in indices
    ]


def _loader(item: Item, bucket: Bucket) -> Callable[[bool], feature_cache.Loaded]:
    def load(flip: bool) -> feature_cache.Loaded:
        example = load_example(item, bucket, flip=flip)
        ids = time_ids(example.original_size, example.crop_top_left, example.target_size)
        mask = None if example.mask is None else torch.from_numpy(example.mask)
        controls = None if example.controls is None else torch.from_numpy(example.controls)
        return torch.from_numpy(example.pixels), ids, mask, controls

    return load
