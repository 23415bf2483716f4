"""What `check` refuses, `train` refuses with the same line, before any rank loads a weight.

Output and cache folders that are files or read-only mounts, and a checkpoint to resume that
belongs to another model family, were found by `check` (or by nobody) while `train` started
its ranks and failed with a traceback minutes later.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from trainkit import ENTRYPOINT, entrypoint_env


def _run(env: dict[str, str], *args: str) -> tuple[int, str, float]:
    started = time.monotonic()
    result = subprocess.run(
        [ENTRYPOINT, *args], env=env, capture_output=True, text=True, timeout=300
    )
    return result.returncode, result.stdout + result.stderr, time.monotonic() - started


def _errors(out: str) -> list[str]:
    return [line.removeprefix("zerotuner: error: ") for line in out.splitlines()
            if line.startswith("zerotuner: error: ")]  # fmt: skip


def _check_line(out: str, name: str) -> str:
    """`check`'s FAIL line for the check `name`, without its prefix."""
    for line in out.splitlines():
        if line.startswith("FAIL") and f" {name} " in line:
            return line[4:].strip().removeprefix(name).strip()
    raise AssertionError(f"no FAIL line for {name}:\n{out}")


def _refused_alike(env: dict[str, str], check_name: str, code: int) -> str:
    """`check` and `train` refuse with `code` and the same one line; train starts no rank
    (it never reaches the plan: no 'launching', no loading)."""
    check_code, check_out, _ = _run(env, "check")
    train_code, train_out, _ = _run(env, "train")
    assert (check_code, train_code) == (code, code), check_out + train_out[-3000:]
    line = _check_line(check_out, check_name)
    assert _errors(train_out) == [line], train_out[-3000:]
    assert "Traceback" not in train_out + check_out
    assert "launching" not in train_out and "loading" not in train_out
    return line


@contextlib.contextmanager
def _read_only_mount(path: Path) -> Iterator[Path]:
    """A read-only tmpfs at `path`, as a `:ro` volume is in a container (root ignores file
    modes, so a chmod would not do)."""
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                             capture_output=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


@pytest.mark.parametrize("setting", ["ZT_OUTPUT_DIR", "ZT_CACHE_DIR"])
def test_a_folder_that_is_a_file_is_refused_before_the_ranks(demo_dir, tmp_path, setting):
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("the user's file\n")
    env = entrypoint_env(demo_dir, tmp_path, **{setting: str(a_file)})
    line = _refused_alike(env, setting.removeprefix("ZT_").lower().replace("_", " "), 3)
    assert line.startswith(f"{setting}={a_file}: ") and "is a file, not a folder" in line
    assert a_file.read_text() == "the user's file\n"  # nothing the user has is touched


@pytest.mark.parametrize("setting", ["ZT_OUTPUT_DIR", "ZT_CACHE_DIR"])
def test_a_read_only_mount_is_refused_before_the_ranks(demo_dir, tmp_path, setting):
    with _read_only_mount(tmp_path / "ro") as ro:
        env = entrypoint_env(demo_dir, tmp_path, **{setting: str(ro / "inside")})
        line = _refused_alike(env, setting.removeprefix("ZT_").lower().replace("_", " "), 3)
    assert f"{setting}={ro / 'inside'} is not writable (Read-only file system" in line


def _foreign_checkpoint(output: Path, family: str, training_type: str = "full") -> Path:
    """A committed checkpoint's manifest as worker.save writes it, for a run of `family`."""
    step = output / "checkpoints" / "step-4"
    step.mkdir(parents=True)
    manifest = {"step": 4, "family": family, "training_type": training_type, "zero_stage": 2,
                "world_size": 2, "files": {}, "sha256": {}}  # fmt: skip
    (step / "zerotuner.json").write_text(json.dumps(manifest))
    (output / "checkpoints" / "latest").write_text("step-4")
    return step


def test_resuming_another_familys_checkpoint_is_refused_before_the_ranks(
    demo_dir, sd1_demo_dir, tmp_path
):
    """An SDXL run's checkpoint in ZT_OUTPUT_DIR, an SD 1.x model now: refused by `config`,
    `check` and `train` alike, with one line, before a rank loads anything."""
    step = _foreign_checkpoint(tmp_path / "output", "sdxl")
    env = entrypoint_env(sd1_demo_dir, tmp_path, ZT_RESUME="auto", ZT_MAX_STEPS="2")
    line = _refused_alike(env, "model", 2)
    assert line == (
        f"ZT_MODEL={sd1_demo_dir / 'model'}: a sd1 model, but the checkpoint to resume ({step}) "
        "trained a sdxl model; set ZT_MODEL back to it, or ZT_RESUME=never or another "
        "ZT_OUTPUT_DIR to start afresh"
    )
    code, out, _ = _run(env, "config")
    assert code == 2 and _errors(out) == [line]
    assert (step / "zerotuner.json").is_file()  # the checkpoint is kept
    # an explicit path names the same checkpoint and gets the same answer
    explicit = entrypoint_env(sd1_demo_dir, tmp_path, ZT_OUTPUT_DIR=str(tmp_path / "elsewhere"),
                              ZT_RESUME=str(step), ZT_MAX_STEPS="2")  # fmt: skip
    code, out, _ = _run(explicit, "train")
    assert code == 2 and _errors(out) == [line], out[-2000:]


def test_resuming_a_lora_checkpoint_as_full_is_refused_before_the_ranks(demo_dir, tmp_path):
    """The training-type check the ranks made after loading now runs in preflight too."""
    step = _foreign_checkpoint(tmp_path / "output", "sdxl", training_type="lora")
    env = entrypoint_env(demo_dir, tmp_path, ZT_RESUME="auto", ZT_MAX_STEPS="2")
    line = _refused_alike(env, "model", 2)
    assert line.startswith("ZT_TRAINING_TYPE=full: the checkpoint to resume") and str(step) in line
    shutil.rmtree(step)
