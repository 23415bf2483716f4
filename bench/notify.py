"""Notifications off the training path (ZT_NOTIFY_URL, issue 46): the step time of a run whose
webhook answers at once, answers 500, or hangs, on the bench UNet, ZeRO-2 on 2 CPU ranks.

Every run commits a checkpoint every 2 steps, so a checkpoint event is sent every other step
(the start's too) while it trains; the sender is node 0's entrypoint, not a rank, so a bad
endpoint should cost the ranks nothing. Rounds interleave the three receivers; per round, each
run's median steady s/step (steps.jsonl intervals, so the sinks and per-step checks count) over
the answering receiver's, and the medians of those ratios over rounds. The receiver is the
tests' too (bench/receiver.py: answers, answers 500, or holds each request until it is
stopped).
"""

from __future__ import annotations

from typing import Any

from bench import runs
from bench.receiver import Receiver
from bench.suites import Bench, interleaved, intervals, median, ratio_rows, steady

MODES = ("ok", "error", "hang")


def notify(b: Bench, rounds: int = 2) -> dict[str, Any]:
    codes: dict[str, list[int]] = {m: [] for m in MODES}

    def step_seconds(mode: str, i: int) -> float:
        work = b.work(f"notify-{mode}-{i}")
        with Receiver(mode) as webhook:
            env = runs.zt_env(work, b.model, b.data, steps=b.steps, zero_stage=2,
                              offload_optimizer="none", checkpoint_every_steps=2,
                              checkpoints_keep=1, notify_url=webhook.url,
                              notify_timeout_seconds=2)  # fmt: skip
            run = runs.run_product(work, env, check=False)
        codes[mode].append(run.code)
        return median(steady(intervals(run.steps), b.warmup))

    seconds, ratios = interleaved(MODES, rounds, step_seconds)
    return {
        "setup": "ZeRO-2, 2 ranks, fp32, micro-batch 2, a checkpoint (and its event) every 2 "
        "steps, ZT_NOTIFY_TIMEOUT_SECONDS=2",
        "rounds": rounds,
        "exit_codes": codes,
        "step_seconds": seconds,
        "step_time_vs_answering": {m: median(ratios[m]) for m in MODES},
        "step_time_vs_answering_rounds": ratios,
    }


def markdown(r: dict[str, Any]) -> list[str]:
    """The report's section (bench/report.py)."""
    out = [
        "## Notifications (ZT_NOTIFY_URL): step time with a webhook that answers, fails or hangs",
        "",
        f"{r['setup']}; {r['rounds']} interleaved rounds.",
        "",
        "| receiver | exit codes | s/step (median) | vs answering (median of rounds) | rounds |",
        "|---|---|---:|---:|---|",
    ]
    out += ratio_rows(MODES, r["step_seconds"], r["step_time_vs_answering_rounds"],
                      extra=lambda mode: str(r["exit_codes"][mode]))  # fmt: skip
    return [*out, ""]
