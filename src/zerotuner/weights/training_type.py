"""What differs between a full and a LoRA run (ZT_TRAINING_TYPE), behind one interface that the
training rank calls without asking which: the dtype the base loads in, what DeepSpeed trains,
what a checkpoint's manifest records, the weights a validation renders with, and the files the
run exports.

A full run trains the whole denoiser and exports a pipeline folder (pipeline_folder). A LoRA run
trains adapters added before ZeRO-3 partitions the model (lora, lora_text, lora_from) and
exports their files (lora_files).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerotuner.settings.schema import Settings
from zerotuner.weights import (
    base_precision,
    lora,
    lora_files,
    lora_from,
    lora_text,
    pipeline_folder,
)
from zerotuner.weights.ema import EMA, full_state_dict

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RenderWith:
    """The weights a validation's pipeline is built with: the trained denoiser's state, or the
    base's with the adapter folder loaded on it."""

    state: dict[str, torch.Tensor] | None
    lora_dir: Path | None = None
    base_precision: str = "auto"  # the base stored as the run stores it (ZT_BASE_PRECISION)


@dataclass(frozen=True)
class Exported:
    """What rank 0 wrote into OUTPUT/final (and final-ema), as the run's log names it."""

    files: str
    note: str | None = None  # how to load them, where not the usual way


class TrainedWeights(ABC):
    """What one rank trains, saves, renders and exports, for one training type."""

    adapter_only = False  # only the parameters that require grad are averaged (EMA)
    texts_trained = False  # the text encoders train: batches carry token ids, not embeddings

    def __init__(self, settings: Settings, family: str) -> None:
        self.settings, self.family = settings, family
        self.tokenizers: list[Any] = []  # set by prepare() when the text encoders train

    @abstractmethod
    def load_dtype(self, run_dtype: torch.dtype) -> torch.dtype:
        """The dtype the denoiser is loaded in."""

    @abstractmethod
    def check_base(self, source: Path, resume: Path | None, *, rank: int) -> None:
        """Once the base is loaded: refuse (exit 2) to resume onto another base than the
        checkpoint's. Every rank calls it."""

    @abstractmethod
    def prepare(
        self, denoiser: Any, *, source: Path, resume: Path | None, gradient_checkpointing: bool
    ) -> torch.nn.Module:
        """The module deepspeed.initialize gets; its parameters that require grad train."""

    @abstractmethod
    def manifest_entries(self) -> dict[str, Any]:
        """What a checkpoint's manifest records about the training type, so that a resume
        cannot mix a LoRA and a full run or two bases (lora.check_resume)."""

    @abstractmethod
    def to_render(
        self, module: torch.nn.Module, *, rank: int, source: Path, part: str | None
    ) -> contextlib.AbstractContextManager[RenderWith | None]:
        """The trained weights as a validation renders them (a collective): None on the ranks
        that do not render."""

    @abstractmethod
    def export(
        self, module: torch.nn.Module, *, rank: int, ema: EMA | None, source: Path, part: str | None
    ) -> Exported | None:
        """OUTPUT/final (and final-ema with `ema`) from the engine's module (a collective): what
        was written on rank 0, None on the others. `part`: the trained denoiser folder when not
        the family's own (Wan 2.2 A14B's expert)."""


class FullWeights(TrainedWeights):
    """ZT_TRAINING_TYPE=full: the whole denoiser trains from fp32 masters."""

    def load_dtype(self, run_dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def check_base(self, source: Path, resume: Path | None, *, rank: int) -> None:
        """Nothing to check: the checkpoint holds the whole denoiser, not an addition to it."""

    def prepare(
        self, denoiser: Any, *, source: Path, resume: Path | None, gradient_checkpointing: bool
    ) -> torch.nn.Module:
        """The denoiser, less what its family does not train (LTX-2's audio stream: frozen, so
        that weight decay leaves it as it was)."""
        from zerotuner import families

        kind = families.get(self.family)
        for name, param in denoiser.named_parameters():
            if not kind.trains(name):
                param.requires_grad_(False)
        return denoiser

    def manifest_entries(self) -> dict[str, Any]:
        return {"training_type": "full"}

    @contextlib.contextmanager
    def to_render(
        self, module: torch.nn.Module, *, rank: int, source: Path, part: str | None
    ) -> Iterator[RenderWith | None]:
        state = full_state_dict(module, rank=rank)
        yield None if state is None else RenderWith(state)

    def export(
        self, module: torch.nn.Module, *, rank: int, ema: EMA | None, source: Path, part: str | None
    ) -> Exported | None:
        state = full_state_dict(module, rank=rank)  # rank 0's only
        if state is None:
            return None
        out_dir = self.settings.output_dir
        out = pipeline_folder.write_pipeline(
            source, state, out_dir / "final", denoiser=part, family=self.family
        )
        if ema is not None:
            pipeline_folder.write_pipeline(
                source, ema.state_dict(), out_dir / "final-ema", denoiser=part, family=self.family
            )
        return Exported(f"{out}{' and final-ema' if ema else ''}")


class LoraWeights(TrainedWeights):
    """ZT_TRAINING_TYPE=lora: adapters train on the frozen base, which loads in the run's dtype
    (no fp32 copy of it) and, with ZT_BASE_PRECISION=fp8 or int8, keeps its blocks' Linear
    weights in 8 bits (base_precision): quantized again from the model's files by every run,
    never saved."""

    adapter_only = True

    def __init__(
        self, settings: Settings, family: str, adapter_file: lora_from.AdapterFile | None
    ) -> None:
        super().__init__(settings, family)
        self.adapter_file = adapter_file  # ZT_LORA_FROM's, read
        self.texts_trained = settings.lora_text_encoder
        self.base_digest: str | None = None  # sha256 of the base weights it sits on
        self.shapes: dict[str, tuple[int, ...]] = {}  # the adapter's, what its files must hold
        self.metadata: dict[str, Any] = {}  # its LoraConfig, as diffusers keeps it
        self.text_metadata: dict[str, Any] | None = None  # the text encoders' adapters'
        self.initial: dict[str, torch.Tensor] | None = None  # PiSSA / OLoRA's start

    def load_dtype(self, run_dtype: torch.dtype) -> torch.dtype:
        return run_dtype

    def check_base(self, source: Path, resume: Path | None, *, rank: int) -> None:
        self.base_digest = lora.base_for_resume(source, self.settings, resume, rank=rank)

    def prepare(
        self, denoiser: Any, *, source: Path, resume: Path | None, gradient_checkpointing: bool
    ) -> torch.nn.Module:
        s = self.settings
        if base_precision.is_low(s.base_precision):  # on the whole base, before the adapter
            log.info("%s", base_precision.quantize_frozen_base(denoiser, s.base_precision).line())
        metadata = lora.metadata(lora.lora_config(s, denoiser))  # the targets as it spells them
        lora.add_adapter(denoiser, s)
        if self.adapter_file is not None and resume:
            log.info("%s: not loaded, the checkpoint resumed continues it", lora_from.NAME)
        elif self.adapter_file is not None:
            lora_from.load_into(denoiser, self.adapter_file)
        self.initial = lora.initial_adapter(denoiser, s.lora_init)
        self.metadata = metadata
        trained = denoiser
        if self.texts_trained:
            trained, self.tokenizers = lora_text.build(
                denoiser, source, self.family, lora.adapter_settings(s), seed=s.seed,
                gradient_checkpointing=gradient_checkpointing,
            )  # fmt: skip
            self.text_metadata = lora.metadata(lora_text.text_config(lora.adapter_settings(s)))
        self.shapes = lora.shapes(trained)
        return trained

    def manifest_entries(self) -> dict[str, Any]:
        adapter = lora.adapter_settings(self.settings) | {"base_unet_sha256": self.base_digest}
        adapter |= base_precision.manifest_entry(self.settings)  # a resume stores it alike
        return {"training_type": "lora", "lora": adapter}

    @contextlib.contextmanager
    def to_render(
        self, module: torch.nn.Module, *, rank: int, source: Path, part: str | None
    ) -> Iterator[RenderWith | None]:
        """The base pipeline, its base stored as the run's, with the adapter as saved so far."""
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "adapter"
            written = self._write(module, rank=rank, out=out, source=source, part=part)
            precision = self.settings.base_precision
            yield RenderWith(None, lora_dir=out, base_precision=precision) if written else None

    def export(
        self, module: torch.nn.Module, *, rank: int, ema: EMA | None, source: Path, part: str | None
    ) -> Exported | None:
        s = self.settings
        final = s.output_dir / "final"
        merge_base = source if s.lora_merge else None  # ZT_LORA_MERGE: final/merged/ too
        written = self._write(
            module, rank=rank, out=final, source=source, part=part, merge_base=merge_base
        )
        if not written:
            return None
        if ema is not None:
            lora_files.write_adapter(
                self.family, ema.state_dict(), self.shapes, self.metadata,
                s.output_dir / "final-ema", text_metadata=self.text_metadata,
                initial=self.initial, denoiser=part, base=source,
            )  # fmt: skip
        merged = f" and {final / lora_files.MERGED}" if s.lora_merge else ""
        files = f"{final / lora_files.ADAPTER_FILE}{merged}{' and final-ema' if ema else ''}"
        if part != "transformer_2":
            return Exported(files)
        return Exported(  # diffusers' WanLoraLoaderMixin
            files,
            "the adapter is the low-noise expert's: load it with "
            "WanPipeline.load_lora_weights(final, load_into_transformer_2=True)",
        )

    def _write(
        self, module: torch.nn.Module, *, rank: int, out: Path, source: Path, part: str | None,
        merge_base: Path | None = None,
    ) -> bool:  # fmt: skip
        """The adapter gathered into `out` (a collective; True on rank 0, which wrote it)."""
        return lora_files.write_gathered(
            module, rank=rank, family=self.family, expected=self.shapes,
            adapter_metadata=self.metadata, out=out, text_metadata=self.text_metadata,
            merge_base=merge_base,
            initial=self.initial, denoiser=part, base=source,
        )  # fmt: skip


def for_settings(
    settings: Settings, family: str, adapter_file: lora_from.AdapterFile | None = None
) -> TrainedWeights:
    """The run's training type. `adapter_file`: ZT_LORA_FROM's, read (lora_from.apply)."""
    if settings.training_type == "lora":
        return LoraWeights(settings, family, adapter_file)
    return FullWeights(settings, family)
