"""The files a LoRA run writes: the adapter in diffusers' and kohya's layouts, and on request a
whole pipeline with the adapter fused into its UNet.

Under ZeRO-3 every parameter, frozen ones included, is a shard on each rank: the adapter is
gathered (fp32 masters) before it is written, and a file that would be empty or of the wrong
shapes (what `state_dict()` of a partitioned model yields) is refused. A folder is built beside
its destination and renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from zerotuner.lora import ADAPTER, make_config, metadata, shapes

log = logging.getLogger(__name__)

ADAPTER_FILE = "pytorch_lora_weights.safetensors"
# Not ending in ADAPTER_FILE: diffusers' `load_lora_weights(folder)` still picks the one above.
KOHYA_FILE = "pytorch_lora_weights_kohya.safetensors"
MERGED = "merged"  # final/merged/: the base pipeline with the adapter fused into its UNet


def check_adapter(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    """Refuse an adapter that is empty, partial or of the wrong shapes (a ZeRO-3 shard or
    placeholder saved as if it were the weight): no file beats a silently broken one."""
    if not state or not expected:
        raise RuntimeError("refusing to write an empty LoRA adapter (no adapter weights)")
    if state.keys() != expected.keys():
        missing = sorted(expected.keys() - state.keys())
        extra = sorted(state.keys() - expected.keys())
        raise RuntimeError(
            f"refusing to write a partial LoRA adapter: missing {missing[:3]}, unexpected "
            f"{extra[:3]}"
        )
    wrong = [
        f"{name} {tuple(t.shape)} (expected {expected[name]})"
        for name, t in state.items()
        if tuple(t.shape) != expected[name] or t.numel() == 0
    ]
    if wrong:
        raise RuntimeError(
            f"refusing to write a LoRA adapter with wrong shapes: {'; '.join(wrong[:3])}"
        )


def write_gathered(
    module: torch.nn.Module,
    *,
    rank: int,
    family: str,
    expected: dict[str, tuple[int, ...]],
    adapter_metadata: dict[str, Any],
    out: Path,
    merge_base: Path | None = None,
) -> bool:
    """The engine's adapter gathered from every rank and written by rank 0 into `out` (a
    collective; a refusal fails every rank, not only rank 0). True on rank 0."""
    from zerotuner.checkpoint import on_rank0
    from zerotuner.ema import trainable_state_dict

    state = trainable_state_dict(module, rank=rank)

    def write() -> None:
        assert state is not None
        write_adapter(family, state, expected, adapter_metadata, out, merge_base=merge_base)

    on_rank0(rank, write)
    return rank == 0


def peft_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Module parameter names to peft's saved names: the adapter name leaves the key
    (`...to_q.lora_A.default.weight` -> `...to_q.lora_A.weight`)."""
    return {name.replace(f".{ADAPTER}.", "."): t for name, t in state.items()}


def kohya(layers: dict[str, torch.Tensor], adapter: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The adapter in the kohya key format that ComfyUI, A1111 and diffusers read
    (`lora_unet_<module>.lora_down.weight`, `.lora_up.weight`, `.alpha`), from peft keys and
    the adapter's LoraConfig (`adapter`, as `metadata` gives it). kohya's scale is always
    alpha / rank: diffusers' converter writes every `.alpha` as the rank, so the true alpha is
    put back (rsLoRA's scale alpha / sqrt(rank) as the alpha alpha * sqrt(rank))."""
    from diffusers.utils import convert_state_dict_to_kohya

    converted = convert_state_dict_to_kohya({f"unet.{k}": v for k, v in layers.items()})
    rank = adapter["r"]
    alpha = adapter["lora_alpha"] * (math.sqrt(rank) if adapter.get("use_rslora") else 1.0)
    for key in converted:
        if key.endswith(".alpha"):
            converted[key] = torch.tensor(float(alpha))
    return {k: v.contiguous() for k, v in converted.items()}


def pipeline_class(family: str) -> Any:
    """The pipeline whose `save_lora_weights` writes this family's layout."""
    if family == "sdxl":
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline


def write_adapter(
    family: str,
    state: dict[str, torch.Tensor],
    expected: dict[str, tuple[int, ...]],
    adapter_metadata: dict[str, Any],
    out: Path,
    *,
    merge_base: Path | None = None,
) -> Path:
    """`out/pytorch_lora_weights.safetensors` (diffusers layout, metadata included) and its
    kohya copy, built in a folder beside `out` and renamed into place; refused when the adapter
    is not whole. With `merge_base`, also `out/merged/`: that pipeline with the adapter fused."""
    check_adapter(state, expected)
    # peft's key names, as diffusers' newer LoRA examples save them: its older `lora.down` /
    # `lora.up` names exist only for attention layers, and a file mixing both with conv or
    # feed-forward targets loads without those layers
    layers = peft_keys(state)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    pipeline_class(family).save_lora_weights(
        tmp,
        unet_lora_layers={k: v.contiguous() for k, v in layers.items()},
        unet_lora_adapter_metadata=adapter_metadata,
        weight_name=ADAPTER_FILE,
    )
    # DoRA has no kohya file: its readers disagree on `dora_scale` (diffusers drops it,
    # ComfyUI divides by the base weight's norm, not the adapted one's): a wrong image is worse
    if adapter_metadata and not adapter_metadata.get("use_dora"):
        save_file(kohya(layers, adapter_metadata), str(tmp / KOHYA_FILE))
    if merge_base is not None:
        from zerotuner.export import write_pipeline

        write_pipeline(merge_base, merged_unet_state(merge_base, state, adapter_metadata),
                       tmp / MERGED)  # fmt: skip
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def merged_unet_state(
    base: Path, state: dict[str, torch.Tensor], adapter_metadata: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The base UNet (fp32) with the adapter fused into its weights by peft's own merge (DoRA's
    magnitudes and rsLoRA's scale included), under the base UNet's parameter names."""
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig
    from peft.tuners.tuners_utils import BaseTunerLayer

    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet", dtype=torch.float32)
    unet.add_adapter(LoraConfig(**adapter_metadata), adapter_name=ADAPTER)
    _, unexpected = unet.load_state_dict(state, strict=False)
    if unexpected:
        raise RuntimeError(f"the adapter does not fit {base}/unet: unexpected {unexpected[:3]}")
    for module in unet.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge(adapter_names=[ADAPTER])
    return {
        name.replace(".base_layer.", "."): tensor.detach()
        for name, tensor in unet.state_dict().items()
        if ".lora_" not in name
    }


def export_checkpoint(
    checkpoint: Path,
    manifest: dict[str, Any],
    base: Path,
    out: Path,
    *,
    ema: bool = False,
    merged: bool = False,
) -> Path:
    """`zerotuner export` of a LoRA checkpoint: its adapter (consolidated from any stage and
    world size; `ema`: the EMA of it) as `out/pytorch_lora_weights.safetensors` (and with
    `merged`, `out/merged/`), checked against the shapes the manifest's adapter has on the base
    UNet (built on the meta device)."""
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    from zerotuner.export import checkpoint_unet_state

    config = make_config(manifest["lora"])
    with init_empty_weights():
        unet = UNet2DConditionModel.from_config(
            UNet2DConditionModel.load_config(base, subfolder="unet")
        )
    unet.requires_grad_(False)
    unet.add_adapter(config, adapter_name=ADAPTER)
    state = checkpoint_unet_state(checkpoint, ema=ema)
    adapter = {name: t for name, t in state.items() if ".lora_" in name}
    return write_adapter(
        manifest["family"], adapter, shapes(unet), metadata(config), out,
        merge_base=base if merged else None,
    )  # fmt: skip
