"""Windows from long clips (issue 44): ZT_VIDEO_WINDOWS and a dataset's `video_windows` cut a
clip into windows of ZT_VIDEO_FRAMES frames, each an example of its own with its own latents;
the epoch order stays independent of world size and resumable; `check` reports clips, windows
and seconds; bad settings are one line."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
from test_video_data import _write
from trainkit import ENTRYPOINT

from zerotuner.data import clips, order
from zerotuner.data.buckets import dataset_buckets
from zerotuner.data.loading import load_example
from zerotuner.data.scan import scan, scan_sources
from zerotuner.settings.datasets import DatasetSource
from zerotuner.settings.video_windows import HEAD, Windows, parse_windows
from zerotuner.train.feature_cache import CacheItem, FeatureCache

STEP = 4  # Wan's VAE: 4k+1 frames
FRAMES = 9
START = order.Position()


@pytest.mark.parametrize(
    ("windows", "available", "starts"),
    [
        ("head", 100, [0]),
        ("uniform:3", 41, [0, 16, 32]),  # the last window ends with the clip
        ("uniform:1", 41, [0]),
        ("uniform:4", 10, [0, 1]),  # a clip one frame longer than a window: two starts
        ("uniform:5", 9, [0]),  # no room for a second window
        ("slide:8", 41, [0, 8, 16, 24, 32]),
        ("slide:9", 27, [0, 9, 18]),  # chunks: windows side by side
        ("slide:4", 5, [0]),  # a clip shorter than one window trains once
    ],
)
def test_windows_start_where_asked(windows, available, starts) -> None:
    assert parse_windows(windows).starts(available, FRAMES) == starts


@pytest.mark.parametrize("text", ["", "uniform", "uniform:0", "slide:0", "slide:-2", "tail",
                                  "uniform:257", "head:2"])  # fmt: skip
def test_a_window_setting_that_yields_no_window_is_refused(text) -> None:
    with pytest.raises(ValueError, match=r"`head`, `uniform:N`.* S at least 1$"):
        parse_windows(text)


@pytest.fixture(scope="module")
def long_clip_dir(tmp_path_factory):
    """A 40-frame clip at 16 fps (frame i: grey level 4 i) and a 5-frame one, both captioned."""
    folder = tmp_path_factory.mktemp("long-clips")
    _write(folder / "long.mp4", 40, 16, size=(32, 24))
    _write(folder / "short.mp4", 5, 16, size=(32, 24))
    (folder / "long.txt").write_text("a grey fade")
    (folder / "short.txt").write_text("a short fade")
    return folder


def _video(windows: Windows) -> clips.Video:
    return clips.Video(fps=16.0, frames=FRAMES, step=STEP, windows=windows)


def test_a_long_clip_trains_each_window_from_its_own_frames(long_clip_dir, tmp_path) -> None:
    dataset = scan(long_clip_dir, log_skipped=False, video=_video(parse_windows("uniform:3")),
                   index=tmp_path / "index.json")  # fmt: skip
    by_name = {item.name: item for item in dataset.items}
    # 40 sampled frames: windows of 9 start at 0, 15.5 -> 16 and 31; the short clip once (5)
    assert sorted(by_name) == ["long.mp4", "long.mp4#16", "long.mp4#31", "short.mp4"]
    assert [by_name[n].start for n in ("long.mp4", "long.mp4#16", "long.mp4#31")] == [0, 16, 31]
    assert by_name["short.mp4"].frames == 5 and by_name["long.mp4#31"].frames == FRAMES
    assert by_name["long.mp4#16"].caption == "a grey fade"
    # 8 + 8 + 8 sampled intervals of the long clip, 4 of the short one: 28 / 16 fps
    assert dataset.summary() == f"0 images and 2 clips in 4 windows (1.8 s) in {long_clip_dir}"
    for name in ("long.mp4", "long.mp4#16", "long.mp4#31"):
        item = by_name[name]
        example = load_example(item, (32, 24, FRAMES))
        levels = (example.pixels.mean(axis=(0, 2, 3)) + 1) * 127.5 / 4
        assert np.allclose(levels, range(item.start, item.start + FRAMES), atol=0.3), name
    # each window is its own latent in the cache
    cache = FeatureCache(tmp_path / "cache", vae_key="v", text_key="t", flip=False)
    paths = {
        cache.latent_path(CacheItem(i.name, i.content, i.caption, (32, 24, i.frames), print))
        for i in dataset.items
    }
    assert len(paths) == 4
    # the head alone is the clip as it trained before windows, under the same cache key
    head = scan(long_clip_dir, log_skipped=False, video=_video(HEAD),
                index=tmp_path / "index.json")  # fmt: skip
    assert {i.name: i.content for i in head.items}["long.mp4"] == by_name["long.mp4"].content
    assert head.summary() == f"0 images and 2 clips (0.8 s) in {long_clip_dir}"
    # read again from the scan index, which remembers how far each clip was read
    again = scan(long_clip_dir, log_skipped=False, video=_video(parse_windows("slide:8")),
                 index=tmp_path / "index.json")  # fmt: skip
    assert [i.name for i in again.items] == ["long.mp4", "long.mp4#8", "long.mp4#16",
                                             "long.mp4#24", "short.mp4"]  # fmt: skip
    assert [i.start for i in again.items if i.path.name == "long.mp4"] == [0, 8, 16, 24]


def test_a_datasets_entry_cuts_its_own_clips(long_clip_dir, tmp_path) -> None:
    sources = [
        DatasetSource(path=str(long_clip_dir), video_windows="slide:16"),
        DatasetSource(path=str(long_clip_dir)),  # the job's windows: the head
    ]
    dataset = scan_sources(sources, tmp_path / "cache", log_skipped=False,
                           video=_video(HEAD))  # fmt: skip
    starts = [(i.name, i.start) for i in dataset.items]
    assert starts == [("long.mp4", 0), ("long.mp4#16", 16), ("short.mp4", 0),
                      ("long.mp4", 0), ("short.mp4", 0)]  # fmt: skip


def test_windows_keep_the_global_order_on_any_world_size_and_after_a_resume(
    long_clip_dir, tmp_path
) -> None:
    dataset = scan(long_clip_dir, log_skipped=False, video=_video(parse_windows("uniform:9")))
    assert len(dataset) == 10  # 9 windows of the long clip, 1 of the short one
    buckets = dataset_buckets(dataset, 32, multiple=16)

    def run(world: int, take: int, start: order.Position = START) -> list[list[int]]:
        """The global batches `take` rounds of `world` ranks train, from `start`."""
        streams = [order.iterate_batches(dataset, buckets, micro_batch=1, rank=r,
                                         world_size=world, seed=7, start=start)
                   for r in range(world)]  # fmt: skip
        return [next(stream)[0] for _ in range(take) for stream in streams]

    one = run(1, 20)
    assert run(2, 10) == one  # 2 ranks take every other batch of the same global order
    # a resume on 1 rank from where 2 ranks stopped after 4 rounds goes on with batch 8
    assert run(1, 12, order.Position(epoch=0, batch=8)) == one[8:20]
    names = {dataset.items[i].name for batch in one[:10] for i in batch}
    assert len(names) == 10  # an epoch trains every window once


def test_check_reports_windows_and_refuses_a_bad_setting(family_demo_dir, tmp_path) -> None:
    demo = family_demo_dir("wan")
    env = {"ZT_MODEL": str(demo / "model"), "ZT_DATA_DIR": str(demo / "data"),
           "ZT_OUTPUT_DIR": str(tmp_path / "out"), "ZT_CACHE_DIR": str(tmp_path / "cache"),
           "ZT_OFFLOAD_DIR": str(tmp_path / "offload"), "ZT_DEVICE": "cpu",
           "ZT_RESOLUTION": "64", "ZT_METRICS_PORT": "0", "ZT_VIDEO_FRAMES": "5",
           "ZT_VIDEO_WINDOWS": "slide:4"}  # fmt: skip
    env = {**os.environ, **env}
    done = subprocess.run([ENTRYPOINT, "check"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # the demo's 8 clips of 9 frames: windows of 5 at 0 and 4
    assert "64 images and 8 clips in 16 windows (4.0 s) in" in done.stdout
    env["ZT_VIDEO_WINDOWS"] = "slide:0"
    done = subprocess.run([ENTRYPOINT, "check"], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr + done.stdout
    (line,) = [x for x in (done.stdout + done.stderr).splitlines() if "ZT_VIDEO_WINDOWS" in x]
    assert "`head`, `uniform:N`" in line and line.count("'slide:0'") == 1
    datasets = tmp_path / "datasets.yaml"
    datasets.write_text(f"datasets:\n  - path: {demo / 'data'}\n    video_windows: uniform:0\n")
    env.update(ZT_VIDEO_WINDOWS="head", ZT_DATASETS_FILE=str(datasets))
    done = subprocess.run([ENTRYPOINT, "check"], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr + done.stdout
    out = done.stdout + done.stderr
    lines = [line for line in out.splitlines() if "datasets[0].video_windows" in line]
    assert lines and all(line.count("'uniform:0'") == 1 for line in lines), out
