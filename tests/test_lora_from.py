"""ZT_LORA_FROM (issue 41): a run trains on from an adapter file in the diffusers, kohya or
ComfyUI layout. The source adapter is the demo SDXL UNet's with every weight moved off its
start (B != 0) at alpha != rank; its three files are what a LoRA run's final/ holds.

Shown: each layout, read as diffusers reads it, gives the source adapter's denoiser output
(TOLERANCE); a 1-rank run from the kohya file (ZeRO-3) and from the ComfyUI file (ZeRO-2) draws
the source adapter's samples at step 1, whose learning rate is 0 (the warm-up starts there, so
its samples show the start), then trains on; bad files and conflicting settings are one line,
exit 2, from `config` and `check`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import trainkit as tk
from lorakit import PROMPT, RANK, lora_settings, unet_output
from PIL import Image
from safetensors.torch import load_file, save_file

from zerotuner.settings.schema import Settings
from zerotuner.weights import lora, lora_files, lora_from
from zerotuner.weights.pipeline_folder import load_part

pytest_plugins = ["lorakit"]

TARGETS = "attention,proj_in,conv1"  # linear and conv layers
ALPHA = 2.0  # != RANK: a reader that drops the alpha is off by 2x
# fp32 throughout; measured: 0.0 (the same weights, the same arithmetic)
TOLERANCE = {"rtol": 0, "atol": 1e-6}
LAYOUTS = {
    "diffusers": lora_files.ADAPTER_FILE,
    "kohya": lora_files.KOHYA_FILE,
    "comfyui": lora_files.COMFY_FILE,
}


@pytest.fixture(scope="module")
def source(demo_dir: Path, tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """The source adapter's files (a final/ folder) and its UNet's output on a fixed input."""
    unet = load_part(demo_dir / "model", "unet")
    settings = lora_settings(lora_targets=TARGETS, lora_alpha=ALPHA)
    lora.add_adapter(unet, settings)
    gen = torch.Generator().manual_seed(3)
    for name, param in unet.named_parameters():
        if "lora_B" in name:
            param.data.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    state = {n: p.detach().clone() for n, p in unet.named_parameters() if p.requires_grad}
    out = lora_files.write_adapter(
        "sdxl", state, lora.shapes(unet), lora.metadata(lora.lora_config(settings)),
        tmp_path_factory.mktemp("lora-from") / "final",
    )  # fmt: skip
    return out, unet_output(unet)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_starts_at_the_source_adapters_output(layout, source, demo_dir) -> None:
    """Read through the family pipeline's `lora_state_dict`, the file gives the run the
    source's rank, alpha and layers, and the UNet with it the source's output."""
    folder, expected = source
    settings = Settings(training_type="lora", lora_from=str(folder / LAYOUTS[layout]))
    settings, adapter = lora_from.apply(settings, "sdxl", model_dir=demo_dir / "model")
    assert adapter is not None
    assert (settings.lora_rank, settings.lora_alpha) == (RANK, ALPHA)
    written = {k.split(".lora_")[0] for k in load_file(folder / lora_files.ADAPTER_FILE)}
    assert {f"unet.{m}" for m in adapter.modules} == written
    unet = load_part(demo_dir / "model", "unet")
    lora.add_adapter(unet, settings)
    lora_from.load_into(unet, adapter)
    torch.testing.assert_close(unet_output(unet), expected, **TOLERANCE)


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_transformer_families_comfyui_files_give_the_adapter(
    family, family_demo_dir, tmp_path
) -> None:
    """The ComfyUI layouts of the transformer families (Flux: peft names, the scale folded into
    lora_B; Wan: the original checkpoint's names) give the source adapter's weight change,
    s B A, on every layer (alpha becomes the rank: the scale is in the weights)."""
    from test_lora_comfyui import adapted, write

    from zerotuner import families

    demo = family_demo_dir(family)
    denoiser, settings = adapted(demo, family)
    folder = write(denoiser, settings, family, tmp_path / "final")
    source = Settings(training_type="lora", lora_from=str(folder / lora_files.COMFY_FILE))
    run, adapter = lora_from.apply(source, family, model_dir=demo / "model")
    assert adapter is not None and run.lora_rank == run.lora_alpha == settings.lora_rank
    module = load_part(demo / "model", families.get(family).denoiser)
    lora.add_adapter(module, run)
    lora_from.load_into(module, adapter)
    expected, loaded = _deltas(denoiser, settings), _deltas(module, run)
    assert loaded.keys() == expected.keys()
    for name, change in loaded.items():
        torch.testing.assert_close(change, expected[name], **TOLERANCE, msg=name)


def _deltas(module: torch.nn.Module, settings: Settings) -> dict[str, torch.Tensor]:
    """Each adapted layer's weight change, alpha / rank * B A."""
    params = dict(module.named_parameters())
    scale = lora.alpha(settings) / settings.lora_rank
    changes = {}
    for name, a in params.items():
        if ".lora_A." in name:
            b = params[name.replace(".lora_A.", ".lora_B.")]
            changes[name.split(".lora_A.")[0]] = scale * b.flatten(1) @ a.flatten(1)
    return changes


def _run(tmp: Path, demo: Path, cache: Path, *, adapter: Path, stage: int, steps: int = 3):
    """`steps` steps on 1 CPU rank from `adapter`, samples at every step."""
    config = tk.ds_config(stage, world=1, steps=steps, lr=1e-2)
    job = tk.write_job(tmp / "job.json", model=demo / "model", deepspeed=config, world=1)
    output = tmp / "output"
    env = tk.settings_env(
        model=demo / "model", data=demo / "data", output=output, cache=cache, max_steps=steps,
        log_every_steps=1, training_type="lora", lora_from=adapter,
        validation_prompts=[PROMPT], validation_every_steps=1, validation_inference_steps=2,
    )  # fmt: skip
    proc = tk.run_ranks(tmp, env, job_file=job, world=1)
    tk.assert_ok(proc, tmp, world=1)
    return output, proc.stdout + proc.stderr


def _pixels(folder: Path) -> list[np.ndarray]:
    return [np.asarray(Image.open(p), dtype=np.int16) for p in sorted(folder.glob("*.png"))]


@pytest.mark.parametrize(("layout", "stage"), [("kohya", 3), ("comfyui", 2)])
def test_a_run_from_a_file_starts_at_its_samples_and_trains_on(
    layout, stage, source, demo_dir, lora_cache, tmp_path
) -> None:
    from zerotuner.train import samples

    folder, _ = source
    output, log = _run(tmp_path, demo_dir, lora_cache, adapter=folder / LAYOUTS[layout],
                       stage=stage)  # fmt: skip
    assert "the adapter starts from" in log
    steps = tk.read_steps(output)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[0]["lr"] == 0 and steps[-1]["lr"] > 0  # step 1 left the weights as loaded
    assert all(s["loss"] is not None for s in steps)
    reference = tmp_path / "reference"
    samples.render(
        demo_dir / "model", None, [PROMPT], reference, resolution=64, inference_steps=2,
        seed=Settings().seed, lora_dir=folder, compare=False,
    )  # fmt: skip
    run, ours = _pixels(output / "samples" / "step-1"), _pixels(reference)
    trained = _pixels(output / "samples" / "step-3")
    assert len(run) == len(ours) == len(trained) == 1
    # uint8 pixels, measured: 1 at step 1 (both layouts), 25 at step 3 (trained on)
    assert np.abs(run[0] - ours[0]).max() <= 1
    assert np.abs(trained[0] - ours[0]).max() > 1
    start, end = (
        load_file(folder / lora_files.ADAPTER_FILE),
        load_file(output / "final" / lora_files.ADAPTER_FILE),
    )
    assert start.keys() == end.keys()
    moved = [k for k in start if "lora_B" in k and not torch.allclose(start[k], end[k])]
    assert moved, "the adapter did not train on"
    if layout == "comfyui":  # a resume wins over the file, and says so
        _, log = _run(tmp_path, demo_dir, lora_cache, adapter=folder / LAYOUTS[layout],
                      stage=stage, steps=4)  # fmt: skip
        assert "ZT_LORA_FROM: not loaded, the checkpoint resumed continues it" in log
        assert "at step 3" in log and "the adapter starts from" not in log


def _refused(monkeypatch, capsys, tmp_path, **env: str) -> str:
    code, out, err = tk.config_explain(monkeypatch, capsys, tmp_path, **env)
    lines = [line for line in err.splitlines() if line.startswith("zerotuner: error")]
    assert code == 2 and out == "" and len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ({"ZT_LORA_RANK": "8"}, "ZT_LORA_RANK=8: ZT_LORA_FROM="),
        ({"ZT_LORA_ALPHA": "4"}, "ZT_LORA_ALPHA=4: ZT_LORA_FROM="),
        ({"ZT_LORA_TARGETS": "attention"}, "ZT_LORA_TARGETS=attention: names"),
        ({"ZT_LORA_INIT": "pissa"}, "ZT_LORA_INIT=pissa: ZT_LORA_FROM starts"),
    ],
)
def test_a_setting_the_file_contradicts_is_one_line(
    setting, expected, source, demo_dir, monkeypatch, capsys, tmp_path
) -> None:
    folder, _ = source
    line = _refused(
        monkeypatch, capsys, tmp_path, ZT_TRAINING_TYPE="lora", ZT_MODEL=str(demo_dir / "model"),
        ZT_LORA_FROM=str(folder / lora_files.KOHYA_FILE), **setting,
    )  # fmt: skip
    assert line.startswith(f"zerotuner: error: {expected}"), line


def test_the_same_values_as_the_file_pass(source, demo_dir, monkeypatch, capsys, tmp_path):
    folder, _ = source
    code, _, err = tk.config_explain(
        monkeypatch, capsys, tmp_path, ZT_TRAINING_TYPE="lora", ZT_MODEL=str(demo_dir / "model"),
        ZT_LORA_FROM=str(folder / lora_files.COMFY_FILE), ZT_LORA_RANK=str(RANK),
        ZT_LORA_ALPHA="2", ZT_LORA_TARGETS=TARGETS,
    )  # fmt: skip
    assert code == 0, err
    assert f"LoRA rank {RANK}, alpha 2 on " in err and "layers of" in err


def _bad_files(folder: Path, tmp: Path) -> dict[str, Path]:
    """Adapter files that must be refused: not one, another family's, another size's."""
    kohya = load_file(folder / lora_files.KOHYA_FILE)
    files = {"garbage": tmp / "garbage.safetensors", "missing": tmp / "absent.safetensors"}
    files["garbage"].write_bytes(b"not a safetensors file")
    # another size: the same layers, one wider than this model's
    wide = dict(kohya)
    key = next(k for k in wide if k.endswith("to_k.lora_down.weight"))
    wide[key] = torch.zeros(wide[key].shape[0], wide[key].shape[1] + 8)
    # another family's UNet: a block this one lacks (SD 1.x has a fourth)
    deeper = {k.replace("down_blocks_1_", "down_blocks_3_"): v for k, v in kohya.items()}
    # another family's transformer (Flux's names, the diffusers layout)
    flux = {
        f"transformer.single_transformer_blocks.0.attn.to_q.lora_{x}.weight": torch.zeros(4, 4)
        for x in "AB"
    }
    for name, state in (("size", wide), ("family", deeper), ("transformer", flux)):
        files[name] = tmp / f"{name}.safetensors"
        save_file(state, str(files[name]))
    return files


def test_bad_adapter_files_are_one_line_from_config_and_check(
    source, demo_dir, monkeypatch, capsys, tmp_path
) -> None:
    from zerotuner.cli import main

    folder, _ = source
    files = _bad_files(folder, tmp_path)
    expected = {
        "garbage": "not a readable safetensors file",
        "missing": "not a readable safetensors file",
        "size": "an adapter for another model family or size",
        "family": "an adapter for another model family",
        "transformer": "not a sdxl model's unet: an adapter for another model family",
    }
    base = {"ZT_TRAINING_TYPE": "lora", "ZT_MODEL": str(demo_dir / "model")}
    for name, path in files.items():
        line = _refused(monkeypatch, capsys, tmp_path, **base, ZT_LORA_FROM=str(path))
        assert line.startswith(f"zerotuner: error: ZT_LORA_FROM={path}: "), line
        assert expected[name] in line, line
    line = _refused(
        monkeypatch, capsys, tmp_path, **base, ZT_LORA_FROM="hf://me/lora/x.safetensors"
    )
    assert "only a local adapter file is taken yet" in line
    # `check` refuses with the same line (the model step), before anything starts
    monkeypatch.setenv("ZT_DATA_DIR", str(demo_dir / "data"))
    monkeypatch.setenv("ZT_OUTPUT_DIR", str(tmp_path / "output"))
    monkeypatch.setenv("ZT_LORA_FROM", str(files["family"]))
    assert main(["check"]) == 2
    out, err = capsys.readouterr()
    assert "an adapter for another model family" in out + err
    assert "Traceback" not in out + err


def test_lora_from_with_full_training_is_an_error(monkeypatch, capsys, tmp_path) -> None:
    line = _refused(monkeypatch, capsys, tmp_path, ZT_LORA_FROM="/x.safetensors")
    assert line == (
        "zerotuner: error: ZT_LORA_FROM is set but ZT_TRAINING_TYPE=full: set "
        "ZT_TRAINING_TYPE=lora or unset ZT_LORA_FROM"
    )
