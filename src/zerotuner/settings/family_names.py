"""The model families' names, below both the settings (ZT_MODEL_FAMILY's choices) and the
family registry (`zerotuner.families.REGISTRY`, whose keys they are, in its order)."""

from __future__ import annotations

FAMILIES: tuple[str, ...] = (
    "sdxl", "sd1", "sd2", "sd3", "flux", "chroma", "zimage", "qwenimage", "flux2", "flux2klein",
    "wan",
)  # fmt: skip
