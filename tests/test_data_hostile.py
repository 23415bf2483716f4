"""A careless or hostile data folder (issue 27): huge captions, links out of the folder, FIFOs
and devices, link loops, thousands of broken files, images far below the training resolution;
and caching that outlasts the process group's collective timeout on two real ranks.

Each folder test is milliseconds on `scan` or the real `zerotuner check`."""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
from pathlib import Path

import pytest
import trainkit as tk
from PIL import Image

from zerotuner.data.captions import CAPTION_BYTES
from zerotuner.data.dataset import Dataset
from zerotuner.data.files import LINK_OUT
from zerotuner.data.notes import upscale_warning
from zerotuner.data.scan import scan
from zerotuner.errors import ConfigError

MIB = 2**20


def _png(path: Path, size=(32, 32)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (200, 30, 30)).save(path)
    return path


def _scan_within(root: Path, seconds: float = 20.0, **kwargs) -> Dataset:
    """scan in a thread: a FIFO or a device that blocks it fails the test, not the suite."""
    result: dict = {}

    def run() -> None:
        try:
            result["dataset"] = scan(root, **kwargs)
        except BaseException as error:  # noqa: BLE001 - handed to the test
            result["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"scan({root}) still running after {seconds} s"
    if "error" in result:
        raise result["error"]
    return result["dataset"]


def _reasons(dataset: Dataset) -> dict[str, str]:
    return {path.relative_to(dataset.root).as_posix(): why for path, why in dataset.skipped}


# --- captions: read a bounded prefix, warn once ----------------------------------------------


def test_huge_captions_are_cut_to_a_prefix_with_one_warning(tmp_path: Path, caplog) -> None:
    root = tmp_path / "data"
    for name in ("a", "b", "c"):
        _png(root / f"{name}.png")
        (root / f"{name}.txt").write_text("a cat " + "é" * (10 * MIB))  # ~20 MB each
    _png(root / "meta" / "m.png")
    row = '{"file_name": "m.png", "text": "%s"}\n' % ("word " * MIB)  # 5 MB in one line
    (root / "meta" / "metadata.jsonl").write_text(row)

    with caplog.at_level(logging.WARNING, logger="zerotuner.data.scan"):
        dataset = scan(root)
    captions = {item.path.name: item.caption for item in dataset.items}
    for name in ("a.png", "b.png", "c.png", "m.png"):
        assert len(captions[name].encode()) <= CAPTION_BYTES, name
    assert captions["a.png"].startswith("a cat é") and "\ufffd" not in captions["a.png"]
    assert captions["m.png"].startswith("word word")
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1, warned  # one line for all four
    assert warned[0].startswith("4 captions longer than 64 KiB cut")
    assert "a.txt" in warned[0] and "and 1 more" in warned[0]


def test_metadata_lines_too_long_or_too_deep_are_one_line_errors(tmp_path, monkeypatch) -> None:
    _png(tmp_path / "a.png")
    meta = tmp_path / "metadata.jsonl"
    meta.write_text('{"file_name": "a.png", "text": "ok"}\n' + "[" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="metadata.jsonl line 2: expected a JSON object"):
        scan(tmp_path)  # nested 100,000 deep: not a RecursionError traceback

    monkeypatch.setattr("zerotuner.data.captions.METADATA_LINE_BYTES", 1000)  # really 64 MiB
    meta.write_text('{"file_name": "a.png", "text": "%s"}\n' % ("x" * 2000))
    with pytest.raises(ConfigError, match=r"metadata.jsonl line 1: longer than"):
        scan(tmp_path)


# --- links that leave the data folder; special files; loops --------------------------------------


def test_links_out_of_the_data_folder_are_skipped_links_inside_are_read(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    _png(outside / "secret.png")
    (outside / "secret.txt").write_text("a caption nobody meant to train on")
    (outside / "metadata.jsonl").write_text('{"file_name": "meta.png", "text": "from outside"}\n')
    _png(outside / "folder" / "far.png")
    root = tmp_path / "data"
    _png(root / "cat.png")
    (root / "cat.txt").symlink_to(outside / "secret.txt")  # a caption link out
    (root / "stolen.png").symlink_to(outside / "secret.png")  # an image link out
    _png(root / "meta.png")
    (root / "metadata.jsonl").symlink_to(outside / "metadata.jsonl")  # captions from outside
    (root / "far").symlink_to(outside / "folder", target_is_directory=True)  # a folder out
    _png(root / "sub" / "dog.png")
    (root / "sub" / "dog words.txt").write_text("a dog inside")
    (root / "sub" / "dog.txt").symlink_to("dog words.txt")  # links inside are fine
    (root / "alias.png").symlink_to(root / "sub" / "dog.png")

    dataset = _scan_within(root)
    captions = {item.path.relative_to(root).as_posix(): item.caption for item in dataset.items}
    assert captions == {"alias.png": "alias", "cat.png": "cat", "meta.png": "meta",
                        "sub/dog.png": "a dog inside"}  # fmt: skip
    reasons = _reasons(dataset)
    for name in ("cat.txt", "stolen.png", "metadata.jsonl", "far"):
        assert reasons[name] == LINK_OUT, (name, reasons)
    assert "skipped 4 files, links outside the data folder: cat.txt, far, metadata.jsonl and " in (
        "\n".join(dataset.warnings())
    )


def test_fifos_devices_and_link_loops_never_block_or_repeat(tmp_path: Path) -> None:
    root = tmp_path / "data"
    _png(root / "a.png")
    _png(root / "b.png")
    os.mkfifo(root / "b.txt")  # a caption nobody writes: reading it would block forever
    os.mkfifo(root / "pipe.png")
    os.mkfifo(root / "metadata.jsonl")
    (root / "zero.png").symlink_to("/dev/zero")  # endless bytes
    (root / "sub").mkdir()
    _png(root / "sub" / "c.png")
    (root / "sub" / "loop").symlink_to("..", target_is_directory=True)  # data/sub/loop -> data
    (root / "self").symlink_to(".", target_is_directory=True)

    dataset = _scan_within(root)
    names = sorted(item.path.relative_to(root).as_posix() for item in dataset.items)
    assert names == ["a.png", "b.png", "sub/c.png"]  # each once, whatever the loops
    reasons = _reasons(dataset)
    for name in ("b.txt", "pipe.png", "metadata.jsonl"):
        assert reasons[name].startswith("not a regular file"), (name, reasons)
    assert reasons["zero.png"] == LINK_OUT
    assert {i.path.name: i.caption for i in dataset.items}["b.png"] == "b"


# --- thousands of broken files: one summary, in train's log and in check --------------------------


def _many_broken(root: Path, count: int) -> None:
    _png(root / "good.png")
    for i in range(count):
        (root / f"gone-{i:05d}.png").symlink_to(root / "nowhere" / f"{i}.png")  # unreadable
    for i in range(3):
        (root / f"text-{i}.png").write_text("not a picture")


def test_thousands_of_unreadable_files_make_a_short_summary(tmp_path: Path, caplog) -> None:
    root = tmp_path / "data"
    _many_broken(root, 2000)  # 10,000 made 10,000 lines; the summary is as short for any count
    with caplog.at_level(logging.WARNING, logger="zerotuner.data.scan"):
        dataset = scan(root)
    warned = [r.getMessage() for r in caplog.records]
    assert warned == dataset.warnings()
    assert warned == [
        "skipped 2000 files, unreadable (No such file or directory): gone-00000.png, "
        "gone-00001.png, gone-00002.png and 1997 more",
        "skipped 3 files, not an image (unrecognised data): text-0.png, text-1.png, text-2.png",
    ]


def test_check_lists_the_skips_and_the_upscaling(demo_job_env, tmp_path, capsys) -> None:
    from zerotuner.cli import main

    broken = tmp_path / "broken"
    broken.mkdir()
    for i in range(500):
        (broken / f"gone-{i}.png").symlink_to(tmp_path / "nowhere.png")
    demo_job_env.setenv("ZT_DATA_DIR", str(broken))
    assert main(["check"]) == 2
    out = capsys.readouterr().out
    dataset_lines = [line for line in out.splitlines() if " dataset " in line]
    assert "no usable images; 500 file(s) skipped, listed below" in dataset_lines[0]
    assert "skipped 500 files, unreadable (No such file or directory): gone-0.png" in out
    assert "see warnings" not in out

    small = tmp_path / "small"
    for i in range(12):
        _png(small / f"small-{i}.png", size=(96, 96))
    for i in range(28):
        _png(small / f"large-{i}.png", size=(1024, 1024))
    (small / "broken.png").write_text("no")
    demo_job_env.setenv("ZT_DATA_DIR", str(small))
    demo_job_env.setenv("ZT_RESOLUTION", "1024")
    main(["check"])
    out = capsys.readouterr().out
    assert (
        "WARN dataset          12 of 40 images are smaller than 1024 px and will be upscaled "
        in (out)
    )
    assert "(up to 10.7x)" in out
    assert "WARN dataset          skipped 1 file, not an image (unrecognised data): broken.png" in (
        out
    )


def test_upscale_warning_follows_the_resolution(tmp_path: Path) -> None:
    _png(tmp_path / "tiny.png", size=(96, 64))
    _png(tmp_path / "big.png", size=(2048, 2048))
    dataset = scan(tmp_path)
    assert upscale_warning(dataset, 64) is None
    line = upscale_warning(dataset, 1024)
    assert line is not None and line.startswith("1 of 2 images are smaller than 1024 px")


# --- caching longer than the collective timeout, on two real ranks ------------------------------


@pytest.mark.slow
def test_caching_outlasts_the_collective_timeout_and_reports_progress(demo_dir, tmp_path) -> None:
    """Rank 0 encodes for several times ZT_COLLECTIVE_TIMEOUT_SECONDS while rank 1 waits: the
    run finishes, and the log shows caching progress, the upscaling and the skipped file."""
    data_dir = tmp_path / "data"
    for i in range(24):
        _png(data_dir / f"img-{i:02d}.png", size=(96, 96))
    (data_dir / "broken.png").write_text("not a picture")
    timeout = 2  # encoding 24 images at 320 px takes 6 to 15 s here
    config = tk.ds_config(0, steps=1)
    job = tk.write_job(tmp_path / "job.json", model=demo_dir / "model", deepspeed=config,
                    resolution=320)  # fmt: skip
    env = tk.settings_env(
        model=demo_dir / "model", data=data_dir, output=tmp_path / "output",
        cache=tmp_path / "cache", max_steps=1, collective_timeout_seconds=timeout,
    )  # fmt: skip
    proc = tk.run_ranks(tmp_path, env, job_file=job)
    tk.assert_ok(proc, tmp_path)
    log = proc.stdout + proc.stderr
    progress = [line for line in log.splitlines() if "caching: " in line and "ETA" in line]
    assert len(progress) >= 3, log[-4000:]
    took = re.search(r"caching: 25 items in (\d+):(\d+):(\d+)", log)
    assert took, log[-4000:]
    hours, minutes, seconds = map(int, took.groups())
    assert hours * 3600 + minutes * 60 + seconds >= 2 * timeout  # rank 1 waited that long
    assert "24 of 24 images are smaller than 320 px and will be upscaled (up to 3.3x)" in log
    assert "skipped 1 file, not an image (unrecognised data): broken.png" in log


def test_patient_barrier_waits_without_deadline_and_fails_on_a_silent_rank(monkeypatch) -> None:
    """Two ranks on a real TCPStore (as torchrun hosts): a late rank is waited for past the
    store's own 1 s timeout; a rank that gives no sign of life fails rank 0 with one line."""
    from datetime import timedelta

    import torch.distributed as dist

    from zerotuner.errors import ZeroTunerError
    from zerotuner.launch import distributed

    monkeypatch.setattr(distributed, "BEAT_SECONDS", 0.1)
    monkeypatch.setattr(distributed, "POLL_SECONDS", 0.05)
    port = tk.free_port()
    second = timedelta(seconds=1)
    server = dist.TCPStore("127.0.0.1", port, None, True, timeout=second, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, None, False, timeout=second)

    def barrier(store, rank: int, silent=60.0, prefix="test") -> distributed.PatientBarrier:
        made = distributed.PatientBarrier("t", store=store, rank=rank, world=2,
                                          silent_seconds=silent)  # fmt: skip
        made.prefix = prefix  # each process numbers its barriers alike; these share one
        return made

    def late_rank() -> None:
        with barrier(client, 1) as late:
            threading.Event().wait(2.5)
            late.wait()

    other = threading.Thread(target=late_rank, daemon=True)
    with barrier(server, 0) as first:
        other.start()
        first.wait()
    other.join(5)
    assert not other.is_alive()

    alone = barrier(server, 0, silent=1, prefix="silent")  # no rank 1, no beat
    with alone, pytest.raises(ZeroTunerError, match="rank 1 gave no sign of life for 1 s"):
        alone.wait()


# --- round 2 (issue 40): masks the walk leaves out, folders that vanish, repeats in total -------


def test_a_mask_that_is_no_file_leaves_its_picture_out(demo_job_env, tmp_path, capsys) -> None:
    """A mask that is a FIFO, a link out of the folder, a dangling link or a folder cannot say
    which part must not train: its picture is left out too, as a corrupt mask's is."""
    from zerotuner.cli import main

    root = tmp_path / "data"
    for name in ("fifo", "out", "dangling", "folder", "kept"):
        _png(root / f"{name}.png", size=(64, 64))
    os.mkfifo(root / "fifo.mask.png")
    (root / "out.mask.png").symlink_to(_png(tmp_path / "outside" / "mask.png"))
    (root / "dangling.mask.png").symlink_to(tmp_path / "nowhere.png")
    _png(root / "folder.mask.png" / "inside.png")  # a folder named as a mask: not read
    Image.new("L", (64, 64), 255).save(root / "kept.mask.png")
    demo_job_env.setenv("ZT_DATA_DIR", str(root))
    demo_job_env.setenv("ZT_RESOLUTION", "64")
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert f"OK   dataset          1 image in {root}" in out
    assert "1 image with a loss mask" in out
    (line,) = [x for x in out.splitlines() if "its mask is unusable" in x]
    assert line.startswith("WARN dataset          skipped 4 files, its mask is unusable: ")
    for name, why in (("dangling.png", "unreadable (No such file or directory)"),
                      ("folder.png", "not a regular file (a folder)"),
                      ("fifo.png", "not a regular file (a FIFO, socket or device)")):  # fmt: skip
        assert f"{name} ({why})" in line, line
    dataset = _scan_within(root, log_skipped=False)
    assert _reasons(dataset)["out.png"] == f"its mask is unusable ({LINK_OUT})"
    assert [item.name for item in dataset.items] == ["kept.png"]


def test_a_folder_that_vanishes_during_the_scan_is_skipped(demo_job_env, tmp_path, capsys):
    """A subfolder listed and then gone (moved away by another process) is an unreadable
    folder in the summary, as a vanished file is, not an unexpected error."""
    from zerotuner.cli import main

    root = tmp_path / "data"
    _png(root / "a.png", size=(64, 64))
    _png(root / "gone" / "b.png", size=(64, 64))
    walk = os.walk

    def vanishing(top, *args, **kwargs):  # the folder goes right after its parent's listing
        for folder, dirs, files in walk(top, *args, **kwargs):
            if Path(folder) == root and (root / "gone").exists():
                shutil.rmtree(root / "gone")
            yield folder, dirs, files

    demo_job_env.setattr(os, "walk", vanishing)
    demo_job_env.setenv("ZT_DATA_DIR", str(root))
    demo_job_env.setenv("ZT_RESOLUTION", "64")
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert f"OK   dataset          1 image in {root}" in out
    assert "skipped 1 file, unreadable folder (No such file or directory): gone" in out


def test_repeats_are_capped_in_total_and_an_epoch_is_counted(demo_job_env, tmp_path, capsys):
    """Every entry's repeats list its images in each epoch's order: 20 entries of 10,000 held
    2.1 GB a rank. Their sum is capped (one line, exit 2, in the settings path every command and
    `train` take before the ranks); `check` and `plan` say how many samples an epoch holds."""
    from zerotuner.cli import main

    a, b = tmp_path / "a", tmp_path / "b"
    for i in range(3):
        _png(a / f"a{i}.png", size=(64, 64))
    _png(b / "b.png", size=(64, 64))
    (b / "b.mask.png").symlink_to("b.png")  # a mask is not a sample
    datasets = tmp_path / "datasets.yaml"
    datasets.write_text(
        "datasets:\n" + "".join(f"  - {{path: {a}, repeats: 5000}}\n" for _ in range(3))
    )
    demo_job_env.setenv("ZT_DATASETS_FILE", str(datasets))
    demo_job_env.setenv("ZT_RESOLUTION", "64")
    for command in ("check", "plan"):
        assert main([command]) == 2
        out, err = capsys.readouterr()
        lines = [x for x in (out + err).splitlines() if "repeats add up" in x]
        assert "Traceback" not in out + err
        assert len(lines) == 1 or lines[0].startswith("FAIL folders"), out + err  # check: first
        assert (
            f"ZT_DATASETS_FILE={datasets}: the entries' repeats add up to 15000; at most 10000 "
            "in all" in lines[0]
        )

    datasets.write_text(f"datasets:\n  - {{path: {a}, repeats: 4}}\n  - {b}\n")
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "4 images in 2 datasets: 3 images in" in out and "; 13 samples an epoch" in out
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "epoch: 13 samples (the files found, each once per repeat" in out
