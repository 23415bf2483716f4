"""torchrun as the launcher runs it: `python -m zerotuner.launch.torchrun ARGS` = `torchrun ARGS`.

On SIGTERM/SIGINT torchrun's agent raises `SignalException` from its signal handler, passes
the signal to the ranks, waits for them (`--shutdown-timeout`) and re-raises, so a requested
stop ends in a Python traceback that reads as a crash. torch documents the exception as one
for the caller to handle: here it ends the process with the shell's code for that signal
(128 + signum), and the ranks' own statuses say whether they saved. Ranks that all exited
with a code they explain in one line of their own (2, 3, 4, and 200 for a lost node:
errors.py) end it with torchrun's exit 1 and no traceback on top. Every other failure
propagates untouched. The ranks learn this process's pid (`ZT_AGENT_PID`): each asks to die
with it (`peers.die_with_parent`), so an agent killed leaves no rank training on alone.
"""

from __future__ import annotations

import logging
import os
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

from zerotuner.errors import EXIT_CONFIG, EXIT_DIVERGED, EXIT_ENVIRONMENT, EXIT_PEER_LOST
from zerotuner.launch.peers import AGENT_PID_ENV

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
        if not all(f.exitcode in EXPLAINED for f in failed.failures.values()):
            raise
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
