"""ZT_LORA_FROM: a run whose adapter starts from an existing adapter file.

The file may be in the diffusers layout (`save_lora_weights`, its LoraConfig in the metadata),
kohya's (with diffusers' module names, or SDXL's original SGM/LDM ones as kohya's sd-scripts
writes them, `lora_unet_input_blocks_4_1_...`) or ComfyUI's: it is read the way
`load_lora_weights` reads it, by the family pipeline's own `lora_state_dict` (diffusers'
converters for kohya/ComfyUI names; for a UNet, the model's config numbers SGM blocks), then
turned into peft's keys and LoraConfig by diffusers' own steps of `load_lora_adapter`. Its rank,
alpha and targets (and DoRA, rsLoRA) become the run's settings, so the plan, the manifest and a
resume's checks see the adapter the run really has; a setting the user gave that says otherwise
is refused.

Preflight checks its layers and shapes against the model built on the meta device (as
`zerotuner export` checks an adapter); the ranks read the file again and copy it into the
freshly added adapter before `deepspeed.initialize`, so the fp32 masters (and ZeRO-3's
partitions) start from it on every rank. A checkpoint to resume wins: it holds the adapter
trained on from the file.

An `s3://bucket/key` or `hf://owner/repo[@revision]/path` file is fetched by preflight (on each
node, before the ranks start: preflight.fetch.fetch_adapter) into ZT_CACHE_DIR; `local_copy`
names that copy the same way on every rank, so the ranks never touch the network.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch

from zerotuner.errors import ConfigError
from zerotuner.settings.schema import Settings, env_name
from zerotuner.settings.urls import refuse_credentials

log = logging.getLogger(__name__)

NAME = env_name("lora_from")
FOLDER = "adapters"  # under ZT_CACHE_DIR: the fetched copies of s3:// adapter files
_S3 = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])/(?P<key>.+)$")
# huggingface_hub's HfFileSystem form: hf://[datasets/]owner/name[@revision]/path/in/repo
_HF = re.compile(
    r"^hf://(?P<type>datasets/)?(?P<repo>[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*)"
    r"(?:@(?P<rev>[\w.\-]+))?/(?P<path>.+)$"
)
FORMS = "a local file, s3://bucket/key or hf://owner/repo[@revision]/path/in/repo"


@dataclass(frozen=True)
class Remote:
    """An adapter file in a bucket (`s3`: bucket, key) or a hub repo (`hf`: repo, file path,
    revision; `dataset`: a dataset repo)."""

    kind: Literal["s3", "hf"]
    where: str
    key: str
    revision: str | None = None
    dataset: bool = False

    @property
    def url(self) -> str:
        if self.kind == "s3":
            return f"s3://{self.where}/{self.key}"
        at = f"@{self.revision}" if self.revision else ""
        return f"hf://{'datasets/' if self.dataset else ''}{self.where}{at}/{self.key}"

    def copy_path(self, cache_dir: Path) -> Path:
        """Where an S3 file's copy lives: a folder per URL, the key's last part as its name
        (preflight refuses a key whose parts are not plain names: fetch._writable)."""
        digest = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        name = self.key.rsplit("/", 1)[-1]
        if name in ("", ".", ".."):  # never a path outside the folder, whoever calls
            raise ConfigError(f"{NAME}={self.url}: the key does not end in a file name")
        return Path(cache_dir) / FOLDER / digest / name


def remote(text: str) -> Remote | None:
    """The URL ZT_LORA_FROM names, None for a local path; one line (exit 2) for a URL of no
    known form or one carrying credentials."""
    if "://" not in text:
        return None
    refuse_credentials(text, NAME)
    if match := _S3.match(text):
        return Remote("s3", match["bucket"], match["key"])
    if match := _HF.match(text):
        return Remote("hf", match["repo"], match["path"], match["rev"], bool(match["type"]))
    raise ConfigError(f"{NAME}={text}: not an adapter file's location; give {FORMS}")


def local_copy(text: str, cache_dir: Path) -> Path:
    """The file to read: the local path, or where preflight put the remote file (no network:
    the ranks read what their node's entrypoint fetched)."""
    found = remote(text)
    if found is None:
        return Path(text).expanduser()
    unfetched = ConfigError(
        f"{NAME}={text}: not fetched into ZT_CACHE_DIR; `zerotuner train` (and `check`, "
        "`config`) fetch it before the ranks start"
    )
    if found.kind == "s3":
        path = found.copy_path(cache_dir)
        if not path.is_file():
            raise unfetched
        return path
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from zerotuner.families import hub_cache_dir

    try:
        cached = hf_hub_download(
            found.where, found.key, revision=found.revision, local_files_only=True,
            repo_type="dataset" if found.dataset else None, cache_dir=hub_cache_dir(cache_dir),
        )  # fmt: skip
        return Path(cached)
    except LocalEntryNotFoundError:
        raise unfetched from None


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


def read(
    path_text: str, family: str, *, cache_dir: Path, model_dir: Path | None = None
) -> AdapterFile:
    """The file's denoiser adapter in peft's keys, with its LoraConfig; one line (exit 2) for a
    file that is not a readable, plain LoRA of this family's denoiser alone. `cache_dir`: where
    a remote file was fetched; `model_dir`: the model's folder (a UNet's config maps SGM
    names; None: the family's built-in config)."""
    from diffusers.utils import convert_unet_state_dict_to_peft
    from diffusers.utils.peft_utils import _create_lora_config
    from safetensors import SafetensorError, safe_open

    from zerotuner import families
    from zerotuner.weights import lora_layouts

    path = local_copy(path_text, cache_dir)
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
    fused = lora_layouts.fused_names(kind.comfy_lora)
    if any(part in fused for k in raw for part in k.split(".")):
        raise ConfigError(
            f"{where}: a {family} LoRA in ComfyUI's layout (its q, k and v fused), which "
            "diffusers cannot read back; give the run's diffusers file "
            "(pytorch_lora_weights.safetensors)"
        )
    pipeline = kind.pipeline_class()
    wanted: dict[str, Any] = {"return_lora_metadata": True}
    if "return_alphas" in inspect.signature(pipeline.lora_state_dict).parameters:
        wanted["return_alphas"] = True  # Flux's reader returns kohya's alphas only when asked
    if kind.denoiser == "unet":  # SGM block numbers (`input_blocks_4_1`) need layers_per_block
        wanted["unet_config"] = _unet_config(family, model_dir)
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


def _unet_config(family: str, model_dir: Path | None) -> SimpleNamespace:
    """The UNet's config as diffusers' SGM map reads it (attributes): the model's own, else the
    family's built-in one."""
    from zerotuner import families

    path = families.unet_config_path(model_dir, "unet") if model_dir else None
    if path is None:  # the built-in config, with the class's defaults for what it leaves out
        return SimpleNamespace(**families.meta_model(family).config)
    return SimpleNamespace(**families.get(family).denoiser_class().load_config(str(path.parent)))


def model_folder(settings: Settings) -> Path | None:
    """The model's folder as a rank finds it without the network: ZT_MODEL's local folder, or
    the hub snapshot whose configs preflight fetched (None: neither, the built-in config)."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    from zerotuner import families

    local = Path(settings.model).expanduser()
    if local.is_dir():
        return local
    try:
        hit = try_to_load_from_cache(
            settings.model, "unet/config.json", cache_dir=families.hub_cache_dir(settings.cache_dir)
        )
    except HFValidationError:
        return None
    return Path(hit).parents[1] if isinstance(hit, str) else None


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

    meta = copy.deepcopy(  # the file's adapter goes on it
        families.meta_model(family, model_dir, families.EXPERTS.get(settings.expert or ""))
    )
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
        targets = set(lora.parse_targets(settings.lora_targets))
        named = sorted(
            n for n, m in layers.items()
            if isinstance(m, lora.LORA_LAYERS) and not targets.isdisjoint(lora.suffixes(n))
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
    preflight accepted, and find the model's folder themselves: model_folder)."""
    if settings.training_type != "lora" or not settings.lora_from:
        return settings, None
    folder = model_dir if check else model_folder(settings)
    adapter = read(settings.lora_from, family, cache_dir=settings.cache_dir, model_dir=folder)
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
