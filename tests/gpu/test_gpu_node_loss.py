"""NCCL fails a lost peer instead of hanging: the settings a rank really runs with on CUDA.

One GPU cannot hold two NCCL ranks (NCCL refuses a duplicate GPU), so the check reads what a
rank's NCCL process group was given: the ZT_COLLECTIVE_TIMEOUT_SECONDS timeout and
TORCH_NCCL_ASYNC_ERROR_HANDLING=1 from the launcher's environment (the watchdog aborts the
communicator and ends the process when a collective fails or times out), and that a
collective runs with them. The loss of a node itself is tested on the CPU (tests/test_node_loss.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

TIMEOUT = 77  # seconds: not a default of torch's, so it can only come from the setting

RANK = """
import json, os, sys, torch, torch.distributed as dist
from zerotuner.launch.distributed import init_distributed
port = int(os.environ["MASTER_PORT"])
init_distributed(device="cuda", master_addr="127.0.0.1", master_port=port,
                 timeout_seconds=@TIMEOUT@)
backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
t = torch.ones(1, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
print("RESULT " + json.dumps({
    "backend": type(backend).__name__,
    "timeout": backend.options._timeout.total_seconds(),
    "async": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    "blocking": os.environ.get("TORCH_NCCL_BLOCKING_WAIT"),
    "sum": t.item(),
}), flush=True)
dist.destroy_process_group()
""".replace("@TIMEOUT@", str(TIMEOUT))


def test_nccl_group_has_the_timeout_and_async_error_handling(check):
    """NCCL gets ZT_COLLECTIVE_TIMEOUT_SECONDS and TORCH_NCCL_ASYNC_ERROR_HANDLING=1."""
    from zerotuner.launch.ranks import Topology, worker_env
    from zerotuner.machine.hardware import GPU, GiB, Hardware

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gpus = Hardware("cuda", (GPU(0, "gpu", 80 * GiB, 80 * GiB),), cpu_count=os.cpu_count() or 1)
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NCCL_")}
    env = worker_env(base, Topology(1, 0, 1, "127.0.0.1", port, "test"), gpus,
                     job_file="unused", status_dir="unused")  # fmt: skip
    env |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CUDA_VISIBLE_DEVICES": "0"}
    done = subprocess.run([sys.executable, "-c", RANK], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        check.set_error(done.stdout[-1000:] + done.stderr[-2000:])
        check.expect(False, f"the NCCL rank ran (exit {done.returncode})")
        return
    got = json.loads(lines[0][len("RESULT ") :])
    check.expect(got["backend"] == "ProcessGroupNCCL", f"backend {got['backend']}")
    check.expect(got["timeout"] == TIMEOUT, f"NCCL timeout {got['timeout']} s (set {TIMEOUT})")
    check.expect(got["async"] == "1", f"TORCH_NCCL_ASYNC_ERROR_HANDLING={got['async']}")
    check.expect(got["blocking"] is None, f"TORCH_NCCL_BLOCKING_WAIT={got['blocking']}")
    check.expect(got["sum"] == 1.0, f"all_reduce on 1 rank: {got['sum']}")
