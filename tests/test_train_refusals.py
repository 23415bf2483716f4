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


@pytest.fixture(scope="module")
def sdxl_run(demo_dir, tmp_path_factory) -> Path:
    """A real 2-step run of the SDXL demo (one rank, ZeRO-0) with a committed checkpoint: its
    output folder."""
    tmp = tmp_path_factory.mktemp("sdxl-run")
    env = entrypoint_env(demo_dir, tmp, ZT_NUM_PROCESSES="1", ZT_ZERO_STAGE="0",
                         ZT_MAX_STEPS="2", ZT_CHECKPOINT_EVERY_STEPS="2")  # fmt: skip
    code, out, _ = _run(env, "train")
    assert code == 0, out[-3000:]
    return tmp / "output"


def test_a_checkpoint_records_what_it_trained(sdxl_run, demo_dir):
    from zerotuner.families import model_shape
    from zerotuner.weights.checkpoint import read_manifest

    manifest = read_manifest(sdxl_run / "checkpoints" / "step-2")
    assert manifest["family"] == "sdxl"
    assert manifest["denoiser_params"] == model_shape("sdxl", demo_dir / "model").denoiser_params


def test_resuming_another_familys_checkpoint_is_refused_before_the_ranks(
    sdxl_run, sd1_demo_dir, tmp_path
):
    """The SDXL run's checkpoint in ZT_OUTPUT_DIR, an SD 1.x model now: refused by `config`,
    `check` and `train` alike, with one line, before a rank loads anything."""
    output = tmp_path / "output"
    shutil.copytree(sdxl_run / "checkpoints", output / "checkpoints")
    step = output / "checkpoints" / "step-2"
    env = entrypoint_env(sd1_demo_dir, tmp_path, ZT_RESUME="auto", ZT_MAX_STEPS="4")
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
                              ZT_RESUME=str(step), ZT_MAX_STEPS="4")  # fmt: skip
    code, out, _ = _run(explicit, "train")
    assert code == 2 and _errors(out) == [line], out[-2000:]


def _edited_copy(run: Path, output: Path, **manifest_changes) -> Path:
    """The run's checkpoints under `output`, step-2's manifest changed as another run's
    would read."""
    shutil.copytree(run / "checkpoints", output / "checkpoints")
    step = output / "checkpoints" / "step-2"
    manifest = json.loads((step / "zerotuner.json").read_text())
    (step / "zerotuner.json").write_text(json.dumps(manifest | manifest_changes))
    return step


def test_resuming_a_checkpoint_of_another_size_is_refused_before_the_ranks(
    sdxl_run, demo_dir, tmp_path
):
    """The same family, a network of another size (an SDXL fine-tune of other widths)."""
    step = _edited_copy(sdxl_run, tmp_path / "output", denoiser_params=123)
    env = entrypoint_env(demo_dir, tmp_path, ZT_RESUME="auto", ZT_MAX_STEPS="4")
    line = _refused_alike(env, "model", 2)
    assert line.startswith(f"ZT_MODEL={demo_dir / 'model'}: its denoiser has ")
    assert f"the checkpoint to resume ({step}) trained one of 123 (another sdxl model)" in line


def test_resuming_a_lora_checkpoint_as_full_is_refused_before_the_ranks(
    sdxl_run, demo_dir, tmp_path
):
    """The training-type check the ranks made after loading now runs in preflight too."""
    step = _edited_copy(sdxl_run, tmp_path / "output", training_type="lora")
    env = entrypoint_env(demo_dir, tmp_path, ZT_RESUME="auto", ZT_MAX_STEPS="4")
    line = _refused_alike(env, "model", 2)
    assert line.startswith("ZT_TRAINING_TYPE=full: the checkpoint to resume") and str(step) in line
