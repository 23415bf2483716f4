"""LoRA outputs beyond the adapter file: rsLoRA and DoRA, the EMA of the adapter, the merged
pipeline, and a stopped run's resume (real torchrun, real DeepSpeed, real peft on the tiny
demo SDXL)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import trainkit as tk
from lorakit import (
    ALPHA,
    LR,
    PROMPT,
    RANK,
    STEPS,
    TARGETS,
    TEXT,
    file_names,
    lora_settings,
    perturb_adapter,
    plain_pipeline,
    train,
    unet_output,
)
from safetensors.torch import load_file

from zerotuner.weights import lora, lora_files
from zerotuner.weights.checkpoint import EMA_FILE, read_manifest

pytest_plugins = ["lorakit"]  # the shared runs: zero3_run, zero3, lora_cache


def trained_unet(demo_dir: Path, **variant):
    """The demo UNet with an adapter whose every weight has an effect (B and DoRA's magnitudes
    moved from their starting values), and the settings that made it."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(demo_dir / "model", subfolder="unet")
    settings = lora_settings(**variant)
    lora.add_adapter(unet, settings)
    perturb_adapter(unet, 0.3)
    return unet, settings


def write(unet, settings, out: Path, **kwargs) -> Path:
    state = {n: p.detach().clone() for n, p in unet.named_parameters() if p.requires_grad}
    config = lora.metadata(lora.lora_config(settings))
    return lora_files.write_adapter("sdxl", state, lora.shapes(unet), config, out, **kwargs)


VARIANTS = [{"lora_rslora": True}, {"lora_dora": True}, {"lora_dora": True, "lora_rslora": True}]


@pytest.mark.parametrize("variant", VARIANTS, ids=["rslora", "dora", "dora+rslora"])
def test_rslora_and_dora_adapters_load_in_diffusers(demo_dir, tmp_path, variant) -> None:
    """The diffusers file gives the trained UNet (its metadata carries use_rslora / use_dora);
    rsLoRA's kohya file carries alpha * sqrt(rank), so kohya's alpha / rank is the trained
    scale; DoRA gets no kohya file (its readers disagree on dora_scale)."""
    unet, settings = trained_unet(demo_dir, **variant)
    out = write(unet, settings, tmp_path / "final")
    expected = unet_output(unet)
    pipe = plain_pipeline(demo_dir)
    base = unet_output(pipe.unet)
    pipe.load_lora_weights(out)
    assert not torch.allclose(base, expected, atol=1e-3)
    torch.testing.assert_close(unet_output(pipe.unet), expected, rtol=1e-4, atol=1e-4)
    if variant.get("lora_dora"):
        assert not (out / lora_files.KOHYA_FILE).exists()
        return
    kohya = load_file(out / lora_files.KOHYA_FILE)
    alphas = {float(t) for k, t in kohya.items() if k.endswith(".alpha")}
    assert len(alphas) == 1 and alphas.pop() == pytest.approx(ALPHA * math.sqrt(RANK))
    pipe = plain_pipeline(demo_dir)
    pipe.load_lora_weights(out, weight_name=lora_files.KOHYA_FILE)
    torch.testing.assert_close(unet_output(pipe.unet), expected, rtol=1e-4, atol=1e-4)


def test_a_merged_unet_is_the_adapted_one(demo_dir, tmp_path) -> None:
    """peft's merge of a DoRA + rsLoRA adapter into the base weights, written as a pipeline:
    the same UNet output with no adapter layer left."""
    from diffusers import DiffusionPipeline

    unet, settings = trained_unet(demo_dir, lora_dora=True, lora_rslora=True)
    out = write(unet, settings, tmp_path / "final", merge_base=demo_dir / "model")
    merged = DiffusionPipeline.from_pretrained(out / lora_files.MERGED).unet
    assert not any(".lora_" in name for name in merged.state_dict())
    torch.testing.assert_close(unet_output(merged), unet_output(unet), rtol=1e-4, atol=1e-4)
    assert (out / lora_files.ADAPTER_FILE).is_file()


def test_merged_export_of_a_full_checkpoint_is_refused(demo_dir, tmp_path, capsys) -> None:
    import json

    from zerotuner.cli import main

    checkpoint = tmp_path / "step-1"
    checkpoint.mkdir()
    manifest = {"step": 1, "zero_stage": 0, "base_model": str(demo_dir / "model")}
    (checkpoint / "zerotuner.json").write_text(json.dumps(manifest))
    assert main(["export", str(checkpoint), str(tmp_path / "out"), "--merged"]) == 2
    err = capsys.readouterr().err
    assert "--merged fuses a LoRA adapter into its base; this checkpoint is from a full run" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


# --- the ZeRO-3 run (lorakit.zero3: 16 steps, EMA, merge) ---------------------------------------
def assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and got
    assert all(torch.equal(got[k], want[k]) for k in want), "not bitwise equal"


@pytest.mark.slow
def test_zero3_ema_tracks_the_adapter_only(zero3, tmp_path) -> None:
    """The checkpoint's EMA holds the adapter (no base weight); final-ema/ is the last one
    written as the adapter files; `export --ema` of the checkpoint writes the same."""
    from zerotuner.weights.export import export_checkpoint

    last = zero3 / "checkpoints" / f"step-{STEPS}"
    ema = load_file(last / EMA_FILE)
    assert ema and all(".lora_" in name for name in ema)
    assert read_manifest(last)["ema_updates"] == STEPS
    written = load_file(zero3 / "final-ema" / lora_files.ADAPTER_FILE)
    assert_equal(written, file_names(ema))
    trained = load_file(zero3 / "final" / lora_files.ADAPTER_FILE)
    assert written.keys() == trained.keys()
    assert any(not torch.equal(written[k], trained[k]) for k in trained), "the EMA is the adapter"
    assert (zero3 / "final-ema" / lora_files.KOHYA_FILE).is_file()
    out = export_checkpoint(last, tmp_path / "ema", ema=True)
    assert_equal(load_file(out / lora_files.ADAPTER_FILE), written)


@pytest.mark.slow
def test_zero3_merged_pipeline_generates_as_base_plus_adapter(zero3, demo_dir, tmp_path) -> None:
    """final/merged/ loads with from_pretrained and renders what the base pipeline with the
    adapter loaded renders; `zerotuner export CKPT OUT --merged` writes the same UNet."""
    import numpy as np
    from diffusers import DiffusionPipeline

    from zerotuner.cli import main

    merged = DiffusionPipeline.from_pretrained(zero3 / "final" / lora_files.MERGED)
    merged.set_progress_bar_config(disable=True)
    adapted = plain_pipeline(demo_dir)
    adapted.load_lora_weights(zero3 / "final")
    torch.testing.assert_close(
        unet_output(merged.unet), unet_output(adapted.unet), rtol=1e-4, atol=1e-4
    )
    images = [
        pipe(PROMPT, num_inference_steps=2, height=64, width=64, output_type="np",
             generator=torch.Generator().manual_seed(0)).images[0]
        for pipe in (merged, adapted, plain_pipeline(demo_dir))
    ]  # fmt: skip
    assert np.abs(images[0] - images[1]).max() < 1e-3
    assert np.abs(images[0] - images[2]).mean() > 1e-2, "the merged pipeline is the base one"
    checkpoint = zero3 / "checkpoints" / f"step-{STEPS}"
    assert main(["export", str(checkpoint), str(tmp_path / "out"), "--merged"]) == 0
    unet = "unet/diffusion_pytorch_model.safetensors"
    exported = load_file(tmp_path / "out" / lora_files.MERGED / unet)
    written = load_file(zero3 / "final" / lora_files.MERGED / unet)
    # The base never moved: what the trained ZeRO-3 engine gathered at the end, outside the
    # adapter's targets, is the model file's tensors bit for bit; the targets moved by B.A.
    base = load_file(demo_dir / "model" / unet)
    targets = set(lora.parse_targets(TARGETS))
    adapted = {k for k in base if not targets.isdisjoint(lora.suffixes(k.rsplit(".", 1)[0]))}
    assert written.keys() == base.keys() and adapted and adapted < base.keys()
    for key in base.keys() - adapted:
        assert torch.equal(written[key], base[key]), key
    assert all(not torch.equal(written[k], base[k]) for k in adapted if k.endswith(".weight"))
    assert exported.keys() == written.keys()
    for key in written:  # the same adapter, merged here with this process's thread count
        torch.testing.assert_close(exported[key], written[key], rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_a_stopped_lora_run_resumes_at_the_next_step_bit_for_bit(
    zero3, tmp_path, demo_dir, lora_cache
) -> None:
    """SIGTERM to torchrun: the ranks agree at a step boundary, commit that step (adapter,
    optimizer and EMA only) and exit 143; run again, the job ends where the uninterrupted
    ZeRO-3 run did: the same losses, the same adapter and EMA, bit for bit."""
    output = tmp_path / "output"
    values = dict(
        training_type="lora", lora_rank=RANK, lora_alpha=ALPHA, lora_targets=TARGETS, ema=True,
        log_every_steps=1, **TEXT,
    )  # fmt: skip
    job = tk.write_job(
        tmp_path / "job.json", model=demo_dir / "model", deepspeed=tk.ds_config(3, lr=LR)
    )
    env = tk.settings_env(
        model=demo_dir / "model", data=demo_dir / "data", output=output, cache=lora_cache,
        max_steps=500, checkpoint_every_steps=0, **values,
    )  # fmt: skip
    tk.sigterm_ranks_after_steps(tmp_path, env, job, output)
    stopped = tk.read_steps(output)[-1]["step"]
    assert 2 <= stopped < STEPS, "stopped too late to compare with the 16-step run"
    assert (output / "checkpoints" / "latest").read_text() == f"step-{stopped}"
    again = tmp_path / "again"
    again.mkdir()
    proc, _ = train(again, demo_dir, lora_cache, stage=3, steps=STEPS, output=output,
                    checkpoint_every_steps=0, ema=True, **TEXT)  # fmt: skip
    tk.assert_ok(proc, again)
    steps, expected = tk.read_steps(output), tk.read_steps(zero3)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert [s["loss"] for s in steps] == [s["loss"] for s in expected]
    for folder in ("final", "final-ema"):
        assert_equal(
            load_file(output / folder / lora_files.ADAPTER_FILE),
            load_file(zero3 / folder / lora_files.ADAPTER_FILE),
        )


@pytest.mark.slow
def test_dora_at_zero3_trains_as_at_zero2(tmp_path, demo_dir, lora_cache) -> None:
    """DoRA reads the base weight outside the base layer's forward: under ZeRO-3 DeepSpeed
    gathers it on access, so the same seeds give the same DoRA adapter as at ZeRO-2 (up to
    the order of float sums)."""
    finals = []
    for stage in (2, 3):
        tmp = tmp_path / f"zero{stage}"
        tmp.mkdir()
        proc, output = train(tmp, demo_dir, lora_cache, stage=stage, steps=4,
                             checkpoint_every_steps=0, lora_dora=True)  # fmt: skip
        tk.assert_ok(proc, tmp)
        finals.append(load_file(output / "final" / lora_files.ADAPTER_FILE))
    zero2, zero3 = finals
    assert zero2.keys() == zero3.keys()
    assert any("lora_magnitude_vector" in k for k in zero3)
    for key in zero2:
        torch.testing.assert_close(zero3[key], zero2[key], rtol=1e-3, atol=1e-3)
    moved = [k for k in zero3 if ".lora_B." in k and zero3[k].abs().sum() > 0]
    assert moved, "the DoRA adapter did not train"


@pytest.mark.parametrize(("init", "rslora"), [("pissa", False), ("olora", True)])
def test_pissa_and_olora_adapters_are_written_for_the_published_base(
    demo_dir, tmp_path, init, rslora
) -> None:
    """PiSSA / OLoRA move part of each target weight into the adapter: the files are the plain
    LoRA of rank 2r that turns the untouched base into the trained model (a plain pipeline's
    load_lora_weights, the kohya copy and the merged UNet all reproduce it), with the scale
    kept (alpha != rank, rsLoRA too)."""
    from diffusers import UNet2DConditionModel

    from zerotuner.weights.pipeline_folder import load_part

    settings = lora_settings(lora_targets="attention", lora_init=init, lora_rslora=rslora)
    unet = UNet2DConditionModel.from_pretrained(demo_dir / "model", subfolder="unet")
    before = unet_output(unet)
    lora.add_adapter(unet, settings)
    torch.testing.assert_close(unet_output(unet), before, rtol=1e-4, atol=1e-4)  # same start
    initial = lora.initial_adapter(unet, settings.lora_init)
    gen = torch.Generator().manual_seed(1)
    for name, param in unet.named_parameters():
        if ".lora_" in name:  # "training": move the adapter away from its start
            param.data.add_(torch.randn(param.shape, generator=gen) * 0.1)
    trained = unet_output(unet)
    assert not torch.allclose(trained, before, atol=1e-3)
    state = {n: p.detach().clone() for n, p in unet.named_parameters() if p.requires_grad}
    meta = lora.metadata(lora.lora_config(settings))
    out = lora_files.write_adapter(
        "sdxl", state, lora.shapes(unet), meta, tmp_path / "final", initial=initial,
        merge_base=demo_dir / "model",
    )  # fmt: skip
    pipe = plain_pipeline(demo_dir)
    pipe.load_lora_weights(out)
    torch.testing.assert_close(unet_output(pipe.unet), trained, rtol=1e-4, atol=1e-4)
    assert pipe.unet.peft_config["default_0"].r == 2 * RANK
    pipe = plain_pipeline(demo_dir)
    pipe.load_lora_weights(out, weight_name=lora_files.KOHYA_FILE)
    torch.testing.assert_close(unet_output(pipe.unet), trained, rtol=1e-4, atol=1e-4)
    merged = load_part(out / lora_files.MERGED, "unet")
    torch.testing.assert_close(unet_output(merged), trained, rtol=1e-4, atol=1e-4)


def test_pissa_is_refused_where_it_cannot_work(demo_dir) -> None:
    from zerotuner.errors import ConfigError
    from zerotuner.families import meta_model

    with pytest.raises(ConfigError, match="ZT_LORA_INIT=pissa with ZT_LORA_DORA=true"):
        lora.check_settings(lora_settings(lora_init="pissa", lora_dora=True))
    with pytest.raises(ConfigError, match="ZT_LORA_INIT=olora with ZT_LORA_TEXT_ENCODER"):
        lora.check_settings(lora_settings(lora_init="olora", lora_text_encoder=True))
    unet = meta_model("sdxl", demo_dir / "model")
    with pytest.raises(ConfigError, match="conv1, conv_in.* name convolutions"):
        lora.check_targets(unet, ("to_q", "conv1", "conv_in"), "pissa")
    lora.check_targets(unet, lora.PRESETS["attention"], "pissa")
    with pytest.raises(ConfigError) as info:
        lora.check_init_stage(lora_settings(lora_init="pissa"), 3)
    assert "ZT_ZERO_STAGE=2" in str(info.value) and info.value.exit_code == 2
    lora.check_init_stage(lora_settings(lora_init="pissa"), 2)
