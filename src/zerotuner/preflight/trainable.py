"""What the optimizer trains: the whole UNet, or a LoRA adapter on a frozen base.

The planner counts the two apart. A trained parameter has weights in the run's dtype,
gradients and fp32 Adam states (master copy and two moments); a frozen one only its weights
(16-bit with mixed precision, fp32 without). The adapter's size comes from the UNet's layer
shapes and the same target rule the trainer uses (`lora.adapter_size`), on a UNet (and text
encoders) built on the meta device from the model's config: no weights read, nothing
downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from zerotuner.families import ModelShape

if TYPE_CHECKING:
    from zerotuner.settings.schema import Settings
    from zerotuner.weights.base_precision import StoredLayers


@dataclass(frozen=True)
class Training:
    type: Literal["full", "lora"]
    trainable_params: int  # with gradients and optimizer state
    largest_trainable: int  # elements of the biggest trained tensor (offload staging buffers)
    frozen_params: int  # base weights in the engine (UNet; text encoders with their LoRA)
    text_encoders: bool = False  # LoRA on the text encoders: they run in every step
    # the denoiser's layers a base stored in 8 bits keeps so (ZT_BASE_PRECISION); None where
    # the base cannot be stored so (full training, an init that rewrites the base)
    stored_base: StoredLayers | None = None

    @property
    def total_params(self) -> int:
        """Every parameter of the module DeepSpeed wraps (ZeRO-3 partitions them all)."""
        return self.trainable_params + self.frozen_params


def full_unet(shape: ModelShape) -> Training:
    return Training("full", shape.denoiser_params, shape.largest_param, 0)


def full_denoiser(shape: ModelShape, model_dir: Path | None = None) -> Training:
    """A full fine-tuning of this denoiser: all of it, less the part its family leaves frozen
    (`ModelFamily.trains`; LTX-2's audio stream), counted on the meta device."""
    from zerotuner.families import get, meta_model
    from zerotuner.families.base import ModelFamily

    kind = get(shape.family)
    if type(kind).trains is ModelFamily.trains:
        return full_unet(shape)
    model = meta_model(shape.family, model_dir)
    frozen = sum(p.numel() for n, p in model.named_parameters() if not kind.trains(n))
    return Training("full", shape.denoiser_params - frozen, shape.largest_param, frozen)


def lora_adapter(
    shape: ModelShape,
    *,
    rank: int,
    targets: tuple[str, ...],
    model_dir: Path | None = None,
    dora: bool = False,
) -> Training:
    """The adapter on this UNet (its own config when `model_dir` has one, else its family's
    built-in config) with the base frozen."""
    from zerotuner.families import meta_model
    from zerotuner.weights.base_precision import stored_layers
    from zerotuner.weights.lora import adapter_size, resolve_targets

    unet = meta_model(shape.family, model_dir)
    params, largest = adapter_size(unet, resolve_targets(unet, targets), rank, dora=dora)
    stored = stored_layers(unet)
    return Training("lora", params, largest, shape.denoiser_params, stored_base=stored)


def for_settings(settings: Settings, shape: ModelShape, model_dir: Path | None = None) -> Training:
    """What ZT_TRAINING_TYPE and the LoRA settings train on this UNet."""
    if settings.training_type != "lora":
        return full_denoiser(shape, model_dir)
    from zerotuner.weights.base_precision import INITS_REWRITING_BASE
    from zerotuner.weights.lora import parse_targets

    targets = parse_targets(settings.lora_targets)
    unet = lora_adapter(
        shape, rank=settings.lora_rank, targets=targets, model_dir=model_dir,
        dora=settings.lora_dora,  # a magnitude per output feature
    )  # fmt: skip
    if settings.lora_init in INITS_REWRITING_BASE:  # the base must stay writable
        unet = replace(unet, stored_base=None)
    if not settings.lora_text_encoder:
        return unet
    from zerotuner.weights import lora_text
    from zerotuner.weights.lora import adapter_size

    # the text encoders join the engine: their adapters train, their weights are frozen
    sizes = [
        adapter_size(encoder, lora_text.TEXT_TARGETS, settings.lora_rank, dora=settings.lora_dora)
        for encoder in lora_text.meta_encoders(shape.family, model_dir)
    ]
    return Training(
        "lora", unet.trainable_params + sum(params for params, _ in sizes),
        max(unet.largest_trainable, *(largest for _, largest in sizes)),
        unet.frozen_params + lora_text.text_params(shape.family, model_dir), text_encoders=True,
        stored_base=unet.stored_base,  # the denoiser's: the text encoders stay as they are
    )  # fmt: skip
