"""The adapter in the key layouts other tools load: kohya's (A1111, kohya's scripts, ComfyUI
for the UNet families) and ComfyUI's for every family (`families.base.ComfyLora` says which),
and a diffusers adapter file read back (`zerotuner export ADAPTER OUT`).

Strength. diffusers applies alpha / rank (alpha / sqrt(rank) with rsLoRA), from the file's
metadata. kohya's layout carries it as `.alpha` tensors, as kohya's readers expect. The other
layouts carry none: the scale is folded into `lora_B`, because several readers drop `.alpha`
or refuse it (diffusers' Flux.2 and Wan converters leave it unread outside some layers, its SD3
and plain loaders reject it) while ComfyUI and every diffusers path apply a file without it at
scale 1.
DoRA. ComfyUI reads `lora_magnitude_vector` as `<module>.dora_scale`, but scales
W + s B A by dora_scale / |W| (the base weight's row norm; comfy/weight_adapter/base.py
`weight_decompose`, ComfyUI v0.3.77) where peft divides by |W + s B A|: the file holds
m |W| / |W + s B A|, so ComfyUI computes peft's weight. That needs the base weights.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from zerotuner.errors import ConfigError
from zerotuner.families.base import ComfyLora

MAGNITUDE = ".lora_magnitude_vector.weight"  # peft's DoRA magnitude, as the diffusers file names it
TEXT_PREFIXES = {"text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}


def scale(adapter: dict[str, Any]) -> float:
    """peft's scale of a LoraConfig (as `metadata` gives it): alpha / rank, or alpha / sqrt(rank)
    with rsLoRA."""
    rank = adapter["r"]
    return adapter["lora_alpha"] / (math.sqrt(rank) if adapter.get("use_rslora") else rank)


def kohya(
    parts: dict[str, dict[str, torch.Tensor]], adapter: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The adapter in kohya's key format that ComfyUI, A1111 and diffusers read
    (`lora_unet_<module>.lora_down.weight`, `.lora_up.weight`, `.alpha`;
    `lora_te1_text_model_...` / `lora_te2_...` for the text encoders), from peft keys per part
    and the UNet adapter's LoraConfig (the text encoders' share its rank and alpha). kohya's
    scale is always alpha / rank: diffusers' converter writes every `.alpha` as the rank, so the
    one that gives peft's scale is put back (rsLoRA's: alpha * sqrt(rank))."""
    from diffusers.utils import convert_state_dict_to_kohya

    converted = convert_state_dict_to_kohya(
        {f"{part}.{k}": v for part, layers in parts.items() for k, v in layers.items()}
    )
    alpha = torch.tensor(scale(adapter) * adapter["r"])
    out = {}
    for key, tensor in converted.items():
        # transformers 5 builds CLIP without its `text_model` level, which kohya's names keep
        for prefix in TEXT_PREFIXES.values():
            if key.startswith(prefix) and not key.startswith(f"{prefix}text_model_"):
                key = f"{prefix}text_model_{key.removeprefix(prefix)}"
        out[key] = alpha.clone() if key.endswith(".alpha") else tensor.contiguous()
    return out


def comfy(
    layout: ComfyLora,
    parts: dict[str, dict[str, torch.Tensor]],
    adapter: dict[str, Any],
    base: dict[str, dict[str, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """pytorch_lora_weights_comfyui.safetensors: `parts` (peft keys per pipeline part) in the
    family's ComfyUI `layout`. `base`: each part's base weights by parameter name, needed for
    DoRA's magnitudes only (module docstring)."""
    magnitudes = {
        (part, k.removesuffix(MAGNITUDE)): v
        for part, layers in parts.items() for k, v in layers.items() if k.endswith(MAGNITUDE)
    }  # fmt: skip
    if magnitudes and base is None:
        raise RuntimeError("a DoRA adapter's ComfyUI file needs the base weights")
    plain = {
        p: {k: v for k, v in ls.items() if not k.endswith(MAGNITUDE)} for p, ls in parts.items()
    }
    s = scale(adapter)
    if layout.kohya:
        out = kohya(plain, adapter)
    else:
        out = {}
        stacks: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        counts: dict[str, int] = {}  # a fused layer's parts
        for part, layers in plain.items():
            for key, tensor in layers.items():
                module, _, rest = key.rpartition(".lora_")
                weight = tensor * s if rest.startswith("B.") else tensor  # the scale folded in
                name = comfy_name(layout, part, module)
                position = fused_position(layout, module)
                if position is None:
                    out[f"{name}.lora_{rest}"] = weight.contiguous()
                else:
                    stacks.setdefault(name, {}).setdefault(position[0], {})[rest] = weight
                    counts[name] = position[1]
        for name, stack in stacks.items():
            a, b = stacked(stack, counts[name])
            out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = a, b
    scales: dict[str, dict[int, torch.Tensor]] = {}
    for (part, module), m in magnitudes.items():
        assert base is not None  # refused above
        a, b = (plain[part][f"{module}.lora_{x}.weight"] for x in "AB")
        weight = base[part][f"{module}.weight"]
        position = fused_position(layout, module)
        scales.setdefault(comfy_name(layout, part, module), {})[position[0] if position else 0] = (
            dora_scale(m, weight, a, b, s)
        )
    for name, rows in scales.items():  # a fused layer's rows are its parts' rows, stacked
        out[f"{name}.dora_scale"] = torch.cat([rows[i] for i in sorted(rows)]).contiguous()
    return out


def partly_fused(layout: ComfyLora, modules: list[str]) -> list[str]:
    """The fused layers (`layout.fused`, by their ComfyUI names) of which `modules` adapt some
    parts but not all: a DoRA file has no `dora_scale` for them (ComfyUI scales the whole fused
    weight, and the parts not adapted would need the base weight's norms)."""
    seen: dict[str, set[int]] = {}
    counts: dict[str, int] = {}
    for module in modules:
        position = fused_position(layout, module)
        if position is not None:
            name = f"{layout.prefix}{original(module, layout)}"
            seen.setdefault(name, set()).add(position[0])
            counts[name] = position[1]
    return sorted(name for name, found in seen.items() if len(found) < counts[name])


def fused_names(layout: ComfyLora) -> set[str]:
    """The last parts of the fused layers' ComfyUI names (`img_attn_qkv`...): a file that has
    them is a ComfyUI file that diffusers' readers split wrongly (they take a fused `lora_A`
    for a weight)."""
    return {
        theirs.rsplit(".", 1)[-1]
        for ours, theirs in layout.renames
        if fused_position(layout, ours) is not None
    }


def fused_position(layout: ComfyLora, module: str) -> tuple[int, int] | None:
    """(index, count) of a layer that ComfyUI's model holds stacked with others in one weight
    (`layout.fused`), else None."""
    for group in layout.fused:
        for index, last in enumerate(group):
            if module == last or module.endswith(f".{last}"):
                return index, len(group)
    return None


def stacked(
    parts: dict[int, dict[str, torch.Tensor]], count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One LoRA (A, B) for a weight ComfyUI holds fused from `count` parts, from their LoRAs
    (`parts`: each position's `A.weight` / `B.weight`, the scale folded into B). Stacking the
    parts' updates B_i A_i by rows is blockdiag(B_0, B_1, ...) @ [A_0; A_1; ...]: a LoRA of the
    parts' summed ranks that ComfyUI's B @ A reproduces exactly (the zeros add nothing). A part
    not adapted is zero rows of B (its output unchanged). The parts are of one size (q, k, v)."""
    rest = {k for p in parts.values() for k in p} - {"A.weight", "B.weight"}
    if rest:
        raise RuntimeError(f"a fused layer's ComfyUI LoRA has no room for lora_{sorted(rest)[0]}")
    order = sorted(parts)
    ups = [parts[i]["B.weight"] for i in order]
    rows = ups[0].shape[0]
    if any(up.shape[0] != rows for up in ups):
        raise RuntimeError(f"a fused layer's parts differ in size: {[u.shape[0] for u in ups]}")
    b = ups[0].new_zeros(count * rows, sum(u.shape[1] for u in ups))
    column = 0
    for index, up in zip(order, ups, strict=True):
        b[index * rows : (index + 1) * rows, column : column + up.shape[1]] = up
        column += up.shape[1]
    return torch.cat([parts[i]["A.weight"] for i in order]).contiguous(), b


def comfy_name(layout: ComfyLora, part: str, module: str) -> str:
    """A module's name in the ComfyUI file (before `.lora_down.weight`, `.dora_scale`...)."""
    if not layout.kohya:
        return f"{layout.prefix}{original(module, layout)}"
    prefix = TEXT_PREFIXES[part] + "text_model_" if part in TEXT_PREFIXES else "lora_unet_"
    return prefix + module.replace(".", "_")


def original(module: str, layout: ComfyLora) -> str:
    """A diffusers module name in the original checkpoint's names (`layout.renames`: whole
    dotted parts, `*` any one part kept as it is)."""
    name = f".{module}."
    for ours, theirs in layout.renames:
        pattern = re.escape(f".{ours}.").replace(r"\*", r"([^.]+)")
        name = re.sub(pattern, f".{theirs}.".replace("*", r"\1"), name)
    return name[1:-1]


def dora_scale(
    magnitude: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float
) -> torch.Tensor:
    """The `dora_scale` with which ComfyUI's output-axis DoRA, m' (W + s B A) / |W|, is peft's
    m (W + s B A) / |W + s B A|: m |W| / |W + s B A| per output row, shaped (out, 1, ...) as
    ComfyUI broadcasts it (LyCORIS's layout)."""
    w = weight.double().flatten(1)
    adapted = w + s * (b.double().flatten(1) @ a.double().flatten(1))
    ratio = w.norm(dim=1) / adapted.norm(dim=1)
    shape = (-1, *[1] * (weight.dim() - 1))
    return (magnitude.double().reshape(-1) * ratio).reshape(shape).float().contiguous()


def base_weights(source: Path, part: str, names: list[str]) -> dict[str, torch.Tensor]:
    """`names` (parameter names) read from the pipeline folder's `part`, nothing else loaded."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for path in sorted((Path(source) / part).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in set(names) & set(f.keys()):
                found[name] = f.get_tensor(name)
    missing = sorted(set(names) - found.keys())
    if missing:
        raise RuntimeError(f"{source}/{part} has no {missing[:3]}: not the adapter's base")
    return found


def read_diffusers(path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """A diffusers adapter file (`save_lora_weights`' layout, its LoraConfig in the metadata):
    its tensors per pipeline part (prefix dropped) and each part's LoraConfig. Not one: one line
    (exit 2)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            header = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except (OSError, SafetensorError) as error:
        raise ConfigError(f"ADAPTER={path}: not a readable safetensors file ({error})") from None
    if "lora_adapter_metadata" not in header:
        raise ConfigError(
            f"ADAPTER={path}: no lora_adapter_metadata (its rank and alpha): not a diffusers "
            "adapter file saved by save_lora_weights"
        )
    flat = json.loads(header["lora_adapter_metadata"])
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        part, _, rest = key.partition(".")
        parts.setdefault(part, {})[rest] = tensor
    configs = {
        part: {k.removeprefix(f"{part}."): v for k, v in flat.items() if k.startswith(f"{part}.")}
        for part in parts
    }
    if not all(c.get("r") and "lora_alpha" in c for c in configs.values()):
        raise ConfigError(f"ADAPTER={path}: its metadata has no rank and alpha for {sorted(parts)}")
    return parts, configs
