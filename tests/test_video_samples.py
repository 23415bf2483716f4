"""Validation samples of a video family (Wan): clips people can watch.

The writers on real frames (an H.264 .mp4 decoded back with PyAV: frames, size, rate; a
contact sheet's grid), the frame count a validation clip gets, `samples.render` on the tiny
WanPipeline demo (clips, contact sheets, the base-vs-trained clip and sheet per prompt), and
the run page: it serves the .mp4 as video/mp4 with byte ranges, only from the samples folder,
and chromium plays and seeks the clip in a <video> whose poster is the contact sheet.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from browserkit import chromium
from PIL import Image
from prometheus_client import CollectorRegistry
from test_flow_training import TOKENS

from zerotuner.monitor.run_page import RunView
from zerotuner.monitor.server import MetricsServer, ranged
from zerotuner.train import samples

PROMPT = "a red circle on a white background"
SLUG = "00-a-red-circle-on-a-white-background"
FPS = 8
FRAMES = 5  # ZT_VIDEO_FRAMES=6, rounded down to Wan's 4k+1


def moving_square(frames: int, height: int, width: int) -> np.ndarray:
    """A white square crossing a dark background, one step right per frame."""
    clip = np.full((frames, height, width, 3), 30, np.uint8)
    for i in range(frames):
        clip[i, 8:24, 2 + 3 * i : 18 + 3 * i] = 255
    return clip


def stream_of(path: Path) -> tuple[str, str, int, int, Fraction, int]:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        decoded = sum(1 for _ in container.decode(video=0))
        context = stream.codec_context
        return (
            context.name,
            context.pix_fmt,
            stream.width,
            stream.height,
            stream.average_rate,
            decoded,
        )


def test_a_clip_is_an_h264_mp4_padded_to_even_sides_at_its_rate(tmp_path):
    clip = moving_square(9, 33, 47)
    path = samples.write_clip(clip, tmp_path / "clip.mp4", 12)
    assert samples.video_codec() == "libx264"  # PyAV's wheel bundles it: what browsers play
    assert stream_of(path) == ("h264", "yuv420p", 48, 34, Fraction(12), 9)
    back = samples.read_clip(path)
    assert back.shape == (9, 34, 48, 3)
    # What was drawn comes back (lossy, close), the padding repeats the last row and column.
    assert np.abs(back[:, :33, :47].astype(int) - clip).mean() < 6
    assert np.abs(back[:, 33].astype(int) - back[:, 32]).mean() < 6
    with path.open("rb") as file:  # the index before the frames: playback starts at once
        head = file.read(64)
    assert head.index(b"moov") < 64
    assert not list(tmp_path.glob(".*.part"))
    # A rate such as NTSC's 23.976 is kept as a fraction.
    fraction = samples.write_clip(clip[:3], tmp_path / "ntsc.mp4", 24000 / 1001)
    assert stream_of(fraction)[4] == Fraction(24000, 1001)


def test_the_contact_sheet_is_a_grid_of_evenly_spaced_frames(tmp_path):
    clip = np.stack([np.full((20, 30, 3), 20 * i, np.uint8) for i in range(9)])
    sheet = samples.contact_sheet(clip, tmp_path / "sheet.png")
    with Image.open(sheet) as image:
        assert image.size == (4 * 30 + 3 * 2, 2 * 20 + 2)  # 8 of 9 frames, 4 a row, 2 px apart
        cells = [image.getpixel((c * 32 + 15, r * 22 + 10)) for r in range(2) for c in range(4)]
        assert image.getpixel((30, 5)) == (255, 255, 255)  # a gap
    assert [cell[0] // 20 for cell in cells] == [0, 1, 2, 3, 5, 6, 7, 8]  # first and last kept
    with Image.open(samples.contact_sheet(clip[:3], tmp_path / "short.png")) as image:
        assert image.size == (3 * 30 + 2 * 2, 20)
    big = np.zeros((2, 480, 832, 3), np.uint8)  # Wan 2.1's 480p: shrunk on the sheet
    with Image.open(samples.contact_sheet(big, tmp_path / "big.png")) as image:
        assert image.size == (2 * 384 + 2, round(480 * 384 / 832))


def test_validation_clips_follow_zt_video_frames_within_a_bound():
    assert samples.sample_frames(81, 4) == samples.MAX_SAMPLE_FRAMES == 33
    assert samples.sample_frames(None, 4) == 33
    assert [samples.sample_frames(n, 4) for n in (17, 16, 6, 1)] == [17, 13, 5, 1]
    assert samples.sample_frames(10, 1) == 10


def test_byte_ranges_are_answered_as_a_video_element_asks():
    whole = ("200 OK", [("Accept-Ranges", "bytes")], (0, 10))
    assert ranged(10, None) == whole
    status, headers, span = ranged(10, "bytes=0-")
    assert (status, dict(headers)["Content-Range"], span) == ("206 Partial Content",
                                                              "bytes 0-9/10", (0, 10))  # fmt: skip
    assert ranged(10, "bytes=2-5")[2] == (2, 6)
    assert ranged(10, "bytes=8-99")[1][1] == ("Content-Range", "bytes 8-9/10")
    assert ranged(10, "bytes=-3")[2] == (7, 10)
    assert ranged(10, "bytes=-30")[2] == (0, 10)
    assert ranged(10, "bytes=0-" + "9" * 5000)[2] == (0, 10)  # past int()'s digit limit
    assert ranged(10, "bytes=-" + "9" * 5000)[2] == (0, 10)
    for unsatisfiable in ("bytes=10-", "bytes=-0", "bytes=" + "9" * 5000 + "-"):
        status, headers, span = ranged(10, unsatisfiable)
        assert (status, headers) == ("416 Range Not Satisfiable", [("Content-Range", "bytes */10")])
    for ignored in ("bytes=0-1,4-5", "bytes=5-2", "items=0-1", "bytes=x-", "bytes=-"):
        assert ranged(10, ignored)[0] == "200 OK", ignored
    assert ranged(10, "bytes=2-5", if_range='"v1"')[0] == "200 OK"


# --- the tiny Wan demo ------------------------------------------------------------------------


def validate(model: Path, output: Path, step: int) -> list[Path]:
    """One validation of the Wan demo (its base weights: the trained clip is the base one), one
    prompt, 2 steps, ZT_VIDEO_FRAMES=6, ZT_VIDEO_FPS=8; the family's own pipeline arguments (a
    one-frame PIL clip) are overridden."""
    return samples.render(
        model, None, [PROMPT], output / "samples" / f"step-{step}", family="wan", resolution=64,
        inference_steps=2, seed=3, video_frames=6, video_fps=FPS,
        pipeline_kwargs={"max_sequence_length": TOKENS, "num_frames": 1, "output_type": "pil"},
    )  # fmt: skip


@pytest.fixture(scope="module")
def rendered(family_demo_dir, tmp_path_factory) -> Path:
    """OUTPUT/ after a validation of the Wan demo at step 2."""
    output = tmp_path_factory.mktemp("video-samples")
    written = validate(family_demo_dir("wan") / "model", output, 2)
    assert written == [output / "samples" / "step-2" / f"{SLUG}.mp4"]
    return output


def test_wan_validation_writes_clips_sheets_and_the_base_comparison(rendered):
    folder = rendered / "samples"
    names = lambda sub: sorted(p.name for p in (folder / sub).iterdir())  # noqa: E731
    assert names("step-2") == [f"{SLUG}.mp4", f"{SLUG}.png", "prompts.txt"]
    assert names("base") == [f"{SLUG}.mp4", f"{SLUG}.png", "prompts.txt", "render.json"]
    assert names("base-vs-trained") == [f"{SLUG}.mp4", f"{SLUG}.png"]
    assert not (folder / samples.COMPARISON).exists()  # the images' sheet is not written
    assert json.loads((folder / "base" / "render.json").read_text())["video_frames"] == 6

    clip = folder / "step-2" / f"{SLUG}.mp4"
    assert stream_of(clip) == ("h264", "yuv420p", 64, 64, Fraction(FPS), FRAMES)
    frames = samples.read_clip(clip)
    assert frames.std() > 1  # a picture, not a blank
    assert np.array_equal(frames, samples.read_clip(folder / "base" / f"{SLUG}.mp4"))
    with Image.open(folder / "step-2" / f"{SLUG}.png") as sheet:
        assert sheet.size == (4 * 64 + 3 * 2, 2 * 64 + 2)  # 5 frames, 4 a row

    # Side by side: each 64-pixel clip enlarged 4x, a 20-pixel label strip above.
    side = folder / "base-vs-trained" / f"{SLUG}.mp4"
    assert stream_of(side) == ("h264", "yuv420p", 2 * 256 + 4, 20 + 256, Fraction(FPS), FRAMES)
    both = samples.read_clip(side)
    left, right = both[:, 20:, :256].astype(int), both[:, 20:, 260:].astype(int)
    assert np.abs(left - right).mean() < 2  # the same clip twice (base weights)
    with Image.open(folder / "base-vs-trained" / f"{SLUG}.png") as sheet:
        assert sheet.height == 2 * (256 + 2) and sheet.width > FRAMES * 256


def test_the_run_page_serves_only_sample_clips_with_byte_ranges(rendered, tmp_path):
    view = RunView(rendered)
    (image,) = view.state([], "training")["samples"]["images"]
    assert image == {"prompt": PROMPT, "url": f"/run/samples/step-2/{SLUG}.png",
                     "video": f"/run/samples/step-2/{SLUG}.mp4"}  # fmt: skip
    mp4 = (rendered / "samples" / "step-2" / f"{SLUG}.mp4").read_bytes()
    path, media = view.sample_path(f"step-2/{SLUG}.mp4")
    assert (path.read_bytes(), media) == (mp4, "video/mp4")
    assert view.sample_path(f"base/{SLUG}.mp4") is not None
    (rendered / "secret.mp4").write_bytes(b"not a sample")
    link = rendered / "samples" / "step-2" / "link.mp4"
    link.symlink_to(rendered / "samples" / "step-2" / "prompts.txt")
    try:
        escapes = ("../secret.mp4", "step-2/../../secret.mp4", "step-2/link.mp4", "x.mp4",
                   f"base-vs-trained/{SLUG}.mp4", f"step-2/{SLUG}.mp4.part")  # fmt: skip
        for escape in escapes:
            assert view.sample_path(escape) is None, escape
    finally:
        link.unlink()

    with MetricsServer("127.0.0.1", 0, source=CollectorRegistry(), output_dir=rendered,
                       history_interval=None) as server:  # fmt: skip
        url = server.url + image["video"]
        with urllib.request.urlopen(url, timeout=30) as response:
            assert response.status == 200 and response.headers["Content-Type"] == "video/mp4"
            assert response.headers["Accept-Ranges"] == "bytes" and response.read() == mp4
        request = urllib.request.Request(url, headers={"Range": "bytes=100-199"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 206
            assert response.headers["Content-Range"] == f"bytes 100-199/{len(mp4)}"
            assert response.read() == mp4[100:200]


def test_chromium_plays_and_seeks_the_clip_on_the_run_page(rendered):
    """A <video> with controls, muted and looping, the contact sheet its poster: chromium
    decodes it (readyState >= 2, the clip's duration) and seeks in it (byte ranges)."""
    with MetricsServer("127.0.0.1", 0, source=CollectorRegistry(), output_dir=rendered,
                       history_interval=None) as server, chromium() as browser:  # fmt: skip
        page = browser.new_page()
        page.goto(server.url + "/")
        page.wait_for_function(
            "document.querySelector('#samples video')?.readyState >= 2", timeout=30_000
        )
        video = page.evaluate(
            """(() => { const v = document.querySelector('#samples video');
            return { controls: v.controls, muted: v.muted, loop: v.loop, poster: v.poster,
                     src: v.currentSrc, duration: v.duration, width: v.videoWidth,
                     error: v.error && v.error.message }; })()"""
        )
        assert video == {"controls": True, "muted": True, "loop": True,
                         "poster": f"{server.url}/run/samples/step-2/{SLUG}.png",
                         "src": f"{server.url}/run/samples/step-2/{SLUG}.mp4",
                         "duration": pytest.approx(FRAMES / FPS, abs=0.05), "width": 64,
                         "error": None}  # fmt: skip
        seeked = page.evaluate(
            """new Promise((done) => { const v = document.querySelector('#samples video');
            v.addEventListener('seeked', () => done([v.currentTime, v.seekable.end(0)]),
                               { once: true });
            v.currentTime = 0.25; })"""
        )
        assert seeked == [pytest.approx(0.25), pytest.approx(FRAMES / FPS, abs=0.05)]
        assert page.inner_text("#samples figcaption").startswith(PROMPT)
        assert page.locator("#samples img").count() == 0


def test_the_base_clips_are_rendered_once(family_demo_dir, rendered, tmp_path):
    """The next validation reuses the base model's clips and rewrites the comparison."""
    output = tmp_path / "output"
    shutil.copytree(rendered, output)
    base = output / "samples" / "base"
    files = [base / "render.json", base / f"{SLUG}.mp4"]
    stamps = [p.stat().st_mtime_ns for p in files]
    side = output / "samples" / "base-vs-trained" / f"{SLUG}.mp4"
    side.unlink()
    validate(family_demo_dir("wan") / "model", output, 4)
    assert [p.stat().st_mtime_ns for p in files] == stamps
    assert (output / "samples" / "step-4" / f"{SLUG}.mp4").is_file() and side.is_file()
