"""The held-out loss and the early stop (issue 46): real DeepSpeed ranks on the CPU, the tiny
demo model. The figure depends on the weights only: the same on 1 and 2 ranks, at ZeRO-3 with
an odd number of held-out images, and after a resume; an early stop on a plateau exports the
best step and keeps its checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from trainkit import (
    assert_ok,
    ds_config,
    read_json,
    read_steps,
    run_ranks,
    settings_env,
    statuses,
    train,
    write_job,
)

from zerotuner.errors import ConfigError
from zerotuner.launch.records import StepRecord
from zerotuner.publish.model_card import model_card
from zerotuner.settings.schema import Settings


def _evals(output: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in read_steps(output) if "eval_loss" in r}


def _run_lr0(tmp: Path, demo: Path, cache: Path, *, world: int, **settings: object):
    """A ZeRO-3 run at learning rate 0 (the weights never change: a plateau)."""
    tmp.mkdir(parents=True, exist_ok=True)
    config = ds_config(3, world=world, micro=1, lr=0.0, steps=6)
    job = write_job(tmp / "job.json", model=demo / "model", deepspeed=config, world=world)
    env = settings_env(
        model=demo / "model", data=demo / "data", output=tmp / "output", cache=cache,
        max_steps=6, log_every_steps=1, **settings,
    )  # fmt: skip
    return run_ranks(tmp, env, job_file=job, world=world), tmp / "output"


@pytest.mark.slow
def test_held_out_loss_is_the_same_after_a_resume(demo_dir: Path, tmp_path: Path) -> None:
    """ZT_EVAL_FRACTION on 2 ranks at ZeRO-2, training a LoRA: the run's step-4 checkpoint,
    alone in a new output folder, trains on to the held-out loss the uninterrupted run reported
    at step 6, steps.jsonl carries it, and the best step and the count of evaluations come back
    from the checkpoint. (The plateau test below trains the full model.)"""
    cache = tmp_path / "cache"
    held = {
        "eval_fraction": 0.1, "eval_every_steps": 2, "checkpoint_every_steps": 2,
        "training_type": "lora", "lora_rank": 4,
    }  # fmt: skip
    whole, whole_out = train(tmp_path / "whole", demo_dir, cache, stage=2, steps=6, **held)
    assert_ok(whole, tmp_path / "whole")
    parts = tmp_path / "parts"
    (parts / "output" / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        whole_out / "checkpoints" / "step-4", parts / "output" / "checkpoints" / "step-4"
    )
    second, out = train(parts, demo_dir, cache, stage=2, steps=6, **held)
    assert_ok(second, parts)
    assert "resumed from" in second.stderr
    expected = _evals(whole_out)
    assert sorted(expected) == [2, 4, 6]
    assert len(set(expected.values())) == 3  # the weights change, and the figure with them
    assert _evals(out) == pytest.approx({6: expected[6]}, rel=1e-6, abs=1e-7)
    assert "held-out loss at step 6" in whole.stderr
    record = read_json(whole_out / "run" / "eval.json")
    assert record["held_out_images"] == 6 and record["evaluations"] == 3  # 0.1 of 64 images
    best = min(expected, key=lambda step: expected[step])
    assert record["best_step"] == best
    # the best and the count of evaluations came back from step-4's manifest (the new folder
    # had no eval.json)
    resumed = read_json(out / "run" / "eval.json")
    assert {k: resumed[k] for k in ("best_step", "evaluations", "last_step")} == {
        "best_step": best,
        "evaluations": 3,
        "last_step": 6,
    }


@pytest.mark.slow
def test_early_stop_on_a_plateau_at_zero3(demo_dir: Path, tmp_path: Path) -> None:
    """Three held-out images (ZT_EVAL_DATA_DIR) on 2 ranks at ZeRO-3 (one rank pads with a
    weighted-0 forward: no hang) give world 1's figure; at learning rate 0 the loss never
    improves, so patience 1 stops at the second evaluation with exit 0 and its one line,
    exports the best (first) step and keeps its checkpoint despite ZT_CHECKPOINTS_KEEP=1."""
    held_dir = tmp_path / "held"
    held_dir.mkdir()
    for image in sorted((demo_dir / "data").glob("*.png"))[:3]:
        shutil.copy(image, held_dir)
        shutil.copy(image.with_suffix(".txt"), held_dir)
    cache = tmp_path / "cache"
    settings = {
        "eval_data_dir": held_dir, "eval_every_steps": 2, "early_stop_patience": 1,
        "checkpoints_keep": 1, "checkpoint_every_steps": 0,
    }  # fmt: skip
    two, out = _run_lr0(tmp_path / "two", demo_dir, cache, world=2, **settings)
    assert_ok(two, tmp_path / "two")
    line = (
        "stopped early at step 4: the held-out loss has not improved by more than 0 in 1 "
        "evaluations; exported the best, step 2"
    )
    assert line in two.stderr
    assert {s["message"].split(" (")[0] for s in statuses(tmp_path / "two").values()} == {line}
    figures = _evals(out)
    assert sorted(figures) == [2, 4] and figures[2] == figures[4]
    kept = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert kept == ["step-2", "step-4"]  # step-2 is the best: kept whatever KEEP says
    assert (out / "final").is_dir()
    record = read_json(out / "run" / "eval.json")
    assert record["exported_step"] == 2 and record["stopped_early_at"] == 4
    assert record["best_step"] == 2 and record["held_out_images"] == 3
    card = model_card(Settings(model="demo"), out, "sdxl")
    assert "at step 2; stopped early at step 4, the export is step 2." in card
    again, out = _run_lr0(tmp_path / "two", demo_dir, cache, world=2, **settings)
    assert_ok(again, tmp_path / "two")  # a restart finds the stop's checkpoint: trains nothing
    assert line in again.stderr and sorted(_evals(out)) == [2, 4]
    assert read_json(out / "run" / "eval.json")["exported_step"] == 2
    one, one_out = _run_lr0(tmp_path / "one", demo_dir, cache, world=1, **settings)
    assert_ok(one, tmp_path / "one", world=1)
    assert _evals(one_out) == pytest.approx(figures, rel=1e-6)


def test_the_run_page_draws_the_held_out_loss(tmp_path: Path) -> None:
    """The run page's loss chart gets the evaluated steps' figures beside the training loss."""
    from zerotuner.monitor.run_page import RunView
    from zerotuner.train.sinks import StepsJsonlSink

    sink = StepsJsonlSink(tmp_path / "run" / "steps.jsonl")
    for step in (1, 2, 3, 4):
        if step % 2 == 0:
            sink.on_eval(step, 1.0 / step)  # heard before its step's record
        sink.on_step(StepRecord(step, 2.0 / step, 1e-3, 1.0, 0.5, 4, 100.0 + step))
    sink.close()
    assert [r.get("eval_loss") for r in read_steps(tmp_path)] == [None, 0.5, None, 0.25]
    state = RunView(tmp_path).state([], "training")
    assert state["eval_loss"] == [[2, 0.5], [4, 0.25]] and len(state["loss"]) == 4


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"ZT_EVAL_FRACTION": "1"}, "ZT_EVAL_FRACTION='1': expected less than 1"),
        ({"ZT_EVAL_FRACTION": "-0.1"}, "ZT_EVAL_FRACTION='-0.1': expected greater than 0"),
        ({"ZT_EVAL_EVERY_STEPS": "-2"}, "ZT_EVAL_EVERY_STEPS='-2': expected greater than or"),
        ({"ZT_EARLY_STOP_MIN_DELTA": "-1"}, "ZT_EARLY_STOP_MIN_DELTA='-1': expected greater"),
        (
            {"ZT_EVAL_FRACTION": "0.2", "ZT_EVAL_DATA_DIR": "/held"},
            "ZT_EVAL_FRACTION='0.2': expected no fraction while ZT_EVAL_DATA_DIR is set",
        ),
        (
            {"ZT_EARLY_STOP_PATIENCE": "2"},
            "ZT_EARLY_STOP_PATIENCE='2': expected 0 (off) unless held-out images are evaluated",
        ),
        (
            {"ZT_EARLY_STOP_PATIENCE": "2", "ZT_EVAL_FRACTION": "0.2"},
            "set ZT_EVAL_DATA_DIR or ZT_EVAL_FRACTION, and ZT_EVAL_EVERY_STEPS above 0",
        ),
    ],
)
def test_bad_eval_settings_are_one_line(monkeypatch, capsys, tmp_path, env, says) -> None:
    from trainkit import config_explain

    code, _, err = config_explain(monkeypatch, capsys, tmp_path, **env)
    assert code == 2
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and says in lines[0], err


def test_a_fraction_that_leaves_no_training_image(demo_dir: Path, tmp_path: Path) -> None:
    """Checked from the file names before the ranks load (64 demo images)."""
    from zerotuner.commands.train_plan import _check_held_out
    from zerotuner.settings.schema import load_settings

    def settings(fraction: str):
        return load_settings(
            {"ZT_DATA_DIR": str(demo_dir / "data"), "ZT_CACHE_DIR": str(tmp_path),
             "ZT_EVAL_FRACTION": fraction}
        )  # fmt: skip

    _check_held_out(settings("0.98"))  # 63 held out, one trains
    with pytest.raises(ConfigError) as refused:
        _check_held_out(settings("0.995"))
    assert str(refused.value).startswith(
        "ZT_EVAL_FRACTION=0.995: holds out 64 of the 64 training image(s), leaving none to "
        "train on; expected a fraction that leaves at least one"
    )


def test_eval_loss_in_the_metrics_exposition() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from zerotuner.monitor.metrics import PrometheusSink

    registry = CollectorRegistry()
    sink = PrometheusSink(1, registry=registry, world_size=2, max_steps=10)
    sink.on_eval(4, 0.125)
    assert 'zerotuner_eval_loss{rank="1"} 0.125' in generate_latest(registry).decode()
