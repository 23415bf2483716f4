"""Property: whatever env, config file, DeepSpeed JSON (inline or a file) and accelerate YAML a
user gives, `zerotuner config` ends in a valid DeepSpeed config (exit 0) or clear one-line
errors (exit 2/3): never a traceback, never a secret in the output.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path
from unittest import mock

import yaml
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
# An `accelerate config` YAML: its launch keys and its deepspeed_config block, with values
# accelerate writes mixed in so that a share of the files is valid.
accelerate_ds_block = st.dictionaries(
    st.sampled_from(
        ["zero_stage", "gradient_accumulation_steps", "gradient_clipping",
         "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path",
         "offload_param_nvme_path", "zero3_init_flag", "zero3_save_16bit_model",
         "deepspeed_config_file", "deepspeed_multinode_launcher", "bogus"]
    ),
    st.one_of(
        st.sampled_from([0, 1, 2, 3, 4, "none", "cpu", "nvme", True, False, 0.5, "auto",
                         "ds.json", "missing.json", "/path/to/nvme", "/nvme"]),
        scalars,
    ),
    max_size=5,
)  # fmt: skip
accelerate_files = st.dictionaries(
    st.sampled_from(
        ["distributed_type", "mixed_precision", "num_processes", "num_machines", "machine_rank",
         "main_process_ip", "main_process_port", "use_cpu", "deepspeed_config", "bogus"]
    ),
    st.one_of(
        st.sampled_from(["DEEPSPEED", "MULTI_GPU", "no", "bf16", "fp16", 1, 2, 4, 0, -1,
                         "10.0.0.1", 29500, 70000]),
        scalars,
        accelerate_ds_block,
    ),
    max_size=6,
)  # fmt: skip


@settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "300")),
    deadline=None,
    derandomize=True,  # the same 300 cases every run: CI never fails on a newly drawn one
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    env=st.dictionaries(setting_names, words, max_size=5),
    deepspeed=st.one_of(st.none(), trees, st.text(max_size=40)),
    deepspeed_as_file=st.booleans(),  # ZT_DEEPSPEED_CONFIG=<path> instead of inline text
    # A third of the cases (YAML syntax errors go through the same reader as the config file).
    accelerate=st.one_of(st.none(), st.none(), accelerate_files),
    secret_from=st.sampled_from(["env", "secrets_dir"]),
    config_file=st.one_of(
        st.none(),
        st.dictionaries(st.sampled_from(["max_steps", "zero_stage", "optimizer", "maxsteps",
                                         "deepspeed_config", "resolution"]),
                        scalars, max_size=3),
        st.text(max_size=40),
    ),
)  # fmt: skip
def test_config_never_tracebacks_and_never_leaks(
    env, deepspeed, deepspeed_as_file, accelerate, secret_from, config_file, tmp_path, demo_dir
):
    folder = Path(tempfile.mkdtemp(dir=tmp_path))  # this example's files only
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ZT_")}
    environ.pop("HF_TOKEN", None)
    environ.update({k: v for k, v in env.items() if "\x00" not in v})
    environ.update(
        ZT_MODEL=str(demo_dir / "model"), ZT_DEVICE="cpu", ZT_OFFLOAD_DIR=str(tmp_path),
        ZT_SECRETS_DIR=str(folder / "secrets"),
    )  # fmt: skip
    if secret_from == "env":
        environ["HF_TOKEN"] = SECRET
    else:
        (folder / "secrets").mkdir()
        (folder / "secrets" / "hf_token").write_text(SECRET + "\n")
    if deepspeed is not None:
        text = deepspeed if isinstance(deepspeed, str) else json.dumps(deepspeed)
        if deepspeed_as_file:
            (folder / "ds.json").write_text(text.replace("\x00", ""))
            environ["ZT_DEEPSPEED_CONFIG"] = str(folder / "ds.json")
        elif "\x00" not in text:
            environ["ZT_DEEPSPEED_CONFIG"] = text if text.strip().startswith("{") else "{" + text
    if accelerate is not None:
        # deepspeed_config_file: ds.json names the DeepSpeed JSON above when it is a file.
        path = folder / "accelerate.yaml"
        body = accelerate if isinstance(accelerate, str) else yaml.safe_dump(accelerate)
        path.write_text(body.replace("\x00", ""))
        environ["ZT_ACCELERATE_CONFIG"] = str(path)
    if config_file is not None:
        path = folder / "zerotuner.yaml"
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
    event(f"accelerate config: {type(accelerate).__name__}, exit {code}")
    event(f"DeepSpeed JSON as a file: {deepspeed is not None and deepspeed_as_file}")
    assert "Traceback" not in stdout + stderr
    assert SECRET not in stdout + stderr
    if code == 0:
        config = json.loads(stdout)
        per_rank = config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
        world = config["train_batch_size"] // per_rank  # ZT_NUM_PROCESSES x ZT_NNODES
        assert world >= 1 and config["train_batch_size"] == per_rank * world
        assert "auto" not in json.dumps(config)
    else:
        assert code in (2, 3), (code, stderr)
        errors = [line for line in stderr.splitlines() if line.startswith("zerotuner: error: ")]
        assert errors, stderr
