"""The offload volume on real filesystems: loop devices, tmpfs, overlay and read-only mounts.

These tests mount things, so they need root (this machine and CI containers run as root);
each mount is undone by its fixture.
"""

from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path

import pytest

from zerotuner.errors import ConfigError, EnvironmentUnfit
from zerotuner.machine.hardware import GiB, MiB
from zerotuner.machine.offload_volume import (
    Mount,
    device_kind,
    filesystem_of,
    mount_for,
    mounted_offload_device,
    parse_mounts,
    prepare_offload_dir,
    required_free,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def mounts():
    """mount(kind, target, ...) that unmounts everything it mounted at teardown."""
    done: list[Path] = []

    def mount(*args: str, target: Path) -> Path:
        target.mkdir(parents=True, exist_ok=True)
        sh("mount", *args, str(target))
        done.append(target)
        return target

    yield mount
    for target in reversed(done):
        subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.fixture
def loop_device(tmp_path):
    """make(size_mib, fmt) -> /dev/loopN backed by a file; detached at teardown."""
    made: list[str] = []

    def make(size_mib: int = 64, *, fmt: bool = False) -> str:
        image = tmp_path / f"disk{len(made)}.img"
        with open(image, "wb") as f:
            f.truncate(size_mib * MiB)
        device = sh("losetup", "-f", "--show", str(image))
        made.append(device)
        if fmt:
            sh("mkfs.ext4", "-q", device)
        return device

    yield make
    for device in made:
        subprocess.run(["umount", device], capture_output=True, check=False)
        subprocess.run(["losetup", "-d", device], check=False)


def stale_tree(root: Path) -> list[Path]:
    """What DeepSpeed leaves under nvme_path after a run."""
    files = [
        root / "zero_stage_3" / "optimizer" / "rank0" / "140.tensor.swp",
        root / "zero_stage_3" / "optimizer" / "rank0" / "140_gradient_0_64.tensor.swp",
        root / "zero_stage_3" / "bfloat16params" / "rank1" / "7_param.tensor.swp",
    ]
    for f in files:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x" * 4096)
    return files


# --- pure decisions -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fstype", "source", "rotational", "kind"),
    [
        ("ext4", "/dev/nvme0n1p1", False, "nvme"),
        ("xfs", "/dev/sdb1", False, "ssd"),
        ("ext4", "/dev/sda1", True, "rotational"),
        ("nfs4", "filer:/export", None, "network"),
        ("fuse.gcsfuse", "bucket", None, "network"),
        ("tmpfs", "tmpfs", None, "tmpfs"),
        ("overlay", "overlay", None, "overlay"),
        ("ext4", "/dev/mapper/x", None, "unknown"),
    ],
)
def test_device_kind(fstype, source, rotational, kind):
    assert device_kind(fstype, source, rotational) == kind


def test_mount_for_picks_the_deepest_mount():
    mounts = parse_mounts(
        "overlay / overlay rw 0 0\n/dev/nvme0n1 /offload ext4 rw 0 0\n"
        "tmpfs /offload/x tmpfs rw 0 0\n/dev/sda /offloadx ext4 rw 0 0\n"
    )
    assert mount_for(Path("/offload/a/b"), mounts) == Mount("/offload", "/dev/nvme0n1", "ext4")
    assert mount_for(Path("/offloadx"), mounts).source == "/dev/sda"
    assert mount_for(Path("/data"), mounts).fstype == "overlay"


def test_margin():
    assert required_free(0) == 0
    assert required_free(1 * GiB) == 2 * GiB  # at least 1 GiB of margin
    assert required_free(100 * GiB) == 110 * GiB


# --- the offload dir on real filesystems --------------------------------------------------------


def test_missing_dir_is_created(tmp_path):
    path = tmp_path / "a" / "offload"
    report = prepare_offload_dir(path, need_bytes=0, nvme=True)
    assert path.is_dir() and report.created
    assert report.o_direct is True  # ext4 here
    assert report.fstype == "ext4"


def test_check_mode_does_not_create_or_clean(tmp_path):
    path = tmp_path / "offload"
    report = prepare_offload_dir(path, need_bytes=0, nvme=True, create=False)
    assert not path.exists() and "train creates it" in report.warnings[0]
    files = stale_tree(tmp_path)
    report = prepare_offload_dir(tmp_path, need_bytes=0, nvme=True, clean=False)
    assert report.removed == () and all(f.exists() for f in files)


def test_read_only_is_refused(tmp_path, mounts):
    source = tmp_path / "src"
    source.mkdir()
    target = mounts("--bind", str(source), target=tmp_path / "ro")
    sh("mount", "-o", "remount,bind,ro", str(target))
    with pytest.raises(EnvironmentUnfit, match="not writable .read-only filesystem") as info:
        prepare_offload_dir(target, need_bytes=0, nvme=True)
    assert str(target) in str(info.value) and info.value.exit_code == 3


def test_too_small_is_refused_with_the_numbers(tmp_path, mounts):
    target = mounts("-t", "tmpfs", "-o", "size=32m", "tmpfs", target=tmp_path / "small")
    with pytest.raises(EnvironmentUnfit, match=r"has 0.0 GiB free; NVMe offload needs 1.1 GiB"):
        prepare_offload_dir(target, need_bytes=100 * MiB, nvme=True)


def test_small_loop_fs_is_measured_after_cleaning_stale_swap(tmp_path, mounts, loop_device):
    device = loop_device(64, fmt=True)
    target = mounts(device, target=tmp_path / "loop")
    big = target / "zero_stage_3" / "optimizer" / "rank0" / "1.tensor.swp"
    big.parent.mkdir(parents=True)
    big.write_bytes(b"x" * 30 * MiB)
    report = prepare_offload_dir(target, need_bytes=0, nvme=True)
    assert report.fstype == "ext4" and report.source == device
    assert report.o_direct is True
    assert 40 * MiB < report.free_bytes < 64 * MiB


def test_a_filesystem_refusing_o_direct_is_refused_with_what_to_do(tmp_path, mounts):
    # tmpfs accepts O_DIRECT since Linux 6.6; ramfs still refuses it, as older tmpfs did.
    target = mounts("-t", "ramfs", "ramfs", target=tmp_path / "ram")
    with pytest.raises(EnvironmentUnfit, match="refuses O_DIRECT") as info:
        prepare_offload_dir(target, need_bytes=0, nvme=True)
    assert "mount an ext4/xfs disk there" in str(info.value)
    report = prepare_offload_dir(target, need_bytes=0, nvme=False)  # CPU offload: unused
    assert report.device_kind == "tmpfs" and report.o_direct is None


def test_stale_swap_dirs_are_removed_and_nothing_else(tmp_path):
    files = stale_tree(tmp_path)
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")
    report = prepare_offload_dir(tmp_path, need_bytes=0, nvme=True)
    assert report.removed == (str(tmp_path / "zero_stage_3"),)
    assert not any(f.exists() for f in files)
    assert keep.read_text() == "mine"


def test_symlinks_pointing_outside_are_never_followed(tmp_path):
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "model.safetensors").write_text("weights")
    offload = tmp_path / "offload"
    offload.mkdir()
    # The stale entry itself is a link out of the offload dir...
    (offload / "zero_stage_3").symlink_to(outside)
    prepare_offload_dir(offload, need_bytes=0, nvme=True)
    assert not (offload / "zero_stage_3").exists()
    assert (outside / "model.safetensors").read_text() == "weights"
    # ...or a link hides inside a real stale tree.
    stale_tree(offload)
    (offload / "zero_stage_3" / "optimizer" / "escape").symlink_to(outside)
    prepare_offload_dir(offload, need_bytes=0, nvme=True)
    assert not (offload / "zero_stage_3").exists()
    assert (outside / "model.safetensors").read_text() == "weights"


def test_overlay_is_refused_for_nvme_with_the_flag_to_add(tmp_path, mounts):
    for d in ("lower", "upper", "work"):
        (tmp_path / d).mkdir()
    options = f"lowerdir={tmp_path}/lower,upperdir={tmp_path}/upper,workdir={tmp_path}/work"
    root = mounts("-t", "overlay", "overlay", "-o", options, target=tmp_path / "merged")
    offload = root / "offload"
    with pytest.raises(EnvironmentUnfit, match="writable layer") as info:
        prepare_offload_dir(offload, need_bytes=0, nvme=True)
    assert f"-v /fast/disk:{offload}" in str(info.value)
    report = prepare_offload_dir(offload, need_bytes=0, nvme=False)  # unused: fine
    assert report.device_kind == "overlay"


# --- mounting ZT_OFFLOAD_DEVICE -----------------------------------------------------------------


def _mounted_at(path: Path) -> Mount | None:
    hit = mount_for(path, parse_mounts(Path("/proc/mounts").read_text()))
    return hit if hit and hit.mount_point == str(path) else None


def test_blank_device_is_formatted_only_when_allowed(tmp_path, loop_device):
    device = loop_device(64)
    target = tmp_path / "offload"
    with (
        pytest.raises(ConfigError, match="ZT_OFFLOAD_FORMAT=true"),
        mounted_offload_device(device, target, allow_format=False),
    ):
        pass
    assert filesystem_of(device) is None  # untouched
    with mounted_offload_device(device, target, allow_format=True) as done:
        assert done.startswith("formatted and mounted ext4")
        assert _mounted_at(target).source == device
        report = prepare_offload_dir(target, need_bytes=0, nvme=True)
        assert report.o_direct
    assert _mounted_at(target) is None  # unmounted at exit
    assert filesystem_of(device) == "ext4"


def test_device_with_a_filesystem_is_mounted_never_formatted(tmp_path, loop_device):
    device = loop_device(64, fmt=True)
    target = tmp_path / "offload"
    with mounted_offload_device(device, target, allow_format=True) as done:
        assert done == f"mounted ext4 {device} at {target}"
        (target / "kept.txt").write_text("data")
    with mounted_offload_device(device, target, allow_format=True) as done:
        assert not done.startswith("formatted")
        assert (target / "kept.txt").read_text() == "data"


@pytest.mark.parametrize("content", ["partition table", "raw data"])
def test_device_holding_data_is_never_formatted(tmp_path, loop_device, content):
    device = loop_device(16)
    with open(device, "r+b") as f:
        if content == "partition table":  # an MBR with one Linux partition
            entry = struct.pack("<B3sB3sII", 0, b"\0\0\0", 0x83, b"\0\0\0", 2048, 8192)
            f.seek(446)
            f.write(entry)
            f.seek(510)
            f.write(b"\x55\xaa")
        else:
            f.seek(4096)
            f.write(os.urandom(512))
    before = Path(device).read_bytes()
    with (
        pytest.raises(EnvironmentUnfit, match="never formats a device holding data"),
        mounted_offload_device(device, tmp_path / "offload", allow_format=True),
    ):
        pass
    assert Path(device).read_bytes() == before


def test_not_a_block_device(tmp_path):
    image = tmp_path / "file.img"
    image.write_bytes(b"")
    with (
        pytest.raises(ConfigError, match="not a block device"),
        mounted_offload_device(str(image), tmp_path / "o", allow_format=True),
    ):
        pass
    with (
        pytest.raises(ConfigError, match="no such device"),
        mounted_offload_device("/dev/does-not-exist", tmp_path / "o", allow_format=True),
    ):
        pass
