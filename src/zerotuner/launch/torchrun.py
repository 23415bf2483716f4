"""torchrun as the launcher runs it: `python -m zerotuner.launch.torchrun ARGS` = `torchrun ARGS`.

On SIGTERM/SIGINT torchrun's agent raises `SignalException` from its signal handler, passes
the signal to the ranks, waits for them (`--shutdown-timeout`) and re-raises, so a requested
stop ends in a Python traceback that reads as a crash. torch documents the exception as one
for the caller to handle: here it ends the process with the shell's code for that signal
(128 + signum), and the ranks' own statuses say whether they saved. Ranks that all exited
with a code they explain in one line of their own (2, 3, 4, and 200 for a lost node:
errors.py) end it with torchrun's exit 1 and no traceback on top. Every other failure
propagates untouched; a rank a signal ended (SIGKILL: the out-of-memory killer) gets the status
it could not write, naming the signal, so the run's one line is its. The ranks learn this
process's pid (`ZT_AGENT_PID`): each asks to die with it (`peers.die_with_parent`), so an agent
killed leaves no rank training on alone.
"""

from __future__ import annotations

import logging
import os
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

from zerotuner.errors import (
    EXIT_CONFIG,
    EXIT_DIVERGED,
    EXIT_ENVIRONMENT,
    EXIT_FAILURE,
    EXIT_PEER_LOST,
)
from zerotuner.launch.peers import AGENT_PID_ENV
from zerotuner.launch.records import killed_line, write_rank_status

EXPLAINED = {EXIT_CONFIG, EXIT_ENVIRONMENT, EXIT_DIVERGED, EXIT_PEER_LOST}


class _Explained(logging.Filter):
    """Drops the agent's "failed (exitcode: N) local_rank: ..." line when N is a code the rank
    explained in a line of its own: one line per failure, the rank's."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        explained = str(record.msg).startswith("failed (exitcode") and args[:1]
        return not (explained and args[0] in EXPLAINED)


def main(argv: list[str] | None = None) -> int:
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # the ranks inherit this environment
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_Explained())
    try:
        torchrun_main(argv)
    except SignalException as stop:
        return 128 + int(stop.sigval)
    except ChildFailedError as failed:
        for rank, failure in failed.failures.items():
            if failure.exitcode < 0:  # a signal ended it: it could say nothing itself
                line = killed_line(rank, failure.signal_name())
                write_rank_status(rank, EXIT_FAILURE, line, killed=True)
        if not all(f.exitcode in EXPLAINED for f in failed.failures.values()):
            raise
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
