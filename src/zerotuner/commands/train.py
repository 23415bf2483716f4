"""`zerotuner train`: the entrypoint's job on one node, from settings to the ranks' exit code.

probe -> topology -> start the torchrun ranks (they import, then wait for the Job) -> (mount
the offload device) -> preflight (plan + DeepSpeed config) -> prepare the offload dir -> write
the Job (the ranks go on) -> public exit code. The metrics
endpoint serves from the first line to the last, so downloads and caching are visible too.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from zerotuner.errors import EXIT_FAILURE, EXIT_OK, ZeroTunerError
from zerotuner.launch.job import load_job
from zerotuner.launch.ranks import resolve_topology, start_ranks
from zerotuner.machine.hardware import describe
from zerotuner.machine.ops import clear_stale_locks
from zerotuner.machine.probe import probe_facts, with_ops
from zerotuner.monitor.logs import rank_level, setup_logging
from zerotuner.preflight.steps import check_reporting
from zerotuner.publish.notify import secret_parts as notify_secret_parts
from zerotuner.settings.effective import Effective, effective_settings
from zerotuner.settings.folders import require_writable
from zerotuner.settings.schema import Settings

if TYPE_CHECKING:  # types only: each is imported where it is used, when the run needs it
    from zerotuner.monitor.server import MetricsServer
    from zerotuner.publish.notify import Notifier, Target
    from zerotuner.publish.push import Pusher

log = logging.getLogger("zerotuner.train")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass  # configured by ZT_* variables and files only


def run(args: argparse.Namespace) -> int:
    effective = effective_settings()  # before the metrics, a mount or a scan touch a folder
    settings = effective.settings
    require_writable(settings)  # a read-only or file output fails here, not after loading
    token = settings.hf_token.get_secret_value() if settings.hf_token else None
    notify_url = settings.notify_url.get_secret_value() if settings.notify_url else None
    level = rank_level(settings.log_level, 0)
    setup_logging(rank=0, log_format=settings.log_format, level=level,
                  secrets=[token, *notify_secret_parts(notify_url)])  # fmt: skip
    with ExitStack() as stack:
        server = _start_metrics(settings, stack)
        reporting, targets = check_reporting(settings)  # exit 2 before the ranks start
        log.info("reporting: %s", reporting)
        news = _notifier(settings, targets)
        code, line = 1, ""
        try:
            code, line = _train(effective, server, stack, news)
            if code == EXIT_FAILURE and line:  # the ranks' own words for an unexpected end
                log.error("%s", line)
        except ZeroTunerError as error:
            code, line = error.exit_code, str(error)
            raise
        except BaseException as error:
            line = type(error).__name__  # its message may quote anything: the log has it
            raise
        finally:
            if server is not None:
                server.set_phase("done" if code == EXIT_OK else "failed")
            if news is not None:
                news.finish(code, line)  # bounded: a dead endpoint never changes the code
        return code


def _notifier(settings: Settings, targets: list[Target]) -> Notifier | None:
    if not settings.notify_url:
        return None
    from zerotuner.publish.notify import Notifier

    return Notifier(targets, settings.output_dir, timeout_seconds=settings.notify_timeout_seconds)


def _start_metrics(settings: Settings, stack: ExitStack) -> MetricsServer | None:
    if not settings.metrics_port:
        return None
    from zerotuner.monitor.server import MetricsServer, prepare_metrics_dir

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


def _train(
    effective: Effective, server: MetricsServer | None, stack: ExitStack, news: Notifier | None
) -> tuple[int, str]:
    """The run on this node: its exit code and, for a failure, the ranks' one line."""
    settings = effective.settings
    # Enough to place the ranks (no DeepSpeed op builders: on the CPU, no torch import yet).
    facts = probe_facts(settings.device, os.environ, ops=False)
    placement = describe(facts, settings.device)
    topology = resolve_topology(settings, placement, os.environ)
    run_dir = Path(tempfile.mkdtemp(prefix="zerotuner-job-"))
    status_dir = run_dir / "status"
    job_file = run_dir / "job.json"
    # The ranks start now and import torch, DeepSpeed and diffusers while this process plans;
    # they wait for the job file, written below once the plan holds.
    ranks = start_ranks(
        topology, placement, job_file=job_file, status_dir=status_dir,
        grace_seconds=settings.stop_grace_seconds,
    )  # fmt: skip
    if news is not None and topology.node_rank == 0:
        news.start()  # node 0 tells, from here on: the ranks exist
    else:
        news = None
    try:
        clear_stale_locks()  # a start killed mid-build left one: every op build would wait on it
        hardware = describe(with_ops(facts, os.environ), settings.device)
        for warning in hardware.warnings:
            log.warning("%s", warning)
        from zerotuner.commands.train_plan import prepare  # imports torch: after the ranks

        pusher = prepare(
            effective, hardware=hardware, topology=topology, job_file=job_file, server=server,
            stack=stack, news=news,
        )  # fmt: skip
    except BaseException:
        ranks.cancel()
        raise
    ranks.release()
    if news is not None:
        news.watch()
    code = ranks.wait()
    if code == EXIT_OK and topology.node_rank == 0:
        _say_where_outputs_are(settings)
    if pusher is not None:
        _finish_pushing(pusher, settings, code, load_job(job_file).family)
    return code, ranks.failure_line() if code != EXIT_OK else ""


# After a successful run the final export may be tens of GB: it gets up to an hour to upload.
FINAL_UPLOAD_SECONDS = 3600.0


def _finish_pushing(pusher: Pusher, settings: Settings, code: int, family: str) -> None:
    from zerotuner.publish.model_card import model_card

    ok = code == EXIT_OK
    card = model_card(settings, settings.output_dir, family) if ok else None
    timeout = FINAL_UPLOAD_SECONDS if ok else settings.stop_grace_seconds
    pusher.finish(succeeded=ok, timeout=timeout, card=card)


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
