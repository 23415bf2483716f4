"""Clips as training data (issue 32): frames sampled at ZT_VIDEO_FPS with the model's frame
rule, buckets by frames x height x width, images as one-frame clips, broken and hostile files
listed with the skipped ones, latents through the video VAE, and `check`'s report."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from zerotuner.data import clips
from zerotuner.data.buckets import bucket_name, bucket_sizes, dataset_buckets
from zerotuner.data.loading import load_example
from zerotuner.data.scan import scan

STEP = 4  # Wan's VAE: 4k+1 frames
VIDEO = clips.Video(fps=16.0, frames=81, step=STEP)


def _write(path: Path, count: int, fps: int, *, codec: str = "libx264", size=(64, 48)) -> Path:
    """A clip whose frame i is the solid grey level 4 * i (H.264 at crf 0: lossless)."""
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = (
            "rgb8" if codec == "gif" else "yuv444p" if codec == "libx264" else "yuv420p"
        )
        if codec == "libx264":
            stream.options = {"crf": "0"}
        for i in range(count):
            frame = np.full((size[1], size[0], 3), 4 * i, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


def _audio_only(path: Path) -> Path:
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("mp2", rate=44100)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1152), dtype=np.int16), layout="mono")
        frame.sample_rate = 44100
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def _levels(frames: list[np.ndarray]) -> list[int]:
    return [round(float(f.mean()) / 4) for f in frames]


@pytest.mark.parametrize(
    ("available", "wanted", "step", "trained"),
    [(9, 81, 4, 9), (10, 81, 4, 9), (3, 81, 4, 1), (200, 81, 4, 81), (6, 81, 2, 5), (1, 81, 4, 1)],
)
def test_a_clip_trains_the_longest_count_the_rule_allows(available, wanted, step, trained):
    assert clips.trained_frames(available, wanted, step) == trained


def test_frames_are_sampled_at_the_rate_asked(tmp_path) -> None:
    """30 fps sampled at 16: frame k is the one on screen at k/16 s; 10 fps at 16 repeats."""
    fast = _write(tmp_path / "fast.mp4", 30, 30)
    got = _levels(clips.sample_frames(fast, fps=16, frames=9))
    assert got == [int(k / 16 * 30 + 1e-9) for k in range(9)] == [0, 1, 3, 5, 7, 9, 11, 13, 15]
    slow = _write(tmp_path / "slow.mp4", 6, 10)
    assert _levels(clips.sample_frames(slow, fps=16, frames=81)) == [0, 0, 1, 1, 2, 3, 3, 4, 5]
    gif = _write(tmp_path / "moving.gif", 5, 16, codec="gif")
    assert len(clips.sample_frames(gif, fps=16, frames=81)) == 5


def test_a_folder_of_clips_and_images_scans_as_clips(tmp_path, demo_dir) -> None:
    for image in sorted((demo_dir / "data").glob("*.png"))[:3]:
        shutil.copy(image, tmp_path / image.name)
        shutil.copy(image.with_suffix(".txt"), tmp_path / image.with_suffix(".txt").name)
    _write(tmp_path / "long.mp4", 48, 24)  # the last frame at 1.96 s: 32 sampled at 16 fps -> 29
    _write(tmp_path / "short.webm", 4, 8, codec="libvpx")  # the last at 0.375 s: 7 -> 5
    (tmp_path / "long.txt").write_text("a grey fade")
    dataset = scan(tmp_path, log_skipped=False, video=VIDEO)
    by_name = {item.name: item for item in dataset.items}
    assert by_name["long.mp4"].frames == 29 and by_name["long.mp4"].caption == "a grey fade"
    assert by_name["short.webm"].frames == 5 and by_name["short.webm"].caption == "short"
    assert all(by_name[n].frames == 1 and not by_name[n].clip for n in by_name if ".png" in n)
    assert dataset.summary() == f"3 images and 2 clips (2.0 s) in {tmp_path}"
    buckets = dataset_buckets(dataset, 64, multiple=16)
    names = {bucket_name(b) for b in buckets}
    assert {"64x48x29", "64x48x5"} <= names or {"80x48x29", "80x48x5"} <= names, names
    long_bucket = next(b for b, ix in buckets.items() if len(b) == 3 and b[2] == 29)
    example = load_example(by_name["long.mp4"], long_bucket)
    assert example.pixels.shape == (3, 29, long_bucket[1], long_bucket[0])
    levels = (example.pixels.mean(axis=(0, 2, 3)) + 1) * 127.5 / 4
    assert np.allclose(levels, [int(k / 16 * 24 + 1e-9) for k in range(29)], atol=0.3)
    flipped = load_example(by_name["long.mp4"], long_bucket, flip=True)
    assert np.allclose(flipped.pixels, example.pixels[..., ::-1], atol=1e-6)
    # The same folder for an image family: the clips are listed, not read.
    images_only = scan(tmp_path, log_skipped=False)
    assert len(images_only) == 3
    assert any("video clips (ZT_MODEL is an image model" in line for line in images_only.warnings())


def test_broken_and_hostile_clips_are_listed_and_the_rest_trains(tmp_path) -> None:
    good = _write(tmp_path / "good.mp4", 17, 16)
    (tmp_path / "empty.mp4").write_bytes(b"")
    (tmp_path / "noise.mov").write_bytes(os.urandom(4096))
    (tmp_path / "text.mkv").write_text("not a video, just text\n" * 100)
    whole = good.read_bytes()
    (tmp_path / "cut.mp4").write_bytes(whole[: len(whole) // 3])
    os.mkfifo(tmp_path / "pipe.mp4")
    _audio_only(tmp_path / "audio.mkv")
    dataset = scan(tmp_path, log_skipped=False, video=VIDEO)
    assert [item.name for item in dataset.items] == ["good.mp4"]
    reasons = {path.name: why for path, why in dataset.skipped}
    assert reasons["empty.mp4"] == "empty (0 bytes)"
    assert reasons["pipe.mp4"].startswith("not a regular file")
    for name in ("noise.mov", "text.mkv", "cut.mp4"):
        assert reasons[name].startswith("not a video"), (name, reasons[name])
    assert reasons["audio.mkv"] == "no video stream"
    lines = dataset.warnings()
    assert len(lines) <= 4
    assert (
        "skipped 3 files, not a video (unreadable: Invalid data found when processing input)"
        in lines[0]
    )


def test_a_decoding_trap_is_bounded(tmp_path, monkeypatch) -> None:
    """A clip that needs far more frames decoded than sampled (a very high frame rate) is
    refused once the bound is passed, not decoded to its end."""
    trap = _write(tmp_path / "trap.mp4", 60, 240)
    monkeypatch.setattr(clips, "DECODED_PER_SAMPLED", 4)
    found = clips.probe(trap, fps=16, frames=9, step=STEP)
    assert found.size is None and found.reason.startswith("too many frames per second")


def test_a_scan_index_is_kept_per_sampling(tmp_path) -> None:
    _write(tmp_path / "a.mp4", 48, 24)
    index = tmp_path / "index" / "scan.json"
    first = scan(tmp_path, log_skipped=False, video=VIDEO, index=index)
    assert scan(tmp_path, log_skipped=False, video=VIDEO, index=index) == first
    fewer = clips.Video(fps=16.0, frames=9, step=STEP)
    assert scan(tmp_path, log_skipped=False, video=fewer, index=index).items[0].frames == 9


def test_clip_latents_keep_their_frames(family_demo_dir) -> None:
    """The demo Wan VAE encodes a clip to (channels, latent frames, h, w), normalised."""
    from diffusers import AutoencoderKLWan

    from zerotuner import families

    wan = families.get("wan")
    demo = family_demo_dir("wan")
    vae = AutoencoderKLWan.from_pretrained(demo / "model" / "vae")
    step = 2 ** sum(vae.config.temperal_downsample)
    pixels = torch.rand(2, 3, 4 * step + 1, 32, 32) * 2 - 1
    latents = wan.encode_latents(vae, pixels)
    scale = 32 // latents.shape[-1]
    assert latents.shape == (2, vae.config.z_dim, 5, 32 // scale, 32 // scale)
    image = wan.encode_latents(vae, pixels[:, :, 0])
    assert image.shape == (2, vae.config.z_dim, 32 // scale, 32 // scale)
    assert torch.allclose(image, latents[:, :, 0], atol=1e-4)  # the first frame alone


def test_check_reports_clips_buckets_and_the_latent_cache(family_demo_dir, tmp_path, capsys):
    from zerotuner.cli import main

    demo = family_demo_dir("wan")
    env = {"ZT_MODEL": str(demo / "model"), "ZT_DATA_DIR": str(demo / "data"),
           "ZT_OUTPUT_DIR": str(tmp_path / "out"), "ZT_CACHE_DIR": str(tmp_path / "cache"),
           "ZT_OFFLOAD_DIR": str(tmp_path / "offload"), "ZT_DEVICE": "cpu",
           "ZT_NUM_PROCESSES": "2", "ZT_RESOLUTION": "64", "ZT_METRICS_PORT": "0"}  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "64 images and 8 clips (4.0 s) in" in out
    (line,) = [x for x in out.splitlines() if x.startswith("OK   latent cache")]
    assert "clips of 9 frames" in line and "MiB of latents" in line


def test_huge_clips_are_refused_before_decoding(tmp_path, monkeypatch) -> None:
    """Over the size limit (2 GiB) or the per-frame pixel limit (PIL's bomb limit): listed as
    too large; the limits are lowered here to stand for a huge file."""
    clip = _write(tmp_path / "big.mp4", 9, 16)
    monkeypatch.setattr(clips, "CLIP_BYTES", clip.stat().st_size - 1)
    assert clips.probe(clip, fps=16, frames=9, step=STEP).reason.startswith("too large (over")
    monkeypatch.setattr(clips, "CLIP_BYTES", 2**30)
    monkeypatch.setattr(clips, "MAX_FRAME_PIXELS", 64 * 48 - 1)
    found = clips.probe(clip, fps=16, frames=9, step=STEP)
    assert found.size is None and found.reason == "too large (frames of 64x48 pixels)"


def test_wans_own_480p_is_a_bucket_at_its_step() -> None:
    """Wan plans and trains at 632 px (the area of 832x480) in 16 px steps (its VAE's 8 x its
    patch's 2): 832x480 and 480x832 are buckets; 64 px steps would miss them."""
    assert {(832, 480), (480, 832)} <= set(bucket_sizes(632, multiple=16))
    assert (832, 480) not in bucket_sizes(632, multiple=64)


# --- round 2 (issue 40): a clip bounded as a whole, kept at its bucket's size; one frame ------

MEMORY_PROBE = """
import sys
from pathlib import Path
import av  # its libraries load before the baseline
from zerotuner.data.clips import Video
from zerotuner.data.loading import load_example
from zerotuner.data.scan import scan

def peak():  # this process's own peak (ru_maxrss keeps the forking parent's across exec)
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024

before = peak()
dataset = scan(Path(sys.argv[1]), log_skipped=False, video=Video(16.0, 33, 4))
(item,) = dataset.items
example = load_example(item, (64, 64, item.frames))
print(item.frames, *example.pixels.shape, peak() - before)
"""


def test_a_clip_is_bounded_as_a_whole_and_kept_at_its_buckets_size(tmp_path, monkeypatch):
    """Each sampled frame was kept at the clip's size while scanning and caching (17 frames of
    8192x8192 took 4.47 GB in `check`): the whole clip's pixels are bounded, and one decoded
    frame is held at a time; training keeps each frame at its bucket's size."""
    import subprocess
    import sys

    (tmp_path / "big").mkdir()
    clip = _write(tmp_path / "big" / "big.mp4", 33, 16, codec="mpeg4", size=(1024, 1024))
    run = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(clip.parent)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    *shape, grown = map(int, run.stdout.split())
    assert shape == [33, 3, 33, 64, 64]  # frames trained; (C, F, H, W)
    kept = 33 * 1024 * 1024 * 3  # every frame at the clip's size, as RGB: 104 MB
    # (it grew by 263 MB when each frame was kept as decoded and resized; 37 MB now)
    assert grown < kept, f"peak memory grew by {grown / 2**20:.0f} MiB"

    small = _write(tmp_path / "small.mp4", 9, 16)  # 64x48
    monkeypatch.setattr(clips, "MAX_CLIP_PIXELS", 64 * 48 * 5 - 1)
    found = clips.probe(small, fps=16, frames=9, step=STEP)
    assert found.size is None
    assert found.reason.startswith("too large (5 frames of 64x48 pixels: over "), found.reason
    assert "lower ZT_VIDEO_FRAMES or downscale it" in found.reason
    assert clips.probe(small, fps=16, frames=4, step=STEP).frames == 1  # 4 frames fit


def test_a_clip_of_one_frame_caches_with_the_images(family_demo_dir, tmp_path) -> None:
    """Wan on images and clips shorter than one window (1 frame; 2 round down to 1 by the
    step * k + 1 rule): they share the images' bucket, so they must be shaped as images;
    caching stacked (C, H, W) with (C, 1, H, W) and failed."""
    from zerotuner import families
    from zerotuner.settings.schema import Settings
    from zerotuner.train import caching, model

    demo = family_demo_dir("wan")
    folder = tmp_path / "data"
    folder.mkdir()
    for image in sorted((demo / "data").glob("*.png"))[:2]:
        shutil.copy(image, folder / image.name)
    size = scan(folder, log_skipped=False).items[0].size
    _write(folder / "still.mp4", 1, 16, size=size)
    _write(folder / "two.mp4", 2, 16, size=size)
    s = Settings(model=str(demo / "model"), data_dir=folder, resolution=64,
                 cache_dir=tmp_path / "cache")  # fmt: skip
    conditioning = families.get("wan").configured(s, demo / "model")
    video = clips.video_sampling(s, conditioning, demo / "model")
    dataset = scan(folder, log_skipped=False, video=video)
    assert sorted(item.frames for item in dataset.items) == [1, 1, 1, 1]
    buckets = dataset_buckets(dataset, 64, multiple=16)
    assert len(buckets) == 1  # the clips and the images batch together
    components = model.load_components(
        demo / "model", "wan", gradient_checkpointing=False, with_frozen=False
    )
    features, items, stats = caching.fill(
        s, demo / "model", components, conditioning, dataset, buckets, rank=0, world=1,
        device=torch.device("cpu"), dtype=torch.float32,
    )  # fmt: skip
    assert stats.latents_encoded == 4
    from safetensors.torch import load_file

    shapes = {load_file(features.latent_path(item))["latents"].shape for item in items}
    assert len(shapes) == 1 and len(shapes.pop()) == 3  # (C, h, w) for every one
