"""Which training images are held out for the evaluation loss (ZT_EVAL_FRACTION): chosen by
the seed and each image's identity (its name and content digest), never by rank or order, so
every rank, every world size and every resume holds out the same ones, and none is trained on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from zerotuner.data.dataset import Item
from zerotuner.errors import ConfigError
from zerotuner.settings.schema import env_name

FRACTION_SETTING = env_name("eval_fraction")


def identity(item: Item) -> str:
    """What names an image for the evaluation: stable across mounts, ranks and restarts."""
    return f"{item.name}|{item.content}"


def held_count(total: int, fraction: float) -> int:
    """Images held out of `total` (at least one)."""
    return max(1, round(total * fraction))


def check_fraction(total: int, fraction: float) -> None:
    """One line (exit 2) when holding out `fraction` of `total` images leaves none to train."""
    held = held_count(total, fraction)
    if held >= total:
        raise ConfigError(
            f"{FRACTION_SETTING}={fraction:g}: holds out {held} of the {total} training "
            f"image(s), leaving none to train on; expected a fraction that leaves at least one "
            f"(or held-out images of their own in {env_name('eval_data_dir')})"
        )


def held_out(items: Sequence[Item], fraction: float, seed: int) -> list[int]:
    """The indices of the held-out items (sorted): the `fraction` whose digest of (seed,
    identity) sorts first."""
    check_fraction(len(items), fraction)

    def rank(index: int) -> str:
        return hashlib.sha256(f"{seed}|{identity(items[index])}".encode()).hexdigest()

    ranked = sorted(range(len(items)), key=lambda i: (rank(i), i))
    return sorted(ranked[: held_count(len(items), fraction)])
