"""Property: whatever env, config file and DeepSpeed JSON a user gives, `zerotuner config`
ends in a valid DeepSpeed config (exit 0) or clear one-line errors (exit 2/3): never a
traceback, never a secret in the output.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from unittest import mock

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from zerotuner.cli import main

SECRET = "hf_FuzzSecretValue9"

words = st.sampled_from(
    ["auto", "none", "cpu", "nvme", "0", "1", "2", "3", "4", "-1", "1e8", "true", "false",
     "bf16", "fp16", "no", "AdamW", "lion", "cpuadam", "OneBitAdam", "sgd", "", " ", "[]",
     "{}", '{"a":', "0.5", "nan", "inf", "1e400", "cosine", "linear", "constant", "/tmp/x",
     "sdxl", "sd1", "text", "json", "ä", "\x00"]
)  # fmt: skip
setting_names = st.sampled_from(
    ["ZT_ZERO_STAGE", "ZT_OFFLOAD_OPTIMIZER", "ZT_OFFLOAD_PARAM", "ZT_MIXED_PRECISION",
     "ZT_OPTIMIZER", "ZT_TRAIN_BATCH_SIZE", "ZT_GRADIENT_ACCUMULATION_STEPS", "ZT_MAX_STEPS",
     "ZT_LEARNING_RATE", "ZT_LR_WARMUP_STEPS", "ZT_LR_SCHEDULER", "ZT_GRADIENT_CLIPPING",
     "ZT_NUM_PROCESSES", "ZT_NNODES", "ZT_RESOLUTION", "ZT_GRADIENT_CHECKPOINTING", "ZT_EMA",
     "ZT_MODEL_FAMILY", "ZT_VALIDATION_PROMPTS", "ZT_LOG_FORMAT", "ZT_MAX_STEPZ", "ZT_SERVICE_HOST"]
)  # fmt: skip
ds_keys = st.sampled_from(
    ["stage", "offload_optimizer", "offload_param", "device", "nvme_path", "buffer_size",
     "buffer_count", "pin_memory", "reduce_bucket_size", "train_batch_size",
     "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
     "optimizer", "scheduler", "type", "params", "lr", "max_grad_norm", "warmup_num_steps",
     "bf16", "fp16", "enabled", "aio", "thread_count", "zero_optimization", "bogus"]
)  # fmt: skip
scalars = st.one_of(
    words, st.integers(-3, 10**9), st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(), st.none(),
)  # fmt: skip
trees = st.recursive(
    scalars, lambda inner: st.dictionaries(ds_keys, inner, max_size=4), max_leaves=12
)


@settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "300")),
    deadline=None,
    derandomize=True,  # the same 300 cases every run: CI never fails on a newly drawn one
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    env=st.dictionaries(setting_names, words, max_size=5),
    deepspeed=st.one_of(st.none(), trees, st.text(max_size=40)),
    config_file=st.one_of(
        st.none(),
        st.dictionaries(st.sampled_from(["max_steps", "zero_stage", "optimizer", "maxsteps",
                                         "deepspeed_config", "resolution"]),
                        scalars, max_size=3),
        st.text(max_size=40),
    ),
)  # fmt: skip
def test_config_never_tracebacks_and_never_leaks(env, deepspeed, config_file, tmp_path, demo_dir):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ZT_")}
    environ.update({k: v for k, v in env.items() if "\x00" not in v})
    environ.update(
        ZT_MODEL=str(demo_dir / "model"), ZT_DEVICE="cpu", ZT_OFFLOAD_DIR=str(tmp_path),
        HF_TOKEN=SECRET, ZT_SECRETS_DIR=str(tmp_path / "none"),
    )  # fmt: skip
    if deepspeed is not None:
        text = deepspeed if isinstance(deepspeed, str) else json.dumps(deepspeed)
        if "\x00" not in text:
            environ["ZT_DEEPSPEED_CONFIG"] = text if text.strip().startswith("{") else "{" + text
    if config_file is not None:
        path = Path(tmp_path) / "zerotuner.yaml"
        body = config_file if isinstance(config_file, str) else json.dumps(config_file)
        path.write_text(body.replace("\x00", ""))
        environ["ZT_CONFIG_FILE"] = str(path)
    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.dict(os.environ, environ, clear=True),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        code = main(["config"])
    stdout, stderr = out.getvalue(), err.getvalue()
    event(f"exit {code}")
    assert "Traceback" not in stdout + stderr
    assert SECRET not in stdout + stderr
    if code == 0:
        config = json.loads(stdout)
        assert config["train_batch_size"] == (
            config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
        )
        assert "auto" not in json.dumps(config)
    else:
        assert code in (2, 3), (code, stderr)
        errors = [line for line in stderr.splitlines() if line.startswith("zerotuner: error: ")]
        assert errors, stderr
