"""The seed's method 3: an `accelerate config` YAML (ZT_ACCELERATE_CONFIG).

Each accelerate key lands where the issue maps it (a DeepSpeed field or a launch setting);
a high-level ZT_* setting the user set explicitly wins over it, and each override is reported.
The seed's own YAML and the multi-machine launch keys are covered in test_settings.py.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import trainkit as tk

from zerotuner.cli import main
from zerotuner.errors import ConfigError
from zerotuner.settings.inputs import UserInputs, apply_implied_settings, read_user_inputs
from zerotuner.settings.schema import Settings, load_settings


def write_accelerate(monkeypatch, tmp_path: Path, text: str) -> Path:
    path = tmp_path / "default_config.yaml"
    path.write_text("distributed_type: DEEPSPEED\n" + textwrap.dedent(text))
    monkeypatch.setenv("ZT_ACCELERATE_CONFIG", str(path))
    return path


def read(monkeypatch, tmp_path: Path, text: str, **env: str) -> tuple[Settings, UserInputs]:
    write_accelerate(monkeypatch, tmp_path, text)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = load_settings()
    return settings, read_user_inputs(settings)


def messages(inputs: UserInputs, level: str) -> list[str]:
    return [n.message for n in inputs.notes.notes if n.level == level]


# --- deepspeed_config.* -> the DeepSpeed config ---------------------------------------------

NVME = {"device": "nvme"}


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ("gradient_clipping: 0.3", {"gradient_clipping": 0.3}),
        (
            "offload_optimizer_device: nvme\n  offload_optimizer_nvme_path: /nvme/opt",
            {"zero_optimization": {"offload_optimizer": NVME | {"nvme_path": "/nvme/opt"}}},
        ),
        (
            "offload_param_device: nvme\n  offload_param_nvme_path: /nvme/param",
            {"zero_optimization": {"offload_param": NVME | {"nvme_path": "/nvme/param"}}},
        ),
        (
            "zero3_save_16bit_model: false",
            {"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": False}},
        ),
        ("zero3_init_flag: true", {}),  # zerotuner loads the UNet itself: reported, not mapped
    ],
)  # fmt: skip
def test_deepspeed_config_keys_map_to_their_deepspeed_fields(
    monkeypatch, tmp_path, block, expected
):
    _, inputs = read(monkeypatch, tmp_path, f"deepspeed_config:\n  {block}\n")
    assert inputs.deepspeed == expected
    assert not messages(inputs, "warning")  # every one of them is a known accelerate key


def test_zero3_init_flag_is_explained_not_ignored_silently(monkeypatch, tmp_path):
    _, inputs = read(monkeypatch, tmp_path, "deepspeed_config:\n  zero3_init_flag: true\n")
    (note,) = messages(inputs, "info")
    assert "deepspeed_config.zero3_init_flag: zerotuner loads the UNet itself" in note


def test_an_unknown_deepspeed_config_key_is_warned_about(monkeypatch, tmp_path):
    _, inputs = read(monkeypatch, tmp_path, "deepspeed_config:\n  zero_stag: 2\n")
    assert inputs.deepspeed == {}
    assert messages(inputs, "warning") == [
        f"ZT_ACCELERATE_CONFIG={tmp_path / 'default_config.yaml'}: deepspeed_config.zero_stag "
        "is not an accelerate key; ignored"
    ]


@pytest.mark.parametrize(
    ("precision", "bf16", "fp16"),
    [("bf16", True, False), ("fp16", False, True), ("'no'", False, False), ("BF16", True, False)],
)
def test_mixed_precision_maps_to_the_bf16_and_fp16_sections(
    monkeypatch, tmp_path, precision, bf16, fp16
):
    _, inputs = read(monkeypatch, tmp_path, f"mixed_precision: {precision}\n")
    assert inputs.deepspeed == {"bf16": {"enabled": bf16}, "fp16": {"enabled": fp16}}


def test_deepspeed_config_file_by_absolute_path_with_the_block_applied_over_it(
    monkeypatch, tmp_path
):
    ds = tmp_path / "elsewhere" / "ds.json"
    ds.parent.mkdir()
    ds.write_text('{"zero_optimization": {"stage": 2}, "gradient_clipping": 0.1}')
    _, inputs = read(
        monkeypatch, tmp_path,
        f"deepspeed_config:\n  deepspeed_config_file: {ds}\n  zero_stage: 3\n",
    )  # fmt: skip
    assert inputs.deepspeed == {"zero_optimization": {"stage": 3}, "gradient_clipping": 0.1}
    assert any(f"DeepSpeed config read from {ds}" in m for m in messages(inputs, "info"))


@pytest.mark.parametrize("value", ["none", "null", "''"])
def test_deepspeed_config_file_none_means_no_file(monkeypatch, tmp_path, value):
    text = f"deepspeed_config:\n  deepspeed_config_file: {value}\n  zero_stage: 1\n"
    _, inputs = read(monkeypatch, tmp_path, text)
    assert inputs.deepspeed == {"zero_optimization": {"stage": 1}}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("missing.json", "deepspeed_config.deepspeed_config_file={dir}/missing.json: no such file"),
        ("5", "deepspeed_config.deepspeed_config_file=5: expected the path of a DeepSpeed JSON"),
        ("'[1]'", "expected a JSON object, got list"),
    ],
)
def test_deepspeed_config_file_errors_name_the_accelerate_key(
    monkeypatch, tmp_path, value, expected
):
    (tmp_path / "[1]").write_text("[1]")
    with pytest.raises(ConfigError) as info:
        read(monkeypatch, tmp_path, f"deepspeed_config:\n  deepspeed_config_file: {value}\n")
    (line,) = info.value.problems
    assert line.startswith(f"ZT_ACCELERATE_CONFIG={tmp_path / 'default_config.yaml'}: ")
    assert expected.format(dir=tmp_path) in line
    assert "ZT_DEEPSPEED_CONFIG" not in line  # the user did not set that one


def test_zt_deepspeed_config_is_applied_over_the_accelerate_fields(monkeypatch, tmp_path):
    _, inputs = read(
        monkeypatch, tmp_path, "deepspeed_config:\n  zero_stage: 2\n  gradient_clipping: 0.3\n",
        ZT_DEEPSPEED_CONFIG='{"zero_optimization": {"stage": 3}}',
    )  # fmt: skip
    assert inputs.deepspeed == {"zero_optimization": {"stage": 3}, "gradient_clipping": 0.3}
    assert "ZT_DEEPSPEED_CONFIG (inline JSON)" in inputs.source
    assert any("applied over the accelerate config" in m for m in messages(inputs, "info"))


# --- launch keys -> launch settings -----------------------------------------------------------

LAUNCH = """\
num_machines: 2
num_processes: 8
machine_rank: 1
main_process_ip: 10.1.2.3
main_process_port: 29555
"""


@pytest.mark.parametrize(
    ("env", "value", "from_file"),
    [
        ("ZT_NUM_PROCESSES", "2", "num_processes=4"),
        ("ZT_NNODES", "4", "nnodes=2"),
        ("ZT_NODE_RANK", "0", "node_rank=1"),
        ("ZT_MASTER_ADDR", "node0", "master_addr='10.1.2.3'"),
        ("ZT_MASTER_PORT", "29600", "master_port=29555"),
    ],
)
def test_an_explicit_launch_setting_wins_and_the_override_is_reported(
    monkeypatch, tmp_path, env, value, from_file
):
    settings, inputs = read(monkeypatch, tmp_path, LAUNCH, **{env: value})
    merged = apply_implied_settings(settings, inputs)
    field = env.removeprefix("ZT_").lower()
    assert str(getattr(merged, field)) == value
    expected = {
        "num_processes": 4, "nnodes": 2, "node_rank": 1,
        "master_addr": "10.1.2.3", "master_port": 29555,
    }  # fmt: skip
    assert {k: getattr(merged, k) for k in expected if k != field} == {
        k: v for k, v in expected.items() if k != field
    }
    (change,) = messages(inputs, "change")
    assert (
        change == f"{env}={getattr(merged, field)!r} overrides the accelerate config's {from_file}"
    )


@pytest.mark.parametrize(
    ("text", "implied"),
    [
        ("num_processes: '4'\n", {"num_processes": 4}),  # a quoted number
        ("num_processes: 4.0\n", {"num_processes": 4}),
        ("num_processes: -1\n", {}),  # accelerate's "not set": ZT_NUM_PROCESSES or detected
        ("num_processes: null\nmachine_rank: null\n", {}),
        ("main_process_ip: ''\n", {}),
    ],
)
def test_launch_values_accelerate_writes_are_read(monkeypatch, tmp_path, text, implied):
    _, inputs = read(monkeypatch, tmp_path, text)
    assert inputs.settings == implied


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("num_machines: 0\n", "num_machines=0: expected a whole number >= 1"),
        ("num_machines: -2\nnum_processes: 4\n", "num_machines=-2: expected a whole number >= 1"),
        ("num_processes: 0\n", "num_processes=0: expected a whole number >= 1"),
        ("num_processes: 2.5\n", "num_processes=2.5: expected a whole number >= 1"),
        ("num_processes: many\n", "num_processes='many': expected a whole number >= 1"),
        ("num_processes: true\n", "num_processes=True: expected a whole number >= 1"),
        ("num_machines: 2\nnum_processes: 3\n",
         "num_processes=3 is not divisible by num_machines=2"),
        ("machine_rank: -1\n", "machine_rank=-1: expected a whole number >= 0"),
        ("num_machines: 2\nmachine_rank: 2\n", "machine_rank=2 is outside 0..1 (num_machines=2)"),
        ("main_process_port: 0\n", "main_process_port=0: expected a whole number 1..65535"),
        ("main_process_port: 70000\n", "main_process_port=70000: expected a whole number 1..65535"),
        ("main_process_ip: [10, 0]\n", "main_process_ip=[10, 0]: expected a host name or IP"),
    ],
)  # fmt: skip
def test_launch_values_a_setting_would_refuse_are_errors(monkeypatch, tmp_path, text, expected):
    # They fill settings without the settings' own validation, so inputs.py checks them.
    with pytest.raises(ConfigError) as info:
        read(monkeypatch, tmp_path, text)
    (line,) = info.value.problems
    assert line == f"ZT_ACCELERATE_CONFIG={tmp_path / 'default_config.yaml'}: {expected}"


# --- end to end: `zerotuner config` --------------------------------------------------------------


def run_config(monkeypatch, capsys, tmp_path, block: str, **env: str):
    """`zerotuner config --explain` on this CPU without a model (the built-in SDXL config)."""
    write_accelerate(monkeypatch, tmp_path, block)
    code, out, err = tk.config_explain(monkeypatch, capsys, tmp_path, **env)
    assert code == 0, err
    return json.loads(out), err


def zero(config):
    return config["zero_optimization"]


OVERRIDES = [
    pytest.param(
        "deepspeed_config:\n  zero_stage: 2\n", {"ZT_ZERO_STAGE": "1"},
        lambda c: zero(c)["stage"], 2, 1,
        "change: zero_optimization.stage 2 -> 1 (ZT_ZERO_STAGE=1)",
        id="zero_stage",
    ),
    pytest.param(
        "deepspeed_config:\n  gradient_accumulation_steps: 4\n",
        {"ZT_GRADIENT_ACCUMULATION_STEPS": "2"},
        lambda c: c["gradient_accumulation_steps"], 4, 2,
        "change: ZT_GRADIENT_ACCUMULATION_STEPS=2 overrides gradient_accumulation_steps=4 "
        "from ZT_ACCELERATE_CONFIG=",
        id="gradient_accumulation_steps",
    ),
    pytest.param(
        "deepspeed_config:\n  gradient_clipping: 0.25\n", {"ZT_GRADIENT_CLIPPING": "0.5"},
        lambda c: c["gradient_clipping"], 0.25, 0.5,
        "change: ZT_GRADIENT_CLIPPING=0.5 overrides gradient_clipping=0.25 "
        "from ZT_ACCELERATE_CONFIG=",
        id="gradient_clipping",
    ),
    pytest.param(
        "mixed_precision: bf16\n", {"ZT_MIXED_PRECISION": "no"},
        lambda c: c["bf16"]["enabled"], True, False,
        "change: ZT_MIXED_PRECISION=no overrides bf16 in config",
        id="mixed_precision",
    ),
    pytest.param(
        "mixed_precision: 'no'\n", {"ZT_MIXED_PRECISION": "bf16"},
        lambda c: c["bf16"]["enabled"], False, True,
        "ZT_MIXED_PRECISION=bf16 overrides",
        id="mixed_precision-no",
    ),
    pytest.param(
        "deepspeed_config:\n  zero_stage: 2\n  offload_optimizer_device: cpu\n",
        {"ZT_OFFLOAD_OPTIMIZER": "none"},
        lambda c: zero(c).get("offload_optimizer", {}).get("device"), "cpu", None,
        "change: zero_optimization.offload_optimizer.device cpu -> none",
        id="offload_optimizer_device",
    ),
    pytest.param(
        "deepspeed_config:\n  zero_stage: 3\n  offload_param_device: cpu\n",
        {"ZT_OFFLOAD_PARAM": "none"},
        lambda c: zero(c).get("offload_param", {}).get("device"), "cpu", None,
        "change: zero_optimization.offload_param.device cpu -> none",
        id="offload_param_device",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("block", "env", "get", "from_file", "overridden", "report"), OVERRIDES)
def test_the_accelerate_value_is_used_unless_a_setting_overrides_it_and_says_so(
    monkeypatch, capsys, tmp_path, block, env, get, from_file, overridden, report
):
    config, err = run_config(monkeypatch, capsys, tmp_path, block)
    assert get(config) == from_file
    assert "overrides" not in err and f"{from_file} ->" not in err
    config, err = run_config(monkeypatch, capsys, tmp_path, block, **env)
    assert get(config) == overridden
    assert report in err


@pytest.mark.parametrize("key", ["offload_optimizer", "offload_param"])
def test_an_accelerate_nvme_path_is_the_offload_dir_and_an_explicit_other_one_is_exit_2(
    monkeypatch, capsys, tmp_path, key
):
    swap = tmp_path / "fast"
    block = f"deepspeed_config:\n  zero_stage: 3\n  {key}_device: nvme\n  {key}_nvme_path: {swap}\n"
    config, err = run_config(monkeypatch, capsys, tmp_path, block, ZT_OFFLOAD_DIR=str(swap))
    assert (zero(config)[key]["device"], zero(config)[key]["nvme_path"]) == ("nvme", str(swap))
    assert "nvme_path" not in err  # one folder, named twice: nothing to say
    monkeypatch.delenv("ZT_OFFLOAD_DIR")  # the setting left at its default: the path wins
    assert main(["config", "--explain"]) == 0
    out, err = capsys.readouterr()
    assert zero(json.loads(out))[key]["nvme_path"] == str(swap)
    assert f"ZT_OFFLOAD_DIR={swap} from {key}_nvme_path in ZT_ACCELERATE_CONFIG=" in err
    monkeypatch.setenv("ZT_OFFLOAD_DIR", str(tmp_path / "offload"))  # both explicit, differing
    assert main(["config"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()
    assert f"ZT_OFFLOAD_DIR={tmp_path / 'offload'} and {key}_nvme_path in" in line
    assert f"({swap}) name different NVMe offload folders" in line


def test_zero3_save_16bit_model_false_is_turned_on_with_a_change(monkeypatch, capsys, tmp_path):
    block = "deepspeed_config:\n  zero_stage: 3\n  zero3_save_16bit_model: false\n"
    config, err = run_config(monkeypatch, capsys, tmp_path, block)
    assert zero(config)["stage3_gather_16bit_weights_on_model_save"] is True
    assert "change: stage3_gather_16bit_weights_on_model_save -> true (needed to export)" in err


def test_a_bad_launch_value_is_exit_2_not_a_config_for_zero_nodes(monkeypatch, capsys, tmp_path):
    write_accelerate(monkeypatch, tmp_path, "num_machines: 0\nnum_processes: 4\n")
    monkeypatch.setenv("ZT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ZT_DEVICE", "cpu")
    assert main(["config"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip().endswith("num_machines=0: expected a whole number >= 1")
