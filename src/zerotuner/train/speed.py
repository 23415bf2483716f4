"""Faster steps on the same model: compiled blocks, attention kernels, memory layout.

`prepare` runs on the trained model (the UNet or the transformer, LoRA adapters already added)
right before `deepspeed.initialize`:

- `torch.compile` per repeated block (UNet down/mid/up blocks, transformer blocks), in place
  (`Module.compile`), so module names, state_dict keys, checkpoints and LoRA key names do not
  change; per block, not the whole model, keeps each graph small and compile time short.
  Shapes are static: each aspect-ratio bucket compiles each block once and reuses it after
  (bounded: blocks x buckets graphs, the recompile limit raised to that so no block falls back
  to eager). Dynamic H/W would need one graph per block, but inductor's CPU backend fails on
  the UNet blocks with symbolic sizes (torch 2.13: "cannot determine truth value of
  Relational"). `graphs_built()` says how many were built; the rank's run logs it.
- PyTorch's fused attention (SDPA): diffusers' default processors already call it; any plain
  `AttnProcessor` left (a model saved with one set) is replaced by `AttnProcessor2_0`.
- Not done, on purpose: fused QKV (`fuse_qkv_projections`) adds `to_qkv` beside to_q/k/v, so
  the trained weights would live under new names (LoRA targets, checkpoints and exports
  break); channels_last, which DeepSpeed's ZeRO-1/2 flat buffers undo (the parameters become
  views of one contiguous buffer) and which gave nothing measurable on the CPU (one paired
  run of the 95M UNet, eager: 0.97 s/step channels_last vs 0.93-1.00 s/step).

`ZT_COMPILE=auto` turns compiling on only where the bench showed it pays (`decide`).

Around the model: a lone ZeRO-0 rank skips DeepSpeed's gradient all-reduce
(`skip_lone_allreduce`), ZeRO-0 clips with foreach kernels (`foreach_clip`), and py-cpuinfo
is asked once per CPU model, early (`warm_cpu_info`), and with compiling off no library
compiles either (`keep_libraries_eager`).
The start-up itself (ranks started before the plan, one rank without torchrun's agent) is
`launch.start_ranks`'s.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotuner.errors import ConfigError, EnvironmentUnfit
from zerotuner.settings.notes import Note
from zerotuner.settings.schema import env_name

if TYPE_CHECKING:
    from zerotuner.settings.schema import Settings

log = logging.getLogger(__name__)

# The model's repeated blocks, by attribute: UNet2DConditionModel, SD3's and Flux's transformers.
BLOCK_LISTS = ("down_blocks", "up_blocks", "transformer_blocks", "single_transformer_blocks")
SINGLE_BLOCKS = ("mid_block",)


@dataclass(frozen=True)
class Decision:
    compile: bool
    reason: str


def decide(setting: str | bool, *, accelerator: str, zero_stage: int) -> Decision:
    """Whether to compile the blocks, and why (what the plan and `check` say).

    Measured (bench `speed` in docs/benchmarks.md; 2 cores): on the CPU, inductor's cold compile
    of the blocks takes minutes per bucket (C++ codegen: ~100 s for the tiny demo UNet, ~170 s
    for the 95M bench UNet; seconds with a warm cache) and compiled steps were no faster
    (tiny) or ~1.5x slower (95M) than eager, so `auto` leaves it off there. ZeRO-3 gathers
    and frees each block's parameters in module hooks that dynamo would trace, so it is
    never compiled. On CUDA at ZeRO 0-2 nothing is measured yet: `auto` stays off until the
    GPU bench shows it pays; `ZT_COMPILE=true` turns it on."""
    name = env_name("compile")
    if zero_stage == 3:
        if setting is True:
            raise ConfigError(
                f"{name}=true does not work with ZeRO-3 (its parameter gathering hooks run inside "
                f"each block): set {name}=auto or false, or {env_name('zero_stage')} to 0, 1 or 2"
            )
        return Decision(False, "off: ZeRO-3 gathers each block's parameters in hooks")
    if setting is False:
        return Decision(False, f"off ({name}=false)")
    if setting is True:
        return Decision(True, f"on ({name}=true)")
    if accelerator == "cpu":
        return Decision(
            False,
            "off (auto): on the CPU the first compile takes minutes and steady steps measured "
            "no faster (bench speed)",
        )
    return Decision(
        False,
        f"off (auto): not yet measured to pay on {accelerator}; {name}=true compiles the blocks",
    )


def notes(settings: Settings, *, accelerator: str, zero_stage: int) -> list[Note]:
    """What `check`, `plan` and `train` say about compiling before the run starts."""
    d = decide(settings.compile, accelerator=accelerator, zero_stage=zero_stage)
    if d.compile and settings.compile is True:
        require_compiler(accelerator)
    what = "torch.compile per block" if d.compile else "no torch.compile"
    return [Note("info", f"{what}: {d.reason}; attention through PyTorch SDPA")]


def require_compiler(accelerator: str) -> None:
    """ZT_COMPILE=true on a machine where inductor cannot build kernels: one line, exit 3."""
    name = env_name("compile")
    if accelerator == "cpu":
        if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
            raise EnvironmentUnfit(
                f"{name}=true needs a C++ compiler on the CPU (torch inductor builds its kernels "
                f"with one): install g++ or set {name}=auto"
            )
        return
    try:
        import triton  # noqa: F401
    except ImportError:
        raise EnvironmentUnfit(
            f"{name}=true needs triton on {accelerator} (torch inductor's GPU kernels): "
            f"install it or set {name}=auto"
        ) from None


@dataclass(frozen=True)
class Prepared:
    compiled_blocks: int
    sdpa_replaced: int
    decision: Decision


def blocks(model: Any) -> list[Any]:
    """The model's repeated blocks, in model order (no duplicates)."""
    found: list[Any] = []
    for name in BLOCK_LISTS:
        found.extend(getattr(model, name, None) or ())
    for name in SINGLE_BLOCKS:
        block = getattr(model, name, None)
        if block is not None:
            found.append(block)
    return list({id(b): b for b in found}.values())


def use_sdpa(model: Any) -> int:
    """Replace any plain (non-SDPA) `AttnProcessor` by `AttnProcessor2_0`; returns how many."""
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    processors = getattr(model, "attn_processors", None)
    if not processors:
        return 0
    plain = [k for k, p in processors.items() if type(p) is AttnProcessor]
    if plain:
        model.set_attn_processor({k: AttnProcessor2_0() if k in plain else p
                                  for k, p in processors.items()})  # fmt: skip
    return len(plain)


def prepare(
    model: Any,
    settings: Settings,
    *,
    accelerator: str,
    zero_stage: int,
    shapes: int = 1,
    backend: str = "inductor",
) -> Prepared:
    """SDPA attention, and compiled blocks where `decide` says so, in place. `shapes`: how many
    input shapes the run feeds (its buckets). `backend`: torch.compile's backend."""
    d = decide(settings.compile, accelerator=accelerator, zero_stage=zero_stage)
    replaced = use_sdpa(model)
    compiled = 0
    if d.compile:
        if settings.compile is True and backend == "inductor":
            require_compiler(accelerator)
        import torch._dynamo

        found = blocks(model)
        # Every compiled block shares Module._call_impl's code object, whose cache holds one
        # entry per block, shape and grad mode: room for the buckets plus two more (samples
        # and validation run the blocks without grad), or dynamo falls back to eager.
        limit = len(found) * (max(1, shapes) + 2)
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, limit)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, limit)
        for block in found:
            block.compile(backend=backend, dynamic=False)  # in place: same names and keys
            compiled += 1
    log.info(
        "speed: %s%s; %d attention processors moved to SDPA",
        f"{compiled} blocks compiled ({backend})" if compiled else "no blocks compiled",
        f" - {d.reason}" if not compiled else "",
        replaced,
    )
    return Prepared(compiled, replaced, d)


def graphs_built() -> int:
    """Graphs dynamo has compiled in this process so far (0 when torch._dynamo is unused)."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def skip_lone_allreduce(engine: Any) -> bool:
    """One data-parallel rank at ZeRO-0: turn off DeepSpeed's post-backward all-reduce.

    With nobody to reduce with, it still flattens every gradient into a bucket, "reduces" it
    over a group of one and copies it back: py-spy put a quarter of a 95M UNet's CPU step
    there. Dividing by a world size of 1 changes nothing, so the step is the same. ZeRO-1/2's
    reduction fills the partitions their optimizer steps on and must run; ZeRO-3 has its own."""
    if engine.zero_optimization_stage() != 0 or engine.dp_world_size != 1:
        return False
    engine.enable_backward_allreduce = False
    log.info("speed: one data-parallel rank at ZeRO-0: DeepSpeed's gradient all-reduce skipped")
    return True


def foreach_clip(engine: Any) -> bool:
    """ZeRO-0 without DeepSpeed's fp16/bf16 optimizer: clip the gradients in two foreach passes.

    DeepSpeed clips there with Python loops: one `.norm()` call per parameter, an all-reduce
    of the (already identical) norm over the data-parallel group, then one `mul_` per
    parameter: a thousand small ops per step. On the 95M bench
    UNet (2 AVX2 cores, one engine alternating both clips step by step) `engine.step` took
    32-36 ms less with this one, of a 1 s step; on the CPU the multiply by 1 is skipped. The
    norm is the same 2-norm and the factor the same min(1, max_norm / (norm + 1e-6)); the
    gradients are equal on every rank once reduced, so no collective is needed. The norm is
    handed to the engine the way DeepSpeed's own optimizers do (`optimizer._global_grad_norm`),
    so steps.jsonl and the metrics get a gradient norm at ZeRO-0 too (DeepSpeed's clip returned
    it to nobody). ZeRO-1/2/3 and the 16-bit optimizers clip their flat fp32 partitions
    themselves."""
    import torch

    if (
        engine.zero_optimization_stage() != 0
        or engine.fp16_enabled()
        or engine.bfloat16_enabled()
        or engine.gradient_clipping() <= 0
    ):
        return False
    params = [p for p in engine.module.parameters() if p.requires_grad]
    max_norm = float(engine.gradient_clipping())
    optimizer = engine.optimizer

    def clip() -> None:
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in params if p.grad is not None], foreach=True
        )
        # step_norm: nonfinite.PlainStepGuard decides on this norm rather than take another
        optimizer._global_grad_norm = optimizer.step_norm = norm
        # A factor of 1 changes nothing: on the CPU, reading the norm costs no device sync, so
        # the multiply (a pass over every gradient) is skipped when the norm is in bounds.
        if norm.device.type == "cpu" and float(norm) + 1e-6 <= max_norm:
            return
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)

    engine.clip_fp32_gradients = clip
    log.info("speed: ZeRO-0 gradients clipped to norm %g with foreach kernels", max_norm)
    return True


def keep_libraries_eager(setting: str | bool) -> bool:
    """With compiling off (`decide` compiles only on ZT_COMPILE=true), nothing compiles behind
    the setting's back: TORCHDYNAMO_DISABLE=1 for this rank, set before the libraries import
    (one the user set is kept). bitsandbytes, which diffusers imports, wraps its CPU kernels in
    `torch.compile` at import: 1.2-1.4 s of CPU per rank, and inductor's C++ build of them on
    first use; they run eager instead. Returns whether it was set."""
    import os

    if setting is True or "TORCHDYNAMO_DISABLE" in os.environ:
        return False
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    return True


def warm_cpu_info(cache: Path) -> None:
    """Ask py-cpuinfo once per CPU model, in the background.

    Loading a JIT-built DeepSpeed CPU op (FusedAdam, CPU Adam, shm comm) recomputes its
    compiler flags before finding the build up to date, and each flag asks
    `cpuinfo.get_cpu_info()`, which runs a subprocess: about 1 s of CPU each, twice per op,
    all inside `deepspeed.initialize`. The answer cannot change within a process, nor between
    processes on the same CPU model: one call, made in a thread while the rank loads its
    model, answers every later one (a caller that comes while it runs waits for it), and is
    kept in `cache` (beside the built ops, which are as machine-specific) under a key of the
    CPU's identity and flags, so a later rank on the same CPU reads it instead of asking.
    Prebuilt ops never ask."""
    import threading

    try:
        import cpuinfo
    except ImportError:  # DeepSpeed falls back to lscpu itself
        return
    if not hasattr(cpuinfo.get_cpu_info, "__wrapped__"):
        cpuinfo.get_cpu_info = _once(_kept(cpuinfo.get_cpu_info, cache))
    threading.Thread(target=_ask, args=(cpuinfo.get_cpu_info,), name="cpuinfo", daemon=True).start()


# The lines of /proc/cpuinfo that name the CPU model and what it can do (not its clock).
_CPU_IDENTITY = (
    "vendor_id", "cpu family", "model", "model name", "stepping", "flags",  # x86
    "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features",  # Arm
)  # fmt: skip


def _cpu_key() -> str | None:
    """A digest of the CPU's identity and flags (None where /proc/cpuinfo is not readable)."""
    import hashlib
    import platform

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    lines = sorted({
        line.strip() for line in text.splitlines()
        if line.partition(":")[0].strip() in _CPU_IDENTITY
    })  # fmt: skip
    return hashlib.sha256("\n".join([platform.machine(), *lines]).encode()).hexdigest()[:16]


def _kept(ask: Any, cache: Path) -> Any:
    """`ask`, its answer read from `cache` when this CPU's is there and written there when not."""
    import json
    import os

    key = _cpu_key()
    if key is None:
        return ask
    kept = cache / f"cpuinfo-{key}.json"

    @functools.wraps(ask)
    def read_or_ask() -> Any:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(kept.read_text())
        answer = ask()
        with contextlib.suppress(OSError):  # a cache that cannot be written only costs time
            cache.mkdir(parents=True, exist_ok=True)
            part = kept.with_name(f"{kept.name}.{os.getpid()}.part")
            part.write_text(json.dumps(answer))
            part.replace(kept)  # whole or absent: ranks of the node may write it together
        return answer

    return read_or_ask


def _once(ask: Any) -> Any:
    import threading

    lock = threading.Lock()
    answer: list[Any] = []  # the answer, once there is one

    @functools.wraps(ask)
    def once() -> Any:
        with lock:
            if not answer:
                answer.append(ask())  # a failure is not kept: the next caller asks again
            return answer[0]

    return once


def _ask(get_cpu_info: Any) -> None:
    with contextlib.suppress(Exception):  # DeepSpeed asks again, and handles the failure
        get_cpu_info()
