"""The seed's configuration methods 2 and 3: a raw DeepSpeed JSON and an accelerate config.

Both become one starting DeepSpeed dict (`UserInputs.deepspeed`) plus the launch settings the
accelerate file implies (processes, machines, rank, address). High-level `ZT_*` settings the
user set explicitly win over both; `deepspeed_config.normalize` reports each override.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerotuner.errors import ConfigError
from zerotuner.settings.files import MAX_INT, check_values, load_mapping, parse_json, read_text
from zerotuner.settings.notes import Notes
from zerotuner.settings.offload_path import NvmePath, resolve_offload_dir, user_nvme_path
from zerotuner.settings.schema import Settings, env_name, file_errors

DS_SETTING = env_name("deepspeed_config")
ACCELERATE_SETTING = env_name("accelerate_config")

# accelerate's deepspeed_config keys -> where they live in a DeepSpeed config.
ACCELERATE_DS_KEYS: dict[str, tuple[str, ...]] = {
    "zero_stage": ("zero_optimization", "stage"),
    "gradient_accumulation_steps": ("gradient_accumulation_steps",),
    "gradient_clipping": ("gradient_clipping",),
    "offload_optimizer_device": ("zero_optimization", "offload_optimizer", "device"),
    "offload_param_device": ("zero_optimization", "offload_param", "device"),
    "offload_optimizer_nvme_path": ("zero_optimization", "offload_optimizer", "nvme_path"),
    "offload_param_nvme_path": ("zero_optimization", "offload_param", "nvme_path"),
    "zero3_save_16bit_model": ("zero_optimization", "stage3_gather_16bit_weights_on_model_save"),
}
# Understood, and handled by zerotuner itself.
ACCELERATE_HANDLED = {
    "zero3_init_flag": "zerotuner loads the UNet itself; the flag is not needed",
    "deepspeed_multinode_launcher": "zerotuner launches nodes with torchrun",
    "deepspeed_hostfile": "zerotuner launches nodes with torchrun",
}


@dataclass(frozen=True)
class UserInputs:
    deepspeed: dict[str, Any]  # the DeepSpeed config to start from ({} when none was given)
    source: str | None  # where it came from, for messages
    settings: dict[str, Any] = field(default_factory=dict)  # implied by the accelerate file
    notes: Notes = field(default_factory=Notes)
    nvme: NvmePath | None = None  # a real nvme_path: the offload dir, unless ZT_OFFLOAD_DIR says


def read_user_inputs(settings: Settings) -> UserInputs:
    notes = Notes()
    deepspeed: dict[str, Any] = {}
    sources = []
    implied: dict[str, Any] = {}
    layers = []  # each file's DeepSpeed dict and how its nvme_path keys read in a message
    if settings.accelerate_config is not None:
        accel_ds, implied = _read_accelerate(settings.accelerate_config, notes)
        deepspeed = accel_ds
        sources.append(f"{ACCELERATE_SETTING}={settings.accelerate_config}")
        layers.append((accel_ds, f"{{key}}_nvme_path in {sources[-1]}"))
    if settings.deepspeed_config is not None:
        raw, where = _read_deepspeed(settings.deepspeed_config)
        if deepspeed:
            notes.info(f"{DS_SETTING} is applied over the accelerate config's DeepSpeed fields")
        deepspeed = _merge(deepspeed, raw)
        sources.append(where)
        layers.append((raw, f"zero_optimization.{{key}}.nvme_path in {where}"))
    source = " + ".join(sources) or None
    return UserInputs(deepspeed, source, implied, notes, user_nvme_path(layers))


def _read_deepspeed(value: str | dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Inline JSON text, a path to a JSON file, or a mapping from the config file."""
    if isinstance(value, dict):
        where = "the config file's deepspeed_config block"
        check_values(value, source=where)  # read by files.py already, unless passed in code
        return value, where
    text = value.strip()
    if text.startswith("{"):
        data, where = parse_json(text, source=DS_SETTING), f"{DS_SETTING} (inline JSON)"
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
        return data, where
    path = Path(text)
    return _read_deepspeed_file(path, setting=DS_SETTING), f"{DS_SETTING}={path}"


def _read_deepspeed_file(path: Path, *, setting: str) -> dict[str, Any]:
    where = f"{setting}={path}"
    with file_errors(setting, path):
        data = parse_json(read_text(path, setting=setting), source=where)
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_accelerate(path: Path, notes: Notes) -> tuple[dict[str, Any], dict[str, Any]]:
    with file_errors(ACCELERATE_SETTING, path):
        data = load_mapping(path, setting=ACCELERATE_SETTING)
    where = f"{ACCELERATE_SETTING}={path}"
    kind = str(data.get("distributed_type", "DEEPSPEED")).upper()
    if kind != "DEEPSPEED":
        notes.warn(f"{where}: distributed_type is {kind}; zerotuner always trains with DeepSpeed")
    ds_block = data.get("deepspeed_config") or {}
    if not isinstance(ds_block, dict):
        raise ConfigError(f"{where}: deepspeed_config must be a mapping")
    deepspeed: dict[str, Any] = {}
    config_file = ds_block.get("deepspeed_config_file")
    if config_file is not None and str(config_file).strip().lower() not in ("none", "null", ""):
        setting = f"{where}: deepspeed_config.deepspeed_config_file"
        if not isinstance(config_file, str):
            raise ConfigError(f"{setting}={config_file!r}: expected the path of a DeepSpeed JSON")
        file = Path(config_file.strip())
        if not file.is_absolute():
            file = path.parent / file
        deepspeed = _read_deepspeed_file(file, setting=setting)
        notes.info(f"{where}: DeepSpeed config read from {file}")
    for key, value in ds_block.items():
        if key == "deepspeed_config_file":
            continue
        if key in ACCELERATE_DS_KEYS:
            if value is None or (key.endswith("_device") and str(value).lower() == "none"):
                continue
            _set(deepspeed, ACCELERATE_DS_KEYS[key], value)
        elif key in ACCELERATE_HANDLED:
            notes.info(f"{where}: deepspeed_config.{key}: {ACCELERATE_HANDLED[key]}")
        else:
            notes.warn(f"{where}: deepspeed_config.{key} is not an accelerate key; ignored")
    precision = data.get("mixed_precision")
    if precision is not None:
        precision = str(precision).lower()
        if precision not in ("no", "fp16", "bf16"):
            raise ConfigError(f"{where}: mixed_precision={precision!r}: expected no, fp16 or bf16")
        deepspeed["bf16"] = {"enabled": precision == "bf16"}
        deepspeed["fp16"] = {"enabled": precision == "fp16"}
    return deepspeed, _accelerate_launch(data, where)


def _accelerate_launch(data: dict[str, Any], where: str) -> dict[str, Any]:
    """accelerate counts processes across all machines; zerotuner counts them per node.

    These values skip the settings' own validation (they fill settings the user did not set),
    so each is checked here against what the setting accepts.
    """
    implied: dict[str, Any] = {}
    machines = _whole(data, "num_machines", where, low=1)
    if machines is not None:
        implied["nnodes"] = machines
    total = _whole(data, "num_processes", where, low=1, unset=-1)  # -1: accelerate's "not set"
    if total is not None:
        if total % (machines or 1):
            raise ConfigError(
                f"{where}: num_processes={total} is not divisible by num_machines={machines}"
            )
        implied["num_processes"] = total // (machines or 1)
    rank = _whole(data, "machine_rank", where, low=0)
    if rank is not None:
        if machines is not None and rank >= machines:
            raise ConfigError(
                f"{where}: machine_rank={rank} is outside 0..{machines - 1} "
                f"(num_machines={machines})"
            )
        implied["node_rank"] = rank
    port = _whole(data, "main_process_port", where, low=1, high=65535)
    if port is not None:
        implied["master_port"] = port
    address = data.get("main_process_ip")
    if address not in (None, ""):
        if not isinstance(address, str) or not address.strip():
            raise ConfigError(f"{where}: main_process_ip={address!r}: expected a host name or IP")
        implied["master_addr"] = address.strip()
    return implied


def _whole(
    data: dict[str, Any],
    key: str,
    where: str,
    *,
    low: int,
    high: int | None = None,
    unset: int | None = None,
) -> int | None:
    """data[key] as a whole number in low..high; None when absent, null or `unset`."""
    value = data.get(key)
    if value is None:
        return None
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        with contextlib.suppress(ValueError):  # "4" from a quoted YAML value
            number = int(value.strip())
    if number is not None and number == unset:
        return None
    if number is not None and number > MAX_INT:
        raise ConfigError(f"{where}: {key}: expected a whole number below 2**63")
    if number is None or number < low or (high is not None and number > high):
        valid = f"{low}..{high}" if high is not None else f">= {low}"
        raise ConfigError(f"{where}: {key}={value!r}: expected a whole number {valid}")
    return number


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(base))
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_implied_settings(settings: Settings, inputs: UserInputs) -> Settings:
    """Launch values from the accelerate file fill settings the user did not set, and a real
    nvme_path is the offload dir: every later step reads these settings, never the files."""
    update = {k: v for k, v in inputs.settings.items() if k not in settings.model_fields_set}
    for key in sorted(set(inputs.settings) - set(update)):
        inputs.notes.change(
            f"{env_name(key)}={getattr(settings, key)!r} overrides the accelerate config's "
            f"{key}={inputs.settings[key]!r}"
        )
    settings = settings.model_copy(update=update) if update else settings
    return resolve_offload_dir(settings, inputs.nvme, inputs.notes)
