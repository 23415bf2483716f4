"""ZT_LORA_FROM: a run whose adapter starts from an existing adapter file.

The file may be in the diffusers layout (`save_lora_weights`, its LoraConfig in the metadata),
kohya's or ComfyUI's: it is read the way `load_lora_weights` reads it, by the family pipeline's
own `lora_state_dict` (diffusers' converters for kohya/ComfyUI names), then turned into peft's
keys and LoraConfig by diffusers' own steps of `load_lora_adapter`. Its rank, alpha and targets
(and DoRA, rsLoRA) become the run's settings, so the plan, the manifest and a resume's checks
see the adapter the run really has; a setting the user gave that says otherwise is refused.

Preflight checks its layers and shapes against the model built on the meta device (as
`zerotuner export` checks an adapter); the ranks read the file again and copy it into the
freshly added adapter before `deepspeed.initialize`, so the fp32 masters (and ZeRO-3's
partitions) start from it on every rank. A checkpoint to resume wins: it holds the adapter
trained on from the file.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerotuner.errors import ConfigError
from zerotuner.settings.schema import Settings, env_name

log = logging.getLogger(__name__)

NAME = env_name("lora_from")


@dataclass(frozen=True)
class AdapterFile:
    path: Path
    state: dict[str, torch.Tensor]  # peft keys on the denoiser (`<module>.lora_A.weight`)
    config: Any  # peft's LoraConfig, as diffusers builds it for this file

    @property
    def modules(self) -> list[str]:
        return sorted({k.split(".lora_")[0] for k in self.state})

    def values(self) -> dict[str, Any]:
        """The settings this adapter fixes (field name -> value)."""
        return {
            "lora_rank": self.config.r,
            "lora_alpha": float(self.config.lora_alpha),
            "lora_targets": ",".join(self.modules),  # whole names: exactly the file's layers
            "lora_dora": bool(self.config.use_dora),
            "lora_rslora": bool(self.config.use_rslora),
        }


def read(path_text: str, family: str) -> AdapterFile:
    """The file's denoiser adapter in peft's keys, with its LoraConfig; one line (exit 2) for a
    file that is not a local, readable, plain LoRA of this family's denoiser alone."""
    from diffusers.utils import convert_unet_state_dict_to_peft
    from diffusers.utils.peft_utils import _create_lora_config
    from safetensors import SafetensorError, safe_open

    from zerotuner import families

    if "://" in path_text:
        raise ConfigError(
            f"{NAME}={path_text}: only a local adapter file is taken yet; download it and give "
            "its path (mounted into the container)"
        )
    path = Path(path_text).expanduser()
    where = f"{NAME}={path_text}"
    try:
        with safe_open(str(path), "pt") as f:
            raw = list(f.keys())
    except (OSError, SafetensorError) as error:
        raise ConfigError(f"{where}: not a readable safetensors file ({error})") from None
    # diffusers drops ComfyUI's `dora_scale` (with a warning) and would train on a plain LoRA
    if any(k.endswith(".dora_scale") for k in raw):
        raise ConfigError(
            f"{where}: a DoRA file in ComfyUI's layout (dora_scale), which diffusers cannot "
            "read back; give the run's diffusers file (pytorch_lora_weights.safetensors)"
        )
    kind = families.get(family)
    pipeline = kind.pipeline_class()
    wanted = {"return_lora_metadata": True}
    if "return_alphas" in inspect.signature(pipeline.lora_state_dict).parameters:
        wanted["return_alphas"] = True  # Flux's reader returns kohya's alphas only when asked
    try:
        result = pipeline.lora_state_dict(str(path), **wanted)
    except Exception as error:  # noqa: BLE001 - a converter's refusal of a foreign layout
        raise ConfigError(
            f"{where}: not a LoRA file diffusers reads for a {family} model "
            f"({type(error).__name__}: {str(error).splitlines()[0][:200]})"
        ) from None
    state, metadata = result[0], result[-1]
    alphas = result[1] if len(result) == 3 else None
    prefix = kind.denoiser
    parts = sorted({k.split(".")[0] for k in state})
    if any(p.startswith("text_encoder") for p in parts):
        raise ConfigError(
            f"{where}: holds text-encoder layers ({', '.join(parts)}); {NAME} takes an adapter "
            f"of the {prefix} alone yet"
        )
    if parts != [prefix]:
        raise ConfigError(
            f"{where}: its layers are a {', '.join(parts) or 'nothing'}'s, not a {family} "
            f"model's {prefix}: an adapter for another model family"
        )
    # what diffusers' load_lora_adapter does with it (loaders/peft.py), up to the LoraConfig
    state = {k.removeprefix(f"{prefix}."): v for k, v in state.items()}
    if metadata:
        metadata = {k.removeprefix(f"{prefix}."): v for k, v in metadata.items()}
    if "lora_A" not in next(iter(state)):
        state = convert_unet_state_dict_to_peft(state)
    ranks = {f"^{k}": v.shape[1] for k, v in state.items() if "lora_B" in k and v.ndim > 1}
    if alphas:
        alphas = {k.removeprefix(f"{prefix}."): v for k, v in alphas.items()}
    config = _create_lora_config(state, alphas or None, metadata or None, ranks)
    if config.rank_pattern or config.alpha_pattern:
        raise ConfigError(
            f"{where}: its layers have different ranks or alphas; {NAME} takes an adapter of "
            "one rank and one alpha"
        )
    if config.init_lora_weights not in (True, "gaussian"):  # a PiSSA/OLoRA run's own config
        config.init_lora_weights = "gaussian"  # the file's weights are the start, not the base's
    return AdapterFile(path, state, config)


def check_settings(settings: Settings, adapter: AdapterFile) -> None:
    """A LoRA setting the user gave that the file contradicts: one line (exit 2)."""
    set_ = settings.model_fields_set
    for name, value in adapter.values().items():
        if name == "lora_targets" or name not in set_:
            continue  # the targets are checked against the model (check_model)
        given = getattr(settings, name)
        given = settings.lora_rank if name == "lora_alpha" and given is None else given
        if given != value:
            raise ConfigError(
                f"{env_name(name)}={_shown(given)}: {NAME}={settings.lora_from} is an adapter "
                f"with {name.removeprefix('lora_')} {_shown(value)}; unset {env_name(name)} "
                "(the file's rank, alpha and targets are the run's)"
            )
    if settings.lora_init != "gaussian":
        raise ConfigError(
            f"{env_name('lora_init')}={settings.lora_init}: {NAME} starts the adapter from the "
            f"file's weights; unset {env_name('lora_init')}"
        )


def _shown(value: Any) -> str:
    if isinstance(value, bool):  # as the variable is written
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_model(
    settings: Settings, adapter: AdapterFile, family: str, model_dir: Path | None
) -> None:
    """The file's layers and shapes against the model (built on the meta device: no weights),
    and ZT_LORA_TARGETS, if given, against the layers it names there."""
    from zerotuner import families
    from zerotuner.weights import lora

    meta = families.meta_model(family, model_dir, families.EXPERTS.get(settings.expert or ""))
    where = f"{NAME}={settings.lora_from}"
    layers = dict(meta.named_modules())
    alien = [m for m in adapter.modules if m not in layers]
    if alien:
        raise ConfigError(
            f"{where}: {alien[0]} is not a layer of this {family} model's "
            f"{families.get(family).denoiser} ({len(alien)} of {len(adapter.modules)} layers "
            "are not): an adapter for another model family"
        )
    meta.requires_grad_(False)
    meta.add_adapter(adapter.config, adapter_name=lora.ADAPTER)
    expected = {k.replace(f".{lora.ADAPTER}.", "."): s for k, s in lora.shapes(meta).items()}
    for key, tensor in adapter.state.items():
        if expected.get(key) != tuple(tensor.shape):
            raise ConfigError(
                f"{where}: {key} is {tuple(tensor.shape)} and this model's layer takes "
                f"{expected.get(key)}: an adapter for another model family or size"
            )
    if "lora_targets" in settings.model_fields_set:
        targets = lora.parse_targets(settings.lora_targets)
        named = sorted(
            n for n, m in layers.items()
            if isinstance(m, lora.LORA_LAYERS) and any(lora._matches(n, t) for t in targets)
        )  # fmt: skip
        if named != adapter.modules:
            raise ConfigError(
                f"{env_name('lora_targets')}={settings.lora_targets}: names {len(named)} layers "
                f"of this model and {where} adapts {len(adapter.modules)}, not the same; unset "
                f"{env_name('lora_targets')} (the file's rank, alpha and targets are the run's)"
            )


def apply(
    settings: Settings,
    family: str,
    *,
    model_dir: Path | None = None,
    check: bool = True,
) -> tuple[Settings, AdapterFile | None]:
    """The settings with the file's rank, alpha and targets (unchanged without ZT_LORA_FROM),
    and the file read. `check`: against the model too (preflight; the ranks read a file
    preflight accepted)."""
    if settings.training_type != "lora" or not settings.lora_from:
        return settings, None
    adapter = read(settings.lora_from, family)
    check_settings(settings, adapter)
    if check:
        check_model(settings, adapter, family, model_dir)
    return settings.model_copy(update=adapter.values()), adapter


@torch.no_grad()
def load_into(module: torch.nn.Module, adapter: AdapterFile) -> None:
    """The file's weights into the adapter `lora.add_adapter` just put on `module` (every rank,
    before deepspeed.initialize: DeepSpeed takes its fp32 masters and ZeRO-3 partitions from
    these). Gathered first, should a parameter be partitioned already."""
    import deepspeed

    from zerotuner.weights.lora import ADAPTER

    named = {
        n.replace(f".{ADAPTER}.", "."): p for n, p in module.named_parameters() if ".lora_" in n
    }
    if named.keys() != adapter.state.keys():
        missing = sorted(named.keys() ^ adapter.state.keys())
        raise ConfigError(f"{NAME}={adapter.path}: does not fit this model ({missing[:3]})")
    with deepspeed.zero.GatheredParameters(list(named.values()), modifier_rank=0):
        for key, param in named.items():
            param.copy_(adapter.state[key].to(param.dtype))
    log.info(
        "the adapter starts from %s: %d layers, rank %d, alpha %g",
        adapter.path, len(adapter.modules), adapter.config.r, adapter.config.lora_alpha,
    )  # fmt: skip
