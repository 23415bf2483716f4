"""Every normalization rule, table-driven, through the pure `normalize` function."""

from __future__ import annotations

import json

import pytest

from zerotuner.errors import ConfigError
from zerotuner.families import ModelShape
from zerotuner.machine.hardware import GPU, GiB, Hardware, cpu_only
from zerotuner.preflight.deepspeed_config import Decisions, normalize
from zerotuner.preflight.pins import pins
from zerotuner.settings.schema import Settings

SDXL = ModelShape("sdxl", 2_567_463_684, 29_491_200, 0, 1024, "built-in sdxl config")
RTX4090 = Hardware("cuda", gpus=(GPU(0, "RTX 4090", 24 * GiB, 24 * GiB, (8, 9)),))
T4 = Hardware("cuda", gpus=(GPU(0, "Tesla T4", 16 * GiB, 16 * GiB, (7, 5)),))
CPU = cpu_only()

# The seed's own examples (reference/seed-deepspeed-offload-guide and SEED.md method 2).
SEED_STAGE2 = {
    "zero_optimization": {
        "stage": 2,
        "offload_param": {"device": "cpu", "pin_memory": True},
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    },
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-4, "warmup_num_steps": 500},
    },
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
}
SEED_NVME = {
    "zero_optimization": {
        "stage": 3,
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/path/to/nvme",
            "buffer_size": 1e8,
            "pin_memory": True,
        },
    }
}


def run(base=None, *, hardware=CPU, world=1, stage=2, opt="none", param="none", **env):
    settings = Settings(offload_dir="/offload", **env)
    decisions = Decisions(stage, opt, param)
    return normalize(
        base or {}, settings=settings, hardware=hardware, shape=SDXL, world_size=world,
        decisions=decisions, source="test.json",
    )  # fmt: skip


def messages(result, level):
    return [n.message for n in result.notes if n.level == level]


def problems(**kwargs):
    with pytest.raises(ConfigError) as info:
        run(**kwargs)
    return info.value.problems


def test_seed_stage2_example_keeps_its_values_and_drops_param_offload_below_stage3():
    r = run(SEED_STAGE2, hardware=RTX4090, stage=2, opt="cpu", param="cpu")
    zero = r.config["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"]["device"] == "cpu"
    assert "offload_param" not in zero
    assert any("offload_param=cpu only works at ZeRO stage 3" in m for m in messages(r, "warning"))
    assert r.config["train_batch_size"] == 8
    assert r.config["gradient_accumulation_steps"] == 4
    assert r.config["optimizer"]["params"]["lr"] == 1e-4
    assert r.config["scheduler"]["params"]["warmup_num_steps"] == 500


def test_seed_nvme_example_gets_the_volume_integer_buffers_and_aio():
    r = run(SEED_NVME, stage=3, param="nvme")
    section = r.config["zero_optimization"]["offload_param"]
    assert section["nvme_path"] == "/offload"
    assert section["buffer_size"] == 100_000_000 and isinstance(section["buffer_size"], int)
    assert section["pin_memory"] is True  # the user's value is kept
    assert r.config["aio"]["intra_op_parallelism"] >= 1
    assert r.config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("adamw", "AdamW"), ("Adam-W", "AdamW"), ("ADAM_W", "AdamW"), ("adam w", "AdamW"),
        ("adam", "Adam"), ("lion", "Lion"), ("LAMB", "Lamb"), ("adagrad", "Adagrad"),
        ("muon", "Muon"),
    ],
)  # fmt: skip
def test_optimizer_names_are_normalized(given, expected):
    r = run({"optimizer": {"type": given}}, hardware=RTX4090)
    assert r.config["optimizer"]["type"] == expected


@pytest.mark.parametrize(
    "given", ["cpuadam", "FusedAdam", "deepspeed_cpu_adam", "DeepSpeedCPUAdam"]
)
def test_implementation_names_become_adamw_with_a_warning(given):
    r = run({"optimizer": {"type": given, "params": {"lr": 3e-5}}})
    assert r.config["optimizer"]["type"] == "AdamW"
    assert any(given in m and "AdamW" in m for m in messages(r, "warning"))


def test_unknown_optimizer_is_an_error_listing_the_valid_ones():
    (problem,) = problems(base={"optimizer": {"type": "sgd"}})
    assert "'sgd' is unknown" in problem and "AdamW" in problem and "Lion" in problem


@pytest.mark.parametrize("name", ["OneBitAdam", "onebit_lamb", "zero-one-adam"])
def test_one_bit_optimizers_with_zero_are_refused(name):
    (problem,) = problems(base={"optimizer": {"type": name}}, stage=2)
    assert "ZeRO" in problem


def test_mup_optimizers_are_recognized_and_refused_with_the_reason():
    (problem,) = problems(base={"optimizer": {"type": "mu_adam_w"}})
    assert "MuAdamW" in problem and "base shapes" in problem


def test_max_grad_norm_moves_to_gradient_clipping():
    r = run({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 0.5}}})
    assert "max_grad_norm" not in r.config["optimizer"]["params"]
    assert r.config["gradient_clipping"] == 0.5
    assert any("max_grad_norm" in m for m in messages(r, "warning"))


def test_no_optimizer_or_scheduler_gives_adamw_and_warmuplr_from_settings():
    r = run({}, learning_rate=2e-5, lr_warmup_steps=7, weight_decay=0.0)
    assert r.config["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 2e-5, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8},
    }
    sched = r.config["scheduler"]
    assert sched["type"] == "WarmupLR"
    assert sched["params"]["warmup_max_lr"] == 2e-5 and sched["params"]["warmup_num_steps"] == 7


@pytest.mark.parametrize(
    ("setting", "kind"), [("constant", "WarmupLR"), ("linear", "WarmupDecayLR"),
                          ("cosine", "WarmupCosineLR")]
)  # fmt: skip
def test_scheduler_from_settings(setting, kind):
    r = run({}, lr_scheduler=setting, max_steps=321)
    assert r.config["scheduler"]["type"] == kind
    if kind != "WarmupLR":
        assert r.config["scheduler"]["params"]["total_num_steps"] == 321


def test_scheduler_auto_fields_are_filled():
    base = {
        "scheduler": {
            "type": "warmup_decay_lr",
            "params": {"warmup_max_lr": "auto", "warmup_num_steps": "auto",
                       "total_num_steps": "auto", "warmup_min_lr": "auto"},
        }
    }  # fmt: skip
    r = run(base, learning_rate=5e-5, lr_warmup_steps=10, max_steps=99)
    assert r.config["scheduler"] == {
        "type": "WarmupDecayLR",
        "params": {"warmup_max_lr": 5e-5, "warmup_num_steps": 10, "total_num_steps": 99,
                   "warmup_min_lr": 0, "warmup_type": "linear"},
    }  # fmt: skip


def test_unknown_scheduler_is_an_error():
    (problem,) = problems(base={"scheduler": {"type": "Cyclic"}})
    assert "Cyclic" in problem and "WarmupCosineLR" in problem


@pytest.mark.parametrize(
    ("base", "world", "expected"),
    [
        ({}, 1, (1, 1, 1)),
        ({}, 4, (1, 1, 4)),
        ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 2, (2, 3, 12)),
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, 2, (2, 4, 16)),
        ({"train_batch_size": 16, "gradient_accumulation_steps": 2}, 4, (2, 2, 16)),
        ({"train_batch_size": 8}, 2, (4, 1, 8)),
        ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}, 2, (1, 1, 2)),
    ],
)
def test_batch_arithmetic_is_filled(base, world, expected):
    r = run(base, world=world)
    c = r.config
    got = (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"])
    assert (*got, c["train_batch_size"]) == expected


def test_batch_contradiction_names_all_three_values():
    (problem,) = problems(base=SEED_STAGE2, world=2, stage=2, opt="cpu")
    assert "train_batch_size=8" in problem and "=2" in problem and "=4" in problem
    assert "world size 2" in problem


def test_batch_not_divisible_is_an_error():
    (problem,) = problems(base={"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3})
    assert "not divisible" in problem


def test_explicit_batch_settings_override_and_recompute_with_a_note():
    r = run(SEED_STAGE2, world=1, stage=2, opt="cpu", train_batch_size=1)
    assert r.config["train_micro_batch_size_per_gpu"] == 1
    assert r.config["train_batch_size"] == 1 * 4 * 1
    changes = messages(r, "change")
    assert any(
        "ZT_TRAIN_BATCH_SIZE=1 overrides train_micro_batch_size_per_gpu=2" in m for m in changes
    )
    assert any("recomputed as 4" in m for m in changes)


def test_explicit_setting_overrides_raw_field_and_says_so():
    r = run(SEED_STAGE2, hardware=RTX4090, stage=2, opt="cpu", learning_rate=3e-6)
    assert r.config["optimizer"]["params"]["lr"] == 3e-6
    assert r.config["scheduler"]["params"]["warmup_max_lr"] == 3e-6
    changes = messages(r, "change")
    assert any("ZT_LEARNING_RATE=3e-06 overrides optimizer.params.lr=0.0001" in m for m in changes)


@pytest.mark.parametrize(
    ("hardware", "setting", "expected"),
    [(RTX4090, "auto", "bf16"), (T4, "auto", "fp16"), (CPU, "auto", "no"), (CPU, "bf16", "bf16"),
     (RTX4090, "no", "no"), (RTX4090, "fp16", "fp16")],
)  # fmt: skip
def test_precision(hardware, setting, expected):
    r = run({}, hardware=hardware, mixed_precision=setting)
    assert r.mixed_precision == expected
    assert r.config["bf16"]["enabled"] is (expected == "bf16")
    assert r.config["fp16"]["enabled"] is (expected == "fp16")


def test_bf16_on_a_gpu_without_bf16_falls_back_to_fp16_with_a_warning():
    r = run({}, hardware=T4, mixed_precision="bf16")
    assert r.mixed_precision == "fp16"
    assert any("Tesla T4" in m and "fp16" in m for m in messages(r, "warning"))


def test_fp16_on_cpu_is_an_error():
    (problem,) = problems(mixed_precision="fp16")
    assert "ZT_MIXED_PRECISION=fp16" in problem and "bf16" in problem


def test_both_precisions_enabled_is_an_error():
    (problem,) = problems(base={"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    assert "both enabled" in problem


def test_precision_from_the_raw_config_is_kept_when_not_set():
    r = run({"bf16": {"enabled": True}}, hardware=RTX4090)
    assert r.mixed_precision == "bf16"


def test_precision_no_reads_as_fp32_in_the_notes():
    off = {"bf16": {"enabled": False}, "fp16": {"enabled": False}}  # the config's own fp32
    r = run(off, hardware=RTX4090, mixed_precision="bf16")
    assert "ZT_MIXED_PRECISION=bf16 overrides fp32 in config" in messages(r, "change")
    assert "precision: fp32" in messages(run(off, hardware=RTX4090), "info")


FP32 = {"bf16": {"enabled": False}, "fp16": {"enabled": False}}  # e.g. accelerate's "no"


@pytest.mark.parametrize(
    ("base", "hardware", "env"),
    [
        (FP32, RTX4090, {}),
        ({"fp16": {"enabled": True}}, RTX4090, {}),
        ({"bf16": {"enabled": True}}, T4, {}),  # no bf16 on a T4: fp16
        ({}, T4, {"mixed_precision": "bf16"}),
        (FP32, RTX4090, {"mixed_precision": "bf16"}),
        ({}, CPU, {}),
    ],
)
def test_the_plan_sizes_the_precision_the_deepspeed_config_enables(base, hardware, env):
    """The planner's precision (bytes per weight) is the one normalize writes into the config:
    a raw config's (or accelerate's) own precision when ZT_MIXED_PRECISION is not set, and
    bf16 on a GPU without it as the fp16 it becomes."""
    from zerotuner.preflight.steps import plan_for

    settings = Settings(offload_dir="/offload", **env)
    plan = plan_for(
        settings, SDXL, hardware, base=base, world_size=1, ranks_per_node=1,
        offload_disk_free=None, require_fit=False,
    )  # fmt: skip
    assert plan.inputs.precision == run(base, hardware=hardware, **env).mixed_precision


def test_nvme_optimizer_below_stage3_becomes_cpu_with_a_warning():
    r = run({}, stage=2, opt="nvme")
    assert r.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert any("nvme only works at stage 3" in m for m in messages(r, "warning"))


def test_nvme_optimizer_below_stage3_set_explicitly_is_refused():
    (problem,) = problems(stage=2, opt="nvme", zero_stage=2, offload_optimizer="nvme")
    assert "ZT_OFFLOAD_OPTIMIZER=nvme" in problem and "ZT_ZERO_STAGE=3" in problem


def test_offload_at_stage0_is_dropped_with_a_warning():
    r = run({}, stage=0, opt="cpu")
    assert r.config["zero_optimization"] == {"stage": 0}
    assert any("stage >= 1" in m for m in messages(r, "warning"))


@pytest.mark.parametrize("placeholder", ["none", "", "/path/to/nvme", "/local_nvme", None])
def test_nvme_path_placeholders_are_replaced(placeholder):
    base = {
        "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": placeholder}}
    }
    r = run(base, stage=3, opt="nvme")
    assert r.config["zero_optimization"]["offload_optimizer"]["nvme_path"] == "/offload"


def test_a_real_nvme_path_other_than_the_offload_dir_is_refused_not_redirected():
    # inputs.py makes a real nvme_path the offload dir before normalize; one that still
    # differs here was set against an explicit ZT_OFFLOAD_DIR: never swap where neither said.
    base = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/mnt/x"}}}
    with pytest.raises(ConfigError) as info:
        run(base, stage=3, param="nvme")
    assert info.value.problems == [
        "ZT_OFFLOAD_DIR=/offload and zero_optimization.offload_param.nvme_path in test.json "
        "(/mnt/x) name different NVMe offload folders: unset ZT_OFFLOAD_DIR, or set it and "
        "nvme_path to the same folder"
    ]
    same = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/offload/"}}}
    assert (
        run(same, stage=3, param="nvme").config["zero_optimization"]["offload_param"]["nvme_path"]
        == "/offload"
    )


@pytest.mark.parametrize("value", ["1e8", 1e8, "100000000", 100000000.0])
def test_numbers_are_coerced_to_integers(value):
    base = {"zero_optimization": {"offload_param": {"device": "nvme", "buffer_size": value}}}
    r = run(base, stage=3, param="nvme")
    size = r.config["zero_optimization"]["offload_param"]["buffer_size"]
    assert size == 100_000_000 and type(size) is int


def test_numbers_that_are_not_numbers_are_errors():
    base = {"zero_optimization": {"reduce_bucket_size": "big"}, "gradient_accumulation_steps": 2.5}
    found = problems(base=base)
    assert any("reduce_bucket_size='big'" in p for p in found)
    assert any("gradient_accumulation_steps=2.5" in p for p in found)  # all problems at once


def test_string_booleans_are_coerced():
    base = {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": "false"}}}
    r = run(base, stage=2, opt="cpu")
    assert r.config["zero_optimization"]["offload_optimizer"]["pin_memory"] is False


def test_aio_thread_count_is_renamed():
    base = {"aio": {"thread_count": 4}}
    r = run(base, stage=3, param="nvme")
    assert r.config["aio"]["intra_op_parallelism"] == 4 and "thread_count" not in r.config["aio"]
    assert any("thread_count" in m for m in messages(r, "change"))


def test_param_buffer_must_hold_the_largest_parameter():
    base = {"zero_optimization": {"offload_param": {"device": "nvme", "buffer_size": 1000}}}
    r = run(base, stage=3, param="nvme")
    assert r.config["zero_optimization"]["offload_param"]["buffer_size"] == SDXL.largest_param


def test_nvme_optimizer_needs_four_buffers():
    base = {"zero_optimization": {"offload_optimizer": {"device": "nvme", "buffer_count": 2}}}
    r = run(base, stage=3, opt="nvme")
    assert r.config["zero_optimization"]["offload_optimizer"]["buffer_count"] == 4


def test_stage3_gathers_16bit_weights_for_export():
    base = {"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": False}}
    r = run(base, stage=3)
    assert r.config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_auto_buckets_come_from_the_model_shapes():
    base = {
        "zero_optimization": {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}
    }
    r = run(base, stage=3)
    zero = r.config["zero_optimization"]
    assert zero["reduce_bucket_size"] >= SDXL.largest_param
    assert zero["stage3_prefetch_bucket_size"] < zero["reduce_bucket_size"]
    assert zero["stage3_param_persistence_threshold"] > 0
    assert "auto" not in str(r.config)


def test_pins_come_from_settings_first_then_the_raw_config():
    assert pins(Settings(), SEED_STAGE2).zero_stage == 2
    assert pins(Settings(zero_stage=3), SEED_STAGE2).zero_stage == 3
    assert pins(Settings(), {}).zero_stage is None
    assert pins(Settings(), SEED_STAGE2).offload_optimizer == "cpu"
    assert pins(Settings(offload_optimizer="none"), SEED_STAGE2).offload_optimizer == "none"


def test_the_input_is_not_modified():
    import copy

    before = copy.deepcopy(SEED_NVME)
    run(SEED_NVME, stage=3, param="nvme")
    assert before == SEED_NVME


def test_deepspeed_rejections_become_config_errors():
    (problem,) = problems(base={"nebula": {"enabled": True}})
    assert problem.startswith("DeepSpeed rejects the config") and "Nebula" in problem


def test_cpu_accelerator_refuses_optimizers_it_cannot_run():
    (problem,) = problems(base={"optimizer": {"type": "lamb"}})
    assert "Lamb has no CPU implementation" in problem
    (problem,) = problems(base={"optimizer": {"type": "lion"}}, stage=2)
    assert "ZT_OFFLOAD_OPTIMIZER=cpu" in problem
    r = run({"optimizer": {"type": "lion"}}, stage=2, opt="cpu")
    assert r.config["optimizer"]["type"] == "Lion"


@pytest.mark.parametrize("setting", ["constant", "linear", "cosine"])
def test_no_warmup_starts_at_the_peak(setting):
    r = run({}, lr_scheduler=setting, lr_warmup_steps=0, learning_rate=1e-4)
    params = r.config["scheduler"]["params"]
    assert params["warmup_num_steps"] == 1  # DeepSpeed refuses 0
    if setting == "cosine":
        assert params["warmup_min_ratio"] == 1.0
    else:
        assert params["warmup_min_lr"] == params["warmup_max_lr"] == 1e-4


def test_bucket_sizes_are_aligned_even_for_odd_parameter_counts():
    odd = ModelShape("sdxl", 95_481_092, 1_000_001, 0, 1024, "odd")  # // 10 is odd
    r = normalize(
        {}, settings=Settings(), hardware=CPU, shape=odd, world_size=2,
        decisions=Decisions(2),
    )  # fmt: skip
    zero = r.config["zero_optimization"]
    assert zero["reduce_bucket_size"] % 8 == 0 and zero["allgather_bucket_size"] % 8 == 0


def test_an_auto_zerotuner_cannot_fill_is_an_error():
    (problem,) = problems(base={"stage": "auto"})  # a misplaced key: DeepSpeed would ignore it
    assert problem.startswith("stage='auto' has no value zerotuner can fill")


# --- the seed's examples through the whole preflight (settings -> plan -> normalize) -------


def preflighted(base: dict, hardware: Hardware = RTX4090, **env):
    from zerotuner.preflight.steps import preflight
    from zerotuner.settings.effective import effective_settings

    settings = Settings(
        model="stabilityai/stable-diffusion-xl-base-1.0", offload_dir="/offload",
        deepspeed_config=json.dumps(base), **env,
    )  # fmt: skip
    return preflight(effective_settings(settings=settings), hardware=hardware, require_fit=False)


def test_seed_stage2_example_runs_the_preflight_dropping_param_offload_with_a_warning():
    result = preflighted(SEED_STAGE2)
    zero = result.normalized.config["zero_optimization"]
    assert zero["stage"] == 2 and "offload_param" not in zero
    warnings = [n.message for n in result.notes if n.level == "warning"]
    assert any("offload_param.device cpu -> none: parameter offload needs ZeRO stage 3" in w
               for w in warnings), warnings  # fmt: skip


def test_a_raw_nvme_optimizer_below_stage3_plans_cpu_as_deepspeed_would():
    base = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}
    zero = preflighted(base).normalized.config["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu"


def test_messages_name_raw_config_pins_by_their_deepspeed_key():
    base = {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}
    result = preflighted(base, hardware=T4)  # 16 GB, ZeRO-0: SDXL cannot fit
    closest = [n.message for n in result.notes if "cannot run it" in n.message]
    assert closest and "zero_optimization.stage=0" in closest[0], result.notes
    assert "ZT_ZERO_STAGE" not in closest[0]
