"""The exit codes of the public interface and the errors that map onto them.

Kubernetes' podFailurePolicy acts on these codes, so each error class owns exactly one.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1  # unexpected: a retry may help
EXIT_CONFIG = 2  # configuration or input error: never retry
EXIT_ENVIRONMENT = 3  # the machine cannot run this job: never retry
EXIT_DIVERGED = 4  # the loss or gradients stayed non-finite: never retry as-is (lower the
# learning rate, change the precision; the last committed checkpoint is kept)
EXIT_SIGNAL = 143  # stopped by SIGTERM/SIGINT after a committed checkpoint: a retry resumes
EXIT_PEER_LOST = 200  # another node of a multi-node job was lost (preempted, killed, gone):
# retry every node; they resume from the last committed checkpoint. In 128-255, so Kubeflow's
# `restartPolicy: ExitCode` retries it, and above 128 + 64, so no signal's exit reads as it.

# What each code tells someone who was not watching (a notification, a summary).
EXIT_MEANINGS = {
    EXIT_OK: "finished",
    EXIT_FAILURE: "failed unexpectedly (a retry may help)",
    EXIT_CONFIG: "a setting or an input is wrong (a retry will not help)",
    EXIT_ENVIRONMENT: "this machine cannot run the job (a retry will not help)",
    EXIT_DIVERGED: "the loss or gradients stayed non-finite (the last checkpoint is kept)",
    EXIT_SIGNAL: "stopped by a signal (a retry resumes from the last checkpoint)",
    EXIT_PEER_LOST: "a node of the job was lost (a retry resumes from the last checkpoint)",
}


class ZeroTunerError(Exception):
    """An error the user can act on: printed as one line, no traceback."""

    exit_code = EXIT_FAILURE

    def __init__(self, message: str, *, problems: list[str] | None = None) -> None:
        self.problems = problems or [message]
        super().__init__(message if problems is None else "; ".join(problems))


class ConfigError(ZeroTunerError):
    """A setting, file or input is invalid (exit 2)."""

    exit_code = EXIT_CONFIG


class EnvironmentUnfit(ZeroTunerError):
    """The hardware or volumes cannot run the job as configured (exit 3)."""

    exit_code = EXIT_ENVIRONMENT


class StoppedBeforeStart(ZeroTunerError):
    """SIGTERM/SIGINT while the entrypoint was still planning: nothing ran, nothing to save
    (exit 143, as a stop after a checkpoint: a retry starts the job)."""

    exit_code = EXIT_SIGNAL


class Diverged(ZeroTunerError):
    """Training went non-finite and stayed so for ZT_MAX_NONFINITE_STEPS steps in a row, or
    the weights themselves did (exit 4). Nothing non-finite was saved, exported or pushed."""

    exit_code = EXIT_DIVERGED


class PeerLost(ZeroTunerError):
    """Another node of the job stopped answering mid-run (exit 200): this node stops with one
    line naming it; a restart of every node resumes from the last committed checkpoint."""

    exit_code = EXIT_PEER_LOST
