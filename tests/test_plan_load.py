"""The load-time host peak: its own row in `zerotuner plan`, and a refusal (exit 3) when
today's path (every rank builds the full fp32 UNet, then caches with the frozen parts) cannot
fit the host, naming the setting that would help."""

from __future__ import annotations

import json

import pytest

from zerotuner import cli
from zerotuner.errors import EnvironmentUnfit
from zerotuner.families import model_shape
from zerotuner.hardware import GPU, GiB, Hardware
from zerotuner.plan import make_plan

SDXL = model_shape("sdxl")
PSI = SDXL.unet_params


def gpus(n: int, memory_gib: float, host_gib: float) -> Hardware:
    mem = int(memory_gib * GiB)
    cards = tuple(GPU(i, "H100", mem, mem, (9, 0)) for i in range(n))
    return Hardware("cuda", cards, host_memory=int(host_gib * GiB), cpu_count=32)


def sdxl_plan(hardware: Hardware, **kw):
    n = len(hardware.gpus)
    return make_plan(SDXL, hardware, resolution=1024, micro_batch=8, world_size=n, **kw)


def test_load_peak_is_every_ranks_fp32_unet_then_the_frozen_parts_while_caching():
    plan = sdxl_plan(gpus(8, 80, 1024))
    load = plan.load
    assert load.per_rank["trained_model_fp32"] == 4 * PSI  # whatever the stage
    assert load.per_rank["frozen_parts"] == 2 * SDXL.frozen_params  # bf16 job
    phases = plan.phases()
    assert phases["caching"]["host_bytes"] - phases["load"]["host_bytes"] == 8 * 2 * (
        SDXL.frozen_params
    )
    assert load.peak_bytes == phases["caching"]["host_bytes"]
    # 8 x (runtime + CUDA host context + 9.6 GiB of fp32 UNet + 1.7 GiB frozen) + entrypoint
    assert 100 * GiB < load.peak_bytes < 115 * GiB
    # the training row no longer carries the load: ZeRO-1 without offload holds no tensors
    # on the host, only the processes
    assert plan.choice.offload_optimizer == "none"
    assert plan.choice.host_bytes < 25 * GiB < load.peak_bytes
    assert not any("model_load" in k for r in plan.rows for k in r.parts)


def test_a_load_peak_over_the_host_is_refused_naming_fewer_ranks_per_node():
    with pytest.raises(EnvironmentUnfit) as info:
        sdxl_plan(gpus(8, 80, 64))  # every training row fits; the load does not
    message = str(info.value)
    assert info.value.exit_code == 3 and "\n" not in message
    assert message.startswith("load peak ") and "usable host" in message
    assert "ZT_NUM_PROCESSES=4" in message and "host with at least" in message
    assert "ZeRO-3" not in message  # not the answer until zero.Init lands
    # the suggestion holds: 4 ranks per node (2 nodes of 4 keep the world size) fit
    fewer = make_plan(
        SDXL, gpus(8, 80, 64), resolution=1024, micro_batch=8, world_size=8, ranks_per_node=4
    )
    assert fewer.load_fits and fewer.choice.fits
    assert fewer.load.peak_bytes <= 0.9 * 64 * GiB


def test_one_rank_that_cannot_load_is_told_to_get_more_host_memory():
    with pytest.raises(EnvironmentUnfit) as info:
        sdxl_plan(gpus(1, 80, 12))
    message = str(info.value)
    assert "ZT_NUM_PROCESSES" not in message
    need = float(message.rsplit("at least ", 1)[1].split(" GiB")[0])
    assert sdxl_plan(gpus(1, 80, need)).load_fits  # the host it names is enough
    with pytest.raises(EnvironmentUnfit, match="load peak"):
        sdxl_plan(gpus(1, 80, need - 0.2))


def test_config_without_fit_plans_anyway_and_says_the_load_does_not_fit():
    plan = sdxl_plan(gpus(8, 80, 64), require_fit=False)
    assert not plan.load_fits
    assert plan.reasons[0].startswith("the hardware planned for cannot run it: load peak")
    assert plan.to_dict()["load_peak"]["fits"] is False


def test_plan_cli_shows_the_phases_and_refuses_with_exit_3(capsys):
    argv = "plan --model-family sdxl --resolution 1024 --train-batch-size 8 --gpus 8"
    base = [*argv.split(), "--gpu-memory", "80GiB"]
    assert cli.main([*base, "--host-memory", "256GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["load_peak"]
    assert data["path"] == "full_copy" and data["fits"] and data["ranks_per_node"] == 8
    phases = data["phases"]
    assert list(phases) == ["load", "caching", "training"]
    assert "full fp32 UNet on every rank" in phases["load"]["live"]
    assert "VAE and text encoders (caching)" in phases["caching"]["live"]
    assert "VAE and text encoders (caching)" not in phases["load"]["live"]
    assert phases["caching"]["host_bytes"] == data["host_bytes"]

    assert cli.main([*base, "--host-memory", "256GiB"]) == 0
    out = capsys.readouterr().out
    assert "host per node by phase (8 rank(s) per node" in out
    assert "load peak: " in out and ", fits" in out
    for phase in ("load", "caching", "training"):
        assert f"\n  {phase} " in out

    assert cli.main([*base, "--host-memory", "64GiB"]) == 3
    err = capsys.readouterr().err
    assert "load peak" in err and "ZT_NUM_PROCESSES=4" in err and "Traceback" not in err
