"""Video clips as training examples (PyAV: FFmpeg's demuxers and decoders).

A clip trains as `frames` frames sampled at `fps` from its start (ZT_VIDEO_FRAMES,
ZT_VIDEO_FPS): frame k is the last decoded frame shown at or before k / fps, so a 30 fps clip
sampled at 16 fps skips frames evenly and a 10 fps one repeats some. The count keeps the
model's rule (`frames = step * k + 1`, Wan: 4k+1): a clip shorter than asked trains at the
longest such count it holds. The same clip always gives the same frames (the latents are
cached), so a run sees each clip's first seconds: cut long videos into clips to train on the
rest.

Every clip is decoded once when the data is scanned (`probe`), as far as training reads it, so
a broken or hostile file is found there and listed with the skipped files, not mid-training.
Decoding is bounded: the file's size, each frame's pixels, and the frames decoded to reach the
last sampled one.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image

CLIP_SUFFIXES = (".mp4", ".webm", ".mov", ".gif", ".mkv")
CLIP_BYTES = 2 * 2**30
MAX_FRAME_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485  # PIL's own bomb limit, per frame
DECODED_PER_SAMPLED = 64  # frames decoded per frame sampled at most (a 1000 fps trap)
HASH_CHUNK = 2**20


@dataclass(frozen=True)
class ClipProbe:
    """What decoding a clip found: its size, how many frames it trains and its digest, or why
    it cannot be used (`reason`)."""

    file_size: int
    mtime_ns: int
    size: tuple[int, int] | None  # (w, h); None when skipped
    frames: int = 0  # frames it trains (the rule applied)
    seconds: float = 0.0  # of the clip those frames span
    digest: str = ""
    reason: str = ""


def trained_frames(available: int, wanted: int, step: int) -> int:
    """The most frames a clip trains: at most `wanted` and `available`, of the form
    step * k + 1 (at least one frame)."""
    count = min(available, wanted)
    return max(1, (count - 1) // step * step + 1)


def probe(path: Path, *, fps: float, frames: int, step: int) -> ClipProbe:
    """Decode the frames training will read and hash the file; never raises for a bad file."""
    try:
        info = os.stat(path)
    except OSError as exc:
        return ClipProbe(-1, -1, None, reason=f"unreadable ({exc.strerror or exc})")
    stamp = (info.st_size, info.st_mtime_ns)
    if not stat.S_ISREG(info.st_mode):
        return ClipProbe(*stamp, None, reason="not a regular file (a FIFO, socket or device)")
    if info.st_size > CLIP_BYTES:
        return ClipProbe(*stamp, None, reason=f"too large (over {CLIP_BYTES // 2**30} GiB)")
    if info.st_size == 0:
        return ClipProbe(*stamp, None, reason="empty (0 bytes)")
    try:
        sampled = sample_frames(path, fps=fps, frames=frames)
    except ClipError as exc:
        return ClipProbe(*stamp, None, reason=str(exc))
    count = trained_frames(len(sampled), frames, step)
    height, width = sampled[0].shape[:2]
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as reader:
        while chunk := reader.read(HASH_CHUNK):
            digest.update(chunk)
    seconds = (count - 1) / fps if count > 1 else 0.0
    return ClipProbe(*stamp, (width, height), count, seconds, digest.hexdigest())


class ClipError(Exception):
    """Why a clip cannot be read, in the words of the skipped-files summary."""


def sample_frames(path: Path, *, fps: float, frames: int) -> list[np.ndarray]:
    """Up to `frames` RGB frames (H, W, 3 uint8) at `fps` from the clip's start; fewer when
    it ends first. ClipError for anything PyAV or the limits refuse."""
    import av

    try:
        container = av.open(str(path), mode="r", metadata_errors="ignore")
    except (av.FFmpegError, OSError, UnicodeDecodeError, ValueError) as exc:
        raise ClipError(f"not a video (unreadable: {_short(exc)})") from None
    with container:
        if not container.streams.video:
            raise ClipError("no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > MAX_FRAME_PIXELS:
            raise ClipError(f"too large (frames of {width}x{height} pixels)")
        step = 1 / Fraction(fps).limit_denominator(1000)
        targets = [k * step for k in range(frames)]  # seconds from the first frame
        sampled: list[np.ndarray] = []
        shown: tuple[Fraction, object] | None = None  # the frame on screen and since when
        first: Fraction | None = None
        decoded = 0

        def keep_shown_until(time: Fraction, *, inclusive: bool) -> None:
            """The frame on screen stands for every target before `time`."""
            array = None
            while shown is not None and len(sampled) < frames:
                target = targets[len(sampled)]
                if target > time or (target == time and not inclusive):
                    break
                array = shown[1].to_ndarray(format="rgb24") if array is None else array
                sampled.append(array)

        try:
            for frame in container.decode(stream):
                decoded += 1
                if decoded > DECODED_PER_SAMPLED * frames:
                    raise ClipError(
                        f"too many frames per second (over {DECODED_PER_SAMPLED} decoded per "
                        "frame sampled)"
                    )
                if frame.width * frame.height > MAX_FRAME_PIXELS:
                    raise ClipError(f"too large (frames of {frame.width}x{frame.height} pixels)")
                at = _time(frame, stream)
                first = at if first is None else first
                keep_shown_until(at - first, inclusive=False)
                if len(sampled) >= frames:
                    break
                shown = (at - first, frame)
        except av.FFmpegError as exc:
            if shown is None:
                raise ClipError(f"not a video (unreadable: {_short(exc)})") from None
            # a cut or damaged tail: the frames before it still train
        if shown is not None:
            keep_shown_until(shown[0], inclusive=True)  # the last frame, to its own time
    if not sampled:
        raise ClipError("not a video (no frame decoded)")
    return sampled


def _time(frame, stream) -> Fraction:  # noqa: ANN001 - PyAV's types
    """When the frame is shown, in seconds from the first one."""
    if frame.pts is None or stream.time_base is None:
        return Fraction(frame.index or 0, 25)  # no timestamps: assume 25 fps, in order
    start = stream.start_time or 0
    return Fraction(frame.pts - start) * Fraction(stream.time_base)


def _short(exc: BaseException) -> str:
    """The error without the file's name (the summary names the file)."""
    text = " ".join(str(getattr(exc, "strerror", None) or exc).split())
    return text[:120] or type(exc).__name__


def load_clip(path: Path, *, fps: float, frames: int) -> list[Image.Image]:
    """The clip's first `frames` sampled frames as RGB images (what `probe` counted)."""
    sampled = sample_frames(path, fps=fps, frames=frames)[:frames]
    return [Image.fromarray(frame, "RGB") for frame in sampled]
