"""The load-time host peak: its own row in `zerotuner plan`. Below ZeRO-3 every rank builds the
full fp32 UNet, then caches with the frozen parts; at ZeRO-3 (zero_init.py) a rank holds its
partition and one tensor being streamed in instead. The planner takes ZeRO-3 when only its load
fits the host, and refuses (exit 3) a plan whose load cannot fit, naming the setting that would
help. The NVMe optimizer's sub-group is the one the planner counts."""

from __future__ import annotations

import json

import pytest

from zerotuner import cli
from zerotuner.errors import EnvironmentUnfit
from zerotuner.families import model_shape
from zerotuner.machine.hardware import GPU, GiB, Hardware
from zerotuner.preflight.memory import (
    LOAD_PART_NAMES,
    PARAM_BUFFERS,
    RANK_PROCESS,
    SUB_GROUP_NVME,
    load_peak,
)
from zerotuner.preflight.plan import PlanRequest, make_plan
from zerotuner.preflight.trainable import Training

SDXL = model_shape("sdxl")
PSI = SDXL.denoiser_params


def gpus(n: int, memory_gib: float, host_gib: float) -> Hardware:
    mem = int(memory_gib * GiB)
    cards = tuple(GPU(i, "H100", mem, mem, (9, 0)) for i in range(n))
    return Hardware("cuda", cards, host_memory=int(host_gib * GiB), cpu_count=32)


def sdxl_plan(
    hardware: Hardware, *, training: Training | None = None, require_fit: bool = True, **pins
):
    request = PlanRequest(resolution=1024, micro_batch=8, world_size=len(hardware.gpus), **pins)
    return make_plan(
        shape=SDXL, hardware=hardware, request=request, training=training, require_fit=require_fit
    )


def test_load_peak_is_every_ranks_fp32_unet_then_the_frozen_parts_once_while_caching():
    plan = sdxl_plan(gpus(8, 80, 1024))
    load = plan.load
    assert plan.choice.zero_stage < 3 and load.path == "full_copy"
    assert load.per_rank["trained_model_fp32"] == 4 * PSI
    assert load.per_node["frozen_parts"] == 2 * SDXL.frozen_params  # bf16 job, once per node
    phases = plan.phases()
    assert phases["caching"]["host_bytes"] - phases["load"]["host_bytes"] == 2 * (
        SDXL.frozen_params
    )
    assert load.peak_bytes == phases["caching"]["host_bytes"]
    # 8 x (runtime + CUDA host context + 9.6 GiB of fp32 UNet) + 1.7 GiB frozen + entrypoint
    assert 90 * GiB < load.peak_bytes < 100 * GiB
    # the training row no longer carries the load: ZeRO-1 without offload holds no tensors
    # on the host, only the processes
    assert plan.choice.offload_optimizer == "none"
    assert plan.choice.host_bytes < 25 * GiB < load.peak_bytes
    assert not any("model_load" in k for r in plan.rows for k in r.parts)


def test_a_load_peak_over_the_host_takes_zero_3_whose_ranks_load_partitions():
    plan = sdxl_plan(gpus(8, 80, 64))  # ZeRO-1 fits the GPUs; its full copies not the host
    assert plan.choice.zero_stage == 3 and plan.load.path == "zero_init" and plan.load_fits
    assert "trained_model_fp32" not in plan.load.per_rank
    assert (
        "ZeRO-1, no offload, no checkpointing fits the devices but not the load"
        in (plan.reasons[1])
    )
    assert sdxl_plan(gpus(8, 80, 1024)).choice.zero_stage == 1  # with the host for it


def test_a_pinned_stage_whose_load_does_not_fit_is_refused_naming_what_would():
    with pytest.raises(EnvironmentUnfit) as info:
        sdxl_plan(gpus(8, 80, 64), zero_stage=1)  # every training row fits; the load does not
    message = str(info.value)
    assert info.value.exit_code == 3 and "\n" not in message
    assert message.startswith("load peak ") and "usable host" in message
    assert "full fp32 UNet on every rank (9.6 GiB)" in message
    assert "ZT_ZERO_STAGE=3" in message
    assert "ZT_NUM_PROCESSES=4" in message and "host with at least" in message
    # each suggestion holds: ZeRO-3; 4 ranks per node (2 nodes of 4 keep the world size)
    assert sdxl_plan(gpus(8, 80, 64), zero_stage=3).load_fits
    request = PlanRequest(
        resolution=1024, micro_batch=8, world_size=8, ranks_per_node=4, zero_stage=1
    )
    fewer = make_plan(shape=SDXL, hardware=gpus(8, 80, 64), request=request)
    assert fewer.load_fits and fewer.choice.fits
    assert fewer.load.peak_bytes <= 0.9 * 64 * GiB


def test_one_rank_that_cannot_load_is_told_to_get_more_host_memory():
    with pytest.raises(EnvironmentUnfit) as info:
        sdxl_plan(gpus(1, 80, 12), zero_stage=1)
    message = str(info.value)
    assert "ZT_NUM_PROCESSES" not in message
    need = float(message.rsplit("at least ", 1)[1].split(" GiB")[0])
    assert sdxl_plan(gpus(1, 80, need), zero_stage=1).load_fits  # the host it names is enough
    with pytest.raises(EnvironmentUnfit, match="load peak"):
        sdxl_plan(gpus(1, 80, need - 0.2), zero_stage=1)
    with pytest.raises(EnvironmentUnfit) as info:  # not even zero.Init's load fits
        sdxl_plan(gpus(1, 80, 4))
    assert "load peak" in str(info.value) and "ZT_ZERO_STAGE" not in str(info.value)


def test_config_without_fit_plans_anyway_and_says_the_load_does_not_fit():
    plan = sdxl_plan(gpus(8, 80, 64), require_fit=False, zero_stage=1)
    assert not plan.load_fits
    assert plan.reasons[0].startswith("the hardware planned for cannot run it: load peak")
    assert plan.to_dict()["load_peak"]["fits"] is False


def test_plan_cli_shows_the_phases_and_refuses_with_exit_3(capsys, monkeypatch):
    argv = "plan --model-family sdxl --resolution 1024 --train-batch-size 8 --gpus 8"
    base = [*argv.split(), "--gpu-memory", "80GiB"]
    assert cli.main([*base, "--host-memory", "256GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["load_peak"]
    assert data["path"] == "full_copy" and data["fits"] and data["ranks_per_node"] == 8
    phases = data["phases"]
    assert list(phases) == ["load", "caching", "training"]
    assert "full fp32 UNet on every rank" in phases["load"]["live"]
    assert "VAE and text encoders, once per node (caching)" in phases["caching"]["live"]
    assert "VAE and text encoders, once per node (caching)" not in phases["load"]["live"]
    assert phases["caching"]["host_bytes"] == data["host_bytes"]

    assert cli.main([*base, "--host-memory", "256GiB"]) == 0
    out = capsys.readouterr().out
    assert "host per node by phase (8 rank(s) per node" in out
    assert "load peak: " in out and ", fits" in out
    for phase in ("load", "caching", "training"):
        assert f"\n  {phase} " in out

    assert cli.main([*base, "--host-memory", "64GiB", "--json"]) == 0  # ZeRO-3 loads
    data = json.loads(capsys.readouterr().out)["load_peak"]
    assert data["path"] == "zero_init" and data["fits"]
    monkeypatch.setenv("ZT_ZERO_STAGE", "1")
    assert cli.main([*base, "--host-memory", "64GiB"]) == 3
    err = capsys.readouterr().err
    assert "load peak" in err and "ZT_NUM_PROCESSES=4" in err and "Traceback" not in err
    assert "ZT_ZERO_STAGE=3" in err


def zero3_load(offload_param: str, *, on_cpu: bool = False, world: int = 8, shape=SDXL):
    return load_peak(
        shape, ranks_per_node=world, precision="bf16", on_cpu=on_cpu, zero_stage=3,
        offload_param=offload_param, world_size=world,
    )  # fmt: skip


def test_zero_init_holds_a_partition_and_one_streamed_tensor_not_the_model():
    full = load_peak(SDXL, ranks_per_node=8, precision="bf16", on_cpu=False)
    assert full.path == "full_copy" and full.trained_bytes == 4 * PSI
    staging = (4 + 2) * SDXL.largest_param  # read as fp32 on rank 0, gathered in bf16
    on_device = zero3_load("none")  # the partition lives on the GPU
    assert on_device.path == "zero_init" and "trained_model_fp32" not in on_device.per_rank
    assert on_device.trained_bytes == staging
    on_host = zero3_load("cpu")
    assert on_host.per_rank["trained_partition"] == 2 * PSI // 8
    assert on_host.trained_bytes == 2 * PSI // 8 + staging
    on_disk = zero3_load("nvme")  # the swap buffers zero.Init allocates, the partition on disk
    assert on_disk.per_rank["param_swap_buffers"] == PARAM_BUFFERS * 2 * 100_000_000
    assert "trained_partition" not in on_disk.per_rank
    # the frozen parts are live while caching, as on the full-copy path
    assert on_host.per_node["frozen_parts"] == full.per_node["frozen_parts"]
    # an 8-GPU SDXL node: ~95 GiB to start with full copies, about a quarter with zero.Init
    assert full.peak_bytes > 90 * GiB and on_host.peak_bytes < 30 * GiB
    for load in (full, on_device, on_host, on_disk):  # every part has a name in the plan
        assert set(load.per_rank) | {"frozen_parts"} <= set(LOAD_PART_NAMES)


def test_zero_init_load_is_the_issues_goal_on_the_cpu():
    """On the CPU accelerator the partition is host memory: a rank's load phase is its
    partition in the training dtype, one largest tensor (twice) and the runtime: within 1.3x of
    params / world x bytes + largest tensor + runtime, for any world size."""
    for world in (1, 2, 8):
        load = zero3_load("none", on_cpu=True, world=world)
        goal = 2 * PSI // world + 2 * SDXL.largest_param + RANK_PROCESS
        assert goal <= load.per_rank_bytes() <= 1.3 * goal
    assert zero3_load("none", on_cpu=True, world=2).trained_bytes < 0.3 * 4 * PSI


def test_the_nvme_optimizer_config_uses_the_sub_group_the_planner_counts():
    from zerotuner.machine.hardware import cpu_only
    from zerotuner.preflight.deepspeed_config import Decisions, normalize
    from zerotuner.settings.schema import Settings

    def zero(base):
        return normalize(
            base, settings=Settings(offload_dir="/offload"), hardware=cpu_only(), shape=SDXL,
            world_size=1, decisions=Decisions(3, "nvme", "nvme"), source="test.json",
        ).config["zero_optimization"]  # fmt: skip

    assert zero({})["sub_group_size"] == SUB_GROUP_NVME
    assert zero({"zero_optimization": {"sub_group_size": 5e7}})["sub_group_size"] == 5e7  # kept


def test_benchmarks_page_node_table_is_what_the_planner_says():
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    from bench.paper import node_load_markdown

    table = node_load_markdown()
    page = (repo / "docs/benchmarks.md").read_text()
    start = page.index("<!-- node-load:start -->\n") + len("<!-- node-load:start -->\n")
    assert page[start : page.index("<!-- node-load:end -->")] == table
    before, *after = [line.split(" | ") for line in table.splitlines()[2:]]
    assert before[1] == "full_copy" and {row[1] for row in after} == {"zero_init"}
    # starting an 8-GPU SDXL node takes a third of the host with zero.Init
    assert all(3 * float(row[2]) < 1.2 * float(before[2]) for row in after)


def test_a_lora_base_loads_in_16_bit_below_zero_3():
    """A frozen base has no fp32 masters: below ZeRO-3 each rank reads it in the run's dtype."""
    from zerotuner.preflight import trainable
    from zerotuner.weights import lora

    adapter = trainable.lora_adapter(SDXL, rank=16, targets=lora.PRESETS["attention"])
    plan = sdxl_plan(gpus(8, 80, 1024), training=adapter)
    assert plan.choice.zero_stage < 3 and plan.load.path == "full_copy"
    assert plan.load.per_rank["base_model_16bit"] == 2 * PSI
    assert "trained_model_fp32" not in plan.load.per_rank
    full = sdxl_plan(gpus(8, 80, 1024))
    assert full.load.peak_bytes - plan.load.peak_bytes == 8 * 2 * PSI
    fp32 = sdxl_plan(gpus(8, 80, 1024), training=adapter, mixed_precision="no")
    assert fp32.load.per_rank["trained_model_fp32"] == 4 * PSI  # no 16-bit dtype to load in
