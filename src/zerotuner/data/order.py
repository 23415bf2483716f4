"""The order batches train in, the same for any world size and after any resume.

Each aspect bucket is shuffled by (seed, epoch) and cut into full micro-batches (the last one
topped up from the same bucket), then all batches are shuffled together. Ranks take every
world_size-th batch, and the list is topped up so every rank gets the same number of batches
(ranks must step together). Every rank computes the same order without talking.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from zerotuner.data.buckets import Bucket
from zerotuner.data.dataset import Dataset
from zerotuner.errors import ConfigError


@dataclass(frozen=True)
class Position:
    """Where training stands in the data: global batches consumed in this epoch.

    Counted in the world-size-independent global order, so a run can resume on another
    number of ranks (rounded up to the next full round of world_size batches).
    """

    epoch: int = 0
    batch: int = 0


def epoch_batches(
    buckets: dict[Bucket, list[int]], *, micro_batch: int, seed: int, epoch: int
) -> list[list[int]]:
    """The global batch order of one epoch: every batch from one bucket, every batch full."""
    rng = np.random.default_rng([seed, epoch])
    out: list[list[int]] = []
    for size in sorted(buckets):
        indices = [int(i) for i in rng.permutation(buckets[size])]
        for start in range(0, len(indices), micro_batch):
            batch = indices[start : start + micro_batch]
            # Top a short last batch up from the same bucket: fixed shapes, no image dropped.
            batch += [indices[j % len(indices)] for j in range(micro_batch - len(batch))]
            out.append(batch)
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def batches(
    dataset: Dataset,
    buckets: dict[Bucket, list[int]],
    *,
    micro_batch: int,
    rank: int,
    world_size: int,
    seed: int,
    epoch: int,
) -> list[list[int]]:
    """This rank's micro-batches for one epoch; every rank gets the same number of them."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    if micro_batch < 1:
        raise ConfigError(f"ZT_TRAIN_BATCH_SIZE={micro_batch}: must be at least 1")
    if any(i >= len(dataset) for v in buckets.values() for i in v):
        raise ValueError("buckets index more items than the dataset holds")
    order = epoch_batches(buckets, micro_batch=micro_batch, seed=seed, epoch=epoch)
    per_rank = -(-len(order) // world_size)
    # Wrap around to the epoch's first batches so every rank gets the same count.
    order = [order[i % len(order)] for i in range(per_rank * world_size)]
    return order[rank::world_size]


def batches_per_epoch(
    buckets: dict[Bucket, list[int]], *, micro_batch: int, world_size: int
) -> int:
    """Micro-batches each rank runs per epoch (what `batches` returns the length of)."""
    total = sum(-(-len(v) // micro_batch) for v in buckets.values())
    return -(-total // world_size)


def iterate_batches(
    dataset: Dataset,
    buckets: dict[Bucket, list[int]],
    *,
    micro_batch: int,
    rank: int,
    world_size: int,
    seed: int,
    start: Position = Position(),
) -> Iterator[tuple[list[int], Position]]:
    """Endless (indices, position after this batch) pairs; save the position, resume from it."""
    epoch, consumed = start.epoch, start.batch
    while True:
        mine = batches(
            dataset,
            buckets,
            micro_batch=micro_batch,
            rank=rank,
            world_size=world_size,
            seed=seed,
            epoch=epoch,
        )
        for local in range(-(-consumed // world_size), len(mine)):
            yield mine[local], Position(epoch, (local + 1) * world_size)
        epoch, consumed = epoch + 1, 0
