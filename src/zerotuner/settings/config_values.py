"""Value hygiene for a user's DeepSpeed JSON: the types DeepSpeed wants, no "auto" left over,
and DeepSpeed's own parser as the last word. Problems are collected, not raised.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

from zerotuner.settings.files import MAX_INT, short_repr
from zerotuner.settings.notes import Notes

# Keys DeepSpeed wants as whole numbers; users write 1e8, "2", 5e8.
INT_KEYS = {
    "stage", "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_max_live_parameters",
    "stage3_max_reuse_distance", "sub_group_size", "buffer_size", "buffer_count", "max_in_cpu",
    "block_size", "queue_depth", "intra_op_parallelism", "train_batch_size",
    "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
    "warmup_num_steps", "total_num_steps", "initial_scale_power", "loss_scale_window",
    "hysteresis", "min_loss_scale",
}  # fmt: skip
BOOL_KEYS = {
    "pin_memory", "overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions",
    "single_submit", "overlap_events", "use_gds", "enabled", "fast_init",
    "stage3_gather_16bit_weights_on_model_save", "round_robin_gradients",
}  # fmt: skip


def config_section(config: dict[str, Any], key: str) -> dict[str, Any]:
    """`config[key]` when it is a mapping, else an empty one (absent, or of a type that
    DeepSpeed's own parser reports)."""
    section = config.get(key)
    return section if isinstance(section, dict) else {}


def is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True  # math.isfinite(10**400) raises OverflowError
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, str):
        try:
            return math.isfinite(float(value))
        except ValueError:
            return False
    return False


def whole_number(value: Any) -> int | None:
    """2, 2.0, "2", "1e8" as an int in 0..2**63-1; None for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif is_number(value) and float(value).is_integer():
        number = int(float(value))
    else:
        return None
    return number if 0 <= number <= MAX_INT else None


def non_finite(value: Any) -> bool:
    """NaN or an infinity, as a number or as text ("nan", "-Infinity", "1e400")."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, str):
        try:
            return not math.isfinite(float(value))
        except ValueError:
            return False
    return False


def coerce_numbers(tree: Any, prefix: str, n: Notes) -> None:
    """1e8 -> 100000000, "2" -> 2, "true" -> True, for the keys DeepSpeed types strictly."""
    if not isinstance(tree, dict):
        return
    for key, value in list(tree.items()):
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            coerce_numbers(value, f"{path}.", n)
        elif value == "auto" or value is None or non_finite(value):
            continue  # no_non_finite names it
        elif key in INT_KEYS:
            number = whole_number(value)
            if number is None:
                n.error(f"{path}={short_repr(value)}: expected a whole number in 0..2**63-1")
            elif number is not value:
                tree[key] = number
        elif key in BOOL_KEYS and isinstance(value, str):
            word = value.strip().lower()
            if word in ("true", "1", "yes", "on"):
                tree[key] = True
            elif word in ("false", "0", "no", "off"):
                tree[key] = False
            else:
                n.error(f"{path}={value!r}: expected true or false")


def no_non_finite(tree: Any, prefix: str, n: Notes) -> None:
    """NaN and infinity anywhere, as numbers or as text ("nan", "-Infinity"): DeepSpeed would
    train with them (a NaN clip norm or LR gives NaN weights that export as a success)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            if not str(key).endswith("path"):  # a folder may be called `inf`
                no_non_finite(value, f"{prefix}{key}.", n)
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            no_non_finite(value, f"{prefix.rstrip('.')}[{i}].", n)
    elif non_finite(tree):
        where = prefix.rstrip(".")
        n.error(f"{where}={short_repr(tree)}: expected a finite number (no NaN or infinity)")


def no_auto_left(tree: Any, prefix: str, n: Notes) -> None:
    """Every "auto" zerotuner knows was filled above; one left is a key it cannot fill."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            no_auto_left(value, f"{prefix}{key}.", n)
    elif tree == "auto":
        n.error(f"{prefix.rstrip('.')}='auto' has no value zerotuner can fill; set it or remove it")


def deepspeed_accepts(cfg: dict[str, Any], n: Notes) -> None:
    """DeepSpeed's own config parser, as a last check (the batch arithmetic was checked above).

    DeepSpeed checks the batch against the process group's size when one exists (inside a
    rank), else against 1; the probe copy is sized to match.
    """
    from deepspeed import comm
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = copy.deepcopy(cfg)
    world = comm.get_world_size() if comm.is_initialized() else 1
    probe["train_batch_size"] = (
        probe["train_micro_batch_size_per_gpu"] * probe["gradient_accumulation_steps"] * world
    )
    ds_logger = logging.getLogger("DeepSpeed")
    level = ds_logger.level
    ds_logger.setLevel(logging.WARNING)
    try:
        DeepSpeedConfig(probe)
    except Exception as exc:  # DeepSpeed raises many types; all mean "config rejected"
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        n.error("DeepSpeed rejects the config: " + "; ".join(lines[:4]))
    finally:
        ds_logger.setLevel(level)
