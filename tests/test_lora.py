"""LoRA (ZT_TRAINING_TYPE=lora): settings, the adapter file, and 2-rank DeepSpeed runs on the
tiny demo SDXL with the base frozen (real torchrun, real DeepSpeed, real peft)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import trainkit as tk
from lorakit import (
    ALPHA,
    LR,
    PROMPT,
    RANK,
    SHORT,
    STEPS,
    TARGETS,
    TEXT,
    UNET_FILE,
    assert_only_the_adapter_trained,
    checkpoint_adapter,
    held_out_loss,
    lora_settings,
    plain_pipeline,
    train,
    unet_output,
)  # fmt: skip
from safetensors.torch import load_file, save_file

from zerotuner.commands import config as _config  # noqa: F401 (imported before any patch)
from zerotuner.errors import ConfigError
from zerotuner.settings.schema import Settings
from zerotuner.weights import lora, lora_files
from zerotuner.weights.checkpoint import read_manifest

pytest_plugins = ["lorakit"]  # the shared runs: zero3_run, zero3, lora_cache


# --- the adapter file ---------------------------------------------------------------------
def test_an_adapter_written_loads_in_diffusers_with_its_alpha(demo_dir, tmp_path):
    """The file reproduces the trained UNet's output in a plain pipeline, conv layers and
    alpha != rank included."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(demo_dir / "model", subfolder="unet")
    settings = lora_settings()
    lora.add_adapter(unet, settings)
    gen = torch.Generator().manual_seed(1)
    for name, param in unet.named_parameters():
        if "lora_B" in name:  # B starts at zero: give the adapter an effect
            param.data.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    state = {n: p.detach().clone() for n, p in unet.named_parameters() if p.requires_grad}
    out = lora_files.write_adapter(
        "sdxl", state, lora.shapes(unet), lora.metadata(lora.lora_config(settings)), tmp_path
    )
    pipe = plain_pipeline(demo_dir)
    base = unet_output(pipe.unet)
    pipe.load_lora_weights(out)
    loaded = unet_output(pipe.unet)
    expected = unet_output(unet)
    assert not torch.allclose(loaded, base, atol=1e-3)
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)
    # the kohya copy, converted by diffusers' own loader: the same UNet, the true alpha
    assert {
        float(t) for k, t in load_file(out / lora_files.KOHYA_FILE).items() if "alpha" in k
    } == {ALPHA}
    pipe = plain_pipeline(demo_dir)
    pipe.load_lora_weights(out, weight_name=lora_files.KOHYA_FILE)
    torch.testing.assert_close(unet_output(pipe.unet), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "state",
    [
        {},  # what a gather that never happened leaves
        {"placeholder": torch.empty(0)},  # ZeRO-3's shape-[0] stand-ins
    ],
)
def test_an_empty_or_partitioned_adapter_is_refused(demo_dir, tmp_path, state):
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(demo_dir / "model", subfolder="unet")
    lora.add_adapter(unet, lora_settings())
    expected = lora.shapes(unet)
    if state:  # every adapter tensor present, each an empty placeholder
        state = {name: torch.empty(0) for name in expected}
    with pytest.raises(RuntimeError, match="refusing to write"):
        lora_files.write_adapter("sdxl", state, expected, {}, tmp_path / "final")
    assert not (tmp_path / "final").exists()
    partial = {name: torch.zeros(shape) for name, shape in list(expected.items())[:-1]}
    with pytest.raises(RuntimeError, match="partial"):
        lora_files.write_adapter("sdxl", partial, expected, {}, tmp_path / "final")
    assert not (tmp_path / "final").exists()


# --- 2-rank DeepSpeed runs ------------------------------------------------------------------
@pytest.mark.slow
def test_zero3_lora_trains_only_the_adapter(zero3, zero3_run, demo_dir: Path) -> None:
    assert len(tk.read_steps(zero3)) == STEPS
    # the per-step loss is too noisy over 16 steps (random timesteps): the same noise and
    # timesteps on the same images, before and after
    pipe = plain_pipeline(demo_dir)
    before = held_out_loss(pipe, demo_dir)
    pipe.load_lora_weights(zero3 / "final")
    assert held_out_loss(pipe, demo_dir) < 0.95 * before
    assert_only_the_adapter_trained(zero3, demo_dir, STEPS)
    log = zero3_run[1]  # DeepSpeed's per-step warning and diffusers' text-encoder notice
    assert "LoRA rank 4, alpha 2 on " in log and "samples: 1 image(s)" in log
    for notice in ("reduce_scatter_tensor", "No LoRA keys associated"):
        assert notice not in log, notice
    manifest = read_manifest(zero3 / "checkpoints" / "step-8")
    assert manifest["training_type"] == "lora" and manifest["zero_stage"] == 3
    assert manifest["lora"]["rank"] == RANK and manifest["lora"]["alpha"] == ALPHA


@pytest.mark.slow
def test_zero3_adapter_loads_in_a_plain_pipeline_and_changes_it(zero3, demo_dir: Path) -> None:
    from peft.tuners.lora import LoraLayer
    from safetensors import safe_open

    with safe_open(str(zero3 / "final" / lora_files.ADAPTER_FILE), "pt") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
    assert (meta["unet.r"], meta["unet.lora_alpha"]) == (RANK, ALPHA)
    pipe = plain_pipeline(demo_dir)
    base = unet_output(pipe.unet)
    pipe.load_lora_weights(zero3 / "final")
    layers = [m for m in pipe.unet.modules() if isinstance(m, LoraLayer)]
    assert layers and all(v == ALPHA / RANK for m in layers for v in m.scaling.values())
    loaded = unet_output(pipe.unet)
    assert not torch.allclose(loaded, base, atol=1e-4)
    kohya = plain_pipeline(demo_dir)
    kohya.load_lora_weights(zero3 / "final", weight_name=lora_files.KOHYA_FILE)
    torch.testing.assert_close(unet_output(kohya.unet), loaded, rtol=1e-5, atol=1e-5)
    # the text encoders' adapters: in the file, loaded by both readers, alike, and trained
    base_text = text_output(plain_pipeline(demo_dir))
    assert {k.split(".")[0] for k in load_file(zero3 / "final" / lora_files.ADAPTER_FILE)} == {
        "unet", "text_encoder", "text_encoder_2"
    }  # fmt: skip
    adapted, kohya_text = text_output(pipe), text_output(kohya)
    for name in base_text:
        assert (meta[f"{name}.r"], meta[f"{name}.lora_alpha"]) == (RANK, ALPHA)
        assert not torch.allclose(adapted[name], base_text[name], atol=1e-4), name
        torch.testing.assert_close(kohya_text[name], adapted[name], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def text_output(pipe) -> dict[str, torch.Tensor]:
    ids = pipe.tokenizer([PROMPT], padding="max_length", max_length=77, return_tensors="pt")
    return {
        name: getattr(pipe, name)(ids.input_ids, output_hidden_states=True).hidden_states[-2]
        for name in ("text_encoder", "text_encoder_2")
    }


@pytest.mark.slow
def test_zero3_validation_samples_use_the_adapter(zero3, demo_dir: Path, tmp_path) -> None:
    """The run's sample differs from the base pipeline's at the same prompt and seed."""
    import numpy as np
    from PIL import Image

    from zerotuner.train import samples

    (made,) = sorted((zero3 / "samples" / f"step-{STEPS}").glob("*.png"))
    (base,) = samples.render(
        demo_dir / "model",
        None,
        [PROMPT],
        tmp_path / "base",
        family="sdxl",
        resolution=64,
        inference_steps=2,
        seed=42,
        compare=False,
    )
    with_adapter = samples.render(
        demo_dir / "model", None, [PROMPT], tmp_path / "again", family="sdxl", resolution=64,
        inference_steps=2, seed=42, lora_dir=zero3 / "final", compare=False,
    )[0]  # fmt: skip
    pixels = [np.asarray(Image.open(p), dtype=np.int16) for p in (made, base, with_adapter)]
    # The rank rendered with its own thread count: float sums may round a pixel differently.
    assert np.abs(pixels[0] - pixels[1]).mean() > 10
    assert np.abs(pixels[0] - pixels[2]).max() <= 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "offload",
    [
        # ZeRO-1 is not run here: its load is ZeRO-2's code in DeepSpeed (stage_1_and_2.py),
        # and a LoRA at ZeRO-1 trains on in the PiSSA test's resume on 1 rank
        {"stage": 0},
        # rsLoRA's scale and bf16 with the optimizer on the CPU: details of one ZeRO-2 run
        {"stage": 2, "offload_optimizer": "cpu", "precision": "bf16", "lora_rslora": True},
        {
            "stage": 3,
            "offload_optimizer": "nvme",
            "offload_param": "nvme",
            "lora_dora": True,
            "gradient_checkpointing": True,
        },
    ],
    ids=[
        "zero0",
        "zero2-cpu-offload-bf16-rslora",
        "zero3-nvme-dora-checkpointing",
    ],
)
def test_lora_at_other_stages(offload, tmp_path, demo_dir: Path, lora_cache: Path) -> None:
    """3 steps, a checkpoint at 2 (the adapter and its optimizer state only), the adapter
    lowering the held-out loss in a plain pipeline, and a restart from the checkpoint in a fresh
    folder (the base read again from the model files) that ends bit for bit where the run did:
    DeepSpeed's own load at every stage, our NVMe path at ZeRO-3."""
    proc, output = train(
        tmp_path, demo_dir, lora_cache, steps=SHORT, checkpoint_every_steps=2, **offload
    )
    tk.assert_ok(proc, tmp_path)
    final = assert_only_the_adapter_trained(output, demo_dir, SHORT)
    pipe = plain_pipeline(demo_dir)  # a plain pipeline loads it, and the loss falls
    before = held_out_loss(pipe, demo_dir)
    pipe.load_lora_weights(output / "final")
    assert held_out_loss(pipe, demo_dir) < before  # (3 steps: by about 1 %)
    again = tmp_path / "again"
    (again / "output" / "checkpoints").mkdir(parents=True)
    shutil.copytree(output / "checkpoints" / "step-2", again / "output" / "checkpoints" / "step-2")
    proc, resumed = train(
        again, demo_dir, lora_cache, steps=SHORT, checkpoint_every_steps=2, **offload
    )
    tk.assert_ok(proc, again)
    assert [s["step"] for s in tk.read_steps(resumed)] == [SHORT]
    assert tk.read_steps(resumed)[0]["loss"] == tk.read_steps(output)[-1]["loss"]
    again_final = load_file(resumed / "final" / lora_files.ADAPTER_FILE)
    assert again_final.keys() == final.keys()
    assert all(torch.equal(again_final[k], final[k]) for k in final)


@pytest.mark.slow
def test_pissa_at_zero2_resumes_and_exports_for_the_published_base(
    tmp_path, demo_dir: Path, lora_cache: Path
) -> None:
    """ZT_LORA_INIT=pissa on 2 ranks at ZeRO-2: the checkpoint holds the rank-r adapter, the
    files (and the validation samples made from them) its rank-2r plain LoRA; a restart from
    step 2 (PiSSA redone on the base read again) ends bit for bit, one on 1 rank at ZeRO-1
    continues, and `zerotuner export` of the checkpoint (the start recomputed from the base)
    writes the same files, which change a plain pipeline's UNet."""
    from zerotuner.cli import main

    pissa = {"stage": 2, "lora_init": "pissa", "lora_targets": "attention"}
    proc, output = train(tmp_path, demo_dir, lora_cache, steps=SHORT, checkpoint_every_steps=2,
                         validation_prompts=[PROMPT], **pissa)  # fmt: skip
    tk.assert_ok(proc, tmp_path)
    (sample,) = (output / "samples" / f"step-{SHORT}").glob("*.png")  # through the files
    assert sample.stat().st_size > 0
    final = load_file(output / "final" / lora_files.ADAPTER_FILE)
    saved = checkpoint_adapter(output / "checkpoints" / f"step-{SHORT}")
    assert final.keys() == saved.keys() and len(final) > 0
    for key, tensor in saved.items():  # r rows of A (columns of B) trained, r more the start's
        grown = 0 if ".lora_A." in key else 1
        assert final[key].shape[grown] == 2 * tensor.shape[grown] == 2 * RANK, key
    again = tmp_path / "again"
    (again / "output" / "checkpoints").mkdir(parents=True)
    shutil.copytree(output / "checkpoints" / "step-2", again / "output" / "checkpoints" / "step-2")
    proc, resumed = train(again, demo_dir, lora_cache, steps=SHORT, checkpoint_every_steps=2,
                          **pissa)  # fmt: skip
    tk.assert_ok(proc, again)
    again_final = load_file(resumed / "final" / lora_files.ADAPTER_FILE)
    assert all(torch.equal(again_final[k], final[k]) for k in final)
    checkpoint = output / "checkpoints" / f"step-{SHORT}"
    assert main(["export", str(checkpoint), str(tmp_path / "exported")]) == 0
    exported = load_file(tmp_path / "exported" / lora_files.ADAPTER_FILE)
    assert exported.keys() == final.keys()
    for key in final:  # the start from this process's SVD of the same base weights
        torch.testing.assert_close(exported[key], final[key], rtol=1e-5, atol=1e-5)
    pipe = plain_pipeline(demo_dir)
    base = unet_output(pipe.unet)
    pipe.load_lora_weights(output / "final")
    assert not torch.allclose(unet_output(pipe.unet), base, atol=1e-4)
    # on 1 rank at ZeRO-1 (the universal checkpoint), the step-2 checkpoint trains step 3
    one = tmp_path / "one"
    (one / "output" / "checkpoints").mkdir(parents=True)
    shutil.copytree(output / "checkpoints" / "step-2", one / "output" / "checkpoints" / "step-2")
    job = tk.write_job(one / "job.json", model=demo_dir / "model", world=1,
                       deepspeed=tk.ds_config(1, world=1, steps=SHORT, lr=LR))  # fmt: skip
    env = tk.settings_env(
        model=demo_dir / "model", data=demo_dir / "data", output=one / "output",
        cache=lora_cache, max_steps=SHORT, training_type="lora", lora_rank=RANK,
        lora_alpha=ALPHA, lora_init="pissa", lora_targets="attention",
    )  # fmt: skip
    proc = tk.run_ranks(one, env, job_file=job, world=1)
    tk.assert_ok(proc, one, world=1)
    assert "converting once to universal" in proc.stdout + proc.stderr
    assert [s["step"] for s in tk.read_steps(one / "output")] == [SHORT]
    moved = load_file(one / "output" / "final" / lora_files.ADAPTER_FILE)
    assert moved.keys() == final.keys()
    assert all(moved[k].shape == final[k].shape for k in final)


@pytest.mark.slow
def test_zero3_lora_resumes_at_the_next_step(zero3, tmp_path, demo_dir, lora_cache) -> None:
    """Restarted from its step-8 checkpoint, the run ends where the uninterrupted one did."""
    stopped = tmp_path / "output"
    (stopped / "checkpoints").mkdir(parents=True)
    shutil.copytree(zero3 / "checkpoints" / "step-8", stopped / "checkpoints" / "step-8")
    (stopped / "checkpoints" / "latest").write_text("step-8")
    proc, output = train(
        tmp_path, demo_dir, lora_cache, stage=3, steps=STEPS, checkpoint_every_steps=8,
        output=stopped, **TEXT,
    )  # fmt: skip
    tk.assert_ok(proc, tmp_path)
    assert "resumed from" in proc.stderr + proc.stdout
    steps, expected = tk.read_steps(output), tk.read_steps(zero3)
    assert [s["step"] for s in steps] == list(range(9, STEPS + 1))
    assert [s["loss"] for s in steps] == [s["loss"] for s in expected[8:]]
    resumed = load_file(output / "final" / lora_files.ADAPTER_FILE)
    uninterrupted = load_file(zero3 / "final" / lora_files.ADAPTER_FILE)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (
            {"training_type": "full"},
            "ZT_TRAINING_TYPE=full: the checkpoint to resume ({path}) is from a lora run; set "
            "ZT_TRAINING_TYPE=lora to continue it, or set ZT_RESUME=never or another "
            "ZT_OUTPUT_DIR to start afresh",
        ),
        (
            {"lora_rank": 8},
            "ZT_LORA_RANK=8: the checkpoint to resume ({path}) has an adapter with rank 4; set "
            "it back to continue, or set ZT_RESUME=never or another ZT_OUTPUT_DIR to start afresh",
        ),
        (
            {"lora_targets": "attention"},
            "ZT_LORA_TARGETS=attention: the checkpoint to resume ({path}) has an adapter with "
            "targets to_k,to_q,to_v,to_out.0,ff.net.0.proj,ff.net.2,proj_in,proj_out,conv1,"
            "conv2,conv_in,conv_out,time_emb_proj; set it back to continue, or set "
            "ZT_RESUME=never or another ZT_OUTPUT_DIR to start afresh",
        ),
        (
            {"lora_text_encoder": False},
            "ZT_LORA_TEXT_ENCODER=false: the checkpoint to resume ({path}) has an adapter with "
            "text encoder on; set it back to continue, or set ZT_RESUME=never or another "
            "ZT_OUTPUT_DIR to start afresh",
        ),
    ],
)
def test_a_lora_checkpoint_resumes_only_as_the_same_lora(zero3, settings, expected) -> None:
    path = zero3 / "checkpoints" / "step-8"
    values = {"training_type": "lora", "lora_rank": RANK, "lora_targets": TARGETS, **TEXT}
    values |= settings
    if values["training_type"] == "full":
        values = {"training_type": "full"}
    with pytest.raises(ConfigError) as caught:
        lora.check_resume(read_manifest(path), Settings(**values), path)
    assert caught.value.problems == [expected.format(path=path)]
    lora.check_resume(read_manifest(path), lora_settings(lora_alpha=8, **TEXT), path)  # alpha too


def test_a_full_checkpoint_is_not_resumed_as_lora(tmp_path) -> None:
    manifest = {"step": 4, "zero_stage": 2}  # written before LoRA existed: a full run's
    with pytest.raises(ConfigError, match="is from a full run; set ZT_TRAINING_TYPE=full"):
        lora.check_resume(manifest, lora_settings(), tmp_path)
    lora.check_resume({"training_type": "full"}, Settings(), tmp_path)


@pytest.mark.slow
def test_export_writes_the_adapter_of_a_lora_checkpoint(zero3, tmp_path) -> None:
    """`zerotuner export CKPT OUT` on a ZeRO-3 LoRA checkpoint: the run's own adapter file."""
    from zerotuner.weights.export import export_checkpoint

    out = export_checkpoint(zero3 / "checkpoints" / f"step-{STEPS}", tmp_path / "exported")
    exported = load_file(out / lora_files.ADAPTER_FILE)
    final = load_file(zero3 / "final" / lora_files.ADAPTER_FILE)
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final)
    assert (out / lora_files.KOHYA_FILE).is_file() and not (out / lora_files.MERGED).exists()


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "world"), [(2, 2), (3, 1)])
def test_zero3_lora_resumes_on_another_stage_or_world_size(
    zero3, tmp_path, demo_dir, lora_cache, stage, world
) -> None:
    """Through the universal checkpoint: on 2 ranks at ZeRO-2 the same samples are seen, so
    the losses match the uninterrupted run's; on 1 rank the run continues from the
    checkpoint's adapter (steps 9 and 10, near the step-8 adapter, not a fresh one)."""
    last = 12 if world == 2 else 10
    stopped = tmp_path / "output"
    (stopped / "checkpoints").mkdir(parents=True)
    shutil.copytree(zero3 / "checkpoints" / "step-8", stopped / "checkpoints" / "step-8")
    config = tk.ds_config(stage, world=world, steps=last, lr=LR)
    job = tk.write_job(tmp_path / "job.json", model=demo_dir / "model", deepspeed=config,
                       world=world)  # fmt: skip
    env = tk.settings_env(
        model=demo_dir / "model", data=demo_dir / "data", output=stopped, cache=lora_cache,
        max_steps=last, training_type="lora", lora_rank=RANK, lora_alpha=ALPHA,
        lora_targets=TARGETS, checkpoint_every_steps=0, **TEXT,
    )  # fmt: skip
    proc = tk.run_ranks(tmp_path, env, job_file=job, world=world)
    tk.assert_ok(proc, tmp_path, world=world)
    assert "converting once to universal" in proc.stdout + proc.stderr
    final = load_file(stopped / "final" / lora_files.ADAPTER_FILE)
    if world == 2:
        losses = [s["loss"] for s in tk.read_steps(stopped)]
        before = [s["loss"] for s in tk.read_steps(zero3)]
        assert losses == pytest.approx(before[8:12], abs=1e-3)
    else:
        assert [s["step"] for s in tk.read_steps(stopped)] == [9, 10]
        saved = checkpoint_adapter(zero3 / "checkpoints" / "step-8")
        assert final.keys() == saved.keys()
        moved = sum((final[k] - saved[k]).norm() ** 2 for k in saved) ** 0.5
        size = sum(saved[k].norm() ** 2 for k in saved) ** 0.5
        assert 0 < moved < 0.5 * size  # trained on, from the checkpoint's adapter


@pytest.mark.slow
def test_a_lora_checkpoint_resumes_only_onto_its_base(zero3, demo_dir, tmp_path) -> None:
    path = zero3 / "checkpoints" / "step-8"
    manifest = read_manifest(path)
    own = lora.base_digest(demo_dir / "model", text_encoder=True)
    assert manifest["lora"]["base_unet_sha256"] == own != lora.base_digest(demo_dir / "model")
    lora.check_resume_base(manifest, own, lora_settings(**TEXT), path)
    other = tmp_path / "model"
    for part in ("unet", "text_encoder", "text_encoder_2"):
        shutil.copytree(demo_dir / "model" / part, other / part)
    assert lora.base_digest(other, text_encoder=True) == own
    weights = load_file(other / UNET_FILE)
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1e-3  # one tensor fine-tuned a little
    save_file(weights, other / UNET_FILE)
    settings = lora_settings(model=str(other), **TEXT)
    with pytest.raises(ConfigError) as caught:
        lora.check_resume_base(manifest, lora.base_digest(other, text_encoder=True), settings, path)
    assert caught.value.problems[0].startswith(
        f"ZT_MODEL={other}: its UNet or text encoder weights differ from those the checkpoint "
        "to resume "
        f"({path}) trained its adapter on"
    )
