"""The planner with a LoRA base stored in 8 bits (ZT_BASE_PRECISION, issue 42): the base counted
at the stored bytes of weights/base_precision.STORAGE and one upcast layer, never ZeRO-3 or
parameter offload with it, and `plan` showing what 8 bits would let fit while `auto` keeps the
run's precision."""

from __future__ import annotations

import json

import pytest

from zerotuner import cli
from zerotuner.errors import ConfigError
from zerotuner.families import meta_model, model_shape
from zerotuner.machine.hardware import GPU, GiB, Hardware
from zerotuner.preflight import trainable
from zerotuner.preflight.plan import PlanRequest, make_plan
from zerotuner.weights import base_precision, lora

FLUX = model_shape("flux")
LOW = base_precision.LOW_PRECISIONS
# FLUX.1-dev LoRA at 1024 px on one 24 GB GPU: at the run's precision only ZeRO-3 with the base
# in host memory fits (docs/models.md)
FLUX_24 = ["plan", "--model-family", "flux", "--resolution", "1024", "--train-batch-size", "1",
           "--gpus", "1", "--gpu-memory", "24GiB", "--host-memory", "128GiB", "--bf16"]  # fmt: skip


def gpus(n: int, memory_gib: float, host_gib: float = 256) -> Hardware:
    mem = int(memory_gib * GiB)
    return Hardware("cuda", tuple(GPU(i, "GPU", mem, mem, (9, 0)) for i in range(n)),
                    host_memory=int(host_gib * GiB), cpu_count=32)  # fmt: skip


@pytest.fixture(scope="module")
def adapter() -> trainable.Training:
    return trainable.lora_adapter(FLUX, rank=16, targets=lora.PRESETS["attention"])


def plan(adapter, hardware, precision="auto", **pins):
    request = PlanRequest(resolution=1024, micro_batch=1, world_size=len(hardware.gpus),
                          mixed_precision="bf16", base_precision=precision, **pins)  # fmt: skip
    return make_plan(shape=FLUX, hardware=hardware, request=request, training=adapter,
                     offload_disk_free=2 * 10**12, require_fit=False)  # fmt: skip


@pytest.mark.parametrize("precision", LOW)
def test_the_base_counts_at_the_tables_bytes_and_one_upcast_layer(adapter, precision):
    """FLUX.1-dev's transformer (11.9B) on the meta device: every layer the trainer stores low
    counts at STORAGE's bytes (a byte per weight, a scale per output channel), everything else
    at bf16's 2 bytes, and the device holds one upcast copy of the largest stored layer; the
    rest of each row is what the same row costs on a bf16 base."""
    storage = base_precision.STORAGE[precision]
    stored = [m for n, m in meta_model("flux").named_modules() if base_precision.stored_low(n, m)]
    weights = sum(m.in_features * m.out_features for m in stored)
    expected = (
        2 * (FLUX.denoiser_params - weights)
        + storage.per_parameter * weights
        + storage.per_row * sum(m.out_features for m in stored)
    )
    upcast = 2 * max(m.in_features * m.out_features for m in stored)
    low, auto = plan(adapter, gpus(1, 80), precision), plan(adapter, gpus(1, 80))
    assert low.rows and low.inputs.base_precision == precision
    for row in low.rows:
        assert row.parts["device.frozen_params"] == expected
        assert row.parts["device.frozen_base_upcast"] == upcast
        same = next(r for r in auto.rows if r.choice() == row.choice())
        assert same.device_bytes - row.device_bytes == 2 * FLUX.denoiser_params - expected - upcast
        assert same.host_bytes == row.host_bytes
    # the load is the run's precision's: each rank loads the base so and stores it low later
    assert low.load == auto.load
    reasons = " ".join(low.reasons)
    assert f"ZT_BASE_PRECISION={precision}: {len(stored)} Linear layers in 8 bits" in reasons


@pytest.mark.parametrize("precision", LOW)
def test_zero_3_and_parameter_offload_are_never_offered_with_a_base_in_8_bits(adapter, precision):
    for hardware in (gpus(1, 24, 128), gpus(1, 80), gpus(8, 80, 1024), gpus(4, 12)):
        rows = plan(adapter, hardware, precision).rows
        assert rows and all(r.zero_stage < 3 and r.offload_param == "none" for r in rows)
    # what `auto` shows a base in 8 bits would fit is below ZeRO-3 too
    shown = plan(adapter, gpus(1, 24, 128)).low_base
    assert shown and all(r.zero_stage < 3 for low in shown for r in low.rows)
    # a DeepSpeed config pinning either: one line naming both settings
    names = {"zero_stage": "zero_optimization.stage"}
    with pytest.raises(ConfigError) as stage:
        plan(adapter, gpus(1, 24), precision, zero_stage=3, pin_names=names)
    assert str(stage.value).startswith(
        f"ZT_BASE_PRECISION={precision} with zero_optimization.stage=3: ZeRO-3 partitions"
    )
    with pytest.raises(ConfigError, match=f"ZT_BASE_PRECISION={precision} with ZT_OFFLOAD_PARAM"):
        plan(adapter, gpus(1, 24), precision, offload_param="cpu")


def test_zero_3_pins_are_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("ZT_TRAINING_TYPE", "lora")
    monkeypatch.setenv("ZT_BASE_PRECISION", "fp8")
    pins = [
        ("ZT_ZERO_STAGE", "3", "ZT_ZERO_STAGE=3"),
        ("ZT_OFFLOAD_PARAM", "nvme", "ZT_OFFLOAD_PARAM=nvme"),
        ("ZT_DEEPSPEED_CONFIG", '{"zero_optimization": {"stage": 3}}', "stage=3"),
    ]
    for name, value, said in pins:
        monkeypatch.setenv(name, value)
        assert cli.main(FLUX_24) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert "ZT_BASE_PRECISION=fp8 with" in err and said in err, err
        monkeypatch.delenv(name)


def test_plan_shows_the_rows_only_a_base_in_8_bits_fits_and_keeps_the_runs_precision(
    monkeypatch, capsys
):
    monkeypatch.setenv("ZT_TRAINING_TYPE", "lora")
    assert cli.main([*FLUX_24, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # auto: the run's precision, so ZeRO-3 with the base in host memory
    assert data["inputs"]["base_precision"] == "auto"
    assert (data["choice"]["zero_stage"], data["choice"]["offload_param"]) == (3, "cpu")
    shown = {low["precision"]: low for low in data["low_precision_base"]}
    assert set(shown) == set(LOW)
    fp8 = shown["fp8"]
    assert fp8["setting"] == "ZT_BASE_PRECISION=fp8" and fp8["choice"]["offload_param"] == "none"
    at_bf16 = next(r for r in data["rows"] if all(r[k] == v for k, v in fp8["choice"].items()))
    assert fp8["rows"][0]["fits"] and not at_bf16["fits"]  # it fits only in 8 bits
    label = fp8["rows"][0]["label"]

    assert cli.main(FLUX_24) == 0
    out = capsys.readouterr().out
    assert "with ZT_BASE_PRECISION=fp8 (the base's " in out and "<- its choice" in out
    assert "a LoRA base stored in 8 bits would fit without parameter offload: " in out
    assert f"ZT_BASE_PRECISION=fp8 ({label}: device " in out
    assert f"choice: {at_bf16['label']}" not in out  # shown, not chosen

    # set, it is what the plan chooses, counted as shown
    monkeypatch.setenv("ZT_BASE_PRECISION", "fp8")
    assert cli.main([*FLUX_24, "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)
    assert chosen["choice"] == fp8["choice"] and chosen["low_precision_base"] == []
    row = next(r for r in chosen["rows"] if r["label"] == label)
    assert row["device_bytes"] == fp8["rows"][0]["device_bytes"]
    assert cli.main(FLUX_24) == 0
    assert "frozen (base UNet, stored at fp8)" in capsys.readouterr().out


def test_why_nothing_fits_names_the_precision_that_would(monkeypatch, capsys):
    """Parameter offload refused (ZT_OFFLOAD_PARAM=none): nothing fits FLUX.1-dev's bf16 base
    on 24 GB, and the one line says which setting would; Qwen-Image (20.4B) fits 24 GB in 8
    bits nowhere, and its line says the run's precision would, at ZeRO-3."""
    monkeypatch.setenv("ZT_TRAINING_TYPE", "lora")
    monkeypatch.setenv("ZT_OFFLOAD_PARAM", "none")
    assert cli.main(FLUX_24) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "or store the LoRA base in 8 bits, which fits: " in err
    monkeypatch.setenv("ZT_BASE_PRECISION", "fp8")
    assert cli.main(FLUX_24) == 0
    label = capsys.readouterr().out.split("choice: ")[1].splitlines()[0]
    assert f"ZT_BASE_PRECISION=fp8 ({label}: device " in err

    monkeypatch.delenv("ZT_OFFLOAD_PARAM")
    qwen = [a if a != "flux" else "qwenimage" for a in FLUX_24]
    assert cli.main(qwen) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "; or ZT_BASE_PRECISION=auto, whose ZeRO-3 fits (ZeRO-3" in err
    monkeypatch.setenv("ZT_BASE_PRECISION", "auto")
    assert cli.main(qwen) == 0
    assert "choice: ZeRO-3" in capsys.readouterr().out


# --- text encoders stored in 8 bits while caching (ZT_TEXT_ENCODER_PRECISION) ---------------


def text_plan(family: str, precision: str, hardware: Hardware):
    shape = model_shape(family)
    request = PlanRequest(
        resolution=512, micro_batch=1, world_size=1, mixed_precision="bf16",
        text_encoder_precision=precision,
        text_encoders=base_precision.stored_text(family) if precision != "auto" else None,
    )  # fmt: skip
    training = trainable.lora_adapter(shape, rank=16, targets=lora.PRESETS["attention"])
    return make_plan(shape=shape, hardware=hardware, request=request, training=training,
                     offload_disk_free=2 * 10**12, require_fit=False)  # fmt: skip


@pytest.mark.parametrize(("family", "streamed"), [("flux", False), ("flux2", True)])
def test_text_encoders_count_at_their_stored_bytes_while_caching(family, streamed):
    """FLUX.1's CLIP-L and T5-XXL, FLUX.2 [dev]'s 24B Mistral: stored at fp8, the node's
    caching phase holds one byte (instead of bf16's two) per stored weight, the embeddings and
    heads kept; the device's caching bytes drop as much, except where the encoder streams from
    the host layer by layer (FLUX.2: its largest layer on the device is the kept embedding)."""
    from zerotuner.families.registry import REGISTRY

    spec = REGISTRY[family]
    saved = spec.text_params - spec.text_kept_params  # a byte per stored weight, at bf16
    hardware = gpus(1, 24, host_gib=512)
    full, low = (text_plan(family, p, hardware) for p in ("auto", "fp8"))
    assert full.load.per_node["frozen_parts"] - low.load.per_node["frozen_parts"] == saved
    assert low.load.peak_bytes < full.load.peak_bytes

    # the row whose device peak is the caching phase (the base in host memory, ZeRO-3, 512 px)
    def row(plan):
        return next(
            r
            for r in plan.rows
            if (r.zero_stage, r.offload_optimizer, r.offload_param, r.gradient_checkpointing)
            == (3, "cpu", "cpu", True)
        )

    rows = [row(full), row(low)]
    assert streamed or "device.caching_peak" in rows[0].parts
    assert rows[0].device_bytes - rows[1].device_bytes == (0 if streamed else saved)


def test_without_stored_layers_the_encoders_count_whole():
    """A family whose encoders' stored part is not known (an installed family's Spec without
    text_kept_params) keeps the run's bytes for them: never an estimate below the truth."""
    hardware = gpus(1, 24, host_gib=512)
    shape = model_shape("flux")
    request = PlanRequest(resolution=1024, micro_batch=1, world_size=1, mixed_precision="bf16",
                          text_encoder_precision="fp8", text_encoders=None)  # fmt: skip
    training = trainable.lora_adapter(shape, rank=16, targets=lora.PRESETS["attention"])
    plan = make_plan(shape=shape, hardware=hardware, request=request, training=training,
                     offload_disk_free=2 * 10**12, require_fit=False)  # fmt: skip
    assert plan.load.per_node["frozen_parts"] == 2 * shape.frozen_params


def test_a_local_models_encoders_are_counted_from_their_headers(demo_dir):
    """The tiny SDXL's two CLIP encoders: the layers their safetensors headers say an 8-bit
    storage takes are the ones quantize_frozen_base stores, element for element, and the
    bytes it saves are the planner's."""
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    planned = base_precision.stored_text("sdxl", demo_dir / "model")
    measured = [
        base_precision.quantize_frozen_base(
            cls.from_pretrained(demo_dir / "model" / folder), "fp8",
            setting="text_encoder_precision",
        )
        for folder, cls in (("text_encoder", CLIPTextModel),
                            ("text_encoder_2", CLIPTextModelWithProjection))
    ]  # fmt: skip
    assert planned is not None and planned.layers == sum(m.layers for m in measured) > 0
    assert planned.params == sum(m.quantized_params for m in measured)
    assert planned.at("fp8", 4).saved == sum(m.saved for m in measured)


def published_encoders():
    """The published encoders' configs (their config.json's shapes), for the KEPT constants."""
    from transformers import CLIPTextConfig, Qwen3Config, T5Config

    from zerotuner.families import registry as r

    return [
        ("CLIPTextModel", CLIPTextConfig(
            vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
            num_attention_heads=12, max_position_embeddings=77), r.CLIP_L, r.CLIP_L_KEPT),
        ("T5EncoderModel", T5Config(
            vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
            feed_forward_proj="gated-gelu"), r.T5_XXL_PARAMS, r.T5_XXL_KEPT),
        ("Qwen3Model", Qwen3Config(
            vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128,
            tie_word_embeddings=True), r.QWEN3_4B_PARAMS, r.QWEN3_4B_KEPT),
    ]  # fmt: skip


@pytest.mark.parametrize("encoder", range(3), ids=["clip-l", "t5-xxl", "qwen3-4b"])
def test_the_published_encoders_kept_parts_are_what_the_rule_keeps(encoder):
    """CLIP-L, T5-XXL and Qwen3-4B on the meta device: their parameters are the registry's,
    and what stored_low leaves at the run's precision is the registry's KEPT count (within
    the biases and norms it counts as stored, under 0.1 %)."""
    import transformers
    from accelerate import init_empty_weights

    name, config, params, kept = published_encoders()[encoder]
    with init_empty_weights():
        module = getattr(transformers, name)(config)
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    stored = base_precision.stored_layers(module)
    total = sum(p.numel() for p in module.parameters())
    assert total == params
    assert abs((total - stored.params) - kept) <= 0.001 * total, (total - stored.params, kept)
