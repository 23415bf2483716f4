"""Hardware decisions fed with described machines (no GPU exists here), plus one real probe."""

from __future__ import annotations

import os

import pytest

from zerotuner.errors import ConfigError, EnvironmentUnfit
from zerotuner.machine.driver import CUDA12_BUILD, Driver, driver_problem, driver_warnings
from zerotuner.machine.hardware import (
    GPU,
    CudaDevice,
    Facts,
    GiB,
    Hardware,
    MiB,
    NvmlDevice,
    OpStatus,
    choose_accelerator,
    describe,
    describe_hardware,
    host_memory,
    join_gpus,
    require_supported,
)
from zerotuner.machine.probe import probe, probe_facts

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
    monkeypatch.setattr(pynvml, "nvmlSystemGetDriverVersion", lambda: b"580.65.06")
    monkeypatch.setattr(pynvml, "nvmlSystemGetCudaDriverVersion", lambda: 13000)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    env = {"NVIDIA_DRIVER_CAPABILITIES": "compute,utility", "NVIDIA_VISIBLE_DEVICES": "1"}
    hw = probe("auto", env, ops=False)
    assert hw.accelerator == "cuda"
    assert [(g.uuid, g.free_memory, g.pci_bus_id, g.bf16) for g in hw.gpus] == [
        (B, 70 * GiB, "0000:02:00.0", True)
    ]
    assert hw.driver_capabilities == "compute,utility"
    assert calls == ["init", "shutdown"] * 2  # devices, then the driver
    assert hw.driver == Driver("580.65.06", (13, 0), gpus=2) and hw.image_cuda == (13, 0)
    assert any("10.0 GiB in use" in w for w in hw.warnings)


# --- the driver floor: the host's driver against the CUDA this image's PyTorch is built for ----

OLD = Driver("550.54.15", (12, 4), gpus=2)  # R550: CUDA 12.4
NEW = Driver("580.65.06", (13, 0), gpus=2)


@pytest.mark.parametrize(
    ("driver", "image", "refused"),
    [
        (NEW, (13, 0), None),
        (Driver("590.44.01", (13, 1), 1), (13, 0), None),
        (OLD, (13, 0), "driver >= 580"),
        (Driver("575.57.08", (12, 9), 1), (13, 0), "driver >= 580"),
        (OLD, (12, 8), None),  # minor-version compatibility: any 12.x driver >= 525.60.13
        (Driver("525.60.13", (12, 0), 1), (12, 8), None),
        (Driver("525.60.11", (12, 0), 1), (12, 8), "driver >= 525.60.13"),
        (Driver("470.256.02", (11, 4), 1), (12, 8), "driver >= 525.60.13"),
    ],
)
def test_driver_floor_follows_the_cuda_major_of_the_wheel(driver, image, refused):
    problem = driver_problem(driver, image, torch_sees_gpus=False)
    assert (problem is None) is (refused is None), problem
    if refused:
        assert refused in problem and driver.version in problem


def test_a_driver_below_the_floor_is_one_line_naming_both_versions_and_the_way_out():
    line = driver_problem(OLD, (13, 0), torch_sees_gpus=False)
    assert line == (
        "NVIDIA driver 550.54.15 supports CUDA up to 12.4; this image's PyTorch is built for "
        "CUDA 13.0 (driver >= 580): use a host whose driver is >= 580, or the CUDA 12 image "
        f"({CUDA12_BUILD})"
    )
    assert "\n" not in line
    # A driver too old for CUDA 12 as well is not sent to the CUDA 12 image.
    ancient = driver_problem(Driver("470.256.02", (11, 4), 1), (13, 0), torch_sees_gpus=False)
    assert "CUDA 12 image" not in ancient and ">= 580" in ancient
    # NVML reporting the forward-compatibility libraries' CUDA: the driver's number decides.
    compat = driver_problem(Driver("570.124.06", (13, 0), 1), (13, 0), torch_sees_gpus=False)
    assert compat.startswith("NVIDIA driver 570.124.06 is too old; this image's PyTorch is built")


def test_no_verdict_without_the_facts_or_when_pytorch_already_runs_the_gpus():
    assert driver_problem(None, (13, 0), torch_sees_gpus=False) is None  # no NVML
    assert driver_problem(OLD, None, torch_sees_gpus=False) is None  # CPU build of PyTorch
    assert driver_problem(Driver("550.54.15", (12, 4), 0), (13, 0), torch_sees_gpus=False) is None
    # Forward compatibility on a data-centre GPU: PyTorch found the GPU, so it runs.
    assert driver_problem(OLD, (13, 0), torch_sees_gpus=True) is None
    [note] = driver_warnings(OLD, (13, 0), torch_sees_gpus=True)
    assert "forward compatibility" in note and "550.54.15" in note
    [note] = driver_warnings(OLD, (12, 8), torch_sees_gpus=True)
    assert "minor-version compatibility" in note
    assert driver_warnings(NEW, (13, 0), torch_sees_gpus=True) == []


def test_a_driver_that_suffices_but_cuda_failed_anyway_says_why():
    line = driver_problem(
        OLD, (12, 8), torch_sees_gpus=False,
        cuda_error="Error 804: forward compatibility was attempted on non supported HW",
    )  # fmt: skip
    assert "NVML sees 2 GPU(s) with driver 550.54.15" in line and "Error 804" in line
    assert "ZT_DEVICE=cpu" in line


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_a_gpu_host_below_the_floor_is_exit_3_not_a_cpu_fallback(device):
    facts = good_facts(cuda=(), nvml=None, driver=OLD, image_cuda=(13, 0))
    with pytest.raises(EnvironmentUnfit, match=r"^NVIDIA driver 550\.54\.15 supports") as info:
        describe(facts, device)
    assert info.value.exit_code == 3
    assert describe(facts, "cpu").accelerator == "cpu"  # asked for the CPU: no verdict


def test_a_healthy_host_reports_its_driver_and_the_wheels_cuda():
    hw = describe(good_facts(driver=NEW, image_cuda=(13, 0)))
    assert hw.driver == NEW and hw.image_cuda == (13, 0) and hw.warnings == ()
    assert "NVIDIA driver 580.65.06 (CUDA 13.0), PyTorch for CUDA 13.0" in describe_hardware(hw)


CUDA_TOO_OLD = (
    "CUDA initialization: The NVIDIA driver on your system is too old (found version 12040). "
    "Please update your GPU driver by downloading and installing a new version from the URL: "
    "http://www.nvidia.com/Download/index.aspx (Triggered internally at "
    "/pytorch/c10/cuda/CUDAFunctions.cpp:119.)"
)


@pytest.fixture
def old_driver_host(monkeypatch):
    """A host with two GPUs on driver 550 under an image whose PyTorch is built for CUDA 13.0:
    torch.cuda says no GPU (with its warning), NVML still reports the driver."""
    import warnings

    import pynvml
    import torch

    import zerotuner.machine.probe

    def is_available():
        warnings.warn(CUDA_TOO_OLD, UserWarning, stacklevel=2)
        return False

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlSystemGetDriverVersion", lambda: "550.54.15")
    monkeypatch.setattr(pynvml, "nvmlSystemGetCudaDriverVersion", lambda: 12040)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 2)
    monkeypatch.setattr(zerotuner.machine.probe, "_ds_ops", lambda *a: OPS_OK)  # not tested here
    for key, value in {"ZT_DEVICE": "auto", "ZT_METRICS_PORT": "0"}.items():
        monkeypatch.setenv(key, value)
    return monkeypatch


EXPECTED_LINE = "NVIDIA driver 550.54.15 supports CUDA up to 12.4; this image's PyTorch is built"


def test_probe_reads_the_driver_from_nvml_when_cuda_cannot_start(old_driver_host):
    facts = probe_facts("auto", {})
    assert facts.cuda == () and facts.image_cuda == (13, 0)
    assert facts.driver == Driver("550.54.15", (12, 4), gpus=2)
    assert facts.cuda_error.startswith("The NVIDIA driver on your system is too old")
    with pytest.raises(EnvironmentUnfit, match=EXPECTED_LINE):
        probe("auto", {})


def test_check_and_train_exit_3_with_the_driver_line(old_driver_host, capsys, tmp_path):
    from zerotuner import cli

    for key in ("ZT_OUTPUT_DIR", "ZT_CACHE_DIR", "ZT_OFFLOAD_DIR"):
        old_driver_host.setenv(key, str(tmp_path / key.lower()))
    assert cli.main(["check"]) == 3
    out = capsys.readouterr().out
    [fail] = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert fail.split()[1] == "hardware" and EXPECTED_LINE in fail

    assert cli.main(["train"]) == 3  # before any rank starts: the probe is the first step
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and EXPECTED_LINE in errors[0]
    assert "Traceback" not in err and not (tmp_path / "zt_output_dir").exists()


# The same host for a fresh process: sitecustomize runs before the CLI and stands in for the
# driver library and the wheel, exactly where the fixture above does.
OLD_DRIVER_SITECUSTOMIZE = f"""
import warnings

import pynvml
import torch

import zerotuner.machine.probe


def _is_available():
    warnings.warn({CUDA_TOO_OLD!r}, UserWarning, stacklevel=2)
    return False


torch.version.cuda = "13.0"
torch.cuda.is_available = _is_available
pynvml.nvmlInit = pynvml.nvmlShutdown = lambda: None
pynvml.nvmlSystemGetDriverVersion = lambda: "550.54.15"
pynvml.nvmlSystemGetCudaDriverVersion = lambda: 12040
pynvml.nvmlDeviceGetCount = lambda: 2
zerotuner.machine.probe._ds_ops = lambda *a: ()
"""


@pytest.mark.slow  # a fresh CLI process (imports torch)
def test_the_entrypoint_exits_3_with_one_line_on_an_old_driver(tmp_path):
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(OLD_DRIVER_SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZT_")}
    env |= {
        "PYTHONPATH": f"{tmp_path / 'site'}:{repo / 'src'}", "ZT_DEVICE": "auto",
        "ZT_METRICS_PORT": "0", "ZT_OUTPUT_DIR": str(tmp_path / "output"),
        "ZT_CACHE_DIR": str(tmp_path / "cache"), "ZT_OFFLOAD_DIR": str(tmp_path / "offload"),
    }  # fmt: skip
    result = subprocess.run(
        [str(repo / "entrypoint")], env=env, capture_output=True, text=True, timeout=300
    )  # no argument: train, as the image runs it
    assert result.returncode == 3, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and EXPECTED_LINE in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "CUDA initialization" not in result.stderr
    assert not (tmp_path / "output").exists()


# --- what the lent H200 showed (bench/results/gpu/2026-11-27) --------------------------------


def test_an_arch_specific_cuda_target_is_given_to_deepspeed_as_the_plain_one(monkeypatch):
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    from zerotuner.launch.ranks import Topology, worker_env
    from zerotuner.machine.ops import deepspeed_arch_list

    builder = FusedAdamBuilder()  # the CUDA op's builder: its arch parsing runs without a GPU
    builder.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")  # what the CUDA image sets
    with pytest.raises(ValueError, match="'0a'"):
        builder.compute_capability_args()
    gpus = Hardware("cuda", (GPU(0, "H200", 140 * GiB, 140 * GiB),), cpu_count=16)
    env = worker_env(dict(os.environ), Topology(1, 0, 1, "h", 1, "x"), gpus,
                     job_file="j", status_dir="s")  # fmt: skip
    assert env["TORCH_CUDA_ARCH_LIST"] == "9.0"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", env["TORCH_CUDA_ARCH_LIST"])
    builder.compute_capability_args()  # parses now
    assert deepspeed_arch_list("8.0;9.0a 10.0f+PTX;9.0") == "8.0;9.0;10.0+PTX"
    cpu = Hardware("cpu", (), cpu_count=2)
    assert "TORCH_CUDA_ARCH_LIST" not in worker_env({}, Topology(1, 0, 1, "h", 1, "x"), cpu,
                                                    job_file="j", status_dir="s")  # fmt: skip


def test_nvml_memory_leaves_out_the_drivers_reserve(monkeypatch):
    import pynvml

    from zerotuner.monitor.metrics import nvml_memory

    class Info:  # the H200's numbers: 140.4 GiB by NVML, 139.8 by CUDA, 1.6 GiB in use
        total, reserved, used = int(140.4 * GiB), int(0.6 * GiB), int(1.6 * GiB)

    def v2(handle, version=None):
        if version is None:
            return type("V1", (), {"total": Info.total, "used": Info.used + Info.reserved})
        assert version == pynvml.nvmlMemory_v2
        return Info

    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", v2)
    assert nvml_memory("handle") == (Info.total - Info.reserved, Info.used)

    def v1_only(handle, version=None):
        if version is not None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return v2(handle)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", v1_only)
    assert nvml_memory("handle") == (Info.total, Info.used + Info.reserved)
