"""Export to a diffusers folder, and the errors `zerotuner export` gives a user (fast, in-process).

The multi-rank checkpoints of every ZeRO stage are exported in test_training.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from zerotuner.cli import main
from zerotuner.errors import ConfigError
from zerotuner.weights.export import export_checkpoint
from zerotuner.weights.pipeline_folder import write_pipeline

UNET_FILE = "unet/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def trained_state(demo_dir: Path) -> dict[str, torch.Tensor]:
    """The base UNet with every weight moved: stands in for trained weights."""
    base = load_file(demo_dir / "model" / UNET_FILE)
    return {k: v + 0.01 for k, v in base.items()}


def fake_stage0_checkpoint(folder: Path, state: dict, base: Path, **manifest) -> Path:
    """DeepSpeed's stage-0 layout: the module state in mp_rank_00_model_states.pt."""
    folder.mkdir(parents=True)
    torch.save({"module": state}, folder / "mp_rank_00_model_states.pt")
    meta = {"step": 5, "zero_stage": 0, "base_model": str(base), **manifest}
    (folder / "zerotuner.json").write_text(json.dumps(meta))
    return folder


def test_write_pipeline_replaces_only_the_unet(demo_dir: Path, trained_state, tmp_path) -> None:
    out = write_pipeline(demo_dir / "model", trained_state, tmp_path / "final")
    written = load_file(out / UNET_FILE)
    assert all(torch.equal(written[k], trained_state[k]) for k in trained_state)
    vae = "vae/diffusion_pytorch_model.safetensors"
    assert (out / vae).read_bytes() == (demo_dir / "model" / vae).read_bytes()
    assert not list(tmp_path.glob(".*tmp")), "the staging folder was left behind"
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(out)
    assert torch.equal(pipe.unet.state_dict()["conv_in.weight"], trained_state["conv_in.weight"])
    # writing again replaces the folder
    write_pipeline(demo_dir / "model", trained_state, tmp_path / "final")


def test_write_pipeline_refuses_foreign_weights(demo_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="do not match"):
        write_pipeline(demo_dir / "model", {"nope.weight": torch.zeros(1)}, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_export_stage0_checkpoint_and_ema(demo_dir: Path, trained_state, tmp_path) -> None:
    ckpt = fake_stage0_checkpoint(tmp_path / "step-5", trained_state, demo_dir / "model")
    out = export_checkpoint(ckpt, tmp_path / "out")
    assert torch.equal(
        load_file(out / UNET_FILE)["conv_in.weight"], trained_state["conv_in.weight"]
    )
    with pytest.raises(ConfigError, match="no EMA weights"):
        export_checkpoint(ckpt, tmp_path / "ema", ema=True)
    ema = {k: v * 0 for k, v in trained_state.items()}
    save_file(ema, str(ckpt / "ema.safetensors"))
    out = export_checkpoint(ckpt, tmp_path / "ema", ema=True)
    assert float(load_file(out / UNET_FILE)["conv_in.weight"].abs().sum()) == 0.0


def test_export_names_what_is_wrong(demo_dir: Path, trained_state, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such checkpoint"):
        export_checkpoint(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "half").mkdir()
    with pytest.raises(ConfigError, match="not a committed"):
        export_checkpoint(tmp_path / "half", tmp_path / "out")
    moved = fake_stage0_checkpoint(tmp_path / "step-9", trained_state, tmp_path / "gone")
    with pytest.raises(ConfigError, match="--base"):
        export_checkpoint(moved, tmp_path / "out")
    out = export_checkpoint(moved, tmp_path / "out", base=demo_dir / "model")
    assert (out / "model_index.json").is_file()


def test_export_command_exit_codes(demo_dir, trained_state, tmp_path, capsys) -> None:
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no such checkpoint" in err and "Traceback" not in err
    ckpt = fake_stage0_checkpoint(tmp_path / "step-5", trained_state, demo_dir / "model")
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / UNET_FILE).is_file()


def test_resume_considers_only_committed_checkpoints(tmp_path: Path) -> None:
    from zerotuner.weights.checkpoint import (
        _rotate,
        committed_checkpoints,
        find_resume,
        write_atomic,
    )

    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        (root / f"step-{step}").mkdir(parents=True)
    for step in (2, 4):  # step-6 crashed mid-save: no manifest
        (root / f"step-{step}" / "zerotuner.json").write_text(json.dumps({"step": step}))
    assert find_resume("never", tmp_path) is None
    assert find_resume("auto", tmp_path) == root / "step-4"  # no pointer: newest committed
    write_atomic(root / "latest", "step-6")  # a pointer to an uncommitted save is ignored
    assert find_resume("auto", tmp_path) == root / "step-4"
    write_atomic(root / "latest", "step-2")
    assert find_resume("auto", tmp_path) == root / "step-2"
    assert find_resume(str(root / "step-4"), tmp_path) == root / "step-4"
    with pytest.raises(ConfigError, match="ZT_RESUME=.*step-6: not a committed"):
        find_resume(str(root / "step-6"), tmp_path)
    assert find_resume("auto", tmp_path / "fresh") is None
    _rotate(root, keep=1, current="step-4")
    assert committed_checkpoints(root) == [root / "step-4"]
    assert (root / "step-6").exists(), "rotation deletes committed checkpoints only"
