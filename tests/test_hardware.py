"""Hardware decisions fed with described machines (no GPU exists here), plus one real probe."""

from __future__ import annotations

import pytest

from zerotuner.errors import ConfigError, EnvironmentUnfit
from zerotuner.hardware import (
    CudaDevice,
    Facts,
    GiB,
    MiB,
    NvmlDevice,
    OpStatus,
    choose_accelerator,
    describe,
    host_memory,
    join_gpus,
    probe,
    require_supported,
)

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
C = "GPU-cccccccc-0000-0000-0000-000000000000"
OPS_OK = tuple(OpStatus(n, True, True, True) for n in ("cpu_adam", "async_io", "fused_adam"))


def cuda(index: int, uuid: str, gib: int = 24, cc: tuple[int, int] = (8, 9)) -> CudaDevice:
    return CudaDevice(index, "NVIDIA GeForce RTX 4090", gib * GiB, cc, uuid)


def good_facts(**kw) -> Facts:
    base = dict(
        cuda=(cuda(0, A),),
        nvml=(NvmlDevice(A, "NVIDIA GeForce RTX 4090", 24 * GiB, 23 * GiB, "00000000:01:00.0"),),
        mem_total=128 * GiB,
        cpu_count=16,
        shm_bytes=16 * GiB,
        memlock_bytes=None,
        environ={"NVIDIA_DRIVER_CAPABILITIES": "compute,utility"},
        ops=OPS_OK,
        libaio=True,
    )
    return Facts(**(base | kw))


def test_nvml_is_joined_by_uuid_not_index():
    # CUDA_VISIBLE_DEVICES=2,0: torch's 0 is NVML's 2, torch's 1 is NVML's 0.
    nvml = (
        NvmlDevice(A, "a", 24 * GiB, 20 * GiB, "bus-a"),
        NvmlDevice(B, "b", 24 * GiB, 1 * GiB, "bus-b"),
        NvmlDevice(C, "c", 24 * GiB, 22 * GiB, "bus-c"),
    )
    gpus = join_gpus((cuda(0, C), cuda(1, A)), nvml)
    assert [(g.index, g.uuid, g.free_memory, g.pci_bus_id) for g in gpus] == [
        (0, C, 22 * GiB, "bus-c"),
        (1, A, 20 * GiB, "bus-a"),
    ]


def test_without_nvml_free_memory_is_the_total_and_a_warning_says_why():
    hw = describe(good_facts(nvml=None))
    assert hw.gpus[0].free_memory == hw.gpus[0].total_memory
    assert any("NVML is not available" in w for w in hw.warnings)


def test_a_healthy_gpu_container_has_no_warnings():
    hw = describe(good_facts())
    assert hw.accelerator == "cuda" and hw.device_count == 1 and hw.bf16
    assert hw.warnings == ()


@pytest.mark.parametrize(
    ("change", "fix"),
    [
        ({"shm_bytes": 64 * MiB}, "--shm-size=16g"),
        ({"memlock_bytes": 64 * 1024}, "--ulimit memlock=-1"),
        (
            {"environ": {"NVIDIA_DRIVER_CAPABILITIES": "utility"}},
            "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
        ),
        ({"ops": (OpStatus("async_io", False, False, True),)}, "install libaio-dev"),
        ({"ops": (OpStatus("cpu_adam", True, False, True),)}, "DS_BUILD_CPU_ADAM=1"),
    ],
)
def test_each_harmful_finding_is_a_warning_with_its_fix(change, fix):
    hw = describe(good_facts(**change))
    assert len(hw.warnings) == 1
    assert fix in hw.warnings[0]


def test_gpu_used_by_another_process_is_reported():
    nvml = (NvmlDevice(A, "x", 24 * GiB, 10 * GiB),)
    hw = describe(good_facts(nvml=nvml))
    assert any("14.0 GiB in use" in w for w in hw.warnings)


def test_memlock_matters_only_for_pinned_cuda_buffers():
    hw = describe(Facts(mem_total=8 * GiB, memlock_bytes=64 * 1024, shm_bytes=8 * GiB))
    assert hw.accelerator == "cpu"
    assert hw.warnings == ()


def test_cgroup_limit_below_memtotal_is_the_host_memory():
    assert host_memory(256 * GiB, 32 * GiB) == 32 * GiB
    assert host_memory(16 * GiB, None) == 16 * GiB
    assert host_memory(16 * GiB, 64 * GiB) == 16 * GiB
    assert describe(good_facts(cgroup_limit=32 * GiB)).host_memory == 32 * GiB


def test_accelerator_choice():
    assert choose_accelerator("auto", Facts()) == "cpu"
    assert choose_accelerator("auto", good_facts()) == "cuda"
    assert choose_accelerator("cpu", good_facts()) == "cpu"
    assert choose_accelerator("auto", Facts(mps=True)) == "mps"
    assert choose_accelerator("auto", good_facts(hip=True)) == "rocm"
    with pytest.raises(EnvironmentUnfit, match="ZT_DEVICE=cuda: no CUDA GPU"):
        choose_accelerator("cuda", Facts())
    with pytest.raises(ConfigError, match="ZT_DEVICE='tpu'"):
        choose_accelerator("tpu", Facts())


@pytest.mark.parametrize(
    ("facts", "word"), [(Facts(mps=True), "MPS"), (good_facts(hip=True), "ROCm")]
)
def test_rocm_and_mps_are_refused_for_training(facts, word):
    hw = describe(facts)
    with pytest.raises(EnvironmentUnfit, match=word) as info:
        require_supported(hw)
    assert "ZT_DEVICE=cpu" in str(info.value)
    require_supported(describe(good_facts()))  # CUDA passes


def test_t4_has_no_bf16():
    hw = describe(good_facts(cuda=(cuda(0, A, 16, (7, 5)),)))
    assert not hw.bf16


def test_probe_this_machine(capsys):
    # capsys: stderr without a file descriptor must not make DeepSpeed's op checks fail
    hw = probe("auto")
    assert hw.accelerator == "cpu"  # no GPU here
    assert hw.host_memory > 1 * GiB and hw.cpu_count >= 1
    assert hw.shm_bytes and hw.shm_bytes > 0
    names = {o.name for o in hw.ops}
    assert names == {"cpu_adam", "async_io", "fused_adam"}
    assert hw.op("async_io").compatible is hw.libaio  # libaio-dev is installed here
    assert hw.nvme_offload_possible is True


def test_probe_path_with_fake_cuda_and_nvml(monkeypatch):
    """The probing code itself, fed at the torch.cuda / NVML level (no GPU can exist here).

    CUDA_VISIBLE_DEVICES=1: torch sees one GPU (the host's second); NVML lists both.
    """
    import types

    import pynvml
    import torch

    props = types.SimpleNamespace(
        name="NVIDIA H100 80GB HBM3", total_memory=80 * GiB, major=9, minor=0,
        uuid="bbbbbbbb-0000-0000-0000-000000000000",
    )  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    host_gpus = [(A, 79 * GiB, b"0000:01:00.0"), (B, 70 * GiB, b"0000:02:00.0")]
    memory = {
        i: types.SimpleNamespace(total=80 * GiB, free=f) for i, (_, f, _) in enumerate(host_gpus)
    }  # noqa: E501
    calls = []
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: calls.append("init"))
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: len(host_gpus))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: i)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda h: memory[h])
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", lambda h: host_gpus[h][0].encode())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(
        pynvml, "nvmlDeviceGetPciInfo", lambda h: types.SimpleNamespace(busId=host_gpus[h][2])
    )
    env = {"NVIDIA_DRIVER_CAPABILITIES": "compute,utility", "NVIDIA_VISIBLE_DEVICES": "1"}
    hw = probe("auto", env, ops=False)
    assert hw.accelerator == "cuda"
    assert [(g.uuid, g.free_memory, g.pci_bus_id, g.bf16) for g in hw.gpus] == [
        (B, 70 * GiB, "0000:02:00.0", True)
    ]
    assert hw.driver_capabilities == "compute,utility"
    assert calls == ["init", "shutdown"]
    assert any("10.0 GiB in use" in w for w in hw.warnings)
