"""`zerotuner train`: the entrypoint's job on one node, from settings to the ranks' exit code.

probe -> topology -> start the torchrun ranks (they import, then wait for the Job) -> (mount
the offload device) -> preflight (plan + DeepSpeed config) -> prepare the offload dir -> write
the Job (the ranks go on) -> public exit code. The metrics
endpoint serves from the first line to the last, so downloads and caching are visible too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from contextlib import ExitStack
from pathlib import Path

from zerotuner.checkpoint import REMOTE_LATEST, checkpoints_dir
from zerotuner.commands.plan import plan_json, render
from zerotuner.errors import EXIT_OK, ZeroTunerError
from zerotuner.hardware_probe import probe
from zerotuner.inputs import UserInputs, apply_implied_settings, read_user_inputs
from zerotuner.job import Job
from zerotuner.job_folders import refuse_overlaps
from zerotuner.launch import resolve_topology, start_ranks
from zerotuner.logs import rank_level, setup_logging
from zerotuner.offload import mounted_offload_device, prepare_offload_dir
from zerotuner.preflight import Preflight, preflight
from zerotuner.settings import Settings, load_settings

log = logging.getLogger("zerotuner.train")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass  # configured by ZT_* variables and files only


def run(args: argparse.Namespace) -> int:
    settings = load_settings()
    inputs = read_user_inputs(settings)
    # Before anything uses a folder: a real nvme_path in the user's files is the offload dir
    # the metrics watch, the device is mounted at, and preflight plans and checks.
    settings = apply_implied_settings(settings, inputs)
    refuse_overlaps(settings)  # before the metrics, a mount or a scan touch any of them
    token = settings.hf_token.get_secret_value() if settings.hf_token else None
    level = rank_level(settings.log_level, 0)
    setup_logging(rank=0, log_format=settings.log_format, level=level, secrets=[token])
    with ExitStack() as stack:
        server = _start_metrics(settings, stack)
        code = 1
        try:
            code = _train(settings, inputs, server, stack)
        except ZeroTunerError as error:
            code = error.exit_code
            raise
        finally:
            if server is not None:
                server.set_phase("done" if code == EXIT_OK else "failed")
        return code


def _start_metrics(settings: Settings, stack: ExitStack):  # noqa: ANN202 - optional server
    if not settings.metrics_port:
        return None
    from zerotuner.metrics_server import MetricsServer, prepare_metrics_dir

    # Node-local, emptied before launch: the ranks inherit PROMETHEUS_MULTIPROC_DIR.
    metrics_dir = prepare_metrics_dir(Path(tempfile.mkdtemp(prefix="zerotuner-metrics-")))
    server = MetricsServer(
        settings.metrics_host,
        settings.metrics_port,
        hang_timeout_seconds=settings.hang_timeout_seconds,
        multiproc_dir=metrics_dir,
        offload_dir=settings.offload_dir,
        output_dir=settings.output_dir,  # the run page at / reads OUTPUT/run and samples
    ).start()
    stack.callback(server.stop)
    server.set_phase("probing")
    log.info("metrics on http://%s:%d/metrics", settings.metrics_host, server.port)
    return server


def _train(settings: Settings, inputs: UserInputs, server, stack: ExitStack) -> int:  # noqa: ANN001
    hardware = probe(settings.device)
    for warning in hardware.warnings:
        log.warning("%s", warning)
    topology = resolve_topology(settings, hardware, os.environ)
    run_dir = Path(tempfile.mkdtemp(prefix="zerotuner-job-"))
    status_dir = run_dir / "status"
    job_file = run_dir / "job.json"
    # The ranks start now and import torch, DeepSpeed and diffusers while this process plans;
    # they wait for the job file, written below once the plan holds.
    ranks = start_ranks(
        topology, hardware, job_file=job_file, status_dir=status_dir,
        grace_seconds=settings.stop_grace_seconds,
    )  # fmt: skip
    try:
        pusher = _prepare(settings, inputs, server, stack, hardware, topology, job_file)
    except BaseException:
        ranks.cancel()
        raise
    ranks.release()
    code = ranks.wait()
    if code == EXIT_OK and topology.node_rank == 0:
        _say_where_outputs_are(settings)
    if pusher is not None:
        _finish_pushing(pusher, settings, code)
    return code


def _prepare(settings, inputs, server, stack, hardware, topology, job_file):  # noqa: ANN001, ANN202
    """Everything before the ranks may go: the plan, the offload volume, the job file, and on
    node 0 the checkpoint pusher (which may first fetch the checkpoint to resume from)."""
    if settings.offload_device:
        stack.enter_context(
            mounted_offload_device(
                settings.offload_device, settings.offload_dir, allow_format=settings.offload_format
            )
        )
    pre = preflight(settings, hardware=hardware, topology=topology, inputs=inputs)
    _log_decisions(pre)
    choice = pre.plan.choice
    if "nvme" in (choice.offload_optimizer, choice.offload_param):
        # Once per node, before any rank starts: stale swap files make a resume load garbage.
        report = prepare_offload_dir(
            settings.offload_dir, need_bytes=choice.disk_bytes, nvme=True, clean=True
        )
        log.info("offload volume: %s", report.summary())
        for removed in report.removed:
            log.info("removed stale swap data: %s", removed)
        for warning in report.warnings:
            log.warning("%s", warning)
    job = job_from(pre)
    if server is not None:
        server.set_job(job)
        server.set_plan(plan_json(pre.plan, pre.hardware))
        server.set_phase("loading")
    log.info(
        "launching %d rank(s) on node %d of %d (world size %d, %s)",
        topology.nproc_per_node, topology.node_rank, topology.nnodes, topology.world_size,
        topology.source,
    )  # fmt: skip
    pusher = None
    if topology.node_rank == 0:  # node 0 commits the checkpoints
        if settings.push_to:
            pusher = _start_pusher(settings, server)
        else:  # an earlier run's remote no longer holds back the local rotation
            (checkpoints_dir(settings.output_dir) / REMOTE_LATEST).unlink(missing_ok=True)
    job.write(job_file)  # the waiting ranks go on from here
    return pusher


# After a successful run the final export may be tens of GB: it gets up to an hour to upload.
FINAL_UPLOAD_SECONDS = 3600.0


def _start_pusher(settings: Settings, server):  # noqa: ANN001, ANN202 - optional server
    """Node 0: resume from the remote when this machine has no checkpoint, then push each new
    one in the background (see zerotuner.push)."""
    from zerotuner import push
    from zerotuner.remote import probe

    store = push.open_remote(settings)
    probe(store)  # credentials and write access, before the ranks spend GPU time
    if settings.resume == "auto":
        push.fetch_latest(store, settings.output_dir)
    pusher = push.Pusher(store, settings.output_dir, keep=settings.checkpoints_keep).start()
    if server is not None:
        server.registry.register(push.PushCollector(pusher.stats))
    log.info("pushing checkpoints, the final export and run records to %s", store.url)
    return pusher


def _finish_pushing(pusher, settings: Settings, code: int) -> None:  # noqa: ANN001
    from zerotuner.model_card import model_card

    ok = code == EXIT_OK
    card = model_card(settings, settings.output_dir) if ok else None
    timeout = FINAL_UPLOAD_SECONDS if ok else settings.stop_grace_seconds
    pusher.finish(succeeded=ok, timeout=timeout, card=card)


def job_from(pre: Preflight) -> Job:
    d, t = pre.decisions, pre.topology
    return Job(
        family=pre.model.family,
        model=pre.model.job_model,
        revision=pre.model.revision,
        resolution=pre.resolution,
        zero_stage=d.zero_stage,
        offload_optimizer=d.offload_optimizer,
        offload_param=d.offload_param,
        gradient_checkpointing=d.gradient_checkpointing,
        mixed_precision=pre.normalized.mixed_precision,
        device="cpu" if pre.hardware.accelerator == "cpu" else "cuda",
        world_size=t.world_size,
        nnodes=t.nnodes,
        nproc_per_node=t.nproc_per_node,
        node_rank=t.node_rank,
        master_addr=t.master_addr,
        master_port=t.master_port,
        deepspeed=pre.normalized.config,
        notes=tuple(str(n) for n in pre.notes),
    )


def _log_decisions(pre: Preflight) -> None:
    """The plan, every normalization change, and the effective DeepSpeed config."""
    log.info("plan:\n%s", render(pre.plan, pre.hardware))
    for note in pre.notes:
        if note.level == "warning":
            log.warning("%s", note.message)
        else:
            log.info("%s", note)
    log.info("effective DeepSpeed config:\n%s", json.dumps(pre.normalized.config, indent=2))


def _say_where_outputs_are(settings: Settings) -> None:
    out = settings.output_dir
    for label, path in (
        ("final pipeline (diffusers)", out / "final"),
        ("EMA pipeline", out / "final-ema"),
        ("samples", out / "samples"),
        ("checkpoints", out / "checkpoints"),
        ("loss curve", out / "run" / "loss.png"),
        ("step log", out / "run" / "steps.jsonl"),
    ):
        if path.exists():
            log.info("%-27s %s", label, path)
