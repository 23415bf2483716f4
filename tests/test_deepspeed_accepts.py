"""Every config the normalizer accepts, DeepSpeed accepts: a real engine on the CPU accelerator.

Cases cover ZeRO 0-3, CPU and NVMe offload, every optimizer the CPU accelerator can run, the
three schedulers, bf16, and the seed's own examples. Each runs two optimizer steps with world
size 1 and 2 (torchrun, gloo). Everything the normalizer refuses is covered in test_normalize.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_normalize import SEED_NVME, SEED_STAGE2

from zerotuner.launch.ranks import free_port

HERE = Path(__file__).parent

CASES = [
    {"name": "stage0", "settings": {}, "decisions": {"zero_stage": 0}},
    {"name": "stage1", "settings": {"lr_scheduler": "linear"}, "decisions": {"zero_stage": 1}},
    {"name": "bf16-2", "settings": {"mixed_precision": "bf16"}, "decisions": {"zero_stage": 2}},
    {"name": "stage3", "settings": {"lr_scheduler": "cosine", "lr_warmup_steps": 2},
     "decisions": {"zero_stage": 3}},
    {"name": "stage2-cpu-offload-accum", "settings": {"gradient_accumulation_steps": 2},
     "decisions": {"zero_stage": 2, "offload_optimizer": "cpu"}},
    {"name": "stage3-cpu-offload", "settings": {},
     "decisions": {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}},
    {"name": "stage3-nvme", "settings": {"offload_dir": "{offload}"},
     "decisions": {"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"}},
    # SD3.5 Large on one 24 GB GPU (docs/models.md): the optimizer on NVMe, the params on the GPU
    {"name": "stage3-nvme-optimizer", "settings": {"offload_dir": "{offload}"},
     "decisions": {"zero_stage": 3, "offload_optimizer": "nvme"}},
    # FLUX.1-dev on one 24 GB GPU (docs/models.md): the optimizer on NVMe, the params in host RAM
    {"name": "stage3-nvme-optimizer-cpu-params", "settings": {"offload_dir": "{offload}"},
     "decisions": {"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "cpu"}},
    {"name": "adam-stage1", "settings": {"optimizer": "adam"}, "decisions": {"zero_stage": 1}},
    {"name": "adagrad-2", "settings": {"optimizer": "Adagrad"}, "decisions": {"zero_stage": 2}},
    {"name": "lion-cpu-offload", "settings": {"optimizer": "lion"},
     "decisions": {"zero_stage": 2, "offload_optimizer": "cpu"}},
    {"name": "cpuadam-renamed", "settings": {"optimizer": "cpuadam"},
     "decisions": {"zero_stage": 2, "offload_optimizer": "cpu"}},
    {"name": "seed-stage2", "settings": {}, "base": SEED_STAGE2, "world": 1,
     "decisions": {"zero_stage": 2, "offload_optimizer": "cpu", "offload_param": "cpu"}},
    {"name": "seed-nvme", "settings": {"offload_dir": "{offload}"}, "base": SEED_NVME,
     "decisions": {"zero_stage": 3, "offload_param": "nvme"}},
]  # fmt: skip


def cases_for(world: int, offload: Path) -> list[dict]:
    chosen = [c for c in CASES if c.get("world", world) == world]
    text = json.dumps(chosen).replace("{offload}", str(offload))
    return json.loads(text)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_deepspeed_initializes_and_steps_with_every_normalized_config(world, tmp_path):
    cases = cases_for(world, tmp_path / "offload")
    (tmp_path / "offload").mkdir()
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
         f"--master_port={free_port()}", str(HERE / "ds_accept.py"), str(path)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    outcomes = [line for line in proc.stdout.splitlines() if line.startswith(("OK ", "FAIL "))]
    assert outcomes == [f"OK {c['name']}" for c in cases], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0


def test_the_readmes_flow_plans_are_among_the_accepted_cases():
    """Each choice of docs/models.md's SD3.5 Large / FLUX.1-dev table is a stage and offload
    that a case above runs through DeepSpeed."""
    from bench.paper import FLOW_HARDWARE, FLOW_MODELS, flow_plan

    accepted = {
        (d["zero_stage"], d.get("offload_optimizer", "none"), d.get("offload_param", "none"))
        for d in (c["decisions"] for c in CASES)
    }
    for _, family in FLOW_MODELS:
        for _, gpus, gpu_gib, host_gib in FLOW_HARDWARE:
            c = flow_plan(family, gpus, gpu_gib, host_gib)["choice"]
            assert (c["zero_stage"], c["offload_optimizer"], c["offload_param"]) in accepted, c
