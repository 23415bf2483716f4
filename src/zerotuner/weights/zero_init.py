"""The trained model built straight into ZeRO-3 partitions (`deepspeed.zero.Init`).

Without it every rank builds the whole denoiser in fp32 before `deepspeed.initialize`
partitions it: ranks x 4 bytes x params of host memory just to start (SDXL on 8 GPUs: ~82 GB;
diffusers memory-maps an fp32 safetensors file and keeps its pages as the weights, which the
ranks of a node then share in the page cache, but weights stored in fp16 or bf16, as many
published fine-tunes are, become fp32 memory of each rank's own).
Here the model is constructed from its config inside `deepspeed.zero.Init` with the run's
effective DeepSpeed config, so each module's parameters are cut into this rank's partition (in
the training dtype, on the device, the host or NVMe as `offload_param` says) as soon as that
module exists. The weights are then streamed in from the safetensors files tensor by tensor:
every rank reads the headers (so every rank checks names and shapes and refuses together,
before any collective), rank 0 alone reads the tensors, a batch of at most one largest tensor
at a time, and `GatheredParameters(modifier_rank=0)` hands them to the owners of each
partition. No rank ever holds more than its partition plus one largest tensor (twice: the
file's and the gathered one).

Why gathered and not each rank copying its own slice: a partition offloaded to NVMe is not a
tensor in memory that could be written; GatheredParameters goes through DeepSpeed's own
partitioning, which knows where every partition lives (device, host, swap file), and costs two
collectives per batch: nothing next to the file reads.

Why plain reads and not `safetensors.safe_open`: safe_open memory-maps the file, and every
mapped page a read touched stays in the process's resident set until the file is closed, so
rank 0's RSS would reach the file's size, the full copy this module exists to avoid. A read into
a fresh tensor leaves the file in the page cache (shared, reclaimable), not in the process.

`ZT_ZERO_INIT=false` (tests and bench only) keeps the full-copy path at ZeRO-3 for comparison.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from zerotuner.errors import ConfigError
from zerotuner.families.stored import DIFFUSERS_STEM, weight_files

log = logging.getLogger("zerotuner.weights.zero_init")

WEIGHTS = f"{DIFFUSERS_STEM}.safetensors"
# safetensors' dtype names (the format's header): https://github.com/huggingface/safetensors
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
SHOWN = 5  # names listed in an error line


def wanted(deepspeed_config: dict[str, Any] | None) -> bool:
    """zero.Init for a ZeRO-3 run (unless ZT_ZERO_INIT=false, the old path for comparison)."""
    if not deepspeed_config:
        return False
    stage = deepspeed_config.get("zero_optimization", {}).get("stage", 0)
    return stage == 3 and os.environ.get("ZT_ZERO_INIT", "true").lower() != "false"


class Reader:
    """One safetensors file: its header, and a tensor read into memory of its own."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: io.BufferedReader = path.open("rb")
        (length,) = struct.unpack("<Q", self.file.read(8))
        header = json.loads(self.file.read(length))
        header.pop("__metadata__", None)
        self.entries: dict[str, dict[str, Any]] = header
        self.base = 8 + length

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def read(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        start, end = entry["data_offsets"]
        raw = torch.empty(end - start, dtype=torch.uint8)
        self.file.seek(self.base + start)
        if self.file.readinto(raw.numpy().data) != end - start:
            raise ConfigError(f"{self.path}: truncated at tensor {name}")
        return raw.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])

    def close(self) -> None:
        self.file.close()


@contextlib.contextmanager
def _readers(files: list[Path]) -> Iterator[dict[str, Reader]]:
    """Every tensor name -> the reader of the file that holds it."""
    opened = [Reader(f) for f in files]
    try:
        yield {name: r for r in opened for name in r.entries}
    finally:
        for r in opened:
            r.close()


def build(cls: type[Any], folder: Path, deepspeed_config: dict[str, Any]) -> Any | None:
    """The denoiser of `folder` (a diffusers model folder) partitioned by ZeRO-3 with its
    weights in; None when the folder has no safetensors weights."""
    files = weight_files(folder, stems=(DIFFUSERS_STEM,))  # a diffusers model's, as it loads
    if files is None:
        log.warning("%s has no %s: every rank loads the whole model first", folder, WEIGHTS)
        return None
    config = cls.load_config(str(folder))
    # The random init is overwritten: skip it (diffusers' switch), and leave the global RNG as
    # the full-copy path leaves it (it builds on the meta device), so the runs stay comparable.
    init = _TrimmingInit(config_dict_or_path=deepspeed_config)
    with torch.random.fork_rng(devices=[]), _no_init(), init:
        model = cls.from_config(config)
    with _readers(files) as readers:
        _check(model, readers, folder)
        _fill(model, readers)
    model.train()
    parts = sum(p.ds_tensor.ds_numel for p in model.parameters())
    log.info(
        "built %s under zero.Init: %d of %d parameters in this rank's partition",
        cls.__name__, parts, sum(p.ds_numel for p in model.parameters()),
    )  # fmt: skip
    return model


def _trimming_init() -> type:
    import deepspeed

    class TrimmingInit(deepspeed.zero.Init):
        """zero.Init that gives the heap back after each module is partitioned: the module's
        full tensors are freed right after, and the heap would keep them (see `trim`)."""

        def _post_init_method(self, module: torch.nn.Module) -> None:
            super()._post_init_method(module)
            trim()

    return TrimmingInit


def _TrimmingInit(**kwargs: Any) -> Any:  # noqa: N802 - a class, built on first use
    return _trimming_init()(**kwargs)


def _no_init() -> contextlib.AbstractContextManager[None]:
    try:
        from diffusers.models.modeling_utils import no_init_weights
    except ImportError:  # another diffusers: the init runs, and is overwritten
        return contextlib.nullcontext()
    return no_init_weights()


def trim() -> None:
    """Give the heap's free memory back to the system (glibc's malloc_trim). Gathering and
    re-partitioning churns tensors below glibc's mmap threshold, and the heap keeps what they
    freed: measured, the RSS of a rank of two grew by about its partition again over the load,
    so each rank's peak would be twice its partition. Elsewhere (musl, macOS): nothing."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc() -> Any:
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


def _targets(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, tuple[int, ...]]]:
    """Every tensor the files must fill: parameters (full shape) and persistent buffers."""
    # a partitioned parameter's full shape is DeepSpeed's ds_shape, unknown to torch's types
    params: list[tuple[str, Any]] = list(model.named_parameters())
    out: dict[str, tuple[torch.Tensor, tuple[int, ...]]] = {
        n: (p, tuple(p.ds_shape)) for n, p in params
    }
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{module_name}.{name}" if module_name else name] = (buf, tuple(buf.shape))
    return out


def _check(model: torch.nn.Module, readers: dict[str, Reader], folder: Path) -> None:
    """Names and shapes, from the headers, the same verdict on every rank (no hang)."""
    targets = _targets(model)
    missing = sorted(set(targets) - set(readers))
    unexpected = sorted(set(readers) - set(targets))
    wrong = [
        f"{n} {list(readers[n].shape(n))} vs {list(shape)}"
        for n, (_, shape) in targets.items()
        if n in readers and readers[n].shape(n) != shape
    ]
    problems = []
    for what, names in (("missing", missing), ("unexpected", unexpected), ("shape", wrong)):
        if names:
            more = f" (+{len(names) - SHOWN} more)" if len(names) > SHOWN else ""
            problems.append(f"{what}: {', '.join(names[:SHOWN])}{more}")
    if problems:
        raise ConfigError(
            f"{folder}: its weights do not match its config.json ({'; '.join(problems)}); "
            "give ZT_MODEL a diffusers folder saved by save_pretrained"
        )


@torch.no_grad()
def _fill(model: torch.nn.Module, readers: dict[str, Reader]) -> None:
    """Rank 0 reads; GatheredParameters gives each rank its partition. Batches of at most one
    largest tensor keep the collectives few and the memory at that tensor."""
    import deepspeed
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    params = list(model.named_parameters())
    for batch in batches(model, [(n, [p]) for n, p in params]):
        with deepspeed.zero.GatheredParameters([p for _, ps in batch for p in ps], modifier_rank=0):
            if rank == 0:
                for n, (p,) in batch:
                    p.data.copy_(readers[n].read(n))
        trim()
    for name, (buf, _) in _targets(model).items():
        if not hasattr(buf, "ds_id"):  # buffers are not partitioned: every rank reads them
            buf.copy_(readers[name].read(name))


def partitioned(module: torch.nn.Module) -> bool:
    """Whether ZeRO-3 already partitioned this module's parameters (built by `build`)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def batches(model: torch.nn.Module, items: list[tuple[str, list[Any]]]) -> list[list[Any]]:
    """`items` (name, partitioned parameters) in order, cut into batches of at most one largest
    parameter's elements, and, with parameters on NVMe, at most as many swapped parameters as
    DeepSpeed has swap buffers (`offload_param.buffer_count`): a gather holds one buffer each."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    params: list[Any] = list(model.parameters())  # partitioned: DeepSpeed's ds_* attributes
    largest = max(p.ds_numel for p in params)
    swapper = next((p.nvme_swapper for p in params if hasattr(p, "nvme_swapper")), None)
    buffers = len(swapper.available_buffer_ids) if swapper is not None else None

    def swapped(ps: list[Any]) -> int:
        return sum(
            getattr(p.ds_tensor, "final_location", None) == OffloadDeviceEnum.nvme for p in ps
        )

    out: list[list[Any]] = []
    size = swaps = 0
    for name, ps in items:
        numel, swaps_here = sum(p.ds_numel for p in ps), swapped(ps)
        full = size + numel > largest or (buffers is not None and swaps + swaps_here > buffers)
        if not out or (out[-1] and full):
            out.append([])
            size = swaps = 0
        out[-1].append((name, ps))
        size, swaps = size + numel, swaps + swaps_here
    return out


def add_adapter(model: Any, config: Any, adapter_name: str) -> None:
    """`model.add_adapter(config, adapter_name)`, also on a model `build` partitioned.

    peft reads each target's base weight when it wraps it (Conv2d: its dimensions; DoRA: the
    weight norm of its magnitude), and a partitioned weight is an empty placeholder. So the
    targets are wrapped a batch at a time (at most one largest tensor of base weights), each
    batch gathered on every rank while peft wraps it. Batches follow the module order of a single
    call, so the adapter's random start draws the same numbers in the same order."""
    if not partitioned(model):
        model.add_adapter(config, adapter_name=adapter_name)
        return
    import copy
    import re

    import deepspeed
    from peft import inject_adapter_in_model
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = [(n, m) for n, m in model.named_modules() if check_target_module_exists(config, n)]
    config.base_model_name_or_path = None  # as diffusers' add_adapter does
    for batch in batches(model, [(n, list(m.parameters())) for n, m in targets]):
        part = copy.deepcopy(config)
        part.target_modules = "|".join(re.escape(n) for n, _ in batch)  # full names: fullmatch
        with deepspeed.zero.GatheredParameters([p for _, ps in batch for p in ps]):
            inject_adapter_in_model(part, model, adapter_name)
    model.peft_config = {adapter_name: config}  # the adapter's own config, not the last batch's
    model._hf_peft_config_loaded = True
    model.set_adapter(adapter_name)
