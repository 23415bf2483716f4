"""The planner with LoRA: trainable (adapter) and frozen (base) parameters counted apart, the
adapter's size from the trainer's own target rule, and the stage it picks."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from diffusers import UNet2DConditionModel

from zerotuner import cli
from zerotuner.families import meta_model, model_shape
from zerotuner.machine.hardware import GPU, GiB, Hardware
from zerotuner.preflight import trainable
from zerotuner.preflight.memory import estimate
from zerotuner.preflight.plan import PlanRequest, make_plan
from zerotuner.settings.schema import Settings
from zerotuner.weights import lora

REPO = Path(__file__).resolve().parents[1]
SDXL = model_shape("sdxl")
ATTENTION_PER_RANK = 1_451_520  # issue 13: SDXL, to_q/to_k/to_v/to_out.0
ALL_LINEAR_PER_RANK = 2_706_176
LORA16 = trainable.Training("lora", 16 * ATTENTION_PER_RANK, 16 * 2048, SDXL.denoiser_params)


def gpus(n: int, memory_gib: float, host_gib: float = 256) -> Hardware:
    mem = int(memory_gib * GiB)
    cards = tuple(GPU(i, "GPU", mem, mem, (8, 9)) for i in range(n))
    return Hardware("cuda", cards, host_memory=int(host_gib * GiB), cpu_count=32)


def choice(plan) -> tuple:
    c = plan.choice
    return (c.zero_stage, c.offload_optimizer, c.offload_param, c.gradient_checkpointing)


def test_sdxl_adapter_sizes_from_the_unet_config_on_the_meta_device():
    unet = meta_model("sdxl")  # the published config, no weights
    assert all(p.device == torch.device("meta") for p in unet.parameters())
    assert sum(p.numel() for p in unet.parameters()) == 2_567_463_684
    linear = [n for n, m in unet.named_modules() if isinstance(m, torch.nn.Linear)]
    for rank in (1, 16):
        assert lora.adapter_size(unet, lora.ATTENTION, rank)[0] == rank * ATTENTION_PER_RANK
        assert lora.adapter_size(unet, linear, rank)[0] == rank * ALL_LINEAR_PER_RANK
    shape = trainable.lora_adapter(SDXL, rank=16, targets=lora.PRESETS["attention"])
    assert (shape.trainable_params, shape.frozen_params) == (23_224_320, 2_567_463_684)


@pytest.mark.parametrize(
    ("targets", "dora"),
    [("attention", False), ("attention+ff,conv1,proj_in", False), ("attention,conv1", True)],
)
def test_adapter_size_is_what_the_trainer_adds(demo_dir, targets, dora):
    """lora.add_adapter (what the worker trains) on the demo UNet, Linear and Conv2d targets,
    DoRA's magnitudes too: the planner's count is the parameters the optimizer gets, and
    their largest tensor."""
    model = demo_dir / "model"
    settings = Settings(training_type="lora", lora_rank=4, lora_targets=targets, lora_dora=dora)
    unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet")
    params = lora.add_adapter(unet, settings)
    counted = trainable.for_settings(settings, model_shape("sdxl", model), model)
    assert counted.trainable_params == sum(p.numel() for p in params)
    assert counted.largest_trainable == max(p.numel() for p in params)
    assert counted.frozen_params == sum(p.numel() for p in unet.parameters() if not p.requires_grad)


def parts(training, **kw):
    args = dict(
        stage=0, offload_optimizer="none", offload_param="none", gradient_checkpointing=True,
        resolution=1024, micro_batch=1, world_size=4, ranks_per_node=4, precision="bf16",
        on_cpu=False, ema=False,
    ) | kw  # fmt: skip
    return estimate(SDXL, training=training, **args)[3]


@pytest.mark.parametrize(("precision", "width"), [("bf16", 2), ("fp16", 2), ("no", 4)])
def test_the_frozen_base_is_weights_only_in_the_runs_dtype(precision, width):
    t, frozen, n = LORA16.trainable_params, LORA16.frozen_params, 4
    for stage in (0, 1, 2):
        p = parts(LORA16, stage=stage, precision=precision)
        assert p["device.frozen_params"] == width * frozen  # whole on every rank
        assert p["device.params"] == width * t
        assert p["device.grads"] == width * t // (n if stage == 2 else 1)
        master = 8 if precision == "no" and stage == 0 else 12  # fp32 master + Adam moments
        assert p["device.optimizer"] == master * t // (n if stage >= 1 else 1)
    # ZeRO-0's flat all-reduce carries the adapter's gradients only
    assert parts(LORA16, precision=precision)["device.buckets"] == width * t


def test_zero_1_and_2_shard_only_the_adapter_zero_3_also_the_base():
    t, frozen, n = LORA16.trainable_params, LORA16.frozen_params, 4
    zero0, zero2 = parts(LORA16), parts(LORA16, stage=2)
    assert zero2["device.frozen_params"] == zero0["device.frozen_params"]
    zero3 = parts(LORA16, stage=3)
    assert zero3["device.frozen_params"] == 2 * frozen // n
    assert zero3["device.grads"] == 2 * t // n
    offloaded = parts(LORA16, stage=3, offload_optimizer="cpu", offload_param="cpu")
    assert "device.frozen_params" not in offloaded
    assert offloaded["host_per_rank.frozen_params"] == 2 * frozen // n
    assert offloaded["host_per_rank.optimizer"] == 12 * t // n
    nvme = parts(LORA16, stage=3, offload_optimizer="nvme", offload_param="nvme")
    assert nvme["disk_per_rank.frozen_params"] == 2 * frozen // n


def test_full_training_rows_are_unchanged_by_the_training_argument():
    full = trainable.full_unet(SDXL)
    for stage in (0, 1, 2, 3):
        assert parts(full, stage=stage) == parts(None, stage=stage)
        assert "device.frozen_params" not in parts(full, stage=stage)


def test_headline_lora_on_one_24_gb_gpu_needs_no_sharding_or_offload():
    """SDXL LoRA (rank 16, attention), 1024 px, batch 8, one 24 GB GPU: the lowest stage that
    fits, where full training of the same job needs ZeRO-2 with the optimizer on the CPU."""
    hw = gpus(1, 24, 128)
    request = PlanRequest(resolution=1024, micro_batch=8, world_size=1)
    full = make_plan(shape=SDXL, hardware=hw, request=request)
    plan = make_plan(shape=SDXL, hardware=hw, request=request, training=LORA16)
    assert choice(full) == (2, "cpu", "none", True)
    assert choice(plan) == (0, "none", "none", True)
    assert plan.choice.device_bytes < full.choice.device_bytes < 0.9 * 24 * GiB
    counts = {"training_type": "lora", "trainable_params": 23_224_320}
    assert asdict(plan.inputs).items() >= (counts | {"frozen_params": SDXL.denoiser_params}).items()
    text = " ".join(plan.reasons)
    assert "LoRA: 23.2M adapter parameters train" in text and "whole on every rank" in text


def test_lora_takes_zero_3_only_when_the_base_does_not_fit_below_it():
    # 8 x 13 GB: ZeRO-3 would fit without recomputation, but the base fits at ZeRO-0 with
    # checkpointing, so the planner stays below ZeRO-3 (full training takes ZeRO-3 here)
    hw = gpus(8, 13)
    request = PlanRequest(resolution=1024, micro_batch=1, world_size=8)
    plan = make_plan(shape=SDXL, hardware=hw, request=request, training=LORA16)
    assert choice(plan) == (0, "none", "none", True)
    assert any(r.fits and r.zero_stage == 3 and not r.gradient_checkpointing for r in plan.rows)
    assert make_plan(shape=SDXL, hardware=hw, request=request).choice.zero_stage == 3
    # 4 x 7 GB: the 16-bit base (4.8 GiB) and the CUDA context leave no room below ZeRO-3
    hw = gpus(4, 7)
    request = PlanRequest(resolution=1024, micro_batch=1, world_size=4)
    plan = make_plan(shape=SDXL, hardware=hw, request=request, training=LORA16)
    assert choice(plan) == (3, "none", "none", True)
    assert "ZeRO-3 partitions it over the ranks, as no lower stage fits" in " ".join(plan.reasons)


WHAT_IF = "plan --model-family sdxl --resolution 1024 --train-batch-size 8 --gpus 1"
WHAT_IF_HW = ["--gpu-memory", "24GiB", "--host-memory", "128GiB"]


def test_plan_cli_shows_training_type_and_counts(monkeypatch, capsys):
    monkeypatch.setenv("ZT_TRAINING_TYPE", "lora")
    assert cli.main([*WHAT_IF.split(), *WHAT_IF_HW, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["choice"]["zero_stage"] == 0
    inputs = data["inputs"]
    assert (inputs["training_type"], inputs["trainable_params"], inputs["frozen_params"]) == (
        "lora", 23_224_320, 2_567_463_684,
    )  # fmt: skip
    assert cli.main([*WHAT_IF.split(), *WHAT_IF_HW]) == 0
    out = capsys.readouterr().out
    assert "training: lora, 23.2M trainable (adapter), 2567.5M frozen (base UNet)" in out
    assert "choice: ZeRO-0, no offload, checkpointing" in out
    monkeypatch.setenv("ZT_LORA_TEXT_ENCODER", "true")
    assert cli.main([*WHAT_IF.split(), *WHAT_IF_HW]) == 0
    text = 16 * (12 * 4 * 2 * 768 + 32 * 4 * 2 * 1280)  # q/k/v/out of CLIP-L and bigG
    assert (
        f"training: lora, {(23_224_320 + text) / 1e6:.1f}M trainable (UNet and text encoder "
        "adapters), 3385.2M frozen (base UNet and text encoders); captions encoded at every "
        "step, not cached"
    ) in capsys.readouterr().out
    monkeypatch.delenv("ZT_LORA_TEXT_ENCODER")
    monkeypatch.setenv("ZT_TRAINING_TYPE", "full")
    assert cli.main([*WHAT_IF.split(), *WHAT_IF_HW]) == 0
    assert "training: full, 2567.5M trainable" in capsys.readouterr().out


def test_plan_refuses_what_train_refuses_for_the_family(monkeypatch, capsys):
    """Text encoder adapters on a transformer family: `plan` says so in one line, exit 2, as
    `train` would (it used to end in a KeyError traceback)."""
    monkeypatch.setenv("ZT_TRAINING_TYPE", "lora")
    monkeypatch.setenv("ZT_LORA_TEXT_ENCODER", "true")
    what_if = WHAT_IF.replace("sdxl", "flux").split()
    assert cli.main([*what_if, *WHAT_IF_HW]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ZT_LORA_TEXT_ENCODER=true" in err and "flux" in err


def test_plan_of_a_local_model_sizes_the_adapter_on_its_own_unet(demo_job_env, demo_dir, capsys):
    demo_job_env.setenv("ZT_TRAINING_TYPE", "lora")
    demo_job_env.setenv("ZT_LORA_RANK", "8")
    assert cli.main(["plan", "--json"]) == 0
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    unet = meta_model("sdxl", demo_dir / "model")
    assert inputs["trainable_params"] == lora.adapter_size(unet, lora.ATTENTION, 8)[0]
    assert inputs["frozen_params"] == sum(p.numel() for p in unet.parameters())


def test_benchmarks_headline_on_paper_is_what_the_planner_says():
    """docs/benchmarks.md's 'GPU picture on paper' (bench/paper.py's hardware: one 24 GB GPU,
    64 GiB host) states the planner's choice and memory for the full and the LoRA job: they
    cannot drift."""
    from bench.paper import LORA_RANK, headline_hardware

    readme = (REPO / "docs/benchmarks.md").read_text()
    hw = headline_hardware()
    request = PlanRequest(resolution=1024, micro_batch=8, world_size=1)
    full = make_plan(shape=SDXL, hardware=hw, request=request).choice
    stated = f"would choose **{full.label()}**: {full.device_bytes / GiB:.1f} GiB on the GPU"
    assert stated in readme
    adapter = trainable.lora_adapter(SDXL, rank=LORA_RANK, targets=lora.PRESETS["attention"])
    plan = make_plan(shape=SDXL, hardware=hw, request=request, training=adapter)
    c = plan.choice
    assert (
        f"would choose **{c.label()}**: {c.device_bytes / GiB:.1f} GiB on the GPU, "
        f"{c.host_bytes / GiB:.1f} GiB host" in readme
    )


def test_text_encoder_adapters_are_what_the_trainer_adds(demo_dir):
    """ZT_LORA_TEXT_ENCODER: the planner adds the encoders' adapters (trained) and weights
    (frozen) as lora_text.build puts them into the engine; the published encoders' sizes
    from their layer shapes (CLIP ViT-L 12 x 768, OpenCLIP ViT-bigG 32 x 1280)."""
    from zerotuner.weights import lora_text

    model = demo_dir / "model"
    settings = Settings(training_type="lora", lora_rank=4, lora_text_encoder=True)
    unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet")
    lora.add_adapter(unet, settings)
    trained, _ = lora_text.build(
        unet, model, "sdxl", lora.adapter_settings(settings), seed=0, gradient_checkpointing=False
    )
    counted = trainable.for_settings(settings, model_shape("sdxl", model), model)
    params = [p for p in trained.parameters() if p.requires_grad]
    assert counted.trainable_params == sum(p.numel() for p in params)
    assert counted.largest_trainable == max(p.numel() for p in params)
    assert counted.frozen_params == sum(
        p.numel() for p in trained.parameters() if not p.requires_grad
    )
    published = [
        lora.adapter_size(encoder, lora_text.TEXT_TARGETS, 16)
        for encoder in lora_text.meta_encoders("sdxl")
    ]
    assert published == [(16 * 12 * 4 * 2 * 768, 16 * 768), (16 * 32 * 4 * 2 * 1280, 16 * 1280)]
