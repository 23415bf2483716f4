"""The latent and text-embedding cache: the frozen VAE and text encoders run once per input.

Entries live under `ZT_CACHE_DIR/features/` as one safetensors file each, named by a digest of
everything the tensor depends on:
- a latent: the VAE (its config and weight files), the image file (relative path and a
  digest of its bytes, and its mask's and control images') and its bucket -- so a changed
  image, control, resolution or bucket re-encodes only that image; an edit model's control
  images are encoded into the same entry (`control_latents`: controls x the latents' shape);
- a text embedding: the text encoders and tokenizers, and the caption; a family whose text
  encoder also reads the control images (Qwen-Image-Edit) caches its captions' states in the
  latent entry instead (`captions_per_item`: the caption and the text key in its name).
Each node's first rank encodes the node's share of the missing entries (round-robin), writes
them atomically, and after a barrier every rank reads any entry from the shared folder. A
restart finds them all and loads no VAE at all; `CacheStats` says how many were encoded and
reused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import torch
from safetensors.torch import load_file, save_file

from zerotuner.data.buckets import Bucket

log = logging.getLogger(__name__)

ENCODE_BATCH = 8  # images or captions per encoder call while caching
T = TypeVar("T")
# What CacheItem.load gives: pixels, time ids and, optionally, the loss mask and the control
# images (None: none).
Loaded = (
    tuple[torch.Tensor, torch.Tensor]
    | tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
    | tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
)

# What else a family caches of a batch beside its latents: (pixels, captions, control images
# (batch, controls, C, H, W) or None) -> tensors by name, each batch-first
Conditions = Callable[[torch.Tensor, list[str], torch.Tensor | None], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class CacheItem:
    """One training example as the cache sees it. `load(flip)` reads the bucketed image:
    (C, H, W) tensor in [-1, 1], SDXL's time ids (original size, crop, target size) and,
    optionally third, its loss mask (1, H, W) in [0, 1] (cached at the latents' size) and
    fourth its control images (controls, C, H, W) in [-1, 1], cropped and flipped with it."""

    name: str  # path relative to the data dir: stable across mounts
    content: str  # a digest of the image file's bytes (and its mask's and controls')
    caption: str
    bucket: Bucket  # target (w, h) in pixels, a clip's (w, h, frames)
    load: Callable[[bool], Loaded]


@dataclass
class CacheStats:
    latents_encoded: int = 0
    latents_reused: int = 0
    texts_encoded: int = 0
    texts_reused: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def component_key(source: Path, subfolders: Iterable[str]) -> str:
    """A digest of frozen components: their config text and their weight files' size/mtime."""
    digest = hashlib.sha256()
    for sub in subfolders:
        folder = source / sub
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            real = path.resolve()
            if not real.is_file():
                continue
            digest.update(f"{sub}/{path.name}".encode())
            if real.suffix in (".json", ".txt"):
                digest.update(real.read_bytes())
            else:
                stat = real.stat()
                digest.update(f"{stat.st_size}-{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def _none(count: int) -> None:
    pass


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


class FeatureCache:
    """Cached latents and text embeddings for one model; see the module docstring."""

    def __init__(
        self, root: Path, *, vae_key: str, text_key: str, flip: bool,
        captions_per_item: bool = False,
    ) -> None:  # fmt: skip
        self.root = root / "features"
        self.vae_key, self.text_key, self.flip = vae_key, text_key, flip
        self.captions_per_item = captions_per_item

    def latent_path(self, item: CacheItem) -> Path:
        texts = [self.text_key, item.caption] if self.captions_per_item else []
        key = _digest(
            "latent", self.vae_key, item.name, item.content, item.bucket, self.flip, *texts
        )
        return self.root / "latents" / key[:2] / f"{key}.safetensors"

    def text_path(self, caption: str) -> Path:
        key = _digest("text", self.text_key, caption)
        return self.root / "text" / key[:2] / f"{key}.safetensors"

    def missing(
        self, items: list[CacheItem], extra_captions: Iterable[str] = ()
    ) -> tuple[list[int], list[str]]:
        """Indices of items without latents, and captions without embeddings (sorted, unique);
        `extra_captions` are cached too (the empty caption of ZT_CAPTION_DROPOUT)."""
        latents = [i for i, item in enumerate(items) if not self.latent_path(item).is_file()]
        captions = sorted({item.caption for item in items} | set(extra_captions))
        if self.captions_per_item:  # in the latent entries
            captions = []
        texts = [c for c in captions if not self.text_path(c).is_file()]
        return latents, texts

    def encode_latents(
        self,
        items: list[CacheItem],
        encode: Callable[[torch.Tensor], torch.Tensor],
        progress: Callable[[int], None] = _none,
        conditions: Conditions | None = None,
    ) -> None:
        """Encode (and write) the given items, batching images of the same bucket;
        `progress(n)` after each batch of n images; `conditions`: what else the family caches
        of a batch's pixels, captions and control images, beside its latents (Wan I2V's first
        frame's condition latents, Qwen-Image-Edit's captions' states)."""
        rows: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        by_bucket: dict[Bucket, list[CacheItem]] = {}
        for item in items:
            by_bucket.setdefault(item.bucket, []).append(item)
        for group in by_bucket.values():
            for start in range(0, len(group), ENCODE_BATCH):
                chunk = group[start : start + ENCODE_BATCH]
                variants = [False, True] if self.flip else [False]
                for flip in variants:
                    loaded = [item.load(flip) for item in chunk]
                    pixels = torch.stack([pixels for pixels, *_ in loaded])
                    latents = encode(pixels)
                    given = [extra[1] if len(extra) > 1 else None for _, _, *extra in loaded]
                    images = torch.stack(given) if None not in given else None  # type: ignore[arg-type]
                    captions = [item.caption for item in chunk]
                    extra = conditions(pixels, captions, images) if conditions is not None else {}
                    controls = _encode_controls([extra for _, _, *extra in loaded], encode)
                    suffix = "_flipped" if flip else ""
                    for i, (_, time_ids, *mask) in enumerate(loaded):
                        row = rows[chunk[i].name]
                        row[f"latents{suffix}"] = latents[i].contiguous()
                        row[f"time_ids{suffix}"] = time_ids
                        if mask and mask[0] is not None:
                            row[f"mask{suffix}"] = latent_mask(mask[0], latents[i].shape[-2:])
                        if (control := controls[i]) is not None:
                            row[f"control_latents{suffix}"] = control
                        for key, values in extra.items():
                            row[f"{key}{suffix}"] = values[i].contiguous()
                for item in chunk:
                    _save(rows.pop(item.name), self.latent_path(item))
                progress(len(chunk))

    def encode_texts(
        self,
        captions: list[str],
        encode: Callable[[list[str]], dict[str, torch.Tensor]],
        progress: Callable[[int], None] = _none,
    ) -> None:
        for start in range(0, len(captions), ENCODE_BATCH):
            chunk = captions[start : start + ENCODE_BATCH]
            embeds = encode(chunk)
            for i, caption in enumerate(chunk):
                _save({k: v[i].contiguous() for k, v in embeds.items()}, self.text_path(caption))
            progress(len(chunk))

    def load_batch(
        self,
        items: list[CacheItem],
        generator: torch.Generator | None = None,
        *,
        texts: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Stack the cached tensors of a batch; with flip on, each image is mirrored at random
        (its pre-encoded mirror image), decided by `generator` so resumed runs match. `texts`
        False: latents and time ids only (the captions were not cached)."""
        rows: list[dict[str, torch.Tensor]] = []
        for item in items:
            row = load_file(self.latent_path(item))
            if self.flip:
                mirrored = torch.rand((), generator=generator).item() < 0.5  # CPU generator
                for key in [k.removesuffix("_flipped") for k in row if k.endswith("_flipped")]:
                    flipped = row.pop(f"{key}_flipped")
                    row[key] = flipped if mirrored else row[key]
            if texts and not self.captions_per_item:
                row.update(load_file(self.text_path(item.caption)))
            rows.append(row)
        if any("mask" in row for row in rows):  # an image without a mask trains everywhere
            for row in rows:
                row.setdefault("mask", torch.ones(1, *row["latents"].shape[-2:]))
        return {key: torch.stack([r[key] for r in rows]) for key in rows[0]}


def latent_cache_bytes(
    buckets: dict[tuple[int, ...], list[int]],
    *,
    channels: int,
    scale: int,
    frame_step: int | None,
    flip: bool,
    controls: int = 0,
) -> int:
    """What the cached latents of these buckets take on disk (fp32, as `encode_latents` writes
    them; a mirror image each with ZT_RANDOM_FLIP): each item once however often it repeats,
    a clip's frames folded by the VAE's temporal step, an edit family's `controls` beside each
    image at its size."""
    total = 0
    for bucket, indices in buckets.items():
        w, h, frames = (*bucket, 1) if len(bucket) == 2 else bucket
        latent_frames = (frames - 1) // frame_step + 1 if frame_step else 1
        total += len(set(indices)) * channels * latent_frames * (h // scale) * (w // scale) * 4
    return total * (2 if flip else 1) * (1 + controls)


def _encode_controls(
    extras: list[list[torch.Tensor | None]], encode: Callable[[torch.Tensor], torch.Tensor]
) -> list[torch.Tensor | None]:
    """Each item's control images (what its load gave after the mask) as latents, (controls,
    c, h, w), encoded in one call: a chunk shares its bucket."""
    controls = [extra[1] if len(extra) > 1 else None for extra in extras]
    given = [c for c in controls if c is not None]
    if not given:
        return controls
    latents = iter(encode(torch.cat(given)).split([len(c) for c in given]))
    return [None if c is None else next(latents).contiguous() for c in controls]


def latent_mask(mask: torch.Tensor, size: torch.Size) -> torch.Tensor:
    """A (1, H, W) pixel mask as the share of each latent cell it covers: (1, h, w)."""
    import torch.nn.functional as F

    return F.interpolate(mask[None].float(), size=tuple(size), mode="area")[0].contiguous()


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write then rename, so a reader (another rank, a restart) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def share(indices: list[T], rank: int, world: int) -> list[T]:
    """This rank's round-robin share of a list every rank computed identically."""
    return indices[rank::world]
