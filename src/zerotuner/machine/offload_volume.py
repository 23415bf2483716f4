"""The NVMe offload volume: mount it, check it, and clear stale swap files before launch.

DeepSpeed's async I/O writes with O_DIRECT to `<nvme_path>/zero_stage_3/...`. A directory on
the container's writable layer (overlay: the user forgot `-v`), a full disk, a filesystem that
refuses O_DIRECT, or swap files left by an earlier run (which a resume would read as state)
all fail late and obscurely inside the ranks; here they fail before launch with the fix.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from zerotuner.errors import ConfigError, EnvironmentUnfit
from zerotuner.machine.hardware import GiB, MiB

# What DeepSpeed writes under nvme_path (runtime/swap_tensor, runtime/zero/stage3.py):
# zero_stage_3/optimizer/rank*/*.tensor.swp and zero_stage_3/<dtype>params/rank*/*.swp.
STALE_ENTRIES = ("zero_stage_3",)
DISK_MARGIN = 0.10
MIN_MARGIN = 1 * GiB
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "beegfs",
              "gpfs", "9p", "virtiofs", "afs"}  # fmt: skip
MEMORY_FS = {"tmpfs", "ramfs"}
ALIGN = 4096
SYSFS = Path("/sys")


@dataclass(frozen=True)
class Mount:
    mount_point: str
    source: str
    fstype: str


@dataclass(frozen=True)
class OffloadReport:
    path: Path
    created: bool
    fstype: str
    device_kind: str  # nvme | ssd | rotational | network | tmpfs | overlay | unknown
    source: str
    free_bytes: int
    need_bytes: int
    o_direct: bool | None  # None: not tested
    removed: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def summary(self) -> str:
        return (
            f"{self.path}: {self.fstype} on {self.source} ({self.device_kind}), "
            f"{self.free_bytes / GiB:.1f} GiB free, need {self.need_bytes / GiB:.1f} GiB"
            + ("" if self.o_direct is None else f", O_DIRECT {'ok' if self.o_direct else 'no'}")
        )


# --- pure decisions ---------------------------------------------------------------------------


def parse_mounts(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            point = parts[1].replace("\\040", " ")
            mounts.append(Mount(point, parts[0], parts[2]))
    return mounts


def mount_for(path: Path, mounts: list[Mount]) -> Mount | None:
    """The mount holding `path` (longest mount point prefix; the last one mounted wins)."""
    target = str(path)
    best: Mount | None = None
    for m in mounts:
        point = m.mount_point.rstrip("/") or "/"
        inside = target == point or target.startswith(point + "/") or point == "/"
        if inside and (best is None or len(point) >= len(best.mount_point.rstrip("/") or "/")):
            best = m
    return best


def device_kind(fstype: str, source: str, rotational: bool | None) -> str:
    if fstype == "overlay":
        return "overlay"
    if fstype in MEMORY_FS:
        return "tmpfs"
    if fstype in NETWORK_FS or fstype.startswith("fuse.") or ":" in source:
        return "network"
    name = Path(source).name
    if name.startswith("nvme"):
        return "nvme"
    if rotational is None:
        return "unknown"
    return "rotational" if rotational else "ssd"


def required_free(need_bytes: int) -> int:
    return need_bytes + max(int(need_bytes * DISK_MARGIN), MIN_MARGIN) if need_bytes else 0


def refusal(kind: str, path: Path, *, nvme: bool) -> str | None:
    """Why this volume cannot hold NVMe swap, with the fix; None when it can."""
    if not nvme:
        return None
    if kind == "overlay":
        return (
            f"ZT_OFFLOAD_DIR={path} is on the container's own writable layer (overlay): NVMe "
            f"offload there is slow and lost with the container; mount a fast disk with "
            f"`-v /fast/disk:{path}` (docker) or a volume at {path} (Kubernetes)"
        )
    return None


def advice(kind: str, path: Path, *, nvme: bool) -> list[str]:
    if not nvme:
        return []
    if kind == "tmpfs":
        return [f"ZT_OFFLOAD_DIR={path} is tmpfs: NVMe offload there uses host RAM; mount a disk"]
    if kind == "network":
        return [f"ZT_OFFLOAD_DIR={path} is a network filesystem: NVMe offload will be slow"]
    if kind == "rotational":
        return [f"ZT_OFFLOAD_DIR={path} is on a rotational disk: NVMe offload will be slow"]
    return []


# --- probing ----------------------------------------------------------------------------------


def _read_mounts() -> list[Mount]:
    return parse_mounts(Path("/proc/mounts").read_text())


def rotational(folder: Path, source: str, *, sysfs: Path | None = None) -> bool | None:
    """queue/rotational of the disk holding `folder` (a partition's parent disk).

    Found by the folder's device number (/sys/dev/block/MAJ:MIN), which holds inside
    containers where /proc/mounts names a /dev/root or /dev/mapper node absent from /dev; else
    by the mount's source name. None when neither leads to a disk (tmpfs, overlay, network).
    """
    sysfs = sysfs or SYSFS
    blocks = []
    with contextlib.suppress(OSError):
        dev = os.stat(folder).st_dev
        if os.major(dev):  # 0: an anonymous device (tmpfs, overlay, btrfs subvolume)
            blocks.append(sysfs / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}")
    if source.startswith("/dev/"):
        blocks.append(sysfs / "class" / "block" / Path(os.path.realpath(source)).name)
    for block in blocks:
        try:
            disk = block.resolve(strict=True)
            if (disk / "partition").exists():
                disk = disk.parent
            return (disk / "queue" / "rotational").read_text().strip() == "1"
        except OSError:
            continue
    return None


def free_bytes_at(path: Path) -> int | None:
    """Free space where `path` is or would be created (its nearest existing parent)."""
    path = Path(path).absolute()
    for candidate in (path, *path.parents):
        if candidate.exists():
            st = os.statvfs(candidate)
            return st.f_bavail * st.f_frsize
    return None


def o_direct_works(folder: Path) -> bool:
    """Write one aligned block with O_DIRECT, as DeepSpeed's async I/O does."""
    fd, name = tempfile.mkstemp(prefix=".zt-odirect-", dir=folder)
    os.close(fd)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_DIRECT)
    except OSError:
        os.unlink(name)
        return False
    try:
        buf = mmap.mmap(-1, ALIGN)  # page-aligned memory, as O_DIRECT requires
        buf.write(b"\0" * ALIGN)
        os.write(fd, buf)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(name)


def remove_stale(folder: Path) -> list[str]:
    """Delete earlier runs' swap trees directly under `folder`. A symlink is unlinked, never
    followed, and rmtree does not follow links inside the tree either."""
    removed = []
    for name in STALE_ENTRIES:
        entry = folder / name
        if entry.is_symlink() or entry.is_file():
            entry.unlink()
        elif entry.is_dir():
            shutil.rmtree(entry)
        else:
            continue
        removed.append(str(entry))
    return removed


def prepare_offload_dir(
    path: Path,
    *,
    need_bytes: int,
    nvme: bool,
    clean: bool = True,
    create: bool = True,
) -> OffloadReport:
    """Create, check and (with `clean`) clear the offload dir; raise EnvironmentUnfit (exit 3)
    with the fix when NVMe offload cannot work there. Run once per node, before launch."""
    path = Path(path)
    created = False
    if not path.exists():
        if not create:
            return _report_missing(path, need_bytes, nvme=nvme)
        try:
            path.mkdir(parents=True)
        except OSError as exc:
            raise EnvironmentUnfit(
                f"ZT_OFFLOAD_DIR={path}: cannot create it ({exc.strerror})"
            ) from None
        created = True
    if not path.is_dir():
        raise ConfigError(f"ZT_OFFLOAD_DIR={path}: not a directory")
    real = path.resolve()
    mount = mount_for(real, _read_mounts()) or Mount("/", "?", "unknown")
    kind = device_kind(mount.fstype, mount.source, rotational(real, mount.source))
    why = refusal(kind, path, nvme=nvme)
    if why:
        raise EnvironmentUnfit(why)
    try:
        with tempfile.NamedTemporaryFile(dir=real, prefix=".zt-write-"):
            pass
    except OSError as exc:
        read_only = exc.errno == errno.EROFS
        raise EnvironmentUnfit(
            f"ZT_OFFLOAD_DIR={path} is not writable ({'read-only filesystem' if read_only else exc.strerror}): "  # noqa: E501
            "mount it read-write (drop `:ro` from -v)"
        ) from None
    removed = remove_stale(real) if clean else []
    free = free_bytes_at(real) or 0
    if not clean:  # a later cleanup frees what earlier runs left
        free += _stale_size(real)
    o_direct = o_direct_works(real) if nvme else None
    if nvme and not o_direct:
        raise EnvironmentUnfit(
            f"ZT_OFFLOAD_DIR={path} ({mount.fstype}) refuses O_DIRECT, which DeepSpeed's async "
            "I/O needs: mount an ext4/xfs disk there (e.g. `-v /mnt/nvme:/offload`)"
        )
    want = required_free(need_bytes)
    if free < want:
        raise EnvironmentUnfit(
            f"ZT_OFFLOAD_DIR={path} has {free / GiB:.1f} GiB free; NVMe offload needs "
            f"{want / GiB:.1f} GiB ({need_bytes / GiB:.1f} GiB + margin): free space or mount a "
            "larger volume"
        )
    return OffloadReport(
        path, created, mount.fstype, kind, mount.source, free, need_bytes, o_direct,
        tuple(removed), tuple(advice(kind, path, nvme=nvme)),
    )  # fmt: skip


def _report_missing(path: Path, need_bytes: int, *, nvme: bool) -> OffloadReport:
    """What the volume train would create the folder on gets: the same verdicts."""
    parent = next((p for p in path.absolute().parents if p.exists()), Path("/"))
    mount = mount_for(parent.resolve(), _read_mounts()) or Mount("/", "?", "unknown")
    kind = device_kind(mount.fstype, mount.source, rotational(parent, mount.source))
    why = refusal(kind, path, nvme=nvme)
    if why:
        raise EnvironmentUnfit(why)
    note = f"ZT_OFFLOAD_DIR={path} does not exist yet: train creates it"
    free = free_bytes_at(path) or 0
    warnings = (note, *advice(kind, path, nvme=nvme))
    return OffloadReport(
        path, False, mount.fstype, kind, mount.source, free, need_bytes, None, (), warnings
    )


def _stale_size(folder: Path) -> int:
    total = 0
    for name in STALE_ENTRIES:
        entry = folder / name
        if entry.is_dir() and not entry.is_symlink():
            for root, _dirs, files in os.walk(entry):
                total += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
    return total


# --- mounting a block device ------------------------------------------------------------------


def filesystem_of(device: str) -> str | None:
    """The filesystem (or partition table) blkid finds; None when the device is blank."""
    out = subprocess.run(
        ["blkid", "-p", "-o", "export", device], capture_output=True, text=True, check=False
    )
    if out.returncode == 2:  # nothing found
        return None
    if out.returncode != 0:
        raise EnvironmentUnfit(f"ZT_OFFLOAD_DEVICE={device}: blkid failed: {out.stderr.strip()}")
    fields = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    if "TYPE" in fields:
        return fields["TYPE"]
    if "PTTYPE" in fields:
        return f"partition table ({fields['PTTYPE']})"
    return "unknown data"


def looks_blank(device: str, probe_bytes: int = 1 * MiB) -> bool:
    """blkid knows signatures, not data: a blank device also reads zeros at its start."""
    with open(device, "rb") as f:
        return not any(f.read(probe_bytes))


@contextlib.contextmanager
def mounted_offload_device(
    device: str | None, path: Path, *, allow_format: bool
) -> Iterator[str | None]:
    """Mount ZT_OFFLOAD_DEVICE at ZT_OFFLOAD_DIR for the run; unmount at exit.

    Formats (ext4) only a device with no filesystem and no partition table, and only with
    ZT_OFFLOAD_FORMAT=true; a device holding anything is never formatted.
    Yields what was done ("mounted ext4 /dev/x at /offload"), or None without a device.
    """
    if not device:
        yield None
        return
    try:
        mode = os.stat(device).st_mode
    except OSError:
        raise ConfigError(f"ZT_OFFLOAD_DEVICE={device}: no such device") from None
    if not stat.S_ISBLK(mode):
        raise ConfigError(f"ZT_OFFLOAD_DEVICE={device}: not a block device")
    path = Path(path)
    current = mount_for(path.absolute(), _read_mounts())
    if (
        current is not None
        and current.mount_point == str(path.absolute())
        and os.path.realpath(current.source) == os.path.realpath(device)
    ):
        yield f"{device} already mounted at {path}"
        return
    fs = filesystem_of(device)
    formatted = False
    if fs is None and not looks_blank(device):
        fs = "unknown data"
    if fs is None:
        if not allow_format:
            raise ConfigError(
                f"ZT_OFFLOAD_DEVICE={device} has no filesystem; set ZT_OFFLOAD_FORMAT=true to "
                "format it as ext4 (erases the device)"
            )
        _run(["mkfs.ext4", "-q", "-F", "-E", "nodiscard", device], device)
        fs, formatted = "ext4", True
    elif fs.startswith("partition table") or fs == "unknown data":
        raise EnvironmentUnfit(
            f"ZT_OFFLOAD_DEVICE={device} holds {fs}, not a filesystem: name a partition "
            "(e.g. /dev/nvme1n1p1) or wipe it yourself; zerotuner never formats a device "
            "holding data"
        )
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-o", "noatime", device, str(path)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise EnvironmentUnfit(
            f"ZT_OFFLOAD_DEVICE={device}: mount at {path} failed ({result.stderr.strip()}); the "
            "container needs --privileged (or --cap-add SYS_ADMIN --device "
            f"{device}), or mount the disk on the host and pass `-v /mnt/disk:{path}`"
        )
    try:
        yield f"{'formatted and ' if formatted else ''}mounted {fs} {device} at {path}"
    finally:
        subprocess.run(["umount", str(path)], capture_output=True, check=False)


def _run(argv: list[str], device: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise EnvironmentUnfit(
            f"ZT_OFFLOAD_DEVICE={device}: {argv[0]} failed: {result.stderr.strip()[:200]}"
        )
