"""Trackers (ZT_REPORT_TO, issue 46): TensorBoard's own reader reads back what the sink wrote,
and a resumed run's events continue from its checkpoint's step; an offline W&B run holds the
steps and samples, continues its run on a resume, and never the API key. (A real run writing
both: test_notify's run.)"""

from __future__ import annotations

import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandbkit import wandb_history

from zerotuner.errors import ConfigError
from zerotuner.launch.records import StepRecord
from zerotuner.monitor.metrics import CpuMemoryProbe
from zerotuner.monitor.trackers import TensorBoardSink, WandbSink, wandb_mode
from zerotuner.settings.schema import load_settings


def _record(step: int, loss: float, *, skipped: bool = False) -> StepRecord:
    return StepRecord(step=step, loss=loss, lr=1e-4 * step, grad_norm=0.5, step_seconds=0.25,
                      samples=8, timestamp=0.0, skipped=skipped)  # fmt: skip


def _read(folder) -> EventAccumulator:
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return events


def test_the_step_log_memory_and_samples_read_back(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb", probe=CpuMemoryProbe(), resumed_step=0)
    for step in (1, 2, 3):
        sink.on_step(_record(step, 1.0 / step, skipped=step == 2))
    sink.on_eval(3, 0.75)  # the held-out loss (ZT_EVAL_*)
    sink.on_checkpoint(3, 1.5)
    folder = tmp_path / "samples" / "step-3"
    folder.mkdir(parents=True)
    Image.new("RGB", (16, 8), (255, 0, 0)).save(folder / "00-a-red-square.png")
    sink.on_samples(3, folder)
    sink.close()
    events = _read(tmp_path / "tb")
    # a skipped step (non-finite) has no loss, as steps.jsonl's null
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert losses == [(1, 1.0), (3, pytest.approx(1 / 3))]  # stored as float32
    assert [e.step for e in events.Scalars("train/lr")] == [1, 2, 3]
    assert events.Scalars("train/samples_per_second")[0].value == 32.0
    assert events.Scalars("memory/allocated_gib")[0].value > 0
    assert [(e.step, e.value) for e in events.Scalars("checkpoint/seconds")] == [(3, 1.5)]
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(3, 0.75)]
    (image,) = events.Images("samples/00-a-red-square")
    assert (image.step, image.width, image.height) == (3, 16, 8)


def test_a_resumed_run_drops_the_steps_its_checkpoint_does_not_hold(tmp_path):
    first = TensorBoardSink(tmp_path, probe=None, resumed_step=0)
    for step in range(1, 6):
        first.on_step(_record(step, float(step)))
    first.close()  # ended at step 5; the last checkpoint holds step 3
    resumed = TensorBoardSink(tmp_path, probe=None, resumed_step=3)
    for step in (4, 5):
        resumed.on_step(_record(step, 10.0 * step))
    resumed.close()
    losses = [(e.step, e.value) for e in _read(tmp_path).Scalars("train/loss")]
    assert losses == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]


def test_a_wandb_run_offline_holds_the_steps_samples_and_masked_settings(tmp_path):
    env = {"ZT_OUTPUT_DIR": str(tmp_path / "out"), "ZT_REPORT_TO": "wandb",
           "ZT_WANDB_MODE": "offline", "WANDB_API_KEY": "k3y-0123456789abcdef"}  # fmt: skip
    settings = load_settings(env)
    sink = WandbSink(settings, probe=CpuMemoryProbe())
    for step in (1, 2):
        sink.on_step(_record(step, 1.0 / step, skipped=step == 2))
    sink.on_eval(2, 0.5)
    folder = tmp_path / "samples" / "step-2"
    folder.mkdir(parents=True)
    Image.new("RGB", (16, 8), (255, 0, 0)).save(folder / "00-a-red-square.png")
    sink.on_samples(2, folder)
    sink.close()
    # a resume continues the same W&B run (its id kept in run/wandb/run-id)
    again = WandbSink(settings, probe=None)
    again.on_step(_record(3, 0.25))
    again.close()
    rows, ids = wandb_history(tmp_path / "out")
    assert len(ids) == 2 and ids[0] == ids[1], ids
    steps = [(r["step"], r.get("train/loss")) for r in rows if "train/lr" in r]
    assert steps == [(1, 1.0), (2, None), (3, 0.25)], rows
    (image,) = [r for r in rows if "samples/00-a-red-square/path" in r]
    assert image["step"] == 2 and image["samples/00-a-red-square/width"] == 16
    assert [(r["step"], r["eval/loss"]) for r in rows if "eval/loss" in r] == [(2, 0.5)]
    assert "memory/allocated_gib" in rows[0]
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert not [p for p in files if b"k3y-0123456789abcdef" in p.read_bytes()]


def test_wandb_online_needs_a_key_and_auto_follows_it():
    online = load_settings({"ZT_REPORT_TO": "wandb", "ZT_WANDB_MODE": "online"})
    with pytest.raises(ConfigError, match=r"^ZT_WANDB_MODE=online needs a W&B API key"):
        wandb_mode(online)
    assert wandb_mode(load_settings({"ZT_REPORT_TO": "wandb"})) == "offline"
    keyed = load_settings({"ZT_REPORT_TO": "wandb", "WANDB_API_KEY": "0123456789abcdef"})
    assert wandb_mode(keyed) == "online"


@pytest.mark.parametrize("command", ["check", "config"])
def test_check_and_config_refuse_wandb_online_without_a_key(demo_job_env, capsys, command):
    from zerotuner.cli import main

    demo_job_env.delenv("WANDB_API_KEY", raising=False)
    demo_job_env.setenv("ZT_REPORT_TO", "wandb")
    demo_job_env.setenv("ZT_WANDB_MODE", "online")
    assert main([command]) == 2
    out = capsys.readouterr()
    assert "ZT_WANDB_MODE=online needs a W&B API key" in out.out + out.err
