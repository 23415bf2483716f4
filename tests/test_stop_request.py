"""The ranks' stop agreement (stop.StopRequest) over a real two-rank gloo group.

The signal is timed by the rank itself: `SIGNAL_AT` says when rank 1 sends itself SIGTERM,
before its Nth agreement, or inside it, after the all_reduce returned but before the result is
read. Every rank must stop after the same agreement, or the one
that stops waits in the checkpoint's barrier while its peer trains on (the hang CI once hit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from zerotuner.launch.ranks import free_port

RANK = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch.distributed as dist
    from zerotuner.train.stop import StopRequest

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stop = StopRequest()
    when, nth = os.environ["SIGNAL_AT"].split(":")
    calls = 0
    real_all_reduce = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        global calls
        calls += 1
        work = real_all_reduce(tensor, *args, **kwargs)
        if rank == 1 and when == "after" and calls == int(nth):
            os.kill(os.getpid(), signal.SIGTERM)  # handled before agreed() reads the result
        return work

    dist.all_reduce = all_reduce
    answers = []
    for call in range(1, 5):
        if rank == 1 and when == "before" and call == int(nth):
            os.kill(os.getpid(), signal.SIGTERM)
        answers.append(stop.agreed())
    print(json.dumps({"rank": rank, "answers": answers, "signal": stop.name}))
    dist.destroy_process_group()
    """
)


def run_two_ranks(signal_at: str) -> list[dict]:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK],
            env={
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "SIGNAL_AT": signal_at,
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.parametrize(
    ("signal_at", "first_stop"),
    [
        ("before:2", 1),  # signalled before its 2nd agreement: both stop at that one
        ("after:2", 2),  # signalled after the 2nd all_reduce returned: both stop at the 3rd
    ],
)
def test_every_rank_stops_after_the_same_agreement(signal_at, first_stop):
    results = run_two_ranks(signal_at)
    expected = [False] * first_stop + [True] * (4 - first_stop)
    assert [r["answers"] for r in results] == [expected, expected]
    assert [r["signal"] for r in results] == ["SIGTERM", "SIGTERM"]
