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

from zerotuner import families
from zerotuner.settings.folders import readable_by_all
from zerotuner.weights import lora_layouts
from zerotuner.weights.lora import ADAPTER
from zerotuner.weights.pipeline_folder import load_part, write_pipeline

log = logging.getLogger(__name__)

ADAPTER_FILE = "pytorch_lora_weights.safetensors"
# Not ending in ADAPTER_FILE: diffusers' `load_lora_weights(folder)` still picks the one above.
KOHYA_FILE = "pytorch_lora_weights_kohya.safetensors"
COMFY_FILE = "pytorch_lora_weights_comfyui.safetensors"  # the layout ComfyUI loads (lora_layouts)
MERGED = "merged"  # final/merged/: the base pipeline with the adapter fused into its UNet
TEXT_PARTS = ("text_encoder", "text_encoder_2")
PARTS = ("unet", *TEXT_PARTS)  # diffusers' names, the prefixes of its adapter files' keys


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
    text_metadata: dict[str, Any] | None = None,
    merge_base: Path | None = None,
    initial: dict[str, torch.Tensor] | None = None,
    denoiser: str | None = None,
    base: Path | None = None,
) -> bool:
    """The engine's adapter gathered from every rank and written by rank 0 into `out` (a
    collective; a refusal fails every rank, not only rank 0). True on rank 0. `denoiser`,
    `base`: see write_adapter."""
    from zerotuner.weights.checkpoint import on_rank0
    from zerotuner.weights.ema import trainable_state_dict

    state = trainable_state_dict(module, rank=rank)

    def write() -> None:
        assert state is not None
        write_adapter(
            family, state, expected, adapter_metadata, out, text_metadata=text_metadata,
            merge_base=merge_base, initial=initial, denoiser=denoiser, base=base,
        )  # fmt: skip

    on_rank0(rank, write)
    return rank == 0


def peft_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Module parameter names to peft's saved names: the adapter name leaves the key
    (`...to_q.lora_A.default.weight` -> `...to_q.lora_A.weight`)."""
    return {name.replace(f".{ADAPTER}.", "."): t for name, t in state.items()}


def by_part(
    state: dict[str, torch.Tensor], denoiser: str = "unet"
) -> dict[str, dict[str, torch.Tensor]]:
    """The adapter's tensors per pipeline part, prefix dropped: a run without text encoder
    adapters trains the bare `denoiser` (the UNet, or a transformer family's `transformer`:
    names without a prefix); with them every name starts with its part (`unet.`,
    `text_encoder.`, `text_encoder_2.`: lora_text.TextAndUNet)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        part, _, rest = name.partition(".")
        if part not in PARTS:
            part, rest = denoiser, name
        parts.setdefault(part, {})[rest] = tensor
    return parts


def write_adapter(
    family: str,
    state: dict[str, torch.Tensor],
    expected: dict[str, tuple[int, ...]],
    adapter_metadata: dict[str, Any],
    out: Path,
    *,
    text_metadata: dict[str, Any] | None = None,
    merge_base: Path | None = None,
    initial: dict[str, torch.Tensor] | None = None,
    denoiser: str | None = None,
    base: Path | None = None,
) -> Path:
    """`out/pytorch_lora_weights.safetensors` (diffusers layout, metadata included), its kohya
    copy and its ComfyUI file (write_layouts), built in a folder beside `out` and renamed into
    place; refused when the adapter is not whole. `base`: the pipeline folder it was trained on
    (a DoRA adapter's ComfyUI file reads its weights; `merge_base` serves too).
    `text_metadata`: the text encoders' LoraConfig when they trained. With `merge_base`,
    also `out/merged/`: that pipeline with the adapter fused. `initial`: a PiSSA / OLoRA
    adapter's starting weights (see plain_lora). `denoiser`: the pipeline part the adapter is
    on when not the family's own (Wan 2.2 A14B's `transformer_2`): the file keeps
    the family's names (`transformer.`: WanPipeline.load_lora_weights(..., load_into_transformer_2=
    True) puts it on that expert), the merged pipeline fuses it into that part."""
    check_adapter(state, expected)
    if initial is not None:
        state, adapter_metadata = plain_lora(state, initial, adapter_metadata)
    # peft's key names, as diffusers' newer LoRA examples save them: its older `lora.down` /
    # `lora.up` names exist only for attention layers, and a file mixing both with conv or
    # feed-forward targets loads without those layers
    kind = families.get(family)
    parts = by_part(peft_keys(state), kind.denoiser)
    meta = {kind.denoiser: adapter_metadata} | {part: text_metadata for part in TEXT_PARTS}
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    kind.pipeline_class().save_lora_weights(
        tmp,
        weight_name=ADAPTER_FILE,
        **{f"{part}_lora_layers": {k: v.contiguous() for k, v in layers.items()}
           for part, layers in parts.items()},
        **{f"{part}_lora_adapter_metadata": meta[part] for part in parts},
    )  # fmt: skip
    write_layouts(tmp, kind, parts, adapter_metadata, base=base or merge_base, denoiser=denoiser)
    if merge_base is not None:
        target = denoiser or kind.denoiser  # the part the adapter is on
        merged = {}
        for part, layers in by_part(state, kind.denoiser).items():
            config = meta[part]
            assert config is not None  # text encoders' layers come with their text_metadata
            merged[part] = merged_state(
                merge_base, target if part == kind.denoiser else part, layers, config
            )
        unet = merged.pop(kind.denoiser)
        write_pipeline(merge_base, unet, tmp / MERGED, text_states=merged, denoiser=denoiser,
                       family=family)  # fmt: skip
    readable_by_all(tmp)  # safetensors writes 0600: the adapter is for other users too
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def write_layouts(
    folder: Path,
    kind: Any,
    parts: dict[str, dict[str, torch.Tensor]],
    adapter: dict[str, Any],
    *,
    base: Path | None = None,
    denoiser: str | None = None,
) -> None:
    """Beside the diffusers file in `folder`: the kohya file (UNet families) and the ComfyUI
    file (every family, `kind.comfy_lora`'s layout), from peft keys per part. DoRA has no kohya
    file: its readers disagree on `dora_scale` (diffusers drops it), and a wrong image is worse;
    its ComfyUI file needs the `base` pipeline (Wan 2.2 A14B: the `denoiser` expert's folder)."""
    dora = any(k.endswith(lora_layouts.MAGNITUDE) for ls in parts.values() for k in ls)
    if kind.comfy_lora.kohya and not dora:
        save_file(lora_layouts.kohya(parts, adapter), str(folder / KOHYA_FILE))
    weights = None
    if dora:
        if base is None:
            log.warning("no %s for this DoRA adapter: its base pipeline is not known", COMFY_FILE)
            return
        modules = [k.removesuffix(lora_layouts.MAGNITUDE) for ls in parts.values() for k in ls
                   if k.endswith(lora_layouts.MAGNITUDE)]  # fmt: skip
        partly = lora_layouts.partly_fused(kind.comfy_lora, modules)
        if partly:
            log.warning("no %s for this DoRA adapter: it adapts only some of the layers ComfyUI "
                        "holds fused as %s", COMFY_FILE, partly[0])  # fmt: skip
            return
        folders = {kind.denoiser: denoiser or kind.denoiser}  # the text encoders' are their names
        weights = {
            part: lora_layouts.base_weights(
                base, folders.get(part, part),
                [k.replace(lora_layouts.MAGNITUDE, ".weight") for k in layers
                 if k.endswith(lora_layouts.MAGNITUDE)],
            )
            for part, layers in parts.items()
        }  # fmt: skip
    comfy = lora_layouts.comfy(kind.comfy_lora, parts, adapter, weights)
    save_file(comfy, str(folder / COMFY_FILE))


def plain_lora(
    state: dict[str, torch.Tensor], initial: dict[str, torch.Tensor], adapter: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A PiSSA / OLoRA adapter as the plain LoRA that turns the published base into the trained
    model. Such an adapter starts at (A0, B0) taken from the base weights, which keep
    W - s B0 A0; trained to (A, B) the model is W + s (B A - B0 A0) = W + s [B, -B0] [A; A0]: a
    LoRA of rank 2r with the same scale s (peft's own conversion for save_pretrained), so its
    alpha doubles (rsLoRA's s = alpha / sqrt(r): times sqrt 2)."""
    out = {k: v for k, v in state.items() if ".lora_A." not in k and ".lora_B." not in k}
    for key, a in state.items():
        if ".lora_A." in key:
            b = key.replace(".lora_A.", ".lora_B.")
            out[key] = torch.cat([a, initial[key].to(a.dtype)], dim=0)
            out[b] = torch.cat([state[b], -initial[b].to(state[b].dtype)], dim=1)
    grow = math.sqrt(2) if adapter.get("use_rslora") else 2.0
    return out, adapter | {
        "r": 2 * adapter["r"], "lora_alpha": adapter["lora_alpha"] * grow,
        "init_lora_weights": True,
    }  # fmt: skip


def merged_state(
    base: Path, part: str, state: dict[str, torch.Tensor], adapter_metadata: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The base pipeline's `part` (fp32) with its adapter (module names, no prefix) fused into
    its weights by peft's own merge (DoRA's magnitudes and rsLoRA's scale included), under the
    base's parameter names."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import BaseTunerLayer

    module = load_part(base, part)
    module.add_adapter(LoraConfig(**adapter_metadata), adapter_name=ADAPTER)
    _, unexpected = module.load_state_dict(state, strict=False)
    if unexpected:
        raise RuntimeError(f"the adapter does not fit {base}/{part}: unexpected {unexpected[:3]}")
    for layer in module.modules():
        if isinstance(layer, BaseTunerLayer):
            layer.merge(adapter_names=[ADAPTER])
    return {
        name.replace(".base_layer.", "."): tensor.detach()
        for name, tensor in module.state_dict().items()
        if ".lora_" not in name
    }
