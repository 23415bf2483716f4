"""torchrun as the launcher runs it: `python -m zerotuner.launch.torchrun ARGS` = `torchrun ARGS`.

On SIGTERM/SIGINT torchrun's agent raises `SignalException` from its signal handler, passes
the signal to the ranks, waits for them (`--shutdown-timeout`) and re-raises, so a requested
stop ends in a Python traceback that reads as a crash. torch documents the exception as one
for the caller to handle: here it ends the process with the shell's code for that signal
(128 + signum), and the ranks' own statuses say whether they saved. Ranks that all exited
with a code they explain in one line of their own (2, 3, 4: errors.py) end it with torchrun's
exit 1 and no traceback on top. Every other failure propagates untouched.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

from zerotuner.errors import EXIT_CONFIG, EXIT_DIVERGED, EXIT_ENVIRONMENT

EXPLAINED = {EXIT_CONFIG, EXIT_ENVIRONMENT, EXIT_DIVERGED}


def main(argv: list[str] | None = None) -> int:
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
