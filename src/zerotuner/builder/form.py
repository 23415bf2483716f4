"""The config builder's form: the fields it shows (described from settings.py), and the form
as ZT_* settings.

The page posts `settings` (ZT_* names, text as in an env file; empty means unset), `deepspeed`
(the DeepSpeed options zerotuner has no setting for: optimizer betas, ZeRO++, ...; composed here
into ZT_DEEPSPEED_CONFIG) and `hardware` (the what-if flags of `config` and `plan`).
"""

from __future__ import annotations

import functools
import json
import re
import types
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin

from zerotuner.docs import bounds_text, default_value, setting_type, type_text
from zerotuner.errors import ConfigError
from zerotuner.preflight.deepspeed_config import OPTIMIZER_DEFAULTS, SCHEDULER_TYPES
from zerotuner.preflight.optimizers import (
    CLIENT,
    REFUSED,
    REPLACED_BY_ADAMW,
    TRAINABLE,
    canonical_optimizer,
)
from zerotuner.settings.schema import Settings, env_name

# The form, section by section: setting names, the what-if hardware flags ("hw.*") and the
# DeepSpeed options without a setting ("ds.*"). Names another slice has not landed are skipped.
SECTIONS = tuple(
    (title, tuple(names.split()))
    for title, names in (
        ("Model", "model model_family resolution"),
        ("Data", "data_dir datasets_file"),
        ("Batch and steps", "train_batch_size gradient_accumulation_steps max_steps"),
        ("Training type", "training_type lora_rank lora_alpha lora_dropout lora_targets "
         "lora_dora lora_rslora lora_merge"),
        ("Hardware to plan for", "hw.gpus hw.gpu_memory hw.host_memory nnodes hw.offload_disk "
         "hw.bf16"),
        ("ZeRO and offload", "zero_stage offload_optimizer offload_param offload_dir "
         "gradient_checkpointing ds.gather_16bit_weights ds.quantized_weights "
         "ds.quantized_gradients ds.hpz_partition_size"),
        ("Optimizer", "optimizer learning_rate ds.betas ds.eps weight_decay prodigy_d_coef "
         "prodigy_safeguard_warmup prodigy_use_bias_correction"),
        ("Scheduler", "lr_scheduler lr_warmup_steps ds.warmup_type ds.warmup_min_lr "
         "ds.cos_min_ratio"),
        ("Precision and clipping", "mixed_precision gradient_clipping"),
        ("Checkpoints", "checkpoint_every_steps checkpoints_keep resume"),
        ("Validation", "validation_prompts validation_images validation_every_steps "
         "validation_inference_steps validation_guidance_scale"),
        ("Held-out loss and early stop", "eval_data_dir eval_fraction eval_every_steps "
         "early_stop_patience early_stop_min_delta"),
        ("Recipes", "caption_template caption_dropout min_image_size upscale timestep_range"),
        ("Video", "video_frames video_fps expert"),
        ("More", "seed ema ema_decay noise_offset snr_gamma prediction_type random_flip "
         "deepspeed_config"),
    )
)  # fmt: skip


@dataclass(frozen=True)
class Extra:
    """A DeepSpeed option without a ZT_* setting: where it goes in the JSON, and its type."""

    label: str
    path: tuple[str, ...]
    kind: Literal["float", "int", "bool", "betas", "choice"]
    help: str
    choices: tuple[str, ...] = ()


# The key each takes in the form is "ds.<name>"; each is a key DeepSpeed reads.
EXTRAS: dict[str, Extra] = {
    "gather_16bit_weights": Extra(
        "16-bit weights on save",
        ("zero_optimization", "stage3_gather_16bit_weights_on_model_save"), "bool",
        "ZeRO-3: gather the 16-bit weights on save (zerotuner's export needs it: always on).",
    ),
    "quantized_weights": Extra(
        "ZeRO++ quantized weights",
        ("zero_optimization", "zero_quantized_weights"), "bool",
        "ZeRO++ (stage 3): all-gather weights quantized to int8.",
    ),
    "quantized_gradients": Extra(
        "ZeRO++ quantized gradients",
        ("zero_optimization", "zero_quantized_gradients"), "bool",
        "ZeRO++ (stage 3): reduce-scatter gradients quantized to int4.",
    ),
    "hpz_partition_size": Extra(
        "ZeRO++ hierarchical partition",
        ("zero_optimization", "zero_hpz_partition_size"), "int",
        "ZeRO++ (stage 3, several nodes): ranks holding a secondary weight copy, "
        "usually the GPUs per node.",
    ),
    "betas": Extra(
        "betas",
        ("optimizer", "params", "betas"), "betas",
        "Adam/AdamW/Lamb/Lion betas, two numbers: 0.9, 0.999.",
    ),
    "eps": Extra(
        "eps", ("optimizer", "params", "eps"), "float", "Adam/AdamW/Lamb/Adagrad epsilon."
    ),
    "warmup_type": Extra(
        "warm-up type",
        ("scheduler", "params", "warmup_type"), "choice", "Warm-up curve.", ("linear", "log")
    ),
    "warmup_min_lr": Extra(
        "warm-up start LR",
        ("scheduler", "params", "warmup_min_lr"), "float",
        "LR at the start of the warm-up (constant and linear schedulers).",
    ),
    "cos_min_ratio": Extra(
        "cosine final LR ratio",
        ("scheduler", "params", "cos_min_ratio"), "float",
        "Cosine: final LR as a fraction of the peak.",
    ),
}  # fmt: skip
# Which schedulers read each scheduler parameter (DeepSpeed's lr_schedules.py).
SCHEDULER_PARAMS = {
    "warmup_type": ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"),
    "warmup_min_lr": ("WarmupLR", "WarmupDecayLR"),
    "cos_min_ratio": ("WarmupCosineLR",),
}
# The what-if flags of `config` and `plan` (commands/what_if.py), by their argparse names.
HARDWARE = {
    "gpus": ("GPUs per node", "Empty: probe this machine. 0: DeepSpeed's CPU accelerator."),
    "gpu_memory": ("GPU memory", "Per GPU, e.g. 24GiB or 80GB (needed with GPUs)."),
    "host_memory": ("Host memory", "Per node, e.g. 128GiB; empty: this machine's."),
    "offload_disk": ("Offload disk", "Free NVMe offload space per node, e.g. 2TB."),
    "bf16": ("GPUs have bf16", "Compute capability 8.0+ (A100, H100, RTX 30xx and newer)."),
}
OPTIMIZER_NAMES = (*TRAINABLE, *CLIENT, *REPLACED_BY_ADAMW, *REFUSED)
DEEPSPEED = env_name("deepspeed_config")
PARTS = ("settings", "deepspeed", "hardware")  # what a form holds
# What `compose` lets into the environment it evaluates in: ZT_* names, never a secret. The
# server takes less: only the settings the page shows (`accepted`).
SETTING_NAME = re.compile(r"ZT_[A-Z0-9_]+")
SECRET_SETTINGS = ("ZT_HF_TOKEN",)


def _choices(annotation: Any) -> list[str] | None:
    """Every value a Literal (or `auto | Literal`, `auto | bool`, bool) allows, as text."""
    origin = get_origin(annotation)
    if annotation is bool:
        return ["true", "false"]
    if origin is Literal:
        return [str(v) for v in get_args(annotation)]
    if origin in (Union, types.UnionType):
        parts = [_choices(a) for a in get_args(annotation) if a is not type(None)]
        if parts and all(p is not None for p in parts):
            return [c for p in parts for c in p]  # type: ignore[union-attr]
    return None


def _text(value: Any) -> str:
    if value is None or value == [] or value == {}:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def form_fields() -> list[dict[str, Any]]:
    """The form the page draws: sections of fields, each described from its declaration."""
    sections = []
    for title, names in SECTIONS:
        fields = [f for f in (_describe(name) for name in names) if f is not None]
        sections.append({"title": title, "fields": fields})
    return sections


def _describe(name: str) -> dict[str, Any] | None:
    if name.startswith("hw."):
        key = name[3:]
        label, help_text = HARDWARE[key]
        flag = "--" + key.replace("_", "-")
        out: dict[str, Any] = {"name": name, "label": label, "help": help_text, "kind": "text",
                               "default": "", "code": flag}  # fmt: skip
        if key == "bf16":
            out |= {"kind": "select", "choices": ["true", "false"], "default": "true"}
        return out
    if name.startswith("ds."):
        extra = EXTRAS[name[3:]]
        kind = "select" if extra.kind in ("bool", "choice") else "text"
        choices = list(extra.choices) or (["true", "false"] if extra.kind == "bool" else None)
        return {
            "name": name,
            "label": extra.label,
            "help": extra.help,
            "kind": kind,
            "choices": choices,
            "default": "",
            "code": ".".join(extra.path),
        }
    if name not in Settings.model_fields:
        return None  # a setting another slice has not landed yet
    info = Settings.model_fields[name]
    kind_text = type_text(setting_type(name))
    bounds = bounds_text(info)
    choices = _choices(setting_type(name))
    kind = "select" if choices else "text"
    if name in ("validation_prompts", "deepspeed_config"):
        kind = "textarea"
    if name == "optimizer":
        kind, choices = "text", list(OPTIMIZER_NAMES)  # free text: a refused name says why
    help_text = f"{info.description} Type: {kind_text}{f' ({bounds})' if bounds else ''}."
    if name == "validation_prompts":
        help_text = "One prompt per line (or a JSON list)."
    return {
        "name": env_name(name),
        "label": name.replace("_", " "),
        "help": help_text,
        "kind": kind,
        "choices": choices,
        "default": _text(default_value(info)),
    }


# --- form -> settings --------------------------------------------------------------------------


@dataclass
class Composed:
    """The form as settings: `env` is exactly what an env file would hold."""

    env: dict[str, str]
    hardware: dict[str, str]
    notes: list[str] = field(default_factory=list)  # what the composition left out, and why


@functools.cache
def shown_settings() -> frozenset[str]:
    """The ZT_* names of the settings the page shows."""
    names = {f["name"] for s in form_fields() for f in s["fields"]}
    return frozenset(n for n in names if not n.startswith(("hw.", "ds.")))


def accepted(form: Any) -> dict[str, Any]:
    """The form as a request may send it, or ConfigError naming the first key the page does not
    show (HF_ENDPOINT, LD_PRELOAD, ZT_HF_TOKEN, ZT_CONFIG_FILE, a name with `=` or a line break
    in it: a form never names anything else) or value no environment can hold."""
    if not isinstance(form, dict):
        raise ConfigError("not a form: expected a JSON object of settings, deepspeed, hardware")
    for key in form:
        if key not in PARTS:
            raise ConfigError(f"{shown(key)}: not part of a form; it holds {', '.join(PARTS)}")
    for key, value in _strings(form.get("settings"), "settings").items():
        if key.upper() not in shown_settings():
            raise ConfigError(
                f"{shown(key)}: not a setting of this form; the builder takes only the settings "
                "it shows"
            )
        _text_value(key.upper(), value)
    for key, value in _strings(form.get("deepspeed"), "deepspeed").items():
        if key.removeprefix("ds.") not in EXTRAS:
            raise ConfigError(f"ds.{shown(key)}: not a DeepSpeed option of this form")
        _text_value(f"ds.{key.removeprefix('ds.')}", value)
    for key, value in _strings(form.get("hardware"), "hardware").items():
        if key not in HARDWARE:
            raise ConfigError(
                f"hw.{shown(key)}: not a hardware field; valid: {', '.join(HARDWARE)}"
            )
        _text_value(f"hw.{key}", value)
    return form


def shown(text: str, limit: int = 80) -> str:
    """A name from a request as one line of an answer: as it is when it is a plain name, else
    escaped (a line break, NUL or `=` shows as such) and shortened."""
    if len(text) <= limit and re.fullmatch(r"[A-Za-z0-9_.:/-]+", text):
        return text
    escaped = ascii(text)
    return escaped if len(escaped) <= limit else escaped[: limit - 4] + "...'"


def _text_value(where: str, value: str) -> None:
    """A value the process environment can hold: no NUL, nothing that is not UTF-8."""
    if "\x00" in value:
        raise ConfigError(f"{where}: the value contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{where}: the value is not valid text (a lone surrogate)") from None


def compose(form: dict[str, Any]) -> Composed:
    """Settings from the form. Raises ConfigError naming the form field for values that have no
    setting to report them (the DeepSpeed options, the hardware flags), and for a key that is
    no ZT_* name or is a secret (it would go into the environment the form is evaluated in)."""
    settings = _strings(form.get("settings"), "settings")
    extras = _strings(form.get("deepspeed"), "deepspeed")
    hardware = _strings(form.get("hardware"), "hardware")
    for key, value in settings.items():
        if not SETTING_NAME.fullmatch(key.upper()) or key.upper() in SECRET_SETTINGS:
            raise ConfigError(
                f"{shown(key)}: not a zerotuner setting a form may set (ZT_* names, no secrets)"
            )
        _text_value(key.upper(), value)
    for part, prefix in ((extras, "ds."), (hardware, "hw.")):
        for key, value in part.items():
            _text_value(prefix + shown(key.removeprefix(prefix)), value)
    env = {k.upper(): v for k, v in settings.items() if v.strip() != ""}
    if "ZT_VALIDATION_PROMPTS" in env and not env["ZT_VALIDATION_PROMPTS"].lstrip().startswith("["):
        lines = [p.strip() for p in env["ZT_VALIDATION_PROMPTS"].splitlines() if p.strip()]
        env["ZT_VALIDATION_PROMPTS"] = json.dumps(lines)  # one prompt per line in the form
    unknown = sorted(set(hardware) - set(HARDWARE))
    if unknown:
        raise ConfigError(f"hw.{unknown[0]}: not a hardware field; valid: {', '.join(HARDWARE)}")
    composed = Composed(env, {k: v.strip() for k, v in hardware.items() if v.strip()})
    extras = {k.removeprefix("ds."): v.strip() for k, v in extras.items() if v.strip()}
    _compose_deepspeed(composed, extras)
    return composed


def _strings(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ConfigError(f"{where}: expected an object of text values")
    return value


def _compose_deepspeed(composed: Composed, extras: dict[str, str]) -> None:
    """The DeepSpeed options over the pasted JSON, as one line of JSON (an env file's)."""
    env = composed.env
    base: dict[str, Any] = {}
    raw = env.get(DEEPSPEED, "").strip()
    if raw and not raw.startswith("{"):
        if extras:
            raise ConfigError(
                f"{DEEPSPEED}={raw}: a file path cannot take the DeepSpeed options of this "
                "form; paste the JSON instead, or set the options in that file"
            )
        return
    if not extras and "\n" not in raw:
        return  # as typed; a pasted multi-line JSON becomes one line (an env file's)
    if raw:
        from zerotuner.settings.files import parse_json

        base = parse_json(raw, source=DEEPSPEED)  # the message `config` gives
        if not isinstance(base, dict):
            raise ConfigError(
                f"{DEEPSPEED} (inline JSON): expected a JSON object, got {type(base).__name__}"
            )
    optimizer = canonical_optimizer(env.get("ZT_OPTIMIZER", _default("optimizer")))[0]
    scheduler = SCHEDULER_TYPES.get(env.get("ZT_LR_SCHEDULER", _default("lr_scheduler")))
    for key, text in extras.items():
        extra = EXTRAS.get(key)
        if extra is None:
            raise ConfigError(f"ds.{key}: not a DeepSpeed option of this form")
        value = _parse_extra(key, extra, text)
        if extra.path[0] == "optimizer" and key not in OPTIMIZER_DEFAULTS.get(optimizer or "", {}):
            composed.notes.append(f"{key} left out: optimizer {optimizer} has no such parameter")
            continue
        if extra.path[0] == "scheduler":
            if scheduler not in SCHEDULER_PARAMS[key]:
                composed.notes.append(f"{key} left out: scheduler {scheduler} does not read it")
                continue
            # An explicit ZT_LR_SCHEDULER replaces the scheduler section: name it there instead.
            base.setdefault("scheduler", {})["type"] = scheduler
            env.pop("ZT_LR_SCHEDULER", None)
        tree = base
        for part in extra.path[:-1]:
            tree = tree.setdefault(part, {})
        tree[extra.path[-1]] = value
    if base or raw:
        env[DEEPSPEED] = json.dumps(base, separators=(",", ":"))


def _default(name: str) -> str:
    return str(Settings.model_fields[name].default)


def _parse_extra(key: str, extra: Extra, text: str) -> Any:
    what = f"ds.{key}={text!r}"
    try:
        if extra.kind == "bool":
            if text.lower() not in ("true", "false"):
                raise ValueError
            return text.lower() == "true"
        if extra.kind == "int":
            number = int(text)
            if number < 1:
                raise ValueError
            return number
        if extra.kind == "float":
            real = float(text)
            if not real >= 0 or real == float("inf"):
                raise ValueError
            return real
        if extra.kind == "betas":
            parts = [float(p) for p in re.split(r"[,\s]+", text.strip("[] ")) if p]
            if len(parts) != 2 or not all(0 <= p < 1 for p in parts):
                raise ValueError
            return parts
        if text not in extra.choices:
            raise ValueError
        return text
    except ValueError:
        valid = {
            "bool": "true or false",
            "int": "a whole number >= 1",
            "float": "a number >= 0",
            "betas": "two numbers in [0, 1), e.g. 0.9, 0.999",
            "choice": " or ".join(extra.choices),
        }[extra.kind]
        raise ConfigError(f"{what}: expected {valid}") from None
