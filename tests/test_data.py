"""The dataset layer on real files: captions, odd image modes, broken files, buckets, order."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from zerotuner.data.buckets import assign_buckets, bucket_sizes, nearest_bucket
from zerotuner.data.dataset import Dataset, Item
from zerotuner.data.loading import load_example
from zerotuner.data.order import (
    Position,
    batches,
    batches_per_epoch,
    epoch_batches,
    iterate_batches,
)
from zerotuner.data.probe import EXIF_ORIENTATION
from zerotuner.data.scan import scan
from zerotuner.errors import EXIT_CONFIG, ConfigError

RED, BLUE = (255, 0, 0), (0, 0, 255)


def _png(path: Path, size=(32, 32), colour=RED, mode="RGB") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, colour).save(path)
    return path


def _rotated_jpeg(path: Path) -> Path:
    """Stored landscape 40x20 (left red, right blue), EXIF says rotate 90 degrees clockwise."""
    image = Image.new("RGB", (40, 20), RED)
    image.paste(Image.new("RGB", (20, 20), BLUE), (20, 0))
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6
    image.save(path, "JPEG", exif=exif, quality=95)
    return path


@pytest.fixture
def mixed_dir(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    _png(root / "sidecar.png")
    (root / "sidecar.txt").write_text("  a caption from the sidecar \n")
    _png(root / "sub" / "meta.png")
    (root / "sub" / "metadata.jsonl").write_text(
        json.dumps({"file_name": "meta.png", "text": "from metadata"}) + "\n\n"
    )
    _png(root / "0042_blue_car-photo.png")
    _rotated_jpeg(root / "rotated.jpg")
    _png(root / "alpha.png", colour=(0, 0, 0, 0), mode="RGBA")
    _png(root / "grey.png", colour=128, mode="L")
    _png(root / "deep" / "er" / "picture.webp")
    palette = Image.new("P", (16, 16), 0)
    palette.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    palette.save(root / "palette.png", transparency=0)
    Image.fromarray(np.full((8, 8), 65535, dtype=np.uint16)).save(root / "sixteen.png")
    # The broken ones.
    (root / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    whole = io.BytesIO()
    Image.effect_noise((256, 256), 60).convert("RGB").save(whole, "JPEG")
    (root / "truncated.jpg").write_bytes(whole.getvalue()[: len(whole.getvalue()) // 2])
    (root / "notes.png").write_text("this is text, not a picture")
    (root / "table.csv").write_text("a,b\n")
    Image.new("RGB", (8, 8)).save(root / "old.bmp")
    _png(root / ".hidden" / "ignored.png")
    (root / "._sidecar.png").write_bytes(b"AppleDouble junk")
    return root


def test_scan_reads_captions_from_sidecar_metadata_and_file_name(mixed_dir: Path) -> None:
    dataset = scan(mixed_dir)
    captions = {item.path.name: item.caption for item in dataset.items}
    assert captions["sidecar.png"] == "a caption from the sidecar"
    assert captions["meta.png"] == "from metadata"
    assert captions["0042_blue_car-photo.png"] == "blue car photo"
    assert "picture.webp" in captions  # found recursively, WebP read
    assert "ignored.png" not in captions and "._sidecar.png" not in captions


def test_scan_skips_broken_files_once_each_and_counts_them(
    mixed_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="zerotuner.data.scan"):
        dataset = scan(mixed_dir)
    reasons = {path.name: reason for path, reason in dataset.skipped}
    assert set(reasons) == {"corrupt.png", "truncated.jpg", "notes.png", "table.csv", "old.bmp"}
    assert reasons["truncated.jpg"].startswith("truncated")
    assert reasons["notes.png"].startswith("not an image")
    assert "'.bmp' files are not read" in reasons["old.bmp"]
    assert len(dataset.items) == 9
    warned = [r.getMessage() for r in caplog.records]
    assert warned == dataset.warnings()  # one line per kind of skip (test_data_hostile.py)
    assert all(sum(name in message for message in warned) == 1 for name in reasons)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zerotuner.data.scan"):
        assert len(scan(mixed_dir, log_skipped=False).skipped) == 5
    assert not caplog.records


def test_scan_records_oriented_size_and_content_digest(mixed_dir: Path) -> None:
    items = {item.path.name: item for item in scan(mixed_dir).items}
    assert items["rotated.jpg"].size == (20, 40)  # portrait after EXIF orientation
    assert items["sidecar.png"].digest == items["meta.png"].digest  # same bytes
    assert items["sidecar.png"].digest != items["grey.png"].digest
    item = items["sidecar.png"]
    assert item.file_size == item.path.stat().st_size
    assert item.mtime_ns == item.path.stat().st_mtime_ns


def test_index_lets_a_restart_skip_unchanged_files(mixed_dir: Path, tmp_path: Path) -> None:
    index = tmp_path / "cache" / "dataset-index.json"
    first = scan(mixed_dir, index=index)
    assert index.is_file()
    assert scan(mixed_dir, index=index) == first

    # Same size and mtime: trusted from the index without reading (the stale digest shows it).
    path = mixed_dir / "sidecar.png"
    stat = path.stat()
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    again = {i.path.name: i for i in scan(mixed_dir, index=index).items}
    assert (
        again["sidecar.png"].digest == {i.path.name: i for i in first.items}["sidecar.png"].digest
    )

    # A changed mtime is read again: the digest follows the new bytes.
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    rescanned = {i.path.name: i for i in scan(mixed_dir, index=index).items}
    assert rescanned["sidecar.png"].digest != again["sidecar.png"].digest

    index.write_text("{not json")  # a damaged index only costs a full scan
    assert scan(mixed_dir, index=index).items == tuple(rescanned.values())


def test_load_example_applies_exif_and_converts_modes(mixed_dir: Path) -> None:
    items = {item.path.name: item for item in scan(mixed_dir).items}
    rotated = load_example(items["rotated.jpg"], (16, 32))
    assert rotated.pixels.shape == (3, 32, 16)
    # Displayed upright, the red half is on top and the blue half at the bottom.
    assert rotated.pixels[0, :8].mean() > 0.8 and rotated.pixels[2, :8].mean() < -0.8
    assert rotated.pixels[2, -8:].mean() > 0.8 and rotated.pixels[0, -8:].mean() < -0.8
    assert rotated.original_size == (40, 20)

    for name in ("alpha.png", "palette.png", "sixteen.png"):  # transparent / 16-bit white
        example = load_example(items[name], (32, 32))
        assert example.pixels.shape == (3, 32, 32)
        assert example.pixels.min() > 0.99, name
    grey = load_example(items["grey.png"], (32, 32)).pixels
    assert np.allclose(grey, grey[0]) and abs(float(grey.mean()) - (128 / 127.5 - 1)) < 0.01


def test_load_example_covers_the_bucket_center_crops_and_flips(tmp_path: Path) -> None:
    image = np.zeros((100, 200, 3), dtype=np.uint8)
    image[:, :100] = RED
    image[:, 100:] = BLUE
    Image.fromarray(image).save(tmp_path / "wide.png")
    item = scan(tmp_path).items[0]

    example = load_example(item, (64, 64))
    assert example.pixels.dtype == np.float32 and example.pixels.shape == (3, 64, 64)
    assert example.pixels.min() >= -1.0 and example.pixels.max() <= 1.0
    assert example.original_size == (100, 200)
    assert example.target_size == (64, 64)
    assert example.crop_top_left == (0, 32)  # resized to 128x64, 32 px cut on each side
    assert example.pixels[0, :, :16].mean() > 0.9  # left is red

    flipped = load_example(item, (64, 64), flip=True)
    assert np.array_equal(flipped.pixels, example.pixels[:, :, ::-1])
    assert flipped.pixels[2, :, :16].mean() > 0.9  # left is blue now

    # An odd margin: the mirrored crop starts one pixel further right (129 px wide, 32 + 33).
    Image.fromarray(np.zeros((100, 201, 3), dtype=np.uint8)).save(tmp_path / "odd.png")
    odd = next(i for i in scan(tmp_path).items if i.path.name == "odd.png")
    assert load_example(odd, (64, 64)).crop_top_left == (0, 32)
    assert load_example(odd, (64, 64), flip=True).crop_top_left == (0, 33)


def test_empty_or_missing_data_dir_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "readme.txt").write_text("no images here")
    with pytest.raises(ConfigError, match="ZT_DATA_DIR=.*no usable images") as empty:
        scan(tmp_path)
    assert empty.value.exit_code == EXIT_CONFIG
    with pytest.raises(ConfigError, match="ZT_DATA_DIR=.*no such directory"):
        scan(tmp_path / "missing")
    (tmp_path / "broken.png").write_text("not a png")
    with pytest.raises(ConfigError, match="1 file.s. skipped"):
        scan(tmp_path)


def test_malformed_metadata_names_file_and_line(tmp_path: Path) -> None:
    _png(tmp_path / "a.png")
    (tmp_path / "metadata.jsonl").write_text('{"file_name": "a.png", "text": "ok"}\n{"text": 1}\n')
    with pytest.raises(ConfigError, match="metadata.jsonl line 2"):
        scan(tmp_path)


# --- buckets -------------------------------------------------------------------------------


def test_buckets_keep_area_and_multiple() -> None:
    sizes = bucket_sizes(1024)
    assert (1024, 1024) in sizes and (832, 1216) in sizes and (1216, 832) in sizes
    for w, h in sizes:
        assert w % 64 == 0 and h % 64 == 0
        assert 0.75 * 1024**2 <= w * h <= 1024**2
        assert max(w / h, h / w) <= 4
    with pytest.raises(ConfigError, match="ZT_RESOLUTION=32"):
        bucket_sizes(32)


@settings(max_examples=200, deadline=None)
@given(st.integers(16, 4000), st.integers(16, 4000))
def test_nearest_bucket_matches_orientation_and_is_closest(w: int, h: int) -> None:
    sizes = bucket_sizes(512, multiple=32)
    bw, bh = nearest_bucket((w, h), sizes)
    if w / h > 1.2:
        assert bw > bh
    elif h / w > 1.2:
        assert bh > bw
    distance = abs(np.log(bw / bh) - np.log(w / h))
    assert all(distance <= abs(np.log(x / y) - np.log(w / h)) + 1e-12 for x, y in sizes)


def test_assign_buckets_groups_every_item(mixed_dir: Path) -> None:
    items = scan(mixed_dir).items
    buckets = assign_buckets(items, 64, multiple=16)
    assert sorted(i for group in buckets.values() for i in group) == list(range(len(items)))
    rotated = next(i for i, item in enumerate(items) if item.path.name == "rotated.jpg")
    (bucket,) = [size for size, group in buckets.items() if rotated in group]
    assert bucket == (48, 80)  # 1:2 portrait: 48x80 (1:1.67) is closer than 32x128 (1:4)


# --- batch order ---------------------------------------------------------------------------


def _fake(sizes: dict[tuple[int, int], int]) -> tuple[Dataset, dict]:
    buckets, n = {}, 0
    for size, count in sizes.items():
        buckets[size] = list(range(n, n + count))
        n += count
    item = Item(Path("x.png"), "", (1, 1), 1, 1, "d")
    return Dataset(Path("."), (item,) * n, ()), buckets


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(1, 23), min_size=1, max_size=5),
    micro_batch=st.integers(1, 6),
    world_size=st.integers(1, 5),
    seed=st.integers(0, 2**31),
)
def test_batches_are_even_across_ranks_single_bucket_and_complete(
    counts: list[int], micro_batch: int, world_size: int, seed: int
) -> None:
    dataset, buckets = _fake({(64 * (i + 1), 64): c for i, c in enumerate(counts)})
    per_rank = [
        batches(
            dataset,
            buckets,
            micro_batch=micro_batch,
            rank=r,
            world_size=world_size,
            seed=seed,
            epoch=3,
        )
        for r in range(world_size)
    ]
    expected = batches_per_epoch(buckets, micro_batch=micro_batch, world_size=world_size)
    assert {len(b) for b in per_rank} == {expected}
    home = {i: size for size, group in buckets.items() for i in group}
    seen = set()
    for batch in (b for rank in per_rank for b in rank):
        assert len(batch) == micro_batch
        assert len({home[i] for i in batch}) == 1  # one bucket per batch
        seen.update(batch)
    assert seen == set(range(len(dataset)))  # nothing dropped


def test_batch_order_is_deterministic_and_reshuffled_per_epoch() -> None:
    dataset, buckets = _fake({(64, 64): 40, (128, 64): 24})

    def order(seed: int, epoch: int) -> list[list[int]]:
        kw = {"micro_batch": 4, "rank": 1, "world_size": 2}
        return batches(dataset, buckets, seed=seed, epoch=epoch, **kw)

    assert order(7, 0) == order(7, 0)
    assert order(7, 0) != order(7, 1)
    assert order(7, 0) != order(8, 0)


@pytest.mark.parametrize("world_size,resume_world", [(2, 2), (1, 1), (2, 1)])
def test_resume_from_a_position_continues_the_same_order(world_size, resume_world) -> None:
    dataset, buckets = _fake({(64, 64): 21, (128, 64): 10})
    kw = {"micro_batch": 3, "seed": 5}

    def run(rank: int, world: int, start: Position, n: int):
        it = iterate_batches(dataset, buckets, rank=rank, world_size=world, start=start, **kw)
        return [next(it) for _ in range(n)]

    first = run(0, world_size, Position(), 30)  # crosses into the next epochs
    assert first[-1][1].epoch >= 2
    stop = first[12][1]
    if resume_world == world_size:
        assert run(0, world_size, stop, 17) == first[13:]
    else:  # a world-size change continues the global order at the same place
        global_order = [b for p in range(3) for b in epoch_batches(buckets, epoch=p, **kw)]
        per_epoch = len(epoch_batches(buckets, epoch=0, **kw))
        resumed = [b for b, _ in run(0, resume_world, stop, 5)]
        offset = stop.epoch * per_epoch + stop.batch
        assert resumed == global_order[offset : offset + 5]
