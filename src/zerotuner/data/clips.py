"""Video clips as training examples (PyAV: FFmpeg's demuxers and decoders).

A clip trains as `frames` frames sampled at `fps` from its start (ZT_VIDEO_FRAMES,
ZT_VIDEO_FPS; a video family's `Video`, from `video_sampling`): frame k is the last decoded
frame shown at or before k / fps, so a 30 fps clip sampled at 16 fps skips frames evenly and a
10 fps one repeats some. The count keeps the model's rule (`frames = step * k + 1`, Wan:
4k+1): a clip shorter than asked trains at the longest such count it holds. The same clip
always gives the same frames (the latents are cached). A long clip trains as one window from
its start, or as several (ZT_VIDEO_WINDOWS, settings/video_windows.py): each window is an
example of its own, its frames sampled from its first one (`start`, in sampled frames).

Every clip is decoded once when the data is scanned (`probe`), as far as training reads it (to
its end, up to MAX_SAMPLED_FRAMES, when it is cut into windows), so a broken or hostile file is
found there and listed with the skipped files, not mid-training. Decoding is bounded: the
file's size, each frame's pixels, the frames decoded to reach the last sampled one, and the
pixels of a window's sampled frames in all (MAX_CLIP_PIXELS). One decoded frame is held at a
time: the probe keeps none, training keeps each at its bucket's size (`load_clip`).
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from zerotuner.settings.video_windows import HEAD, Windows

if TYPE_CHECKING:
    import av
    import av.video.stream

    from zerotuner.families.base import ModelFamily
    from zerotuner.settings.schema import Settings

CLIP_SUFFIXES = (".mp4", ".webm", ".mov", ".gif", ".mkv")
CLIP_BYTES = 2 * 2**30
MAX_FRAME_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485  # PIL's own bomb limit, per frame
# Sampled frames x pixels per frame, each decoded at the source's size: 81 frames of 4K (0.63 Gi
# pixels) pass, 17 of 8192x8192 (1.06 Gi, 3.4 GB of RGB) do not.
MAX_CLIP_PIXELS = 2**30
DECODED_PER_SAMPLED = 64  # frames decoded per frame sampled at most (a 1000 fps trap)
HASH_CHUNK = 2**20
# A clip cut into windows is read this far at most (4 min 16 s at 16 fps): its windows lie there.
MAX_SAMPLED_FRAMES = 4096


@dataclass(frozen=True)
class Video:
    """How a video family trains clips (ZT_VIDEO_FPS, ZT_VIDEO_FRAMES, and `step`, the
    model's frame rule: step * k + 1 frames; `windows`: ZT_VIDEO_WINDOWS or the dataset's). A
    scan without it is an image family's."""

    fps: float
    frames: int
    step: int
    windows: Windows = HEAD


def video_sampling(settings: Settings, family: ModelFamily, source: Path) -> Video | None:
    """How this run samples clips: for a video family (its `frame_step`), ZT_VIDEO_FPS,
    ZT_VIDEO_FRAMES and ZT_VIDEO_WINDOWS; None for an image family. `train` and `check` both
    ask here."""
    step = family.frame_step(Path(source))
    if not step:
        return None
    return Video(settings.video_fps, settings.video_frames, step, settings.windows)


@dataclass(frozen=True)
class ClipProbe:
    """What decoding a clip found: its size, how many frames it trains and its digest, or why
    it cannot be used (`reason`)."""

    file_size: int
    mtime_ns: int
    size: tuple[int, int] | None  # (w, h); None when skipped
    frames: int = 0  # frames a window trains (the rule applied)
    seconds: float = 0.0  # of the clip those frames span
    available: int = 0  # sampled frames the clip holds, as far as it was read
    digest: str = ""
    reason: str = ""


def trained_frames(available: int, wanted: int, step: int) -> int:
    """The most frames a clip trains: at most `wanted` and `available`, of the form
    step * k + 1 (at least one frame)."""
    count = min(available, wanted)
    return max(1, (count - 1) // step * step + 1)


def probe(path: Path, *, fps: float, frames: int, step: int, windows: Windows = HEAD) -> ClipProbe:
    """Decode the frames training will read (the whole clip, up to MAX_SAMPLED_FRAMES, when
    `windows` cut it) and hash the file; never raises for a bad file. One frame is held at a
    time, whatever the clip's length."""
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
    import av

    read = frames if windows == HEAD else max(frames, MAX_SAMPLED_FRAMES)
    try:
        sampled, size = 0, (0, 0)
        for frame, new in _sampled(path, fps=fps, frames=read, held=frames):
            if new:  # converted as training converts it, then dropped
                size = frame.to_ndarray(format="rgb24").shape[1::-1]
            sampled += 1
    except ClipError as exc:
        return ClipProbe(*stamp, None, reason=str(exc))
    except av.FFmpegError as exc:  # a frame that does not convert to RGB
        return ClipProbe(*stamp, None, reason=f"not a video (unreadable: {_short(exc)})")
    count = trained_frames(sampled, frames, step)
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as reader:
        while chunk := reader.read(HASH_CHUNK):
            digest.update(chunk)
    seconds = (count - 1) / fps if count > 1 else 0.0
    return ClipProbe(*stamp, size, count, seconds, sampled, digest.hexdigest())


class ClipError(Exception):
    """Why a clip cannot be read, in the words of the skipped-files summary."""


def sample_frames(path: Path, *, fps: float, frames: int, start: int = 0) -> list[np.ndarray]:
    """Up to `frames` RGB frames (H, W, 3 uint8) at `fps` from sampled frame `start`, at the
    clip's size; fewer when it ends first. ClipError for anything PyAV or the limits refuse."""
    arrays: list[np.ndarray] = []
    for frame, new in _sampled(path, fps=fps, frames=frames, start=start):
        arrays.append(frame.to_ndarray(format="rgb24") if new else arrays[-1])
    return arrays


def load_clip(
    path: Path,
    *,
    fps: float,
    frames: int,
    fit: Callable[[Image.Image], Image.Image],
    start: int = 0,
) -> list[Image.Image]:
    """The window of `frames` sampled frames from sampled frame `start` (what `probe`
    counted), each passed through `fit` (to the bucket's size) as it is decoded: only fitted
    frames are kept."""
    fitted: list[Image.Image] = []
    for frame, new in _sampled(path, fps=fps, frames=frames, start=start):
        fitted.append(fit(frame.to_image()) if new else fitted[-1])
    return fitted


def _sampled(
    path: Path, *, fps: float, frames: int, start: int = 0, held: int | None = None
) -> Iterator[tuple[Any, bool]]:
    """(PyAV frame, whether it is new) for each of up to `frames` sampled times from sampled
    time `start` (earlier ones are decoded, not converted): the frame on screen then, so a
    frame shown across several times comes again (not new). The limits hold here: the frame's
    pixels, the frames decoded per frame sampled, the pixels of the frames given, or of the
    first `held` of them (what training holds of a clip read to its end)."""
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
        end = start + frames  # the sampled time after the last one given
        bounded = frames if held is None else min(held, frames)
        count = 0  # sampled times passed, given a frame from `start` on
        shown: tuple[Fraction, Any] | None = None  # the frame on screen and since when
        first: Fraction | None = None
        decoded = 0

        def due(time: Fraction, *, inclusive: bool) -> int:
            """How many more sampled times the frame on screen stands for, before `time`."""
            n = 0
            while count + n < end and (
                (count + n) * step < time or (inclusive and (count + n) * step == time)
            ):
                n += 1
            return n

        def give(frame: Any, times: int) -> Iterator[tuple[Any, bool]]:
            nonlocal count
            new = True
            for _ in range(times):
                count += 1
                if count <= start:
                    continue
                given = min(count - start, bounded)
                if given * frame.width * frame.height > MAX_CLIP_PIXELS:
                    raise ClipError(
                        f"too large ({given} frames of {frame.width}x{frame.height} pixels: over "
                        f"{MAX_CLIP_PIXELS / 2**30:g} Gi pixels a clip; lower ZT_VIDEO_FRAMES or "
                        "downscale it)"
                    )
                yield frame, new
                new = False

        try:
            for frame in container.decode(stream):
                decoded += 1
                if decoded > DECODED_PER_SAMPLED * end:
                    raise ClipError(
                        f"too many frames per second (over {DECODED_PER_SAMPLED} decoded per "
                        "frame sampled)"
                    )
                if frame.width * frame.height > MAX_FRAME_PIXELS:
                    raise ClipError(f"too large (frames of {frame.width}x{frame.height} pixels)")
                at = _time(frame, stream, index=decoded - 1)
                first = at if first is None else first
                if shown is not None:
                    yield from give(shown[1], due(at - first, inclusive=False))
                if count >= end:
                    break
                shown = (at - first, frame)
        except av.FFmpegError as exc:
            if shown is None:
                raise ClipError(f"not a video (unreadable: {_short(exc)})") from None
            # a cut or damaged tail: the frames before it still train
        if shown is not None and count < end:
            yield from give(shown[1], due(shown[0], inclusive=True))  # the last, to its time
    if count <= start:
        why = "not a video (no frame decoded)" if count == 0 else "ends before its window"
        raise ClipError(why)


def _time(frame: av.VideoFrame, stream: av.video.stream.VideoStream, *, index: int) -> Fraction:
    """When the frame is shown, in seconds from the first one (`index`: its place in decoding
    order)."""
    if frame.pts is None or stream.time_base is None:
        return Fraction(index, 25)  # no timestamps: assume 25 fps, in order
    start = stream.start_time or 0
    return Fraction(frame.pts - start) * Fraction(stream.time_base)


def _short(exc: BaseException) -> str:
    """The error without the file's name (the summary names the file)."""
    text = " ".join(str(getattr(exc, "strerror", None) or exc).split())
    return text[:120] or type(exc).__name__
