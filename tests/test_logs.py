"""Logging setup and the progress sink: rank filtering, formats, secret masking, progress lines."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import textwrap
import warnings

import pytest
from PIL import Image

from zerotuner.launch.records import StepRecord
from zerotuner.monitor.logs import (
    ProgressSink,
    demote_known_noise,
    format_duration,
    mask,
    rank_level,
    secret_values,
    setup_logging,
)
from zerotuner.monitor.metrics import DeviceMemory

SECRET = "hf_zt_l0gSecretValue42"


@pytest.fixture(autouse=True)
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


class GpuProbe:
    gpu_uuid = "GPU-0000"

    def sample(self) -> DeviceMemory:
        return DeviceMemory(3 << 30, 4 << 30, 5 << 30, 24 << 30, gpu_uuid=self.gpu_uuid)


def records(n: int, *, start: int = 0, seconds: float = 2.0, t0: float = 1000.0):
    for i in range(1, n + 1):
        step = start + i
        yield StepRecord(step, 1.0 / step, 1e-4, 0.5, seconds, 16, t0 + i * seconds)


def test_rank_zero_logs_info_other_ranks_only_warnings():
    out0, out1 = io.StringIO(), io.StringIO()
    log = logging.getLogger("zerotuner.test")
    setup_logging(rank=0, world_size=2, stream=out0)
    log.info("hello from zero")
    setup_logging(rank=1, world_size=2, stream=out1)
    log.info("hello from one")
    log.error("broken on one")
    assert "[rank 0] zerotuner.test: hello from zero" in out0.getvalue()
    assert "hello from one" not in out1.getvalue()
    assert "ERROR [rank 1] zerotuner.test: broken on one" in out1.getvalue()


def test_single_rank_lines_have_no_rank_prefix():
    out = io.StringIO()
    setup_logging(rank=0, world_size=1, stream=out)
    logging.getLogger("zerotuner").info("plain")
    assert "INFO zerotuner: plain" in out.getvalue()
    assert "[rank" not in out.getvalue()


def test_json_lines_parse_and_carry_the_fields():
    out = io.StringIO()
    setup_logging(rank=3, world_size=4, log_format="json", level=logging.INFO, stream=out)
    log = logging.getLogger("zerotuner.train.loop")
    log.info("step %d", 7)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(x["level"], x["rank"], x["logger"], x["msg"]) for x in lines] == [
        ("INFO", 3, "zerotuner.train.loop", "step 7"),
        ("ERROR", 3, "zerotuner.train.loop", "failed"),
    ]
    assert lines[0]["ts"].endswith("Z")
    assert "RuntimeError: boom" in lines[1]["exc"]


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_secret_values_never_reach_the_log(monkeypatch, log_format):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    out = io.StringIO()
    setup_logging(rank=0, log_format=log_format, secrets=["file-secret-xyz"], stream=out)
    log = logging.getLogger("zerotuner")
    log.info("token is %s", SECRET)
    log.info("url https://user:file-secret-xyz@host")
    try:
        raise ValueError(f"bad token {SECRET}")
    except ValueError:
        log.exception("download failed")
    text = out.getvalue()
    assert SECRET not in text
    assert "file-secret-xyz" not in text
    assert text.count("***") == 3  # message, url, exception message


def test_secret_values_skip_trivial_ones():
    env = {"HF_TOKEN": "a", "WANDB_API_KEY": "abcdefgh", "OTHER": "zzzzzzzz"}
    assert secret_values(["abcdefghij", None, ""], environ=env) == ["abcdefghij", "abcdefgh"]
    assert mask("x abcdefghij y", ["abcdefghij", "abcdefgh"]) == "x *** y"


def test_library_loggers_with_own_handlers_are_routed_through_ours():
    library = logging.getLogger("DeepSpeed")
    own = io.StringIO()
    library.addHandler(logging.StreamHandler(own))
    library.propagate = False
    library.setLevel(logging.INFO)
    out = io.StringIO()
    setup_logging(rank=1, world_size=2, stream=out)
    library.info("rank 1 chatter")
    library.warning("rank 1 trouble")
    assert own.getvalue() == ""
    assert "rank 1 chatter" not in out.getvalue()
    assert "WARNING [rank 1] DeepSpeed: rank 1 trouble" in out.getvalue()


@pytest.mark.slow
def test_a_rank_process_logs_through_the_real_deepspeed_logger(tmp_path):
    """DeepSpeed's own logger (stdout handler, no propagation) is adopted in a real process."""
    code = textwrap.dedent(
        """
        import os
        os.environ["DS_ACCELERATOR"] = "cpu"
        from deepspeed.utils import logger
        from zerotuner.monitor.logs import setup_logging
        setup_logging(rank=1, world_size=2, log_format="json")
        logger.info("info from deepspeed")
        logger.warning("warning from deepspeed HF-%s" % os.environ["HF_TOKEN"])
        """
    )
    env = {"HF_TOKEN": SECRET, "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(x) for x in result.stderr.splitlines() if x.startswith("{")]
    assert [(x["logger"], x["msg"]) for x in lines] == [
        ("DeepSpeed", "warning from deepspeed HF-***")
    ]
    assert "info from deepspeed" not in result.stdout + result.stderr


# What the libraries print in a normal run, word for word, and what they may print that matters.
NOTICES = [
    ("DeepSpeed", "Attempting to get learning rate from scheduler before it has started"),
    ("transformers.utils.import_utils", "`CLIPImageProcessor` requires torchvision (not "
     "installed); falling back to `CLIPImageProcessorPil` for backward compatibility."),
    ("torch.utils.cpp_extension", "No CUDA runtime is found, using CUDA_HOME='/usr/local/cuda'"),
    ("matplotlib.font_manager", "generated new fontManager"),
]  # fmt: skip
DEPRECATED_GATHER = (
    "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
    "`torch.distributed.all_gather_single` instead."
)
RELEVANT = [
    ("DeepSpeed", "Gradient overflow. Skipping step, loss scale: 65536"),
    ("transformers.utils.import_utils", "tokenizer requires sentencepiece (not installed)"),
    ("torch.utils.cpp_extension", "Error building extension 'cpu_adam'"),
]


def _emit_all() -> None:
    for name, text in NOTICES + RELEVANT:
        logging.getLogger(name).warning("%s", text)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn(DEPRECATED_GATHER, FutureWarning, stacklevel=1)
        warnings.warn("`upcast_vae` is deprecated and will be removed", FutureWarning, stacklevel=1)
        warnings.warn("the dataset has 3 images", UserWarning, stacklevel=1)


@pytest.mark.parametrize("level", [None, logging.WARNING])
def test_known_third_party_notices_are_held_back_and_the_rest_shows(level):
    out = io.StringIO()
    setup_logging(rank=0, world_size=2, level=level, stream=out)
    _emit_all()
    text = out.getvalue()
    for _, notice in NOTICES:
        assert notice not in text
    assert "all_gather_into_tensor" not in text
    for name, relevant in RELEVANT:
        assert f"WARNING [rank 0] {name}: {relevant}" in text
    assert "FutureWarning: `upcast_vae` is deprecated" in text
    assert "UserWarning: the dataset has 3 images" in text


def test_debug_level_shows_the_held_back_notices():
    out = io.StringIO()
    setup_logging(rank=1, world_size=2, level=rank_level("debug", 1), stream=out)
    _emit_all()
    text = out.getvalue()
    for name, notice in NOTICES:
        assert f"DEBUG [rank 1] {name}: {notice}" in text
    assert "DEBUG [rank 1] py.warnings: " in text and DEPRECATED_GATHER in text
    for name, relevant in RELEVANT:
        assert f"WARNING [rank 1] {name}: {relevant}" in text
    # but not PIL's debug lines for every chunk of every image read
    png = io.BytesIO()
    Image.new("RGB", (2, 2)).save(png, format="PNG")
    Image.open(png).load()
    assert "STREAM" not in out.getvalue()


def test_notices_printed_before_logging_is_set_up_are_held_back(monkeypatch, tmp_path):
    """At import time the libraries' own handlers (no level of their own) or basicConfig's
    would print them: the real cpp_extension notice of the CUDA image on a host with no GPU."""
    import torch
    from torch.utils import cpp_extension

    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the host has no GPU
    own = io.StringIO()
    library = logging.getLogger("torch.utils.cpp_extension")
    monkeypatch.setattr(library, "handlers", [logging.StreamHandler(own)])
    monkeypatch.setattr(library, "filters", [])  # as in a fresh process
    logging.getLogger().setLevel(logging.INFO)
    cpp_extension._find_cuda_home()
    assert "No CUDA runtime is found" in own.getvalue()  # what a user saw
    own.seek(0)
    own.truncate()
    demote_known_noise()
    cpp_extension._find_cuda_home()
    library.warning("Error building extension 'cpu_adam'")
    assert own.getvalue() == "Error building extension 'cpu_adam'\n"


def test_log_levels_per_rank():
    assert [rank_level("info", r) for r in (0, 1)] == [logging.INFO, logging.WARNING]
    assert [rank_level("debug", r) for r in (0, 1)] == [logging.DEBUG, logging.DEBUG]
    assert [rank_level("warning", r) for r in (0, 1)] == [logging.WARNING, logging.WARNING]


def test_progress_lines_without_a_terminal():
    out = io.StringIO()
    setup_logging(rank=0, stream=out)
    sink = ProgressSink(0, max_steps=25, every_steps=10, probe=GpuProbe(), stream=io.StringIO())
    for record in records(25):
        sink.on_step(record)
    sink.on_checkpoint(25, 3.25)
    sink.close()
    lines = [x for x in out.getvalue().splitlines() if "zerotuner.progress" in x]
    steps = [x.split("step ")[1].split(" ")[0] for x in lines if ": step " in x]
    assert steps == ["10/25", "20/25", "25/25"]
    first = lines[0]
    for part in ("loss 0.1000", "2.00 s/step", "8.0 samples/s", "ETA 0:00:30", "vram 3.0/24.0 GiB"):
        assert part in first
    assert "ETA 0:00:00" in lines[2]
    assert "checkpoint at step 25 committed in 3.2 s" in out.getvalue()


def test_progress_bar_on_a_terminal():
    bar = io.StringIO()
    sink = ProgressSink(0, max_steps=40, start_step=10, probe=GpuProbe(), stream=bar, tty=True)
    for record in records(20, start=10):
        sink.on_step(record)
    sink.close()
    assert "30/40" in bar.getvalue()
    assert "samples/s" in bar.getvalue()


def test_other_ranks_show_no_progress():
    out = io.StringIO()
    setup_logging(rank=0, stream=out)
    sink = ProgressSink(1, max_steps=5, every_steps=1, stream=out, tty=True)
    for record in records(5):
        sink.on_step(record)
    sink.close()
    assert out.getvalue() == ""


def test_cpu_progress_reports_process_memory():
    out = io.StringIO()
    setup_logging(rank=0, stream=out)
    sink = ProgressSink(0, max_steps=1, stream=io.StringIO())
    sink.on_step(next(records(1)))
    assert "| rss " in out.getvalue()


def test_durations():
    assert format_duration(3723.4) == "1:02:03"
    assert format_duration(2 * 86400 + 5) == "2d 0:00:05"
    assert format_duration(-3) == "0:00:00"


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="log_format"):
        setup_logging(log_format="xml")
