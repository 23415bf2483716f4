"""The builder answers what the CLI answers: `config --explain` and `plan --json` for the same
settings and hardware give the same JSON, lines and exit codes as the page's evaluation; and
the pieces around it (composing the DeepSpeed options, naming the field of an error, templates).
No browser here (tests/test_builder_page.py drives the page)."""

from __future__ import annotations

import json
import os

import pytest

from zerotuner.builder.evaluate import evaluate, fields_named
from zerotuner.builder.form import compose, form_fields
from zerotuner.builder.server import Templates
from zerotuner.cli import main
from zerotuner.errors import ConfigError

GPU24 = {"gpus": "1", "gpu_memory": "24GiB", "host_memory": "64GiB"}
H100X4 = {"gpus": "4", "gpu_memory": "80GiB", "host_memory": "512GiB"}

CASES = {
    "defaults, this machine": ({}, {}),
    "stage 2 on one 24 GiB GPU": ({"ZT_ZERO_STAGE": "2", "ZT_RESOLUTION": "1024"}, GPU24),
    "fp16 on 2 nodes without bf16": (
        {"ZT_NNODES": "2", "ZT_MIXED_PRECISION": "fp16", "ZT_TRAIN_BATCH_SIZE": "4"},
        H100X4 | {"bf16": "false"},
    ),
    "illegal pin": ({"ZT_ZERO_STAGE": "2", "ZT_OFFLOAD_PARAM": "cpu"}, GPU24),
    "unsafe optimizer swapped, cosine": (
        {
            "ZT_OPTIMIZER": "cpuadam",
            "ZT_LR_SCHEDULER": "cosine",
            "ZT_LR_WARMUP_STEPS": "10",
            "ZT_OFFLOAD_OPTIMIZER": "cpu",
        },
        GPU24,
    ),  # fmt: skip
    "refused optimizer": ({"ZT_OPTIMIZER": "OneBitAdam"}, GPU24),
    "bad value": ({"ZT_RESOLUTION": "abc", "ZT_MAX_STEPS": "0"}, GPU24),
    "misspelt setting": ({"ZT_ZERO_STAG": "2"}, GPU24),
    "lora": ({"ZT_TRAINING_TYPE": "lora", "ZT_LORA_RANK": "8"}, GPU24),
    "raw json, nvme at stage 3": (
        {
            "ZT_DEEPSPEED_CONFIG": '{"zero_optimization": {"stage": 3, "offload_param": '
            '{"device": "nvme"}}}',
            "ZT_OFFLOAD_DIR": "/mnt/nvme",
        },
        {"gpus": "1", "gpu_memory": "16GiB", "host_memory": "32GiB", "offload_disk": "2TB"},
    ),  # fmt: skip
    "gpus without memory": ({}, {"gpus": "2"}),
    "cpu accelerator, prompts": (
        {"ZT_VALIDATION_PROMPTS": '["a red circle", "a blue square"]', "ZT_MODEL_FAMILY": "sd1"},
        {"gpus": "0", "host_memory": "64GiB"},
    ),
}

FLAGS = {"gpus": "--gpus", "gpu_memory": "--gpu-memory", "host_memory": "--host-memory",
         "offload_disk": "--offload-disk"}  # fmt: skip


def cli(monkeypatch, capsys, env: dict[str, str], hardware: dict[str, str], *command: str):
    """One in-process CLI run with exactly `env` as settings: (exit code, stdout, our lines)."""
    with monkeypatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        flags = [f for k, v in hardware.items() if k in FLAGS for f in (FLAGS[k], v)]
        if "bf16" in hardware:
            flags.append("--bf16" if hardware["bf16"] == "true" else "--no-bf16")
        code = main([*command, *flags])
    out, err = capsys.readouterr()
    return code, out, [line for line in err.splitlines() if line.startswith("zerotuner: ")]


@pytest.mark.parametrize("case", CASES)
def test_the_builder_answers_what_config_and_plan_answer(case, monkeypatch, capsys, tmp_path):
    settings, hardware = CASES[case]
    settings = settings | {"ZT_CACHE_DIR": str(tmp_path / "cache")}  # nothing cached there
    result = evaluate({"settings": settings, "hardware": hardware})
    assert result["settings"] == settings  # nothing added, nothing dropped

    code, out, lines = cli(monkeypatch, capsys, settings, hardware, "config", "--explain")
    assert result["exit_code"] == code
    expected = [f"zerotuner: error: {e['line']}" for e in result["errors"]]
    if code == 0:
        assert json.loads(out) == result["config"]
        if result["described"]:
            expected.append(f"zerotuner: for described hardware: {result['described']}")
        expected += [f"zerotuner: {n['level']}: {n['message']}" for n in result["notes"]]
    assert lines == expected

    code, out, lines = cli(monkeypatch, capsys, settings, hardware, "plan", "--json")
    assert result["plan_exit_code"] == code
    if code == 0:
        assert json.loads(out) == result["plan"]
    else:
        assert lines == [f"zerotuner: error: {e['line']}" for e in result["plan_errors"]]


def test_the_cases_cover_valid_invalid_and_unfit_answers(tmp_path):
    codes = set()
    for settings, hardware in CASES.values():
        result = evaluate({"settings": settings, "hardware": hardware})
        codes |= {("config", result["exit_code"]), ("plan", result["plan_exit_code"])}
    assert codes >= {("config", 0), ("config", 2), ("plan", 0), ("plan", 2), ("plan", 3)}


def test_errors_name_the_fields_they_are_about():
    illegal = evaluate({"settings": CASES["illegal pin"][0], "hardware": GPU24})
    (error,) = illegal["errors"]
    assert error["fields"] == ["ZT_ZERO_STAGE", "ZT_OFFLOAD_OPTIMIZER", "ZT_OFFLOAD_PARAM"]
    assert fields_named("optimizer 'sgd' is unknown; valid: AdamW") == ["ZT_OPTIMIZER"]
    assert fields_named("--gpus=2 needs --gpu-memory, e.g. --gpu-memory 24GiB") == [
        "hw.gpus",
        "hw.gpu_memory",
    ]
    assert fields_named("train_batch_size=8 is not divisible by ...") == ["ZT_TRAIN_BATCH_SIZE"]
    assert fields_named("the hardware planned for cannot run it") == []
    every = {f["name"] for s in form_fields() for f in s["fields"]}
    for name in ("ZT_ZERO_STAGE", "ZT_OPTIMIZER", "ZT_LR_SCHEDULER", "ZT_DEEPSPEED_CONFIG"):
        assert name in every


def test_form_covers_the_issues_fields_with_their_declared_choices():
    fields = {f["name"]: f for s in form_fields() for f in s["fields"]}
    assert fields["ZT_ZERO_STAGE"]["choices"] == ["auto", "0", "1", "2", "3"]
    assert fields["ZT_OFFLOAD_PARAM"]["choices"] == ["auto", "none", "cpu", "nvme"]
    assert fields["ZT_GRADIENT_CHECKPOINTING"]["choices"] == ["auto", "true", "false"]
    assert fields["ZT_TRAINING_TYPE"]["choices"] == ["full", "lora"]
    assert fields["ZT_RESOLUTION"]["kind"] == "text"  # any text reaches the server's check
    for name in ("ZT_LORA_RANK", "ZT_LORA_TARGETS", "ZT_OFFLOAD_DIR", "ZT_GRADIENT_CLIPPING",
                 "ZT_VALIDATION_PROMPTS", "ZT_CHECKPOINT_EVERY_STEPS", "ZT_NNODES", "hw.gpus",
                 "ds.betas", "ds.quantized_weights", "ds.hpz_partition_size"):  # fmt: skip
        assert name in fields, name


def test_deepspeed_options_become_the_keys_deepspeed_reads():
    composed = compose({
        "settings": {"ZT_LR_SCHEDULER": "cosine", "ZT_OPTIMIZER": "AdamW"},
        "deepspeed": {"betas": "0.9, 0.98", "eps": "1e-6", "cos_min_ratio": "0.1",
                      "warmup_min_lr": "0.0", "quantized_weights": "true"},
    })  # fmt: skip
    raw = json.loads(composed.env["ZT_DEEPSPEED_CONFIG"])
    assert raw == {
        "optimizer": {"params": {"betas": [0.9, 0.98], "eps": 1e-6}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"cos_min_ratio": 0.1}},
        "zero_optimization": {"zero_quantized_weights": True},
    }
    # An explicit ZT_LR_SCHEDULER would replace the section: the JSON names it instead.
    assert "ZT_LR_SCHEDULER" not in composed.env
    assert composed.notes == ["warmup_min_lr left out: scheduler WarmupCosineLR does not read it"]
    result = evaluate({"settings": {"ZT_LR_SCHEDULER": "cosine"}, "hardware": GPU24,
                       "deepspeed": {"cos_min_ratio": "0.1", "betas": "0.8 0.9"}})  # fmt: skip
    assert result["exit_code"] == 0
    assert result["config"]["scheduler"]["params"]["cos_min_ratio"] == 0.1
    assert result["config"]["optimizer"]["params"]["betas"] == [0.8, 0.9]

    lion = compose({"settings": {"ZT_OPTIMIZER": "lion"}, "deepspeed": {"eps": "1e-6"}})
    assert "ZT_DEEPSPEED_CONFIG" not in lion.env  # Lion takes no eps: DeepSpeed would crash
    with pytest.raises(ConfigError, match=r"ds.betas='0.9': expected two numbers"):
        compose({"deepspeed": {"betas": "0.9"}})


def test_a_template_name_cannot_leave_the_folder(tmp_path):
    folder = tmp_path / "templates"
    templates = Templates(folder)
    form = {"settings": {"ZT_ZERO_STAGE": "3"}, "deepspeed": {}, "hardware": {"gpus": "2"}}
    templates.save("sdxl-24gb_v1.0", form)
    assert templates.names() == ["sdxl-24gb_v1.0"]
    assert templates.load("sdxl-24gb_v1.0") == form
    for name in ("../escape", "a/b", "..", ".hidden", "/etc/passwd", "x" * 65, "a\\b", ""):
        with pytest.raises(ConfigError, match="template name"):
            templates.save(name, form)
    (folder / "out.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(ConfigError, match="leads outside"):
        templates.save("out", form)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["templates"]


def test_the_form_is_the_whole_configuration_but_for_where_this_machine_caches(monkeypatch):
    from zerotuner.builder.evaluate import EMPTY_CONFIG, form_environ

    monkeypatch.setenv("ZT_ZERO_STAGE", "3")  # the builder's own shell: not the form's job
    monkeypatch.setenv("ZT_CACHE_DIR", "/srv/hf-cache")
    environ = form_environ({"ZT_MAX_STEPS": "10"})
    zt = {k: v for k, v in environ.items() if k.startswith("ZT_")}
    assert environ["HF_HUB_OFFLINE"] == "1"
    assert zt == {
        "ZT_MAX_STEPS": "10",
        "ZT_CACHE_DIR": "/srv/hf-cache",
        "ZT_CONFIG_FILE": EMPTY_CONFIG,  # read as an empty mapping: the form is the config
        "ZT_SECRETS_DIR": os.devnull,  # no secret file: a form is evaluated without the token
    }
    assert os.environ["ZT_ZERO_STAGE"] == "3"  # the process's own, untouched
