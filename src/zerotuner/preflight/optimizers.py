"""Optimizer and scheduler names, as users write them, mapped to DeepSpeed's.

Matching ignores case, spaces, dashes and underscores ("adam-w", "Adam W", "ADAMW"). Names the
seed's toolkit accepted but that cannot train a diffusers UNet under DeepSpeed 0.19 are
recognized and refused with the reason, never silently swapped.
"""

from __future__ import annotations

import re

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


_CANONICAL = {_key(n): n for n in (*TRAINABLE, *REFUSED)}
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
    return ", ".join(TRAINABLE)
