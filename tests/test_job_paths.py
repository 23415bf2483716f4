"""What `check`, `plan`, `config` and `train` say about the job's folders and precision.

The commands run in-process through `cli.main`, on the demo model and data, on the CPU.
"""

from __future__ import annotations

import pytest

from zerotuner import cli


@pytest.fixture
def job_env(monkeypatch, demo_dir, tmp_path):
    """The demo job on two CPU ranks, every folder of its own under tmp_path."""
    env = {
        "ZT_MODEL": str(demo_dir / "model"),
        "ZT_DATA_DIR": str(demo_dir / "data"),
        "ZT_OUTPUT_DIR": str(tmp_path / "output"),
        "ZT_CACHE_DIR": str(tmp_path / "cache"),
        "ZT_DEVICE": "cpu",
        "ZT_NUM_PROCESSES": "2",
        "ZT_METRICS_PORT": "0",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return monkeypatch


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- precision: the setting's `no` reads as fp32 ------------------------------------------------


def test_plan_and_check_say_fp32_not_a_bare_no(job_env, capsys):
    job_env.setenv("ZT_MIXED_PRECISION", "no")
    code, out, err = run(capsys, "plan")
    assert code == 0, err
    (job,) = [line for line in out.splitlines() if line.startswith("job:")]
    assert job.endswith("world size 2, fp32"), job
    code, out, err = run(capsys, "check")
    assert code == 0, out + err
    (line,) = [line for line in out.splitlines() if " deepspeed config " in line]
    assert line.endswith(", fp32)"), line
    code, out, err = run(capsys, "config", "--explain")
    assert code == 0, err
    assert "info: precision: fp32" in err and "mixed precision: no" not in err
