"""A rank's end when another node of the job was lost (exit 200, EXIT_PEER_LOST): one line that
says which node, when, and what a restart resumes from.

The peer watch (zerotuner.launch.peers) finds the loss in its own thread: either the rank's own
failure came from it (a collective that failed, a wait that timed out), and `lost` turns that
failure into the loss, or the main thread may be stuck in a collective that never returns, and
`end_lost` ends the process from the watch's thread.
"""

from __future__ import annotations

import os
import sys
import threading

from zerotuner.errors import EXIT_PEER_LOST, PeerLost
from zerotuner.launch import distributed, peers
from zerotuner.launch.records import Sink, StepRecord, write_rank_status
from zerotuner.settings.schema import Settings
from zerotuner.weights import checkpoint


class Whereabouts(Sink):
    """A sink that remembers where the run is (the last finished step, the phase), for the
    line a lost node ends this rank with."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.phase = "starting"

    def on_phase(self, phase: str) -> None:
        self.phase = phase

    def on_step(self, record: StepRecord) -> None:
        self.step = record.step

    def on_checkpoint(self, step: int, seconds: float) -> None:
        pass

    def close(self) -> None:
        pass


def lost_line(lost: peers.LostPeers, where: Whereabouts, settings: Settings) -> str:
    """One line: which node was lost, when, and what a restart resumes from."""
    when = f"after step {where.step}" if where.step else f"while {where.phase} (no step yet)"
    last = checkpoint.last_committed(settings.output_dir)
    if settings.resume == "never":
        resumes = "starts over (ZT_RESUME=never)"
    elif last is None:
        resumes = "starts over: no checkpoint was committed yet"
    else:
        resumes = f"resumes from {last}"
    return (
        f"lost {lost.describe()} {when}: it {lost.how}. Restart every node (exit "
        f"{EXIT_PEER_LOST}, retryable); training {resumes}"
    )


def say_lost(error: PeerLost) -> None:
    """The line, once per node (every rank of a surviving node knows the same)."""
    if distributed.World.from_environ().node_leader:
        print(f"zerotuner: error: {error}", file=sys.stderr, flush=True)


def end_lost(lost: peers.LostPeers, *, rank: int, where: Whereabouts, settings: Settings) -> None:
    """The watch found the node lost while this rank's main thread may wait in a collective
    that never returns (NCCL): say so, record the status and end the process from here."""
    try:
        error = PeerLost(lost_line(lost, where, settings))
        say_lost(error)
        write_rank_status(rank, EXIT_PEER_LOST, str(error))
    finally:
        sys.stderr.flush()
        os._exit(EXIT_PEER_LOST)


def lost(watch: peers.PeerWatch | None, where: Whereabouts, settings: Settings) -> PeerLost | None:
    """After a failure: the lost node it came from, if one was lost (else None: the failure is
    this node's own)."""
    if watch is None:
        return None
    found = watch.diagnose()
    if found is None:
        return None
    if not watch.claim():  # the watch's thread is ending this rank with the same verdict
        threading.Event().wait()
    return PeerLost(lost_line(found, where, settings))
