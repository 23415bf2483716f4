"""One training rank: `python -m zerotuner.train.worker`, started by torchrun (one per device).

Settings come from the environment and config file, decisions from the Job file
(`ZT_JOB_FILE`). `train()` is the whole per-rank job and reads rank and world size from
torch.distributed, so another launcher (Ray Train, Kubeflow) can call it unchanged: it checks
what it can before loading anything, runs the phases of a `zerotuner.train.run.Run`, and turns
how they ended into the rank's exit status (`_exit_status`).

Each rank writes its exit status (records.write_rank_status): 0 done, 2 ConfigError,
3 EnvironmentUnfit, 4 Diverged (non-finite steps, see zerotuner.train.nonfinite), 200 PeerLost
(another node of the job was lost: zerotuner.train.lost_peer), 143 stopped by a signal,
1 anything else; torchrun itself exits 1 for every failure. A rank dies with its agent
(`peers.die_with_parent`).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from zerotuner import families
from zerotuner.errors import (
    EXIT_DIVERGED,
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_SIGNAL,
    Diverged,
    ZeroTunerError,
)
from zerotuner.launch import distributed, peers
from zerotuner.launch.job import Job, load_job, wait_for_job
from zerotuner.launch.records import Sink, write_rank_status
from zerotuner.machine.ops import extensions_root
from zerotuner.settings.effective import effective_settings
from zerotuner.settings.schema import Settings
from zerotuner.train import lost_peer, speed
from zerotuner.train.lost_peer import Whereabouts
from zerotuner.train.run import Run
from zerotuner.train.sinks import build_sinks
from zerotuner.train.stop import Stopped
from zerotuner.weights import checkpoint, lora, lora_from, training_type

log = logging.getLogger("zerotuner.train.worker")


def train(settings: Settings, job: Job, *, sinks: Sequence[Sink] | None = None) -> int:
    """The whole job of one rank; returns its exit code (and writes it as its rank status).
    `sinks`: the step records' consumers (None: build_sinks')."""
    rank, code, message = distributed.World.from_environ().rank, EXIT_FAILURE, ""
    where, watch = Whereabouts(), None
    opened = list(sinks or ())  # closed at the end, whatever happened
    try:
        world = distributed.init_distributed(
            device=job.device, master_addr=job.master_addr, master_port=job.master_port,
            timeout_seconds=settings.collective_timeout_seconds,
        )  # fmt: skip
        rank = world.rank
        end = functools.partial(lost_peer.end_lost, rank=rank, where=where, settings=settings)
        watch = peers.start_watch(
            rank=rank, world=world.size, master_addr=job.master_addr, master_port=job.master_port,
            silent_seconds=settings.peer_timeout_seconds, on_lost=end,
        )  # fmt: skip
        settings, weights, resume = _checked(settings, job, world)
        if sinks is None:
            opened += build_sinks(settings, job, world=world, resume=resume)
        opened.append(where)
        run = Run(settings, job, sinks=opened, world=world, weights=weights, resume=resume)
        run.load()
        run.cache()
        if run.stop.agreed():  # signalled while downloading or caching: no step to save yet
            raise Stopped(None, run.stop.name)
        run.engine()
        run.train()
        code, message = EXIT_OK, run.finish()
    except Exception as error:  # noqa: BLE001 - the status must be written whatever happened
        code, message = _exit_status(error, rank=rank, watch=watch, where=where, settings=settings)
    finally:
        if watch is not None:
            watch.settle()
        for sink in opened:
            if code != EXIT_OK:
                sink.unfinished()  # the progress summary must not read as a finished run
            sink.close()
        write_rank_status(rank, code, message)
        if code in (EXIT_OK, EXIT_SIGNAL, EXIT_DIVERGED):  # every rank got here together
            distributed.leave_group()
    return code


def _checked(
    settings: Settings, job: Job, world: distributed.World
) -> tuple[Settings, training_type.TrainedWeights, Path | None]:
    """What is checked before anything loads: the settings (ZT_LORA_FROM's applied), what the
    run trains, and the committed checkpoint it resumes from, verified against the job."""
    if world.rank == 0:
        for warning in distributed.timeout_warnings(settings, device=job.device):
            log.warning("%s", warning)
    lora.check_settings(settings)  # preflight did too; a launcher of its own may not
    families.check_family_settings(settings, job.family)
    # ZT_LORA_FROM's rank, alpha and targets (preflight checked the file against the model)
    settings, adapter_file = lora_from.apply(settings, job.family, check=False)
    if world.rank == 0:  # before anything looks for a checkpoint to resume
        checkpoint.restore_set_aside(settings.output_dir)
    distributed.barrier()
    resume = checkpoint.find_resume(settings.resume, settings.output_dir)  # hashes files
    if resume:
        manifest = checkpoint.read_manifest(resume) or {}
        checkpoint.check_model(
            manifest, family=job.family, denoiser_params=job.denoiser_params,
            model=job.model, path=resume, expert=settings.expert,
        )  # fmt: skip
        lora.check_resume(manifest, settings, resume)
    return settings, training_type.for_settings(settings, job.family, adapter_file), resume


def _exit_status(
    error: Exception,
    *,
    rank: int,
    watch: peers.PeerWatch | None,
    where: Whereabouts,
    settings: Settings,
) -> tuple[int, str]:
    """The exit code and status line for what ended the run: a signal's agreed stop, a lost
    node (whatever failed here because of it), a known error's own code, else 1."""
    if isinstance(error, Stopped):
        if watch is not None:
            watch.settle()
        resumes = f"at step {error.step + 1}" if error.step else "where this one started"
        log.warning("%s: exit %d, a restart resumes %s", error, EXIT_SIGNAL, resumes)
        return EXIT_SIGNAL, str(error)
    # a failed collective, or a rank that stopped hearing from the others (caching's wait)
    asks = not isinstance(error, ZeroTunerError) or error.exit_code == EXIT_FAILURE
    lost = lost_peer.lost(watch, where, settings) if asks else None
    if watch is not None:
        watch.settle()
    if lost is not None:
        lost_peer.say_lost(lost)
        return lost.exit_code, str(lost)
    if isinstance(error, ZeroTunerError):
        # every rank diverges at the same step: rank 0 says it once
        if rank == 0 or not isinstance(error, Diverged):
            _say_problems(error)
        return error.exit_code, str(error)
    traceback.print_exception(error)
    return EXIT_FAILURE, f"{type(error).__name__}: {error}"


def _say_problems(error: ZeroTunerError) -> None:
    """One line per problem on stderr, as the entrypoint says them."""
    for line in error.problems:
        print(f"zerotuner: error: {line}", file=sys.stderr, flush=True)


def _import_libraries() -> None:
    """diffusers' model classes and transformers, imported while the entrypoint still plans
    (seconds, the family not known yet: one import brings every denoiser class); no per-file
    progress bars from either in a training log."""
    import diffusers
    import transformers
    from diffusers import AutoencoderKL, UNet2DConditionModel  # noqa: F401

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def main() -> None:
    """torchrun's entry: settings, imports, the job, logging, then train(); exits with the
    rank's code. The entrypoint starts the ranks before it has planned: the imports here
    overlap its planning, then `wait_for_job` waits for the job file."""
    from zerotuner.monitor.logs import demote_known_noise, rank_level, setup_logging

    peers.die_with_parent()  # no rank trains on alone after its agent was killed
    world = distributed.World.from_environ()
    rank = world.rank
    if os.environ.get("DS_ACCELERATOR") == "cpu":  # JIT-built ops: deepspeed.initialize asks
        speed.warm_cpu_info(extensions_root())  # for it; the answer comes while the rank imports
    demote_known_noise()  # before DeepSpeed's import, which may print some
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    try:
        # the entrypoint's settings path, read again (secrets never pass through the job file);
        # it warned about unknown names already
        settings = effective_settings(warn=False).settings
        level = rank_level(settings.log_level, rank)
        logging.getLogger().setLevel(level)  # ZT_LOG_LEVEL=debug shows what the import prints
        speed.keep_libraries_eager(settings.compile)  # before any library imports torch.compile
        import deepspeed  # noqa: F401 - its logger must exist before ours adopts it

        _import_libraries()
        job = load_job(wait_for_job())  # DS_ACCELERATOR came with the launcher's environment
    except ZeroTunerError as error:
        _say_problems(error)
        write_rank_status(rank, error.exit_code, str(error))
        sys.exit(error.exit_code)
    token = settings.hf_token.get_secret_value() if settings.hf_token else None
    setup_logging(
        rank=rank,
        world_size=world.size,
        log_format=settings.log_format,
        level=level,
        secrets=[token],
    )
    distributed.exit_process(train(settings, job))  # done and recorded: status written


if __name__ == "__main__":
    main()
