"""DeepSpeed checkpoints under OUTPUT/checkpoints/step-N/, committed in one place.

Every rank saves its shards with `save_latest=False`; after a barrier rank 0 writes the
manifest `step-N/zerotuner.json` (step, world size, ZeRO stage, base model, data position,
files with sizes and sha256) and then moves the pointer `checkpoints/latest` by write-temp,
fsync, rename. A checkpoint without a manifest was never committed and is never resumed from;
one whose files no longer match it is skipped for the one before. Old checkpoints are deleted
(by rank 0) only after the new one is committed; so is a committed step-N that a new save of
step N replaces (`ZT_RESUME=never`, or an older step resumed over a longer run's output): it
waits in `.step-N.replaced` and is put back if the new save never commits. A checkpoint saved
on another world size or ZeRO stage resumes through zerotuner.weights.universal.

The manifest also makes a checkpoint self-contained for `zerotuner export`: it names the base
pipeline whose frozen parts complete the exported folder. Frozen parameters (a LoRA run's base
UNet) are left out of it (`exclude_frozen_parameters`): the base model's files hold them, so a
LoRA checkpoint is the adapter and its optimizer state only.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from zerotuner.errors import ConfigError, EnvironmentUnfit, ZeroTunerError
from zerotuner.launch.distributed import barrier

log = logging.getLogger(__name__)

MANIFEST = "zerotuner.json"
LATEST = "latest"
EMA_FILE = "ema.safetensors"
STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoints_dir(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


@dataclass(frozen=True)
class Resumed:
    step: int
    position: Any  # the data order's resumable position (see data.batches)
    ema: dict[str, torch.Tensor] | None
    ema_updates: int
    path: Path


def on_rank0(rank: int, work: Callable[[], object]) -> None:
    """`work` on rank 0, its outcome shared: if it fails, every rank raises (our own error
    classes as they are), so no rank waits at a barrier for one that has gone."""
    error: Exception | None = None
    if rank == 0:
        try:
            work()
        except Exception as caught:  # noqa: BLE001 - shared, then raised again
            error = caught
    if dist.is_available() and dist.is_initialized():
        outcome: tuple[type[Exception], str] | None = None
        if isinstance(error, ZeroTunerError):
            outcome = (type(error), str(error))
        elif error is not None:
            outcome = (RuntimeError, f"rank 0 failed: {type(error).__name__}: {error}")
        shared = [outcome]
        dist.broadcast_object_list(shared, src=0)
        if rank != 0 and shared[0] is not None:
            kind, text = shared[0]
            error = kind(text)
    if error is not None:
        raise error


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)


def save(
    engine: Any,
    *,
    output_dir: Path,
    step: int,
    meta: dict[str, Any],
    ema: dict[str, torch.Tensor] | None,
    ema_updates: int,
    keep: int,
    rank: int,
    keep_step: int | None = None,
) -> float:
    """Save and commit step-N on every rank (a collective). Returns the seconds it took.
    `keep_step`: a committed step the rotation keeps besides the last `keep` (the best
    evaluated one, which an early stop exports)."""
    started = time.perf_counter()
    root = checkpoints_dir(output_dir)
    tag = f"step-{step}"
    if rank == 0:
        _set_aside(root, tag)
    barrier()
    try:
        engine.save_checkpoint(
            str(root), tag=tag, client_state={"zerotuner_step": step}, save_latest=False,
            exclude_frozen_parameters=True,
        )  # fmt: skip
        _test_hook("ZT_TEST_SLEEP_IN_SAVE")
        barrier()  # every shard is written
        commit = functools.partial(
            _commit, root, step, meta, ema=ema, ema_updates=ema_updates, keep=keep,
            keep_step=keep_step,
        )  # fmt: skip
        on_rank0(rank, commit)
    except Exception as error:
        if not (_disk_full(error) or _nearly_full(root)):
            raise
        # Never committed: free what it took. A committed step-N it was replacing goes back
        # by rank 0 alone (here, or at the next start): another rank's delete could race it.
        if rank == 0:
            shutil.rmtree(root / tag, ignore_errors=True)
            restore_set_aside(output_dir)
        elif not _aside(root, tag).exists():
            shutil.rmtree(root / tag, ignore_errors=True)
        previous = find_resume("auto", output_dir)
        raise EnvironmentUnfit(
            f"ZT_OUTPUT_DIR={output_dir}: no space left on the device while saving checkpoint "
            f"{tag}; the last committed checkpoint ({previous.name if previous else 'none'}) is "
            "intact and resumes on restart: free space on that volume or lower ZT_CHECKPOINTS_KEEP"
        ) from None
    barrier()
    return time.perf_counter() - started


def _commit(
    root: Path,
    step: int,
    meta: dict[str, Any],
    *,
    ema: dict[str, torch.Tensor] | None,
    ema_updates: int,
    keep: int,
    keep_step: int | None = None,
) -> None:
    """EMA weights, the manifest, the pointer, then rotation: what makes a saved step
    resumable (rank 0, after every rank saved its shards)."""
    tag = f"step-{step}"
    if ema is not None:
        save_file(ema, str(root / tag / EMA_FILE))
    paths = [p for p in sorted((root / tag).rglob("*")) if p.is_file()]
    name = {p: str(p.relative_to(root / tag)) for p in paths}
    manifest = {
        **meta,
        "step": step,
        "ema_updates": ema_updates,
        "files": {name[p]: p.stat().st_size for p in paths},
        "sha256": dict(zip((name[p] for p in paths), _sha256_all(paths), strict=True)),
    }
    write_atomic(root / tag / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))
    write_atomic(root / LATEST, tag)
    shutil.rmtree(_aside(root, tag), ignore_errors=True)  # replaced: the new step-N is safe
    _rotate(root, keep=keep, current=tag, keep_step=keep_step)


def _aside(root: Path, tag: str) -> Path:
    return root / f".{tag}.replaced"


def _set_aside(root: Path, tag: str) -> None:
    """Before step-N is saved (rank 0): an uncommitted leftover of a crashed save goes; a
    committed step-N is renamed aside, to be deleted only once its replacement commits."""
    path = root / tag
    if not path.exists():
        return
    if read_manifest(path) is None:
        shutil.rmtree(path)
        return
    shutil.rmtree(_aside(root, tag), ignore_errors=True)  # an older aside of a committed save
    path.rename(_aside(root, tag))
    log.warning("keeping the committed %s aside until the new %s commits", tag, tag)


def restore_set_aside(output_dir: Path) -> None:
    """Put back each committed step-N whose replacement never committed (rank 0, before
    anything looks for a checkpoint to resume)."""
    root = checkpoints_dir(output_dir)
    for aside in sorted(root.glob(".step-*.replaced")) if root.is_dir() else ():
        original = root / aside.name[1 : -len(".replaced")]
        if read_manifest(original) is not None:
            shutil.rmtree(aside)  # the replacement committed; only the clean-up was missed
            continue
        shutil.rmtree(original, ignore_errors=True)  # the half-written replacement
        aside.rename(original)
        log.warning("restored %s: the save that was replacing it did not commit", original)


def _disk_full(error: BaseException | None) -> bool:
    """torch.save reports ENOSPC as a RuntimeError from its zip writer, not an OSError."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(error)
        if "No space left" in text or "failed writing file" in text or "file write failed" in text:
            return True
        error = error.__cause__ or error.__context__
    return False


def _nearly_full(root: Path) -> bool:
    """torch's zip writer may report a short write only as "unexpected pos": look at the disk."""
    try:
        return shutil.disk_usage(root).free < 64 * 2**20
    except OSError:
        return False


def _test_hook(name: str) -> None:
    """Fault tests stretch a save to kill a rank inside it (a number of seconds)."""
    seconds = os.environ.get(name)  # test-only: not a setting
    if seconds:
        time.sleep(float(seconds))


def _sha256_all(paths: list[Path]) -> list[str]:
    """Every file's sha256, files in parallel: hashlib releases the GIL while it hashes, and
    rank 0 hashes every rank's shards (tens of GB for an SDXL checkpoint)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(len(paths), os.cpu_count() or 1))) as pool:
        return list(pool.map(_sha256, paths))


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# With ZT_PUSH_TO the entrypoint's pusher keeps here the tag of the remote's latest ("none"
# before the first upload): a local checkpoint newer than it is nowhere else, so it stays.
REMOTE_LATEST = ".remote-latest"


def _rotate(root: Path, *, keep: int, current: str, keep_step: int | None = None) -> None:
    committed = sorted(committed_checkpoints(root), key=lambda p: step_of(p))
    marker = root / REMOTE_LATEST
    remote = marker.read_text().strip() if marker.is_file() else None
    for old in committed[:-keep]:
        if old.name == current or step_of(old) == keep_step:
            continue
        if remote is not None and step_of(old) > step_of(root / remote):
            continue  # not yet safe on the remote (its upload is late or failing)
        shutil.rmtree(old, ignore_errors=True)


def step_of(path: Path) -> int:
    """The step a step-N folder names (a checkpoint's or a sample's); -1 for any other name."""
    match = STEP_DIR.match(path.name)
    return int(match.group(1)) if match else -1


def read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def verify(path: Path) -> str | None:
    """Why the committed checkpoint at `path` cannot be trusted (None: every file the manifest
    lists is there with its size and hash)."""
    manifest = read_manifest(path)
    if manifest is None:
        return f"no readable {MANIFEST}"
    hashes = manifest.get("sha256", {})
    for name, size in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {size}"
        if name in hashes and _sha256(file) != hashes[name]:
            return f"{name} is corrupt (sha256 differs from the manifest)"
    return None


def committed_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if STEP_DIR.match(p.name) and read_manifest(p) is not None]


def last_committed(output_dir: Path) -> Path | None:
    """The checkpoint `latest` names when it is committed, else the newest committed one; the
    files are not re-hashed (a message's answer to "where do I resume from")."""
    root = checkpoints_dir(output_dir)
    pointer = root / LATEST
    tag = pointer.read_text().strip() if pointer.is_file() else None
    if tag and read_manifest(root / tag) is not None:
        return root / tag
    return max(committed_checkpoints(root), key=step_of, default=None)


def find_resume(resume: str, output_dir: Path) -> Path | None:
    """The checkpoint to resume from: `never`, `auto` (latest committed) or a path."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if read_manifest(path) is None:
            raise ConfigError(
                f"ZT_RESUME={resume}: not a committed zerotuner checkpoint (no {MANIFEST}); "
                "use auto, never or a checkpoints/step-N folder"
            )
        return path
    root = checkpoints_dir(output_dir)
    pointer = root / LATEST
    tag = pointer.read_text().strip() if pointer.is_file() else None
    if tag and read_manifest(root / tag) is None:
        log.warning("checkpoints/latest names %r, which is not committed: looking further", tag)
    # the pointer's checkpoint first, then older ones newest first (an explicit ZT_RESUME of
    # an old step makes newer leftovers of the earlier run stale: they come last)
    newest_first = sorted(committed_checkpoints(root), key=step_of, reverse=True)
    limit = step_of(root / tag) if tag and read_manifest(root / tag) else None
    if limit is not None:
        newest_first.sort(key=lambda p: (step_of(p) > limit, -step_of(p)))
    for path in newest_first:
        problem = _verified(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s; trying the one before", path, problem)
    return None


_VERIFIED: dict[tuple[str, int], str | None] = {}


def _verified(path: Path) -> str | None:
    """verify() once per process and manifest (every rank asks more than once at start)."""
    key = (str(path), (path / MANIFEST).stat().st_mtime_ns)
    if key not in _VERIFIED:
        _VERIFIED[key] = verify(path)
    return _VERIFIED[key]


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def same_layout(manifest: dict[str, Any], *, stage: int, world: int) -> bool:
    """DeepSpeed loads a checkpoint natively only into the layout that saved it (ZeRO 1 and 2
    share one); anything else goes through zerotuner.weights.universal."""
    saved_stage, saved_world = int(manifest["zero_stage"]), int(manifest["world_size"])
    stages_match = saved_stage == stage or {saved_stage, stage} == {1, 2}
    return stages_match and saved_world == world


def _load_other_topology(
    engine: Any, path: Path, manifest: dict[str, Any], *, stage: int, world: int
) -> None:
    from zerotuner.weights import universal

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank == 0:
        log.info(
            "resuming %s (ZeRO-%s on %s rank(s)) as ZeRO-%d on %d: converting once to %s/",
            path, manifest["zero_stage"], manifest["world_size"], stage, world, universal.FOLDER,
        )  # fmt: skip
    names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    on_rank0(rank, lambda: universal.convert(path, names))
    universal.load_into(engine, path / universal.FOLDER, rank=rank)


def load(engine: Any, path: Path) -> Resumed:
    """Weights, optimizer and LR schedule into the engine; the rest returned (every rank)."""
    manifest = read_manifest(path)
    assert manifest is not None
    from zerotuner.weights.universal import SWAPPED

    stage, world = engine.zero_optimization_stage(), _world()
    # DeepSpeed's own load of an NVMe-offloaded optimizer copies the swap files back but not
    # the learning rate or Adam's step count and moments: those checkpoints take our path
    nvme = engine.zero_nvme_offload_optimizer() or (path / SWAPPED).is_dir()
    if same_layout(manifest, stage=stage, world=world) and not nvme:
        # a checkpoint without the frozen base loads into a module that has it (from the model)
        frozen = any(not p.requires_grad for p in engine.module.parameters())
        loaded, _ = engine.load_checkpoint(
            str(path.parent), tag=path.name, load_module_strict=not frozen
        )
        if loaded is None:
            raise ConfigError(f"ZT_RESUME: DeepSpeed could not load the checkpoint {path}")
    else:
        _load_other_topology(engine, path, manifest, stage=stage, world=world)
    _replay_cpu_adam_steps(engine)
    ema_file = path / EMA_FILE
    ema = load_file(str(ema_file)) if ema_file.is_file() else None
    return Resumed(
        step=int(manifest["step"]),
        position=manifest.get("position"),
        ema=ema,
        ema_updates=int(manifest.get("ema_updates", 0)),
        path=path,
    )


def _replay_cpu_adam_steps(engine: Any) -> None:
    """DeepSpeed's CPU Adam (DeepSpeedCPUAdam, and FusedAdam on the CPU accelerator) keeps
    beta1^t and beta2^t in C++, advanced by one multiplication a step, but takes pow() for a
    step out of sequence, as the first one after a resume is: in float the two differ in the
    last bit (0.999^3, 0.9^9), and the resumed run drifts from the uninterrupted one. Walk the
    counter up to the resumed step as the run did: one update of an empty tensor per step,
    which only moves it (DeepSpeed 0.19's ds_adam_step). CUDA's FusedAdam takes pow() at every
    step: nothing to replay there."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
    group = getattr(optimizer, "param_groups", [{}])[0]
    if "betas" not in group:
        return
    beta1, beta2 = group["betas"]
    lr, eps, decay, correct = (
        group["lr"],
        group["eps"],
        group["weight_decay"],
        group.get("bias_correction", True),
    )
    empty = torch.empty(0)
    if isinstance(optimizer, DeepSpeedCPUAdam):

        def update(step: int) -> None:
            optimizer.ds_opt_adam.adam_update(
                optimizer.opt_id, step, lr, beta1, beta2, eps, decay, correct, empty, empty,
                empty, empty,
            )  # fmt: skip

    elif isinstance(optimizer, FusedAdam) and get_accelerator().device_name() == "cpu":

        def update(step: int) -> None:
            optimizer.multi_tensor_adam(
                2048 * 32, optimizer._dummy_overflow_buf, [[empty]] * 4, lr, beta1, beta2, eps,
                step, optimizer.adam_w_mode, int(correct), decay,
            )  # fmt: skip

    else:
        return
    for step in range(1, engine.global_steps - engine.skipped_steps + 1):
        update(step)


def check_model(
    manifest: dict[str, Any],
    *,
    family: str,
    denoiser_params: int | None,
    model: str,
    path: Path,
    expert: str | None = None,
) -> None:
    """Refuse (exit 2, one line) to resume a checkpoint trained on another model family or on
    a network of another size: its tensors have other shapes, and DeepSpeed would fail
    mid-load with a size mismatch; or on Wan 2.2 A14B's other expert (`expert`: ZT_EXPERT;
    the same shapes, another network). (Manifests from before the count was recorded are
    checked by family only.)"""
    fresh = "set ZT_MODEL back to it, or ZT_RESUME=never or another ZT_OUTPUT_DIR to start afresh"
    saved = manifest.get("family")
    if saved is not None and saved != family:
        raise ConfigError(
            f"ZT_MODEL={model}: a {family} model, but the checkpoint to resume ({path}) trained "
            f"a {saved} model; {fresh}"
        )
    if (manifest.get("expert") or None) != (expert or None):
        trained = f"ZT_EXPERT={manifest['expert']}" if manifest.get("expert") else "no ZT_EXPERT"
        raise ConfigError(
            f"ZT_EXPERT={expert or ''}: the checkpoint to resume ({path}) trained with {trained} "
            f"(another expert of the model); set ZT_EXPERT back, or ZT_RESUME=never or another "
            f"ZT_OUTPUT_DIR to start afresh"
        )
    params = manifest.get("denoiser_params")
    if params is not None and denoiser_params is not None and params != denoiser_params:
        raise ConfigError(
            f"ZT_MODEL={model}: its denoiser has {denoiser_params:,} parameters, but the "
            f"checkpoint to resume ({path}) trained one of {params:,} (another {family} "
            f"model); {fresh}"
        )


def resume_candidate(resume: str, output_dir: Path) -> Path | None:
    """The checkpoint `find_resume` would most likely pick, without hashing its files: what
    the entrypoint checks against the job before any rank loads (the ranks verify it)."""
    if resume != "auto":
        return find_resume(resume, output_dir)  # a path: only its manifest is read
    root = checkpoints_dir(output_dir)
    pointer = root / LATEST
    tag = pointer.read_text().strip() if pointer.is_file() else ""
    if tag and STEP_DIR.match(tag) and read_manifest(root / tag) is not None:
        return root / tag
    committed = committed_checkpoints(root)
    return max(committed, key=step_of) if committed else None
