"""Planner decisions for described hardware, the ZeRO formulas, and `zerotuner plan`."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from zerotuner import cli
from zerotuner.errors import ConfigError, EnvironmentUnfit
from zerotuner.families import (
    FAMILIES,
    REGISTRY,
    ModelShape,
    frozen_params,
    model_shape,
    resolve_family,
)
from zerotuner.machine.hardware import GPU, GiB, Hardware, OpStatus, cpu_only
from zerotuner.preflight.plan import PlanRequest, estimate, make_plan

SDXL = model_shape("sdxl")
PSI = SDXL.denoiser_params
# The demo's tiny SDXL-architecture UNet (zerotuner demo), as counted from its config.
TINY = ModelShape("sdxl", 1_028_708, 73_728, 736_647, 256, "demo", base_channels=32)
ONE_1024 = PlanRequest(resolution=1024, micro_batch=1, world_size=1)  # one image, one rank


def gpus(n: int, memory_gib: float, host_gib: float, cc=(8, 9), name="GPU") -> Hardware:
    mem = int(memory_gib * GiB)
    cards = tuple(GPU(i, name, mem, mem, cc) for i in range(n))
    return Hardware("cuda", cards, host_memory=int(host_gib * GiB), cpu_count=32)


def choice(plan) -> tuple:
    c = plan.choice
    return (c.zero_stage, c.offload_optimizer, c.offload_param, c.gradient_checkpointing)


CASES = [
    # id, hardware, job, expected (stage, optimizer, param, checkpointing)
    # The seed's headline: SDXL 1024 px, batch 8 on one 24 GB RTX 4090 + 128 GiB host.
    ("rtx4090", gpus(1, 24, 128, name="RTX 4090"), dict(micro_batch=8), (2, "cpu", "none", True)),
    # The same job on one 80 GB GPU needs no offload at all.
    ("a100-80", gpus(1, 80, 128), dict(micro_batch=8), (0, "none", "none", True)),
    # 8 x H100: sharding the optimizer over 8 ranks frees room for full activations.
    ("8xh100", gpus(8, 80, 1024, name="H100"), dict(micro_batch=8), (1, "none", "none", False)),
    # 2 x T4 (16 GB, no bf16): fp16; SDXL only fits with the optimizer on the host.
    ("2xt4", gpus(2, 16, 64, cc=(7, 5)), dict(micro_batch=1), (2, "cpu", "none", False)),
    # 8 GB GPU, 16 GiB host, a 1 TB NVMe: the optimizer goes to NVMe at stage 3.
    (
        "8gb-nvme",
        gpus(1, 8, 16),
        dict(micro_batch=1, offload_disk_free=1000 * GiB),
        (3, "nvme", "cpu", True),
    ),
]


@pytest.mark.parametrize(
    ("hardware", "job", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_choice_for_described_hardware(hardware, job, expected):
    world = len(hardware.gpus)
    request = PlanRequest(resolution=1024, micro_batch=job["micro_batch"], world_size=world)
    disk = job.get("offload_disk_free")
    plan = make_plan(shape=SDXL, hardware=hardware, request=request, offload_disk_free=disk)
    assert choice(plan) == expected
    assert plan.choice.fits
    assert plan.choice.device_bytes <= 0.9 * hardware.min_device_memory


def test_headline_reasons_say_why_stage_2_and_why_checkpointing():
    request = PlanRequest(resolution=1024, micro_batch=8, world_size=1)
    plan = make_plan(shape=SDXL, hardware=gpus(1, 24, 128), request=request)
    text = " ".join(plan.reasons)
    assert "ZeRO-2 rather than ZeRO-1" in text
    assert "gradient checkpointing is what makes it fit" in text
    assert "less offload does not fit" in text
    # With one GPU, ZeRO-1 + optimizer offload also fits: stage 2 is a choice, not a necessity.
    stage1 = [r for r in plan.rows if r.zero_stage == 1 and r.offload_optimizer == "cpu"]
    assert any(r.fits for r in stage1)
    # Within reach of what the seed measured (13,102 MiB) and far below 24 GB.
    assert 9 * GiB < plan.choice.device_bytes < 16 * GiB


def test_t4_plans_in_fp16():
    request = PlanRequest(resolution=1024, micro_batch=1, world_size=2)
    plan = make_plan(shape=SDXL, hardware=gpus(2, 16, 64, cc=(7, 5)), request=request)
    assert plan.inputs.precision == "fp16"


def test_small_gpu_and_little_ram_without_nvme_exits_3_naming_the_way_out():
    with pytest.raises(EnvironmentUnfit) as info:
        make_plan(shape=SDXL, hardware=gpus(1, 8, 16), request=ONE_1024)
    message = str(info.value)
    assert info.value.exit_code == 3
    assert message.startswith("nothing fits: closest is ZeRO-")
    assert "would fit with" in message and "ZT_OFFLOAD_DIR" in message


def test_nvme_needs_async_io():
    no_aio = Hardware(
        "cuda",
        gpus(1, 8, 16).gpus,
        host_memory=16 * GiB,
        ops=(OpStatus("async_io", False, False, True),),
    )
    with pytest.raises(EnvironmentUnfit, match="async_io"):
        make_plan(shape=SDXL, hardware=no_aio, request=ONE_1024, offload_disk_free=10**13)


def test_cpu_only_demo_picks_plain_fp32_zero_0():
    request = PlanRequest(resolution=256, micro_batch=2, world_size=2)
    plan = make_plan(shape=TINY, hardware=cpu_only(24 * GiB), request=request)
    assert choice(plan) == (0, "none", "none", False)
    assert plan.inputs.precision == "no"
    assert plan.choice.device_bytes < 1 * GiB


def test_cpu_only_sdxl_does_not_fit_in_24_gib():
    with pytest.raises(EnvironmentUnfit, match="host"):
        make_plan(shape=SDXL, hardware=cpu_only(24 * GiB), request=ONE_1024)


def test_pins_are_kept():
    hw = gpus(1, 80, 128)
    request = PlanRequest(resolution=1024, micro_batch=8, world_size=1, zero_stage=3)
    plan = make_plan(shape=SDXL, hardware=hw, request=request)
    assert plan.choice.zero_stage == 3
    assert {r.zero_stage for r in plan.rows} == {3}
    request = PlanRequest(resolution=1024, micro_batch=1, world_size=1, offload_optimizer="cpu")
    plan = make_plan(shape=SDXL, hardware=hw, request=request)
    assert plan.choice.offload_optimizer == "cpu"
    with pytest.raises(EnvironmentUnfit, match="ZT_GRADIENT_CHECKPOINTING=False"):
        request = PlanRequest(
            resolution=1024, micro_batch=8, world_size=1, gradient_checkpointing=False
        )
        make_plan(shape=SDXL, hardware=gpus(1, 24, 128), request=request)


@pytest.mark.parametrize(
    ("pins", "word"),
    [
        (dict(zero_stage=2, offload_param="cpu"), "parameter offload needs ZeRO stage 3"),
        (dict(zero_stage=1, offload_optimizer="nvme"), "NVMe optimizer offload needs"),
        (dict(zero_stage=0, offload_optimizer="cpu"), "needs ZeRO stage >= 1"),
    ],
)
def test_illegal_pins_are_config_errors(pins, word):
    with pytest.raises(ConfigError, match=word) as info:
        request = PlanRequest(resolution=1024, micro_batch=1, world_size=1, **pins)
        make_plan(shape=SDXL, hardware=gpus(1, 80, 128), request=request)
    assert "ZT_ZERO_STAGE=" in str(info.value)


@pytest.mark.parametrize("n", [1, 4, 8])
@pytest.mark.parametrize(
    ("stage", "psi_factor"),
    [
        (0, lambda n: 16),
        (1, lambda n: 4 + 12 / n),
        (2, lambda n: 2 + 14 / n),
        (3, lambda n: 16 / n),
    ],
)
def test_model_states_follow_the_zero_formulas(stage, psi_factor, n):
    _, _, _, parts = estimate(
        SDXL, stage=stage, offload_optimizer="none", offload_param="none",
        gradient_checkpointing=True, resolution=1024, micro_batch=1, world_size=n,
        ranks_per_node=n, precision="bf16", on_cpu=False, ema=False,
    )  # fmt: skip
    states = sum(parts.get(f"device.{k}", 0) for k in ("params", "grads", "optimizer"))
    assert states == pytest.approx(psi_factor(n) * PSI, rel=1e-6)


def test_optimizer_offload_moves_master_moments_and_fp32_grads_to_the_host():
    kw = dict(
        gradient_checkpointing=True, resolution=1024, micro_batch=1, world_size=2,
        ranks_per_node=2, precision="bf16", on_cpu=False, ema=False,
    )  # fmt: skip
    _, host, _, parts = estimate(SDXL, stage=2, offload_optimizer="cpu", offload_param="none", **kw)
    assert parts["host_per_rank.optimizer"] == 12 * PSI // 2
    assert parts["host_per_rank.fp32_grads"] == 4 * PSI // 2
    assert "device.optimizer" not in parts and "device.grads" not in parts
    _, _, disk, parts = estimate(
        SDXL, stage=3, offload_optimizer="nvme", offload_param="nvme", **kw
    )
    assert disk == 2 * (16 * PSI // 2 + 2 * PSI // 2)  # two ranks on this node


def test_activations_scale_with_pixels_batch_and_checkpointing():
    def act(resolution, batch, ckpt):
        return estimate(
            SDXL, stage=0, offload_optimizer="none", offload_param="none",
            gradient_checkpointing=ckpt, resolution=resolution, micro_batch=batch, world_size=1,
            ranks_per_node=1, precision="bf16", on_cpu=False, ema=False,
        )[3]["device.activations"]  # fmt: skip

    assert act(1024, 1, False) == pytest.approx(6.4 * GiB, rel=0.01)  # the measured SDXL figure
    assert act(1024, 1, True) == pytest.approx(0.55 * GiB, rel=0.01)
    assert act(512, 1, False) == pytest.approx(act(1024, 1, False) / 4, rel=0.01)
    assert act(1024, 8, True) == pytest.approx(8 * act(1024, 1, True), rel=0.01)


def test_activations_follow_width_not_parameter_count():
    def act(shape):
        return estimate(
            shape, stage=0, offload_optimizer="none", offload_param="none",
            gradient_checkpointing=True, resolution=512, micro_batch=1, world_size=1,
            ranks_per_node=1, precision="bf16", on_cpu=False, ema=False,
        )[3]["device.activations"]  # fmt: skip

    # SD1 has a third of SDXL's parameters but the same first-block width (320 channels)
    assert act(model_shape("sd1")) == act(SDXL)
    assert act(TINY) == pytest.approx(act(SDXL) * 32 / 320, rel=0.01)


def test_ema_is_an_fp32_copy_on_the_host():
    hw = gpus(1, 80, 256)
    base = make_plan(shape=SDXL, hardware=hw, request=ONE_1024)
    with_ema = make_plan(shape=SDXL, hardware=hw, request=replace(ONE_1024, ema=True))
    assert with_ema.choice.host_bytes - base.choice.host_bytes == 4 * PSI  # once per node
    assert with_ema.choice.device_bytes == base.choice.device_bytes


@pytest.mark.slow
def test_builtin_counts_match_the_configs_on_the_meta_device():
    counts = {
        f: spec.builtin_counts for f, spec in REGISTRY.items()
    }  # SD3.5 Large 8.06B, Flux 11.9B
    for family in FAMILIES:
        shape = model_shape(family, recount=True)
        assert (shape.denoiser_params, shape.largest_param) == counts[family]


def test_plan_cli_what_if_json(capsys):
    argv = "plan --model-family sdxl --resolution 1024 --train-batch-size 8 --gpus 1"
    code = cli.main([*argv.split(), "--gpu-memory", "24GiB", "--host-memory", "128GiB", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["choice"] == {
        "zero_stage": 2,
        "offload_optimizer": "cpu",
        "offload_param": "none",
        "gradient_checkpointing": True,
        "offload_activations": "none",  # an image family's stay on the device
    }
    assert len(data["rows"]) > 10 and data["reasons"]

    code = cli.main([*argv.split(), "--gpu-memory", "80GiB", "--host-memory", "128GiB", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert (data["choice"]["offload_optimizer"], data["choice"]["offload_param"]) == (
        "none",
        "none",
    )


def test_plan_cli_table_and_exit_codes(capsys):
    base = ["plan", "--model-family", "sdxl", "--resolution", "1024", "--train-batch-size", "8"]
    base += ["--gpus", "1"]
    assert cli.main([*base, "--gpu-memory", "24GiB", "--host-memory", "128GiB"]) == 0
    out = capsys.readouterr().out
    assert "choice: ZeRO-2, optimizer->cpu, checkpointing" in out
    assert "<- choice" in out
    assert cli.main([*base, "--gpu-memory", "24 gigs", "--host-memory", "128GiB"]) == 2
    assert "--gpu-memory=24 gigs" in capsys.readouterr().err
    assert cli.main([*base, "--gpu-memory", "4GiB", "--host-memory", "8GiB"]) == 3
    assert "nothing fits" in capsys.readouterr().err


def test_plan_cli_probes_this_machine_with_settings(capsys, demo_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("ZT_MODEL", str(demo_dir / "model"))
    monkeypatch.setenv("ZT_NUM_PROCESSES", "2")
    monkeypatch.setenv("ZT_OFFLOAD_DIR", str(tmp_path / "offload"))
    assert cli.main(["plan", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"]["accelerator"] == "cpu"
    assert data["inputs"]["world_size"] == 2
    assert data["choice"]["offload_param"] == "none"


@pytest.mark.parametrize(
    ("model", "family"),
    [
        ("stabilityai/stable-diffusion-xl-base-1.0", "sdxl"),
        ("stabilityai/stable-diffusion-2-1", "sd2"),
        ("runwayml/stable-diffusion-v1-5", "sd1"),
        ("black-forest-labs/FLUX.1-dev", "flux"),
        ("stabilityai/stable-diffusion-3.5-large", "sd3"),
    ],
)
def test_family_from_hub_names(model, family, monkeypatch, tmp_path):
    assert resolve_family(model) == family
    assert resolve_family(model, "sd1") == "sd1"  # ZT_MODEL_FAMILY wins
    # preflight with no hub in reach (HF_HUB_OFFLINE: conftest) plans the family the name says
    from zerotuner.preflight.steps import resolve_model
    from zerotuner.settings.schema import Settings

    source = resolve_model(Settings(model=model, cache_dir=tmp_path))
    assert source.family == family and "guessed from the hub id" in source.reason


def test_a_hub_name_that_says_no_family_is_one_line_naming_the_setting(tmp_path):
    from zerotuner.preflight.steps import resolve_model
    from zerotuner.settings.schema import Settings

    with pytest.raises(ConfigError) as info:
        resolve_model(Settings(model="someone/my-model", cache_dir=tmp_path))
    message = str(info.value)
    assert "ZT_MODEL=someone/my-model" in message and "set ZT_MODEL_FAMILY" in message
    assert "flux" in message and "\n" not in message and info.value.exit_code == 2


def test_families_detected_from_a_transformer_config_alone_or_refused(tmp_path):
    from zerotuner.families import detect_family

    def folder(name: str, index: dict | None, config: dict) -> Path:
        root = tmp_path / name
        (root / "transformer").mkdir(parents=True)
        (root / "transformer" / "config.json").write_text(json.dumps(config))
        if index is not None:
            (root / "model_index.json").write_text(json.dumps(index))
        return root

    assert detect_family(folder("flux", None, {"_class_name": "FluxTransformer2DModel"})) == "flux"
    assert detect_family(folder("sd3", None, {"_class_name": "SD3Transformer2DModel"})) == "sd3"
    with pytest.raises(ConfigError, match="a PixArtTransformer2DModel model; zerotuner trains"):
        detect_family(folder("pixart", None, {"_class_name": "PixArtTransformer2DModel"}))
    kandinsky = {
        "_class_name": "KandinskyV22Pipeline",
        "unet": ["diffusers", "UNet2DConditionModel"],
    }
    with pytest.raises(ConfigError) as info:  # a UNet, but not a Stable Diffusion pipeline
        detect_family(folder("kandinsky", kandinsky, {"_class_name": "UNet2DConditionModel"}))
    assert "a KandinskyV22Pipeline pipeline" in str(info.value)
    assert "sdxl, sd1, sd2, sd3, flux" in str(info.value)


def test_unknown_hub_name_asks_for_the_family():
    with pytest.raises(ConfigError, match="set ZT_MODEL_FAMILY"):
        resolve_family("someone/my-model")


def test_local_model_counts_its_frozen_encoders(demo_dir):
    import torch
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    model = demo_dir / "model"
    real = 0
    for sub, cls in (
        ("text_encoder", CLIPTextModel),
        ("text_encoder_2", CLIPTextModelWithProjection),
        ("vae", AutoencoderKL),
    ):
        module = cls.from_pretrained(model / sub, torch_dtype=torch.float32)
        real += sum(p.numel() for p in module.parameters())
    assert frozen_params(model) == real > 0
    shape = model_shape("sdxl", model)
    assert shape.frozen_params == real and shape.source.endswith("unet/config.json")


# --- the buffers DeepSpeed holds at the in-step peak (bench/peak.py measured them) -------------

BENCH = ModelShape("sdxl", 95_505_668, 4_718_592, 1_032_839, 64, "bench", base_channels=128)


def _parts(shape, **kw):
    args = dict(
        offload_optimizer="none", offload_param="none", gradient_checkpointing=False,
        resolution=64, micro_batch=2, world_size=2, ranks_per_node=2, precision="no",
        on_cpu=True, ema=False,
    ) | kw  # fmt: skip
    return estimate(shape, **args)[3]


def test_zero_0_all_reduce_flattens_the_whole_gradient_up_to_5e8_elements():
    # engine.allreduce_no_retain: one flat copy of every gradient per 5e8 elements, even on
    # one rank; the planner once counted a tenth of the model here
    psi = BENCH.denoiser_params
    assert _parts(BENCH, stage=0)["device.buckets"] == 4 * psi
    assert _parts(BENCH, stage=0, world_size=1, ranks_per_node=1)["device.buckets"] == 4 * psi
    # SDXL's 2.6e9 parameters go through buckets of 5e8
    big = _parts(SDXL, stage=0, precision="bf16", world_size=1, ranks_per_node=1)
    assert big["device.buckets"] == 2 * min(PSI, 500_000_000)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_2_hold_one_bucket_and_build_a_flat_grad_partition_at_the_step(stage):
    psi, n = BENCH.denoiser_params, 2
    fp32 = _parts(BENCH, stage=stage)
    assert fp32["device.buckets"] == 4 * 9_550_568  # one reduce bucket (overlap_comm off)
    assert fp32["device.flat_grad_partition"] == 4 * psi // n  # flat fp32 copy, no cast
    bf16 = _parts(BENCH, stage=stage, precision="bf16")
    assert bf16["device.flat_grad_partition"] == (2 + 4) * psi // n  # 16-bit flat + fp32 cast
    assert "device.flat_grad_partition" not in _parts(BENCH, stage=stage, offload_optimizer="cpu")


def test_cpu_optimizer_offload_keeps_a_16_bit_partition_copy_and_staging_on_the_host():
    psi, big = BENCH.denoiser_params, BENCH.largest_param
    for stage in (1, 2):
        parts = _parts(BENCH, stage=stage, offload_optimizer="cpu", precision="bf16")
        assert parts["host_per_rank.param_partition_copy"] == 2 * psi // 2
        assert parts["host_per_rank.grad_staging"] == parts["device.grad_staging"] == 2 * big
    stage3 = _parts(BENCH, stage=3, offload_optimizer="cpu", offload_param="cpu")
    assert "host_per_rank.param_partition_copy" not in stage3  # stage3.py has no such copy


def test_nvme_optimizer_steps_each_sub_group_with_an_fp32_gradient_buffer_in_memory():
    parts = _parts(BENCH, stage=3, offload_optimizer="nvme", offload_param="nvme")
    group = BENCH.denoiser_params // 2  # below the 1e8 sub-group size: the whole partition
    assert parts["host_per_rank.subgroup_grad_buffer"] == 4 * group
    assert parts["host_per_rank.optimizer_swap_buffers"] == 4 * 4 * group


@pytest.mark.parametrize(
    ("stage", "optimizer", "param", "measured"),
    [  # peak live tensor bytes per rank, bench/results/2026-11-23.json (ranks' max)
        (0, "none", "none", 1_910_000_000),
        (1, "none", "none", 1_539_000_000),
        (2, "none", "none", 1_346_000_000),
        (3, "none", "none", 1_457_000_000),
        (2, "cpu", "none", 1_495_000_000),
        (3, "cpu", "cpu", 1_648_000_000),
        (3, "nvme", "nvme", 1_887_000_000),
    ],
)
def test_tensor_parts_match_the_measured_in_step_peak_within_10_percent(
    stage, optimizer, param, measured
):
    skip = {"device.caching_peak", "device.framework", "host_per_rank.process"}
    parts = _parts(BENCH, stage=stage, offload_optimizer=optimizer, offload_param=param)
    planned = sum(v for k, v in parts.items() if not k.startswith("disk_") and k not in skip)
    assert abs(planned - measured) / measured < 0.10


def test_tiny_demo_host_plan_matches_what_its_processes_use():
    """The tiny demo on 2 CPU ranks (ZeRO-2): its process tree peaked at 1.72 GiB summed RSS
    (bench/results/2026-11-23: ranks 575 and 559 MiB, `zerotuner train` 404, torchrun 223);
    the plan once said 4.5 GiB (2 GiB per rank, the CUDA-host figure, on the CPU path)."""
    request = PlanRequest(resolution=64, micro_batch=2, world_size=2, zero_stage=2)
    plan = make_plan(shape=TINY, hardware=cpu_only(24 * GiB), request=request)
    measured = 1.72 * GiB
    assert abs(plan.choice.host_bytes - measured) / measured < 0.15


def test_a_cuda_rank_adds_the_cuda_host_context_to_the_runtime():
    kw = dict(
        stage=2, offload_optimizer="none", offload_param="none", gradient_checkpointing=True,
        resolution=1024, micro_batch=1, world_size=2, ranks_per_node=2, precision="bf16",
        ema=False,
    )  # fmt: skip
    cpu = estimate(TINY, on_cpu=True, **kw)[3]
    cuda = estimate(TINY, on_cpu=False, **kw)[3]
    assert "host_per_rank.cuda_host_context" not in cpu
    assert cuda["host_per_rank.process"] == cpu["host_per_rank.process"] < 1 * GiB
    fixed = cuda["host_per_rank.process"] + cuda["host_per_rank.cuda_host_context"]
    assert 1.5 * GiB < fixed < 2.5 * GiB  # a CUDA rank's host memory besides its tensors


def test_counts_from_safetensors_headers_equal_the_meta_models(
    demo_dir, sd1_demo_dir, sd2_demo_dir, flow_demo_dirs, tmp_path
):
    """The entrypoint counts a local UNet from its weight files' headers (no diffusers
    import); the meta-device count agrees for every family (the transformers are counted
    there), and a folder without safetensors weights is still counted, on the meta device."""
    from diffusers import UNet2DConditionModel

    from zerotuner.families import meta_model
    from zerotuner.families.stored import stored_counts

    models = {"sdxl": demo_dir, "sd1": sd1_demo_dir, "sd2": sd2_demo_dir, **flow_demo_dirs}
    for family, folder in models.items():
        model = folder / "model"
        shape = model_shape(family, model)
        sizes = [p.numel() for p in meta_model(family, model).parameters()]
        assert (shape.denoiser_params, shape.largest_param) == (sum(sizes), max(sizes)), family
    copy = tmp_path / "bin"
    shutil.copytree(demo_dir / "model", copy)
    unet = UNet2DConditionModel.from_pretrained(copy / "unet")
    for weights in (copy / "unet").glob("*.safetensors"):
        weights.unlink()
    unet.save_pretrained(copy / "unet", safe_serialization=False)  # pytorch_model .bin only
    assert stored_counts(copy / "unet") is None
    meta, stored = model_shape("sdxl", copy), model_shape("sdxl", demo_dir / "model")
    assert (meta.denoiser_params, meta.largest_param) == (
        stored.denoiser_params,
        stored.largest_param,
    )
