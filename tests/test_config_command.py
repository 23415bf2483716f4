"""`zerotuner config`: JSON on stdout, changes on stderr, usable before renting GPUs."""

from __future__ import annotations

import json

from zerotuner.cli import main


def run_config(monkeypatch, capsys, tmp_path, *args, **env):
    monkeypatch.setenv("ZT_CACHE_DIR", str(tmp_path / "cache"))  # nothing downloaded there
    monkeypatch.setenv("ZT_OFFLOAD_DIR", str(tmp_path / "offload"))
    monkeypatch.setenv("ZT_DEVICE", "cpu")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code = main(["config", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_works_without_a_model_from_the_default_familys_builtin_config(
    monkeypatch, capsys, tmp_path
):
    code, out, err = run_config(monkeypatch, capsys, tmp_path, "--explain", ZT_ZERO_STAGE="2")
    assert code == 0
    config = json.loads(out)
    assert config["zero_optimization"]["stage"] == 2
    assert "built-in sdxl config" in err and "guessed from the hub id" in err


def test_a_job_this_machine_cannot_run_still_gets_its_config_and_a_warning(
    monkeypatch, capsys, tmp_path
):
    # Full SDXL on 4 CPU ranks x 2 nodes does not fit this machine's RAM.
    code, out, err = run_config(
        monkeypatch, capsys, tmp_path, ZT_NUM_PROCESSES="4", ZT_NNODES="2",
        ZT_MASTER_ADDR="node0", ZT_RESOLUTION="1024",
    )  # fmt: skip
    assert code == 0
    assert json.loads(out)["train_batch_size"] == 8
    assert "warning: this machine cannot run it" in err


def test_invalid_settings_exit_2_with_one_line_and_nothing_on_stdout(monkeypatch, capsys, tmp_path):
    code, out, err = run_config(monkeypatch, capsys, tmp_path, ZT_OPTIMIZER="sgd")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "zerotuner: error: optimizer 'sgd' is unknown; valid: AdamW, Adam, Adagrad, Lamb, "
        "Lion, Muon"
    ]
