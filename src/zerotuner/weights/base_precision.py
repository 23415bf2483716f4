"""The frozen base of a LoRA run stored at a lower precision (ZT_BASE_PRECISION).

A LoRA run trains only the adapter: the base weights are read, never written, so they can be
stored in 8 bits and upcast layer by layer for each matmul, as every peer trainer does. The
storage is torchao's weight-only quantization (`quantize_`): `fp8` is float8 e4m3 with a scale
per output channel (`Float8WeightOnlyConfig`, PerRow), `int8` symmetric int8 with a scale per
output channel (`Int8WeightOnlyConfig`, PerRow); the matmul runs in the layer's own dtype (the
run's). peft wraps such a layer with its `TorchaoLoraLinear`; the adapter stays at the run's
precision (DeepSpeed's fp32 masters).

Which layers are stored so (`stored_low`): the Linear layers of the repeated blocks, as the
references do: musubi-tuner's fp8 storage takes the transformer blocks' Linear weights only
and leaves out every `norm` (so also the modulation Linear of an adaptive norm);
SimpleTuner's quanto lists keep the norms, embedders (`x_embedder`, `context_embedder`,
`time_text_embed`, `pos_embed`, `condition_embedder`), `proj_out` and `norm_out` at full
precision, and its torchao filter takes only nn.Linear layers whose dimensions are multiples of
16; diffusers' TorchAoConfig quantizes nn.Linear only. So convolutions, embeddings, norms, the
layers outside the blocks (time and caption embedders, the input and final projections) and
the small layers keep the run's precision.

Each stored layer upcasts its weight for its own matmul only, in the forward and again in the
backward (`StoredLinear`): left to autograd, the upcast copy that a layer's forward makes would
be saved for the backward's input gradient, and from the forward to the backward every stored
layer's weight would be held at the run's precision again, beside its 8-bit one (measured on
bench's 596M-parameter SDXL-shaped UNet in bf16: 490 MiB of such copies, none with it).

The quantized weights become non-persistent buffers (`_as_buffers`): DeepSpeed then neither
casts them, nor broadcasts them, nor saves them in a checkpoint (the base is no trained state:
a resume quantizes it again from the model's files), and `deepspeed.initialize`'s move to the
device does not trip over them (see there). ZeRO-3 is refused: its partitioned weights cannot
be quantized, and a quantized base would sit whole on every rank anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerotuner.errors import ConfigError
from zerotuner.settings.schema import Settings, env_name
from zerotuner.weights import zero_init


@dataclass(frozen=True)
class Storage:
    """Bytes a stored layer takes: per weight element, and per output channel (its fp32
    scale; torchao's Int8Tensor also keeps an int8 zero point per row, all zeros)."""

    per_parameter: int
    per_row: int


# The planner's bytes and the measured ones (tests/test_base_precision.py) come from this table.
STORAGE = {"fp8": Storage(per_parameter=1, per_row=4), "int8": Storage(per_parameter=1, per_row=5)}
LOW_PRECISIONS = tuple(STORAGE)
TILE = 16  # both dimensions a multiple of it (SimpleTuner's torchao filter)
INITS_REWRITING_BASE = ("pissa", "olora")  # peft moves part of each base weight into the adapter


@dataclass(frozen=True)
class BaseBytes:
    """The frozen base's storage at one precision: measured (quantize_frozen_base) or planned
    from the layers' shapes (planned_bytes, a meta-device model will do)."""

    precision: str
    layers: int  # Linear layers stored at `precision`
    kept_layers: int  # Linear layers kept at the run's precision
    quantized_params: int  # their weights' elements
    quantized_before: int  # bytes of those weights at the run's precision
    quantized_after: int  # ... as stored (8-bit values and scales)
    before: int  # bytes of the whole module's parameters and buffers
    after: int
    largest_upcast: int  # bytes of the largest stored weight upcast for its matmul

    @property
    def saved(self) -> int:
        """Bytes the low storage saves against the run's precision."""
        return self.quantized_before - self.quantized_after

    def line(self, subject: str = "frozen base") -> str:
        return (
            f"{subject} stored at {self.precision}: {self.layers} Linear layers "
            f"({self.quantized_params / 1e6:.1f}M parameters; {self.kept_layers} kept at the "
            f"run's precision), {_size(self.before)} -> {_size(self.after)}"
        )


def _size(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def is_low(precision: str) -> bool:
    return precision in LOW_PRECISIONS


def stored_low(name: str, module: torch.nn.Module) -> bool:
    """Whether a layer is stored at the low precision: a plain Linear inside a repeated block
    (a numbered part in its path), of no norm, both dimensions multiples of TILE."""
    if type(module) is not torch.nn.Linear:  # a peft wrapper or a subclass of its own
        return False
    return storable(name, module.out_features, module.in_features)


def storable(name: str, out_features: int, in_features: int) -> bool:
    """stored_low's rule for a Linear layer's name and sides."""
    parts = name.split(".")
    return (
        any(p.isdigit() for p in parts)
        and not any("norm" in p.lower() for p in parts)
        and in_features % TILE == 0
        and out_features % TILE == 0
    )


@dataclass(frozen=True)
class StoredLayers:
    """The layers a low base stores (`stored_low`), from the module's shapes alone (a
    meta-device model will do): what the planner counts at each precision."""

    layers: int  # Linear layers stored low
    linears: int  # every plain Linear layer of the module
    params: int  # elements of the stored layers' weights
    rows: int  # their output channels: a scale each
    largest: int  # elements of the largest stored weight
    total: int  # elements of every parameter and buffer of the module

    def at(self, precision: str, run_bytes: int) -> BaseBytes:
        """The base's bytes stored at `precision` (`run_bytes`: bytes per element of the run's
        precision, what every other parameter and buffer keeps; `auto` stores nothing low)."""
        if not is_low(precision):
            whole = self.total * run_bytes
            return BaseBytes(precision, 0, self.linears, 0, 0, 0, whole, whole, 0)
        storage = STORAGE[precision]
        stored = self.params * storage.per_parameter + self.rows * storage.per_row
        return BaseBytes(
            precision=precision,
            layers=self.layers,
            kept_layers=self.linears - self.layers,
            quantized_params=self.params,
            quantized_before=self.params * run_bytes,
            quantized_after=stored,
            before=self.total * run_bytes,
            after=(self.total - self.params) * run_bytes + stored,
            largest_upcast=self.largest * run_bytes,
        )


def stored_layers(module: torch.nn.Module) -> StoredLayers:
    low = [m for n, m in module.named_modules() if stored_low(n, m)]
    return StoredLayers(
        layers=len(low),
        linears=sum(1 for m in module.modules() if type(m) is torch.nn.Linear),
        params=sum(m.weight.numel() for m in low),
        rows=sum(m.out_features for m in low),
        largest=max((m.weight.numel() for m in low), default=0),
        total=sum(t.numel() for t in (*module.parameters(), *module.buffers())),
    )


TEXT_FOLDERS = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")  # HiDream: 4


def stored_text(family: str, model_dir: Path | None = None) -> StoredLayers | None:
    """What ZT_TEXT_ENCODER_PRECISION stores low of the family's text encoders, for the
    planner: from `model_dir`'s safetensors headers (every 2-D `.weight` stored_low's rule
    takes, headers naming no module types: an embedding inside a numbered block counts too,
    none of the encoders has a large one), else from the published encoders' counts (their
    output channels, a scale each, left out: under 0.1 % of the bytes); None where neither is
    known (the planner counts them at the run's precision)."""
    from zerotuner.families import REGISTRY

    folders = [model_dir / f for f in TEXT_FOLDERS] if model_dir is not None else []
    folders = [f for f in folders if (f / "config.json").is_file()]
    if folders:
        return _stored_from_headers(folders)
    spec = REGISTRY[family]
    if spec.text_kept_params is None:
        return None
    stored = spec.text_params - spec.text_kept_params
    return StoredLayers(0, 0, stored, 0, 0, spec.text_params)


def _stored_from_headers(folders: list[Path]) -> StoredLayers | None:
    from safetensors import safe_open

    from zerotuner.families.stored import weight_files

    shapes: list[tuple[str, list[int]]] = []
    for folder in folders:
        files = weight_files(folder)
        if not files:
            return None
        for path in files:
            with safe_open(str(path), framework="numpy") as weights:
                shapes += [(k, weights.get_slice(k).get_shape()) for k in weights.keys()]  # noqa: SIM118 - safe_open is no dict
    linear = [(k, s) for k, s in shapes if k.endswith(".weight") and len(s) == 2]
    low = [s for k, s in linear if storable(k.removesuffix(".weight"), s[0], s[1])]
    return StoredLayers(
        layers=len(low), linears=len(linear), params=sum(o * i for o, i in low),
        rows=sum(o for o, _ in low), largest=max((o * i for o, i in low), default=0),
        total=sum(math.prod(s) for _, s in shapes),
    )  # fmt: skip


def planned_bytes(module: torch.nn.Module, precision: str, run_bytes: int) -> BaseBytes:
    """The base's bytes at `precision` from the shapes alone (`run_bytes`: bytes per parameter
    of the run's precision, what every other parameter and buffer keeps)."""
    return stored_layers(module).at(precision, run_bytes)


def quantize_frozen_base(
    module: torch.nn.Module, precision: str, *, setting: str = "base_precision"
) -> BaseBytes:
    """Store `module`'s blocks' Linear weights at `precision` (in place) and say what it
    measured. Call it on the loaded model, at the run's dtype (each layer computes in its
    weight's dtype), before the LoRA adapter is added and before deepspeed.initialize.
    `setting`: the one that asked for it (ZT_TEXT_ENCODER_PRECISION's text encoders too)."""
    if not is_low(precision):
        raise ValueError(f"not a low precision: {precision}")
    if zero_init.partitioned(module):
        raise ConfigError(
            f"{env_name(setting)}={precision}: the model was built partitioned "
            f"(ZeRO-3), and its weights cannot be quantized so; set {env_name('zero_stage')} "
            "to 0-2"
        )
    if any(p.requires_grad and ".lora_" in n for n, p in module.named_parameters()):
        raise ValueError("quantize the base before the LoRA adapter is added")
    from torchao.quantization import quantize_  # type: ignore[import-untyped]

    low = [(n, m) for n, m in module.named_modules() if stored_low(n, m)]
    linears = sum(1 for m in module.modules() if type(m) is torch.nn.Linear)
    weights = [m.weight for _, m in low]
    before, quantized_before = _bytes(module), sum(_tensor_bytes(w) for w in weights)
    largest = max((_tensor_bytes(w) for w in weights), default=0)
    del weights
    wanted = {id(m) for _, m in low}
    quantize_(module, _config(precision), filter_fn=lambda m, _name: id(m) in wanted)
    _as_buffers(m for _, m in low)
    for _, layer in low:
        layer.__class__ = StoredLinear  # the same layer, its forward upcasting per matmul
    return BaseBytes(
        precision=precision,
        layers=len(low),
        kept_layers=linears - len(low),
        quantized_params=sum(m.in_features * m.out_features for _, m in low),
        quantized_before=quantized_before,
        quantized_after=sum(_tensor_bytes(m.weight) for _, m in low),
        before=before,
        after=_bytes(module),
        largest_upcast=largest,
    )


def _config(precision: str) -> Any:
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, PerRow

    # set_inductor_config=False: torchao would otherwise change torch._inductor's global
    # settings for the whole process (ZT_COMPILE compiles the blocks with their defaults)
    if precision == "fp8":
        return Float8WeightOnlyConfig(
            weight_dtype=torch.float8_e4m3fn, granularity=PerRow(), set_inductor_config=False
        )
    return Int8WeightOnlyConfig(granularity=PerRow(), set_inductor_config=False)


class _UpcastMatmul(torch.autograd.Function):
    """`F.linear(x, weight, bias)` with `weight` stored low and frozen: what the backward keeps
    is the stored weight (no copy), upcast again for the input's gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
        ctx.save_for_backward(weight)
        return torch.nn.functional.linear(x, weight, bias)  # torchao upcasts inside

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (weight,) = ctx.saved_tensors
        grad_x = grad @ weight.dequantize(grad.dtype) if ctx.needs_input_grad[0] else None
        grad_bias = grad.flatten(0, -2).sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias


class StoredLinear(torch.nn.Linear):
    """A Linear layer whose weight is stored low (quantize_frozen_base makes them): its upcast
    copy lives for one matmul, not from the forward to the backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not x.requires_grad:
            return super().forward(x)
        return _UpcastMatmul.apply(x, self.weight, self.bias)


def _as_buffers(layers: Any) -> None:
    """Each quantized weight from a parameter to a non-persistent buffer of the same name, so
    that `layer.weight` still reads it (F.linear, peft's TorchaoLoraLinear). DeepSpeed (0.19)
    keeps a weakref.finalize on every parameter it is given a module with, and torch's
    `Module.to` replaces a tensor-subclass parameter by swapping it, which a weakref'd tensor
    refuses: `deepspeed.initialize` would fail on its move to the device. Buffers are replaced
    by assignment; DeepSpeed does not cast them (its buffer_dtype is unset) or broadcast them,
    and a non-persistent one is in no state_dict, so no checkpoint."""
    for layer in layers:
        weight = layer.weight.detach()
        del layer.weight
        layer.register_buffer("weight", weight, persistent=False)


def _tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds: a torchao tensor's are its inner tensors' (values and scales)."""
    names = [
        *getattr(tensor, "tensor_data_names", ()),
        *(getattr(tensor, "optional_tensor_data_names", None) or ()),
    ]
    if not names:
        return tensor.numel() * tensor.element_size()
    inner = (getattr(tensor, n, None) for n in names)
    return sum(t.numel() * t.element_size() for t in inner if isinstance(t, torch.Tensor))


def _bytes(module: torch.nn.Module) -> int:
    return sum(_tensor_bytes(t) for t in (*module.parameters(), *module.buffers()))


# --- settings -------------------------------------------------------------------------------


def settings_problems(settings: Settings) -> list[str]:
    """ZT_BASE_PRECISION and ZT_TEXT_ENCODER_PRECISION against the other settings, one line
    each (lora.check_settings)."""
    return _text_problems(settings) + _base_problems(settings)


def _text_problems(settings: Settings) -> list[str]:
    """Text encoders stored low only to encode: a LoRA on them writes through their weights."""
    precision = settings.text_encoder_precision
    if not is_low(precision) or not settings.lora_text_encoder:
        return []
    name, train = env_name("text_encoder_precision"), env_name("lora_text_encoder")
    return [
        f"{name}={precision} with {train}=true: text encoders that train are kept at the run's "
        f"precision; set {name}=auto or unset {train}"
    ]


def _base_problems(settings: Settings) -> list[str]:
    precision = settings.base_precision
    if not is_low(precision):
        return []
    name = f"{env_name('base_precision')}={precision}"
    auto = f"{env_name('base_precision')}=auto"
    if settings.training_type == "full":
        return [
            f"{name} with {env_name('training_type')}=full: full training writes the base "
            f"weights, and a base stored at {precision} is read-only; set "
            f"{env_name('training_type')}=lora or {auto}"
        ]
    problems = []
    if settings.zero_stage == 3:
        problems.append(stage_problem(precision, f"{env_name('zero_stage')}=3"))
    if settings.offload_param in ("cpu", "nvme"):
        pin = f"{env_name('offload_param')}={settings.offload_param}"
        problems.append(offload_problem(precision, pin))
    if settings.lora_init in INITS_REWRITING_BASE:
        problems.append(
            f"{name} with {env_name('lora_init')}={settings.lora_init}: it moves part of each "
            f"base weight into the adapter, and a base stored at {precision} is read-only; set "
            f"{env_name('lora_init')}=gaussian or {auto}"
        )
    return problems


def stage_problem(precision: str, stage: str) -> str:
    return (
        f"{env_name('base_precision')}={precision} with {stage}: ZeRO-3 partitions the base "
        f"weights, and DeepSpeed cannot partition a base stored at {precision}; set "
        f"{env_name('zero_stage')} to 0-2 (with {env_name('offload_optimizer')} if it must "
        f"fit) or {env_name('base_precision')}=auto"
    )


def offload_problem(precision: str, pin: str) -> str:
    return (
        f"{env_name('base_precision')}={precision} with {pin}: parameter offload is ZeRO-3's, "
        f"and DeepSpeed cannot partition a base stored at {precision}; set "
        f"{env_name('offload_param')}=none (the optimizer may still be offloaded) or "
        f"{env_name('base_precision')}=auto"
    )


def check_stage(settings: Settings, zero_stage: int) -> None:
    """The stage the plan chose (ZT_ZERO_STAGE=auto, or a DeepSpeed config's) against
    ZT_BASE_PRECISION."""
    if settings.training_type == "lora" and is_low(settings.base_precision) and zero_stage == 3:
        raise ConfigError(stage_problem(settings.base_precision, "ZeRO-3 (the plan's stage)"))


def manifest_entry(settings: Settings) -> dict[str, str]:
    """What a LoRA checkpoint's manifest records (under `lora`), so that a resume stores the
    base as the checkpoint's run did."""
    return {"base_precision": settings.base_precision}


def check_resume(manifest: dict[str, Any], settings: Settings, path: Path) -> None:
    """Refuse (exit 2, one line) to resume a LoRA checkpoint trained on a base stored at
    another precision (checkpoints from before the setting: `auto`)."""
    if settings.training_type != "lora":
        return
    saved = manifest.get("lora", {}).get("base_precision", "auto")
    if saved != settings.base_precision:
        raise ConfigError(
            f"{env_name('base_precision')}={settings.base_precision}: the checkpoint to resume "
            f"({path}) trained its adapter on a base stored at {saved}; set it back to "
            f"continue, or {env_name('resume')}=never or another {env_name('output_dir')} to "
            "start afresh"
        )
