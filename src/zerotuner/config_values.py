"""Value hygiene for a user's DeepSpeed JSON: the types DeepSpeed wants, no "auto" left over,
and DeepSpeed's own parser as the last word. Problems are collected, not raised.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

from zerotuner.notes import Notes

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


def is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return math.isfinite(value)
    if isinstance(value, str):
        try:
            return math.isfinite(float(value))
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
        elif value == "auto" or value is None:
            continue
        elif key in INT_KEYS:
            number = float(value) if is_number(value) else None
            if number is None or not number.is_integer() or number < 0:
                n.error(f"{path}={value!r}: expected a whole number >= 0")
            elif not isinstance(value, int) or isinstance(value, bool):
                tree[key] = int(number)
        elif key in BOOL_KEYS and isinstance(value, str):
            word = value.strip().lower()
            if word in ("true", "1", "yes", "on"):
                tree[key] = True
            elif word in ("false", "0", "no", "off"):
                tree[key] = False
            else:
                n.error(f"{path}={value!r}: expected true or false")


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
