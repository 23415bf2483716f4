"""Optimizer and scheduler names, as users write them, mapped to DeepSpeed's, and what each
optimizer keeps per trained parameter.

Matching ignores case, spaces, dashes and underscores ("adam-w", "Adam W", "ADAMW"). Names the
seed's toolkit accepted but that cannot train a diffusers UNet under DeepSpeed 0.19 are
recognized and refused with the reason, never silently swapped. Client optimizers (prodigy,
adamw_schedulefree, adamw8bit, adafactor) are built by the rank (train/optimizer.py) and handed
to DeepSpeed; their knobs are settings that only they read (KNOBS).
"""

from __future__ import annotations

import re

from zerotuner.train.optimizer import BUILDERS

# DeepSpeed's canonical names (runtime/config.py DEEPSPEED_OPTIMIZERS), as written in its docs.
TRAINABLE = ("AdamW", "Adam", "Adagrad", "Lamb", "Lion", "Muon")
# Recognized, but refused: (name, why).
REFUSED = {
    "OneBitAdam": "1-bit optimizers were removed in DeepSpeed 0.19 and never worked with ZeRO",
    "OneBitLamb": "1-bit optimizers were removed in DeepSpeed 0.19 and never worked with ZeRO",
    "ZeroOneAdam": "1-bit optimizers were removed in DeepSpeed 0.19 and never worked with ZeRO",
    "MuAdam": "muP optimizers need muP base shapes (mup.set_base_shapes), which diffusers "
    "UNets do not carry",
    "MuAdamW": "muP optimizers need muP base shapes (mup.set_base_shapes), which diffusers "
    "UNets do not carry",
    "MuSGD": "muP optimizers need muP base shapes (mup.set_base_shapes), which diffusers "
    "UNets do not carry",
}
ONE_BIT = ("OneBitAdam", "OneBitLamb", "ZeroOneAdam")
# Implementation names the seed's toolkit swaps for AdamW (DeepSpeed picks the implementation).
REPLACED_BY_ADAMW = ("cpuadam", "fusedadam", "deepspeedcpuadam")

SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]+", "", name).lower()


# Built by the rank and passed to deepspeed.initialize(optimizer=...): ZT_OPTIMIZER's names.
CLIENT = tuple(BUILDERS)
# The settings only one client optimizer reads (a knob set for another is refused).
KNOBS = {
    "prodigy_d_coef": "prodigy",
    "prodigy_safeguard_warmup": "prodigy",
    "prodigy_use_bias_correction": "prodigy",
}

_CANONICAL = {_key(n): n for n in (*TRAINABLE, *REFUSED, *CLIENT)}
_CANONICAL |= {"adam8bit": "adamw8bit", "schedulefree": "adamw_schedulefree"}
_SCHEDULERS = {_key(n): n for n in SCHEDULERS}


def canonical_optimizer(name: str) -> tuple[str | None, str | None]:
    """(DeepSpeed name, warning) for a user's name; (None, None) when unknown."""
    key = _key(name)
    if key in _CANONICAL:
        return _CANONICAL[key], None
    if key in REPLACED_BY_ADAMW:
        return "AdamW", (
            f"optimizer '{name}' is an implementation, not an algorithm: using AdamW "
            "(DeepSpeed picks CPU Adam with offload, fused Adam otherwise)"
        )
    return None, None


def canonical_scheduler(name: str) -> str | None:
    return _SCHEDULERS.get(_key(name))


def valid_optimizer_names() -> str:
    return ", ".join((*TRAINABLE, *CLIENT))


def is_client(name: str) -> bool:
    """Built by zerotuner and handed to DeepSpeed, not built by DeepSpeed from its config."""
    return name in CLIENT


# Bytes of optimizer state per trained parameter, beside the weights, gradients and DeepSpeed's
# fp32 master copy (memory.py counts those). Read from each implementation's step:
# - AdamW/Adam/Lamb: exp_avg, exp_avg_sq in fp32. Lion: exp_avg. Adagrad: the squared sum.
#   Muon: the momentum buffer (its 1-D parameters step with AdamW: rounded down here).
# - prodigy: exp_avg, exp_avg_sq, s and p0 (the start point it measures distance from), fp32.
# - adamw_schedulefree: z (the base sequence) and exp_avg_sq, fp32; no first moment.
# - adamw8bit (bitsandbytes): both moments in uint8 plus one fp32 absmax per 256-value block.
# - adafactor: factored row and column statistics for a matrix (~0 per parameter), but at
#   ZeRO >= 1 DeepSpeed hands it one flat 1-D partition, whose second moment is not factored:
#   a full fp32 one (4 bytes). No first moment (beta1=None).
STATE_BYTES: dict[str, float] = {
    "AdamW": 8, "Adam": 8, "Lamb": 8, "Lion": 4, "Adagrad": 4, "Muon": 4,
    "prodigy": 16,
    "adamw_schedulefree": 8,
    "adamw8bit": 2 + 2 * 4 / 256,
    "adafactor": 4,
}  # fmt: skip
ADAFACTOR_FACTORED_BYTES = 0.05  # ZeRO-0: rows + columns of the 2-D weights, ~0 per parameter


def state_bytes(name: str, *, zero_stage: int) -> float:
    """Optimizer state bytes per trained parameter for `name` (a canonical name) at a stage."""
    if name == "adafactor" and zero_stage == 0:
        return ADAFACTOR_FACTORED_BYTES
    return STATE_BYTES.get(name, STATE_BYTES["AdamW"])


def client_problem(
    name: str, stage: int | None, offload_optimizer: str, *, names: dict[str, str]
) -> str | None:
    """Why DeepSpeed 0.19 cannot run this client optimizer at this stage and optimizer offload
    (None: it can; `stage` None: not decided yet). NVMe offload swaps only DeepSpeed's own
    optimizers' state; schedule-free's evaluation weights cannot be written into ZeRO-3's
    partitioned module. `names`: what set optimizer, zero_stage and offload_optimizer."""
    if not is_client(name):
        return None
    opt, off, zero = names["optimizer"], names["offload_optimizer"], names["zero_stage"]
    if offload_optimizer == "nvme":
        return (
            f"{opt}={name} with {off}=nvme: DeepSpeed swaps only its own optimizers' state to "
            f"NVMe; use {off}=cpu or none, or {opt}=AdamW"
        )
    if name == "adamw_schedulefree" and stage == 3:
        return (
            f"{opt}={name} with {zero}=3: its evaluation weights cannot be written back into "
            f"ZeRO-3's partitioned module for samples and export; use {zero}=1 or 2"
        )
    return None


def client_refuses(name: str, stage: int, offload_optimizer: str) -> bool:
    """Whether the planner must leave this option out for this optimizer."""
    names = dict.fromkeys(("optimizer", "offload_optimizer", "zero_stage"), "")
    return client_problem(name, stage, offload_optimizer, names=names) is not None


def planned_optimizer(setting: str, *, explicit: bool, config_type: object) -> str:
    """The canonical optimizer a run will have, for the planner: ZT_OPTIMIZER when set, else
    the raw DeepSpeed config's optimizer.type, else the default (unknown names: AdamW's
    bytes; normalize refuses them)."""
    given = setting if explicit or config_type in (None, "auto") else str(config_type)
    return canonical_optimizer(given)[0] or "AdamW"
