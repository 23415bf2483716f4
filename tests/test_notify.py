"""Notifications (ZT_NOTIFY_URL, issue 46): a real run's start, checkpoints, samples and finish
reach a webhook through apprise, while a hanging endpoint and one answering 500 change neither
the exit code nor the other's events (the same run is tracked: TensorBoard and W&B offline);
a bad URL is one line, exit 2, not shown; the URL never reaches the log. (Failures: exit 4 in
test_nonfinite, exit 143 in test_entrypoint_train.)"""

from __future__ import annotations

import base64
import io
import logging
import subprocess
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from trainkit import ENTRYPOINT, entrypoint_env
from wandbkit import wandb_history

from bench.receiver import Receiver
from zerotuner.errors import ConfigError
from zerotuner.monitor.logs import setup_logging
from zerotuner.publish.notify import Event, Notifier, secret_parts, targets


def test_a_url_no_notifier_takes_is_named_by_position_not_shown():
    with pytest.raises(ConfigError) as caught:
        targets("https://hooks.example.com/ok not-a-url-s3cr3t", timeout_seconds=5)
    line = str(caught.value)
    assert line.startswith("ZT_NOTIFY_URL: entry 2 of 2 is no URL a notifier takes"), line
    assert "s3cr3t" not in line and "example" not in line


def test_each_target_has_its_own_sender_and_a_dead_one_is_bounded(tmp_path, caplog):
    """A hanging endpoint holds back nobody else's events, and the end waits one timeout at
    most; an endpoint answering 500 is tried again, then given up with a warning."""
    caplog.set_level(logging.INFO)
    with Receiver() as good, Receiver("hang") as hang, Receiver("error") as bad:
        found = targets(f"{hang.url} {bad.url},{good.url}", timeout_seconds=1)
        assert [t.name for t in found] == ["JSON #1", "JSON #2", "JSON #3"]
        news = Notifier(found, tmp_path, timeout_seconds=1, backoff_seconds=(0.1,)).start()
        for n in range(3):
            news.send(Event("checkpoint", f"checkpoint {n}"))
        started = time.monotonic()
        news.finish(2, "ZT_THING=x: expected y")
        assert time.monotonic() - started < 5
        assert good.titles() == ["zerotuner: checkpoint"] * 3 + ["zerotuner: failure"]
        assert good.bodies[-1]["message"] == (
            "exit 2: a setting or an input is wrong (a retry will not help): ZT_THING=x: expected y"
        )
        assert good.bodies[-1]["type"] == "failure"
        assert bad.requests == 4 * 2  # each event tried twice (one backoff)
        assert "notification checkpoint to JSON #2 not delivered after 2 tries" in caplog.text
        assert "notifications to JSON #1 still unsent" in caplog.text


def test_the_url_and_its_parts_never_reach_the_log(tmp_path):
    """apprise logs the URL it posts to at DEBUG: the whole value and its token are masked."""
    stream = io.StringIO()
    with Receiver() as good:
        url = f"{good.url}/tok3n-0123456789?key=k3y-abcdefgh"
        setup_logging(level=logging.DEBUG, secrets=secret_parts(url), stream=stream)
        news = Notifier(targets(url, timeout_seconds=5), tmp_path, timeout_seconds=5).start()
        news.finish(0)
        assert good.titles() == ["zerotuner: finish"]
    text = stream.getvalue()
    assert "POST" in text or "JSON" in text, text  # apprise said something at DEBUG
    assert "tok3n-0123456789" not in text and "k3y-abcdefgh" not in text, text


@pytest.mark.slow
def test_a_run_tells_and_tracks_its_start_checkpoints_samples_and_finish(demo_dir, tmp_path):
    with Receiver() as good, Receiver("hang") as hang, Receiver("error") as bad:
        env = entrypoint_env(
            demo_dir, tmp_path, ZT_MAX_STEPS="2", ZT_CHECKPOINT_EVERY_STEPS="1",
            ZT_VALIDATION_PROMPTS='["a red square"]', ZT_VALIDATION_INFERENCE_STEPS="2",
            ZT_NOTIFY_URL=f"{good.url} {hang.url} {bad.url}", ZT_NOTIFY_TIMEOUT_SECONDS="2",
            ZT_REPORT_TO="tensorboard,wandb", ZT_WANDB_MODE="offline",
        )  # fmt: skip
        done = subprocess.run([ENTRYPOINT, "train"], env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        out = done.stdout + done.stderr
        assert done.returncode == 0, out[-4000:]
        assert good.titles() == [
            f"zerotuner: {kind}"
            for kind in ("start", "checkpoint", "checkpoint", "samples", "finish")
        ], out
        start, first, _, samples, finish = good.bodies
        assert start["message"].startswith("sdxl full training, 2 steps, 2 rank(s): ZeRO-")
        assert first["message"].startswith("checkpoint at step 1 committed")
        assert samples["message"].startswith("samples at step 2: 1 image(s)")
        (image,) = samples["attachments"]
        assert base64.b64decode(image["base64"])[:8] == b"\x89PNG\r\n\x1a\n"
        assert finish["type"] == "success" and "final" in finish["message"]
        assert hang.requests >= 1 and bad.requests >= 1
    assert "notifications to JSON #1, JSON #2, JSON #3" in out
    assert "Unparseable URL" not in out  # apprise's noise while a plain webhook is tried
    # the same run, tracked (ZT_REPORT_TO): TensorBoard's reader and W&B's records hold the
    # curve and the sample (test_trackers reads every name)
    events = EventAccumulator(str(tmp_path / "output" / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]
    assert [e.step for e in events.Images("samples/00-a-red-square")] == [2]
    rows, _ = wandb_history(tmp_path / "output")
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2], rows
    assert [r["step"] for r in rows if "samples/00-a-red-square/path" in r] == [2], rows
    records = [p for p in (tmp_path / "output").rglob("*") if p.suffix in (".json", ".jsonl")]
    for url in (good.url, hang.url, bad.url):
        assert url not in out
        assert not [p for p in records if url in p.read_text()]


@pytest.mark.parametrize("command", ["check", "config"])
def test_check_and_config_refuse_a_url_no_notifier_takes(demo_job_env, capsys, command):
    from zerotuner.cli import main

    url = "nope://secret-token@example.invalid"
    demo_job_env.setenv("ZT_NOTIFY_URL", url)
    assert main([command]) == 2
    out = capsys.readouterr()
    assert "ZT_NOTIFY_URL: the value is no URL a notifier takes" in out.out + out.err
    assert "secret-token" not in out.out + out.err
