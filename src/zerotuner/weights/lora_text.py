"""LoRA on the text encoders too (ZT_LORA_TEXT_ENCODER): what DeepSpeed trains is then the UNet
and the family's text encoders side by side, each with its adapter.

The module keeps diffusers' pipeline names for its parts (`unet`, `text_encoder`,
`text_encoder_2`), so its parameter names carry the prefixes the adapter files use, and the
same code gathers, checks and writes them. Captions cannot come from the feature cache (the
embeddings change as the encoders train): batches carry token ids, and the encoders run in
every forward, under the same ZeRO stage, precision and offload as the UNet (their frozen base
in 16-bit with mixed precision, partitioned at ZeRO-3). The targets are the attention
projections, as diffusers' SDXL DreamBooth LoRA example trains them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zerotuner import families
from zerotuner.families import REGISTRY
from zerotuner.families.base import ModelFamily

TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
# (layers, hidden size) of the published text encoders (CLIP ViT-L, OpenCLIP ViT-bigG and
# ViT-H): the planner sizes their adapters before anything is downloaded
BUILTIN_TEXT_ENCODERS: dict[str, tuple[tuple[int, int], ...]] = {
    "sdxl": ((12, 768), (32, 1280)),
    "sd1": ((12, 768),),
    "sd2": ((23, 1024),),
}


class TextAndUNet(torch.nn.Module):
    """The UNet and the text encoders under their pipeline names; `forward` takes token ids
    where the UNet takes embeddings, and otherwise the UNet's arguments."""

    def __init__(self, unet: Any, encoders: list[Any], conditioning: ModelFamily) -> None:
        super().__init__()
        self.unet = unet
        self.encoder_names = [folder for folder, _ in conditioning.text_subfolders]
        for name, encoder in zip(self.encoder_names, encoders, strict=True):
            self.add_module(name, encoder)
        self.conditioning = conditioning

    def forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor,
        *,
        input_ids: torch.Tensor,
        batch: dict[str, torch.Tensor],
    ) -> Any:
        encoders = [getattr(self, name) for name in self.encoder_names]
        embeds = self.conditioning.embed(encoders, input_ids.to(sample.device))
        kwargs = self.conditioning.model_kwargs(batch | embeds, sample.dtype)
        return self.unet(sample, timestep, **kwargs)


class TrainedText:
    """The loop's conditioning when the encoders train: the batch goes to `TextAndUNet` as
    token ids plus the cached rest (time ids), not as embeddings."""

    def __init__(self, conditioning: ModelFamily) -> None:
        self.conditioning = conditioning

    def model_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        rest = {k: v for k, v in batch.items() if k not in ("latents", "input_ids")}
        return {"input_ids": batch["input_ids"], "batch": rest}


def text_config(adapter: dict[str, Any]) -> Any:
    """The text encoders' LoraConfig: the UNet adapter's rank, alpha and variants on the
    attention projections."""
    from zerotuner.weights.lora import make_config

    return make_config(adapter | {"targets": list(TEXT_TARGETS)})


def add_text_adapters(encoders: list[Any], adapter: dict[str, Any], *, seed: int) -> None:
    """Freeze each encoder and add its adapter, seeded like the UNet's (every rank alike)."""
    from zerotuner.weights.lora import ADAPTER

    config = text_config(adapter)
    for index, encoder in enumerate(encoders):
        encoder.requires_grad_(False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1 + index)
            encoder.add_adapter(config, adapter_name=ADAPTER)


def build(
    unet: Any, source: Path, family: str, adapter: dict[str, Any], *, seed: int,
    gradient_checkpointing: bool,
) -> tuple[TextAndUNet, list[Any]]:  # fmt: skip
    """The trained module (the UNet already carries its adapter) and the tokenizers."""
    conditioning = families.get(family)
    encoders, tokenizers = conditioning.load_text(source, dtype=torch.float32)
    add_text_adapters(encoders, adapter, seed=seed)
    for encoder in encoders:
        if gradient_checkpointing:  # non-reentrant: the encoders' inputs need no gradient
            encoder.gradient_checkpointing_enable({"use_reentrant": False})
        encoder.train()
    return TextAndUNet(unet, encoders, conditioning), tokenizers


def meta_module(unet: Any, source: Path, family: str, adapter: dict[str, Any]) -> TextAndUNet:
    """`build` on the meta device from the configs alone (export's shapes)."""
    encoders = meta_encoders(family, source)
    add_text_adapters(encoders, adapter, seed=0)
    return TextAndUNet(unet, encoders, families.get(family))


def _local_folders(family: str, model_dir: Path | None) -> tuple[str, ...] | None:
    """The family's text encoder folders when `model_dir` has a config in each, else None."""
    folders = tuple(folder for folder, _ in families.get(family).text_subfolders)
    if model_dir is None or not all((model_dir / f / "config.json").is_file() for f in folders):
        return None
    return folders


def meta_encoders(family: str, model_dir: Path | None = None) -> list[Any]:
    """The family's text encoders on the meta device (no weights): of `model_dir`'s configs
    when it has them all, else of the published encoders' layer shapes, so the planner sizes
    their adapters (`lora.adapter_size`) before anything is downloaded."""
    import transformers
    from accelerate import init_empty_weights

    folders = _local_folders(family, model_dir)
    if model_dir is not None and folders is not None:  # folders: only with a model_dir
        configs = [transformers.AutoConfig.from_pretrained(model_dir, subfolder=f) for f in folders]
    else:  # CLIP's heads are 64 wide and its MLP 4x: only q, k, v and out matter here
        configs = [
            transformers.CLIPTextConfig(
                num_hidden_layers=layers,
                hidden_size=hidden,
                intermediate_size=4 * hidden,
                num_attention_heads=hidden // 64,
            )
            for layers, hidden in BUILTIN_TEXT_ENCODERS[family]
        ]
    encoders = []
    for config in configs:
        arch = (config.architectures or ["CLIPTextModel"])[0]
        with init_empty_weights():
            encoders.append(getattr(transformers, arch)(config))
    return encoders


def text_params(family: str, model_dir: Path | None = None) -> int:
    """The text encoders' (frozen) parameters: `model_dir`'s when it has their configs, else
    the published encoders'."""
    folders = _local_folders(family, model_dir)
    if folders is None:
        return REGISTRY[family].text_params
    from zerotuner.families import frozen_params

    return frozen_params(model_dir, parts=folders)  # type: ignore[arg-type]
