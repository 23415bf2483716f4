"""Helpers for the training tests: a Job file, a DeepSpeed config, torchrun with N CPU ranks.

The DeepSpeed dicts have the shape `zerotuner.preflight.deepspeed_config.normalize` produces, built
directly so these tests pin the worker, not the normalizer.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from zerotuner.launch.job import Job
from zerotuner.launch.ranks import lone_rank

REPO = Path(__file__).resolve().parents[1]
ENTRYPOINT = str(REPO / "entrypoint")
RUN_TIMEOUT = 600  # seconds; a 2-rank tiny run takes well under a minute
SHUTDOWN_TIMEOUT = 120  # seconds torchrun gives ranks after SIGTERM (launch() passes the grace)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ds_config(
    stage: int,
    *,
    world: int = 2,
    micro: int = 2,
    accumulation: int = 1,
    lr: float = 1e-3,
    steps: int = 10,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    nvme_dir: Path | None = None,
    precision: str = "no",
    param_buffer: int = 1_000_000,
) -> dict[str, Any]:
    """What the normalizer would produce for the tiny demo model on the CPU (fp32);
    `param_buffer`: offloaded parameters' buffer_size (the largest tensor must fit)."""
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zero |= {"reduce_bucket_size": 500_000, "allgather_bucket_size": 500_000}
    if stage == 3:
        zero |= {
            "stage3_prefetch_bucket_size": 450_000,
            "stage3_param_persistence_threshold": 1_000,
            "stage3_gather_16bit_weights_on_model_save": True,
        }
    for key, target in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if target == "none":
            continue
        section: dict[str, Any] = {"device": target, "pin_memory": False}
        if target == "nvme":
            section["nvme_path"] = str(nvme_dir)
            if key == "offload_optimizer":
                section["buffer_count"] = 4
        if key == "offload_param":
            section |= {"buffer_size": param_buffer, "buffer_count": 5}
        zero[key] = section
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro * accumulation * world,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0,
                "warmup_max_lr": lr,
                "warmup_num_steps": 2,
                "warmup_type": "linear",
            },
        },  # fmt: skip
        "zero_optimization": zero,
        "gradient_clipping": 1.0,
        "steps_per_print": steps + 1,
        "wall_clock_breakdown": False,
    }
    if precision != "no":
        config["bf16" if precision == "bf16" else "fp16"] = {"enabled": True}
    if "nvme" in (offload_optimizer, offload_param):
        config["aio"] = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
                         "single_submit": False, "overlap_events": True}  # fmt: skip
    return config


def write_job(
    path: Path,
    *,
    model: Path,
    deepspeed: dict[str, Any],
    family: str = "sdxl",
    resolution: int = 64,
    world: int = 2,
    **extra: Any,
) -> Path:
    stage = deepspeed["zero_optimization"]["stage"]
    zero = deepspeed.get("zero_optimization", {})
    job = Job(
        family=family,
        model=str(model),
        resolution=resolution,
        zero_stage=stage,
        offload_optimizer=zero.get("offload_optimizer", {}).get("device", "none"),
        offload_param=zero.get("offload_param", {}).get("device", "none"),
        gradient_checkpointing=extra.pop("gradient_checkpointing", False),
        mixed_precision=extra.pop("mixed_precision", "no"),
        device="cpu",
        world_size=world,
        nproc_per_node=world,
        deepspeed=deepspeed,
        **extra,
    )
    return job.write(path)


def settings_env(*, model: Path, data: Path, output: Path, cache: Path, **settings: Any) -> dict:
    """ZT_* variables for a run; anything else given becomes ZT_<NAME>."""
    env = {
        "ZT_MODEL": str(model),
        "ZT_DATA_DIR": str(data),
        "ZT_OUTPUT_DIR": str(output),
        "ZT_CACHE_DIR": str(cache),
        "ZT_METRICS_PORT": "0",
    }
    for key, value in settings.items():
        env[f"ZT_{key.upper()}"] = json.dumps(value) if isinstance(value, list) else str(value)
    return env


def rank_command(
    tmp: Path, env: dict[str, str], *, job_file: Path, world: int = 2
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment for `world` CPU ranks running the worker: torchrun's,
    or one rank alone as the entrypoint starts a world of one (launch.ranks.lone_rank)."""
    status = tmp / "status"
    status.mkdir(parents=True, exist_ok=True)
    full = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ZT_")},
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions")
        ),
        "OMP_NUM_THREADS": "1",
        "ZT_JOB_FILE": str(job_file),
        "ZT_STATUS_DIR": str(status),
        "PYTHONUNBUFFERED": "1",
        **env,
    }
    if world == 1:
        cmd, lone = lone_rank("zerotuner.train.worker", "127.0.0.1", free_port())
        return cmd, full | lone
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
        f"--master_port={free_port()}", f"--shutdown-timeout={SHUTDOWN_TIMEOUT}",
        "-m", "zerotuner.train.worker",
    ]  # fmt: skip
    return cmd, full


def run_ranks(
    tmp: Path, env: dict[str, str], *, job_file: Path, world: int = 2
) -> subprocess.CompletedProcess[str]:
    """torchrun with `world` CPU ranks running the worker, to the end; output captured."""
    cmd, full = rank_command(tmp, env, job_file=job_file, world=world)
    return subprocess.run(
        cmd, env=full, capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=tmp
    )


def statuses(tmp: Path) -> dict[int, dict]:
    return {
        int(p.stem.split("-")[1]): json.loads(p.read_text())
        for p in sorted((tmp / "status").glob("rank-*.json"))
    }


def read_steps(output: Path) -> list[dict]:
    path = output / "run" / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def train(
    tmp: Path, demo: Path, cache: Path, *, stage: int, steps: int, world: int = 2,
    output: Path | None = None, offload_optimizer: str = "none", offload_param: str = "none",
    **settings: Any,
) -> tuple[subprocess.CompletedProcess[str], Path]:  # fmt: skip
    """A whole run of the tiny demo on `world` CPU ranks; `settings` become ZT_* variables."""
    output = output or tmp / "output"
    config = ds_config(
        stage, world=world, steps=steps, offload_optimizer=offload_optimizer,
        offload_param=offload_param, nvme_dir=tmp / "nvme",
    )  # fmt: skip
    job = write_job(tmp / "job.json", model=demo / "model", deepspeed=config, world=world)
    env = settings_env(
        model=demo / "model", data=demo / "data", output=output, cache=cache, max_steps=steps,
        log_every_steps=1, **settings,
    )  # fmt: skip
    return run_ranks(tmp, env, job_file=job, world=world), output


def assert_ok(proc: subprocess.CompletedProcess[str], tmp: Path, world: int = 2) -> None:
    codes = {rank: s["exit_code"] for rank, s in statuses(tmp).items()}
    assert proc.returncode == 0 and codes == dict.fromkeys(range(world), 0), (
        f"rc={proc.returncode} statuses={codes}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )


def entrypoint_env(demo_dir: Path, out: Path, **overrides: str) -> dict[str, str]:
    """The environment of `./entrypoint train` on the demo: no ZT_*/HF_* of the caller's,
    offline unless an override says otherwise, every output under `out`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZT_", "HF_"))}
    env.update(
        ZT_DEVICE="cpu",
        ZT_MODEL=str(demo_dir / "model"),
        ZT_DATA_DIR=str(demo_dir / "data"),
        ZT_OUTPUT_DIR=str(out / "output"),
        ZT_CACHE_DIR=str(out / "cache"),
        ZT_OFFLOAD_DIR=str(out / "offload"),
        ZT_CONFIG_FILE=str(REPO / "config" / "demo.yaml"),
        ZT_METRICS_PORT="0",
        ZT_VALIDATION_PROMPTS="[]",
        ZT_LOG_EVERY_STEPS="1",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
    )
    env.update(overrides)
    return env


def config_explain(monkeypatch, capsys, tmp_path: Path, **env: str) -> tuple[int, str, str]:
    """`zerotuner config --explain` in process on this CPU, with cache and offload folders
    under tmp_path and `env` set: (exit code, stdout, stderr)."""
    from zerotuner.cli import main

    monkeypatch.setenv("ZT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ZT_OFFLOAD_DIR", str(tmp_path / "offload"))
    monkeypatch.setenv("ZT_DEVICE", "cpu")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code = main(["config", "--explain"])
    out, err = capsys.readouterr()
    return code, out, err


def steps_done(out: Path) -> list[dict]:
    """The steps `./entrypoint train` logged under `out/output/run/steps.jsonl`."""
    path = out / "output" / "run" / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def sigterm_after_steps(env: dict[str, str], out: Path, steps: int = 3) -> tuple[int, str]:
    """`./entrypoint train` signalled with SIGTERM (as `docker stop` does, to the entrypoint
    only) once `steps` steps are logged: (exit code, its output)."""
    proc = subprocess.Popen(
        [ENTRYPOINT, "train"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    while len(steps_done(out)) < steps and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate(timeout=300)[0]
    return proc.returncode, text


def sigterm_ranks_after_steps(tmp: Path, env: dict[str, str], job: Path, output: Path,
                              steps: int = 2) -> None:  # fmt: skip
    """The ranks (torchrun, no entrypoint) signalled with SIGTERM once `steps` steps are
    logged; both must exit 143 (a checkpoint committed: a restart resumes)."""
    cmd, full = rank_command(tmp, env, job_file=job)
    log_path = tmp / "log.txt"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=full, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
        try:
            deadline = time.monotonic() + 300  # start-up and a few steps on a busy machine
            logged = output / "run" / "steps.jsonl"
            while proc.poll() is None and not (
                logged.is_file() and len(read_steps(output)) >= steps
            ):
                assert time.monotonic() < deadline, log_path.read_text()[-4000:]
                time.sleep(0.5)
            assert proc.poll() is None, log_path.read_text()[-4000:]
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    codes = {rank: s["exit_code"] for rank, s in statuses(tmp).items()}
    assert codes == {0: 143, 1: 143}, log_path.read_text()[-4000:]


def lone_rank_result(tmp: Path, source: str, *, timeout: int = 600) -> dict[str, Any]:
    """Run `source` (a script that builds DeepSpeed engines) as a lone rank 0 of 1 on the CPU
    accelerator; the JSON it prints after `RESULT `."""
    script = tmp / "lone_rank.py"
    # End as a finished rank does (worker.main): the interpreter's teardown of a gloo group
    # has aborted a finished process (SIGABRT)
    ending = "from zerotuner.launch.distributed import exit_process\nexit_process(0)\n"
    script.write_text(f"{source}\n{ending}")
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")  # fmt: skip
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))  # cpu_adam
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    noise = ("FutureWarning", "return func", "OVERFLOW! Skipping", "get_lr")
    errors = [x for x in done.stderr.splitlines() if not any(n in x for n in noise)]
    assert done.returncode == 0, f"exit {done.returncode}\n" + "\n".join(errors)[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def check_output(monkeypatch, capsys, model: Path, data: Path, tmp: Path) -> str:
    """`zerotuner check`'s output (it must pass) for `model` on `data` at 64 px, one CPU rank,
    every folder under `tmp`."""
    from zerotuner.cli import main

    for key, value in {"ZT_MODEL": str(model), "ZT_DATA_DIR": str(data),
                       "ZT_OUTPUT_DIR": str(tmp / "output"), "ZT_DEVICE": "cpu",
                       "ZT_CACHE_DIR": str(tmp / "cache"), "ZT_RESOLUTION": "64",
                       "ZT_OFFLOAD_DIR": str(tmp / "offload"),
                       "ZT_NUM_PROCESSES": "1"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    assert main(["check"]) == 0
    return capsys.readouterr().out


def checked_buckets(capsys, **settings: Any) -> set[str]:
    """The buckets `zerotuner check` says train will build (its latent-cache line), for
    `settings` as ZT_* variables (settings_env's names)."""
    import re

    import pytest

    from zerotuner.cli import main

    with pytest.MonkeyPatch.context() as patch:
        for key, value in settings_env(**settings).items():
            patch.setenv(key, value)
        patch.setenv("ZT_DEVICE", "cpu")
        capsys.readouterr()
        assert main(["check"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("OK   latent cache")]
    listed = re.search(r"buckets \(([^)]*)\)", line)
    assert listed and "..." not in listed.group(1), line
    return set(listed.group(1).split(", "))
