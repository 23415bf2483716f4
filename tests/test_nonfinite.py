"""Non-finite steps are skipped with the weights unchanged, and a run that stays non-finite
stops with exit 4, its last committed checkpoint finite and nothing exported (nonfinite.py)."""

from __future__ import annotations

import json
import math
import subprocess
import textwrap
import time

import pytest
import torch
from prometheus_client import CollectorRegistry
from trainkit import ENTRYPOINT, entrypoint_env, lone_rank_result

from bench.receiver import Receiver
from zerotuner.errors import EXIT_DIVERGED, Diverged
from zerotuner.launch.records import StepRecord
from zerotuner.monitor.metrics import PrometheusSink
from zerotuner.train import nonfinite
from zerotuner.train.sinks import StepsJsonlSink

# One rank, a real engine per case, set up as the worker does (foreach clip, the ZeRO-0
# guard); each micro-batch's loss goes through nonfinite.poison as in loop.forward_backward.
# After a finite step: a NaN input (NaN gradients), then an infinite loss whose gradients are
# finite, then a finite step again: the weights (gathered at ZeRO-3) must not move on the
# first two, and must on the third.
STAGES = textwrap.dedent(
    """
    import json, math
    import deepspeed, torch
    from zerotuner.train import nonfinite
    from zerotuner.train import speed

    deepspeed.init_distributed(dist_backend="gloo")
    CASES = [("0", 0, "none", "no", 1.0), ("0-noclip", 0, "none", "no", 0.0),
             ("1", 1, "none", "no", 1.0), ("2", 2, "none", "no", 1.0),
             ("2-bf16", 2, "none", "bf16", 1.0), ("2-offload", 2, "cpu", "no", 1.0),
             ("3", 3, "none", "no", 1.0), ("3-offload", 3, "cpu", "no", 1.0)]
    result = {}
    for name, stage, offload, precision, clip in CASES:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        zero = {"stage": stage}
        if offload != "none":
            zero["offload_optimizer"] = {"device": offload, "pin_memory": False}
            if stage == 3:
                zero["offload_param"] = {"device": offload, "pin_memory": False}
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": clip,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                  "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3,
                                "warmup_max_lr": 1e-2, "warmup_num_steps": 10}},
                  "zero_optimization": zero, "bf16": {"enabled": precision == "bf16"}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
        speed.foreach_clip(engine)
        guard = nonfinite.guard_plain_optimizer(engine)
        gen = torch.Generator().manual_seed(1)

        def weights():
            params = list(engine.module.parameters())
            with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
                return [p.detach().float().clone() for p in params]

        def step(kind):
            x = torch.randn(4, 8, generator=gen)
            if kind == "nan-input":
                x[0, 0] = math.nan
            loss = engine(x.to(next(engine.module.parameters()).dtype)).float().pow(2).mean()
            if kind == "inf-loss":
                loss = loss + math.inf
            before = engine.skipped_steps
            engine.backward(nonfinite.poison(loss))
            engine.step()
            return engine.skipped_steps - before

        step("finite")
        steps = []
        for kind in ("nan-input", "inf-loss", "finite"):
            w0, lr0 = weights(), engine.get_lr()[0]
            skipped = step(kind)
            w1 = weights()
            steps.append({"kind": kind, "skipped": skipped,
                          "unchanged": all(torch.equal(a, b) for a, b in zip(w0, w1)),
                          "lr_moved": engine.get_lr()[0] != lr0})
        result[name] = {"guard": guard is not None, "steps": steps,
                        "finite": nonfinite.weights_finite(engine.module)}
    print("RESULT " + json.dumps(result))
    """
)


@pytest.mark.slow
def test_a_non_finite_step_leaves_the_weights_at_every_zero_stage(tmp_path):
    result = lone_rank_result(tmp_path, STAGES)
    assert set(result) == {"0", "0-noclip", "1", "2", "2-bf16", "2-offload", "3", "3-offload"}
    for name, case in result.items():
        assert case["guard"] == name.startswith("0"), name  # only ZeRO-0 fp32 needs ours
        nan, inf, finite = case["steps"]
        for skipped in (nan, inf):  # weights, optimizer step and LR schedule stay put
            assert skipped["skipped"] == 1 and skipped["unchanged"], (name, skipped)
            assert not skipped["lr_moved"], (name, skipped)
        assert finite["skipped"] == 0 and not finite["unchanged"] and finite["lr_moved"], name
        assert case["finite"], name


def _record(step: int, loss: float, *, skipped: bool) -> StepRecord:
    norm = math.inf if skipped else 0.5
    return StepRecord(step, loss, 1e-4, norm, 0.1, 8, time.time(), skipped=skipped)


def test_isolated_skips_go_on_and_a_streak_stops_with_the_checkpoint_named(tmp_path, caplog):
    checkpoint = tmp_path / "checkpoints" / "step-2"
    streak = nonfinite.Streak(3, rank=0, counts=True, last_checkpoint=lambda: checkpoint)
    pattern = [False, True, False, True, True, False]  # skips never 3 in a row: goes on
    for step, skipped in enumerate(pattern, 1):
        streak.update(_record(step, math.nan if skipped else 0.2, skipped=skipped))
    assert streak.total == 3 and streak.in_a_row == 0
    assert sum("skipped: loss nan, grad norm inf" in r.message for r in caplog.records) == 3
    streak.update(_record(7, math.nan, skipped=True))
    streak.update(_record(8, math.inf, skipped=True))
    with pytest.raises(Diverged) as diverged:
        streak.update(_record(9, math.nan, skipped=True))
    assert diverged.value.exit_code == EXIT_DIVERGED == 4
    text = str(diverged.value)
    assert "steps 7-9" in text and "ZT_MAX_NONFINITE_STEPS=3" in text, text
    assert f"Last committed checkpoint: {checkpoint}" in text and "\n" not in text
    # fp16: the loss scaler's skips are its own; they never end the run
    fp16 = nonfinite.Streak(1, rank=0, counts=False, last_checkpoint=lambda: None)
    for step in range(1, 5):
        fp16.update(_record(step, 0.3, skipped=True))
    assert fp16.total == 4


def test_skipped_steps_reach_steps_jsonl_and_the_counter(tmp_path):
    sink = StepsJsonlSink(tmp_path / "steps.jsonl")
    registry = CollectorRegistry()
    metrics = PrometheusSink(0, registry=registry, world_size=1)
    for record in (_record(1, 0.2, skipped=False), _record(2, math.nan, skipped=True)):
        sink.on_step(record)
        metrics.on_step(record)
    sink.close()
    lines = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [x["skipped"] for x in lines] == [False, True]
    assert lines[1]["loss"] is None and lines[1]["grad_norm"] is None  # strict JSON, no NaN
    assert "NaN" not in (tmp_path / "steps.jsonl").read_text()
    value = registry.get_sample_value("zerotuner_nonfinite_steps_total", {"rank": "0"})
    assert value == 1.0
    assert registry.get_sample_value("zerotuner_steps_total", {"rank": "0"}) == 2.0


@pytest.mark.slow
def test_a_diverging_run_exits_4_keeping_its_last_finite_checkpoint(demo_dir, tmp_path):
    """2 ranks, ZeRO-2, through `./entrypoint train`: a learning rate of 1e30 makes step 2's
    update huge (finite) and every later step NaN."""
    with Receiver() as webhook:  # ZT_NOTIFY_URL (issue 46): the failure is told, with its line
        env = entrypoint_env(
            demo_dir, tmp_path, ZT_LEARNING_RATE="1e30", ZT_LR_WARMUP_STEPS="0",
            ZT_MAX_STEPS="10", ZT_CHECKPOINT_EVERY_STEPS="1", ZT_CHECKPOINTS_KEEP="5",
            ZT_MAX_NONFINITE_STEPS="3", ZT_NOTIFY_URL=webhook.url,
        )  # fmt: skip
        done = subprocess.run([ENTRYPOINT, "train"], env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
    err = done.stderr
    assert done.returncode == EXIT_DIVERGED, err[-4000:]
    told = webhook.bodies[-1]
    assert told["type"] == "failure" and told["message"].startswith("exit 4: "), told
    assert "training diverged:" in told["message"], told
    assert "Traceback" not in err + done.stdout, err[-4000:]
    (line,) = [x for x in err.splitlines() if "diverged" in x]
    assert line.startswith("zerotuner: error: training diverged:"), line
    output = tmp_path / "output"
    assert not (output / "final").exists() and not (output / "final-ema").exists()
    steps = [json.loads(x) for x in (output / "run" / "steps.jsonl").read_text().splitlines()]
    skipped = [s["step"] for s in steps if s["skipped"]]
    assert len(skipped) == 3 and skipped == list(range(skipped[0], skipped[0] + 3)), steps
    assert steps[-1]["step"] == skipped[-1] and steps[-1]["loss"] is None
    # no checkpoint at a skipped step: the last one is the last step that applied, finite,
    # and the one the line names
    root = output / "checkpoints"
    last = root / (root / "latest").read_text().strip()
    assert last.name == f"step-{skipped[0] - 1}", sorted(p.name for p in root.iterdir())
    assert f"Last committed checkpoint: {last} " in line, line
    assert not any((root / f"step-{s}").exists() for s in skipped)
    state = torch.load(last / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    weights = state["module"]
    assert weights and all(torch.isfinite(t).all() for t in weights.values())
