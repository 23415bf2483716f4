"""Settings sources and the seed's configuration methods 2 (DeepSpeed JSON) and 3 (accelerate)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from zerotuner.cli import main
from zerotuner.errors import ConfigError
from zerotuner.settings.effective import check_unknown_env
from zerotuner.settings.inputs import apply_implied_settings, read_user_inputs
from zerotuner.settings.schema import Settings, load_settings, masked_dump

SEED_ACCELERATE = textwrap.dedent(
    """\
    compute_environment: LOCAL_MACHINE
    debug: false
    deepspeed_config:
      gradient_accumulation_steps: 4
      zero3_init_flag: false
      zero_stage: 1
    distributed_type: DEEPSPEED
    downcast_bf16: 'no'
    machine_rank: 0
    main_training_function: main
    mixed_precision: bf16
    num_machines: 1
    num_processes: 1
    rdzv_backend: static
    same_network: true
    tpu_env: []
    tpu_use_cluster: false
    tpu_use_sudo: false
    use_cpu: false
    """
)


def error_lines(**env) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_settings(**env)
    return info.value.problems


def test_env_values_are_typed(monkeypatch):
    monkeypatch.setenv("ZT_MAX_STEPS", "12")
    monkeypatch.setenv("ZT_ZERO_STAGE", "3")
    monkeypatch.setenv("ZT_GRADIENT_CHECKPOINTING", "true")
    monkeypatch.setenv("ZT_VALIDATION_PROMPTS", "a red circle | a blue square")
    s = load_settings()
    assert (s.max_steps, s.zero_stage, s.gradient_checkpointing) == (12, 3, True)
    assert s.validation_prompts == ["a red circle", "a blue square"]
    assert {"max_steps", "zero_stage"} <= s.model_fields_set


def test_prompts_as_a_json_list(monkeypatch):
    monkeypatch.setenv("ZT_VALIDATION_PROMPTS", '["a, b", "c | d"]')
    assert load_settings().validation_prompts == ["a, b", "c | d"]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"ZT_MAX_STEPS": "ten"}, "ZT_MAX_STEPS='ten': expected a valid integer"),
        ({"ZT_ZERO_STAGE": "4"}, "ZT_ZERO_STAGE=4: expected 'auto' or 0, 1, 2 or 3"),
        ({"ZT_MIXED_PRECISION": "fp8"}, "expected 'auto', 'bf16', 'fp16' or 'no'"),
        ({"ZT_OFFLOAD_OPTIMIZER": "disk"}, "ZT_OFFLOAD_OPTIMIZER='disk'"),
        ({"ZT_LEARNING_RATE": "-1"}, "ZT_LEARNING_RATE='-1': expected greater than 0"),
    ],
)
def test_bad_values_name_the_variable_the_value_and_what_is_valid(monkeypatch, env, expected):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    (line,) = error_lines()
    assert expected in line


def test_every_problem_is_reported_at_once(monkeypatch):
    monkeypatch.setenv("ZT_MAX_STEPS", "x")
    monkeypatch.setenv("ZT_SEED", "y")
    assert len(error_lines()) == 2


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("zerotuner.yaml", "max_steps: 7\nzero_stage: 1\n"),
        ("zerotuner.json", '{"max_steps": 7, "ZT_ZERO_STAGE": 1}'),
        ("zerotuner.toml", "max_steps = 7\nzero_stage = 1\n"),
    ],
)
def test_config_file_formats(monkeypatch, tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    monkeypatch.setenv("ZT_CONFIG_FILE", str(path))
    s = load_settings()
    assert (s.max_steps, s.zero_stage) == (7, 1)


def test_env_wins_over_the_config_file(monkeypatch, tmp_path):
    path = tmp_path / "zerotuner.yaml"
    path.write_text("max_steps: 7\nlearning_rate: 0.5\n")
    monkeypatch.setenv("ZT_CONFIG_FILE", str(path))
    monkeypatch.setenv("ZT_MAX_STEPS", "9")
    s = load_settings()
    assert (s.max_steps, s.learning_rate) == (9, 0.5)


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("c.yaml", "max_steps: 7\n  bad: [1,\n", "invalid YAML at line 2"),
        ("c.json", '{"max_steps": 7,\n "x": }', "invalid JSON at line 2, column 7"),
        ("c.toml", "max_steps = \n", "invalid TOML"),
    ],
)
def test_config_file_syntax_errors_give_line_and_column(monkeypatch, tmp_path, name, text, where):
    path = tmp_path / name
    path.write_text(text)
    monkeypatch.setenv("ZT_CONFIG_FILE", str(path))
    (line,) = error_lines()
    assert where in line and str(path) in line


@pytest.mark.parametrize("value", ["2020-13-01", "!!int hf_secret_value", "!!timestamp x"])
def test_a_yaml_value_pyyaml_cannot_construct_is_one_line_without_the_value(
    monkeypatch, tmp_path, value
):
    path = tmp_path / "c.yaml"
    path.write_text(f"hf_token: {value}\n")
    monkeypatch.setenv("ZT_CONFIG_FILE", str(path))
    (line,) = error_lines()
    assert "invalid YAML" in line and str(path) in line
    assert "hf_secret_value" not in line


def test_unknown_config_key_suggests_the_right_one(monkeypatch, tmp_path):
    path = tmp_path / "zerotuner.yaml"
    path.write_text("max_stepz: 7\n")
    monkeypatch.setenv("ZT_CONFIG_FILE", str(path))
    (line,) = error_lines()
    assert "unknown setting 'max_stepz'" in line and "did you mean 'max_steps'" in line


def test_missing_config_file_named_explicitly_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("ZT_CONFIG_FILE", str(tmp_path / "nope.yaml"))
    (line,) = error_lines()
    assert "no such file" in line


def test_misspelt_env_variable_is_an_error_with_a_suggestion(monkeypatch):
    monkeypatch.setenv("ZT_MAX_STEPZ", "3")
    with pytest.raises(ConfigError) as info:
        check_unknown_env()
    assert info.value.problems == ["ZT_MAX_STEPZ: unknown setting (did you mean 'ZT_MAX_STEPS'?)"]


def test_kubernetes_service_variables_are_only_warned_about(monkeypatch, caplog):
    monkeypatch.setenv("ZT_SERVICE_HOST", "10.0.0.1")  # a Service named "zt" injects these
    check_unknown_env()
    assert "ZT_SERVICE_HOST is not a zerotuner setting" in caplog.text


def test_secret_from_a_docker_secrets_file_is_read_and_masked(monkeypatch, tmp_path):
    (tmp_path / "hf_token").write_text("hf_SeCrEt123\n")
    monkeypatch.setenv("ZT_SECRETS_DIR", str(tmp_path))
    s = load_settings()
    assert s.hf_token.get_secret_value() == "hf_SeCrEt123"
    assert "hf_SeCrEt123" not in repr(s) and "hf_SeCrEt123" not in json.dumps(masked_dump(s))


def test_hf_token_env_is_accepted(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    assert load_settings().hf_token.get_secret_value() == "hf_env"


def test_stray_secret_files_do_not_change_settings(monkeypatch, tmp_path):
    (tmp_path / "max_steps").write_text("1")
    monkeypatch.setenv("ZT_SECRETS_DIR", str(tmp_path))
    assert load_settings().max_steps == Settings.model_fields["max_steps"].default


def test_deepspeed_json_inline_and_as_a_file(monkeypatch, tmp_path):
    monkeypatch.setenv("ZT_DEEPSPEED_CONFIG", '{"zero_optimization": {"stage": 3}}')
    inputs = read_user_inputs(load_settings())
    assert inputs.deepspeed == {"zero_optimization": {"stage": 3}}
    path = tmp_path / "ds.json"
    path.write_text('{"gradient_clipping": 0.3}')
    monkeypatch.setenv("ZT_DEEPSPEED_CONFIG", str(path))
    assert read_user_inputs(load_settings()).deepspeed == {"gradient_clipping": 0.3}


def test_deepspeed_json_syntax_error_gives_line_and_column(monkeypatch):
    monkeypatch.setenv("ZT_DEEPSPEED_CONFIG", '{"zero_optimization":\n {"stage": 2,}}')
    with pytest.raises(ConfigError) as info:
        read_user_inputs(load_settings())
    assert "ZT_DEEPSPEED_CONFIG: invalid JSON at line 2, column" in str(info.value)


def test_deepspeed_block_in_the_config_file(monkeypatch, tmp_path):
    path = tmp_path / "zerotuner.yaml"
    path.write_text("deepspeed_config:\n  zero_optimization:\n    stage: 2\n")
    monkeypatch.setenv("ZT_CONFIG_FILE", str(path))
    inputs = read_user_inputs(load_settings())
    assert inputs.deepspeed == {"zero_optimization": {"stage": 2}}
    assert "config file" in inputs.source


def test_seed_accelerate_config_maps_to_deepspeed_and_launch_settings(monkeypatch, tmp_path):
    path = tmp_path / "default_config.yaml"
    path.write_text(SEED_ACCELERATE.replace("num_processes: 1", "num_processes: 4"))
    monkeypatch.setenv("ZT_ACCELERATE_CONFIG", str(path))
    settings = load_settings()
    inputs = read_user_inputs(settings)
    assert inputs.deepspeed == {
        "zero_optimization": {"stage": 1},
        "gradient_accumulation_steps": 4,
        "bf16": {"enabled": True},
        "fp16": {"enabled": False},
    }
    assert inputs.settings == {"nnodes": 1, "num_processes": 4, "node_rank": 0}
    assert apply_implied_settings(settings, inputs).num_processes == 4


def test_accelerate_multi_machine_processes_are_per_node(monkeypatch, tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text(
        "distributed_type: DEEPSPEED\nnum_machines: 2\nnum_processes: 8\nmachine_rank: 1\n"
        "main_process_ip: 10.1.2.3\nmain_process_port: 29555\n"
        "deepspeed_config:\n  offload_optimizer_device: cpu\n  offload_param_device: none\n"
        "  zero3_save_16bit_model: true\n  zero_stage: 3\n"
    )
    monkeypatch.setenv("ZT_ACCELERATE_CONFIG", str(path))
    monkeypatch.setenv("ZT_NODE_RANK", "0")  # explicit wins and is reported
    settings = load_settings()
    inputs = read_user_inputs(settings)
    merged = apply_implied_settings(settings, inputs)
    assert (merged.nnodes, merged.num_processes, merged.node_rank) == (2, 4, 0)
    assert (merged.master_addr, merged.master_port) == ("10.1.2.3", 29555)
    zero = inputs.deepspeed["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu"} and "offload_param" not in zero
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert any("ZT_NODE_RANK=0 overrides" in n.message for n in inputs.notes.notes)


def test_accelerate_deepspeed_config_file_is_read_relative_to_it(monkeypatch, tmp_path):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}}')
    path = tmp_path / "a.yaml"
    path.write_text("deepspeed_config:\n  deepspeed_config_file: ds.json\n")
    monkeypatch.setenv("ZT_ACCELERATE_CONFIG", str(path))
    assert read_user_inputs(load_settings()).deepspeed["zero_optimization"] == {"stage": 2}


def test_accelerate_bad_precision_is_an_error(monkeypatch, tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text("mixed_precision: fp8\n")
    monkeypatch.setenv("ZT_ACCELERATE_CONFIG", str(path))
    with pytest.raises(ConfigError, match="mixed_precision='fp8': expected no, fp16 or bf16"):
        read_user_inputs(load_settings())


def test_config_file_keys_that_are_not_text_are_an_error(monkeypatch, tmp_path):
    path = tmp_path / "zerotuner.yaml"
    path.write_text("?\n")  # YAML for {None: None}
    monkeypatch.setenv("ZT_CONFIG_FILE", str(path))
    (line,) = error_lines()
    assert "setting names must be text" in line


# --- the Hugging Face token: precedence of its sources, never printed -------------------------

TOKENS = {"env": "hf_FromEnv1111", "config": "hf_FromConfig2222", "secrets": "hf_FromSecrets3333"}


def token_sources(monkeypatch, tmp_path, sources, env_var="ZT_HF_TOKEN"):
    """The token given by each of `sources`: env, the config file, a file in the secrets dir."""
    monkeypatch.delenv("HF_TOKEN", raising=False)  # the developer's own
    monkeypatch.setenv("ZT_SECRETS_DIR", str(tmp_path / "secrets"))
    if "env" in sources:
        monkeypatch.setenv(env_var, TOKENS["env"])
    if "config" in sources:
        (tmp_path / "zerotuner.yaml").write_text(f"hf_token: {TOKENS['config']}\nmax_steps: 5\n")
        monkeypatch.setenv("ZT_CONFIG_FILE", str(tmp_path / "zerotuner.yaml"))
    if "secrets" in sources:
        (tmp_path / "secrets").mkdir()
        (tmp_path / "secrets" / "hf_token").write_text(TOKENS["secrets"] + "\n")


@pytest.mark.parametrize("env_var", ["ZT_HF_TOKEN", "HF_TOKEN"])
@pytest.mark.parametrize(
    ("sources", "winner"),
    [
        (("env", "config"), "env"),
        (("env", "secrets"), "env"),
        (("config", "secrets"), "config"),
        (("env", "config", "secrets"), "env"),
        (("secrets",), "secrets"),
    ],
    ids=lambda value: "+".join(value) if isinstance(value, tuple) else f"{value}-wins",
)
def test_hf_token_precedence_env_then_config_file_then_secrets_dir(
    monkeypatch, tmp_path, sources, winner, env_var
):
    token_sources(monkeypatch, tmp_path, sources, env_var)
    settings = load_settings()
    assert settings.hf_token.get_secret_value() == TOKENS[winner]
    assert settings.max_steps == (5 if "config" in sources else 1000)  # the rest still applies


def test_run_secrets_is_the_default_secrets_dir(monkeypatch, tmp_path):
    from zerotuner.settings import schema as settings_module

    assert Path("/run/secrets") == settings_module.DEFAULT_SECRETS_DIR
    (tmp_path / "hf_token").write_text(TOKENS["secrets"])
    monkeypatch.setattr(settings_module, "DEFAULT_SECRETS_DIR", tmp_path)  # not the machine's
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert load_settings().hf_token.get_secret_value() == TOKENS["secrets"]


@pytest.mark.parametrize(
    "sources", [("env",), ("config",), ("secrets",), ("env", "config", "secrets")], ids="+".join
)
def test_the_token_is_never_in_config_explain_output(
    monkeypatch, capsys, caplog, tmp_path, sources
):
    token_sources(monkeypatch, tmp_path, sources)
    monkeypatch.setenv("ZT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ZT_DEVICE", "cpu")
    assert main(["config", "--explain"]) == 0
    out, err = capsys.readouterr()
    config = json.loads(out)  # the normalized DeepSpeed config
    assert config["steps_per_print"] == (6 if "config" in sources else 1001)  # the file was read
    for token in TOKENS.values():
        assert token not in out + err + caplog.text
        assert token not in json.dumps(config)


def test_the_token_is_masked_in_an_invalid_token_error(monkeypatch, capsys, tmp_path):
    (tmp_path / "zerotuner.yaml").write_text(f"hf_token: [{TOKENS['config']}]\n")
    monkeypatch.setenv("ZT_CONFIG_FILE", str(tmp_path / "zerotuner.yaml"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("ZT_DEVICE", "cpu")
    assert main(["config", "--explain"]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == "zerotuner: error: ZT_HF_TOKEN=***: expected a valid string"
    assert TOKENS["config"] not in out + err


def test_a_secret_file_that_is_not_text_is_an_error_without_its_bytes(monkeypatch, tmp_path):
    (tmp_path / "hf_token").write_bytes(b"\xffhf_\xfe")
    monkeypatch.setenv("ZT_SECRETS_DIR", str(tmp_path))
    (line,) = error_lines()
    assert line == f"ZT_SECRETS_DIR={tmp_path / 'hf_token'}: not a UTF-8 text file"


# --- paths the OS refuses are one clear line, not a traceback ---------------------------------


@pytest.mark.parametrize("name", ["ZT_CONFIG_FILE", "ZT_SECRETS_DIR"])
def test_a_path_too_long_for_the_os_is_a_config_error(monkeypatch, name):
    monkeypatch.setenv(name, "/tmp/" + "x" * 5000)
    (line,) = error_lines()
    assert line.startswith(f"{name}=/tmp/xxx") and line.endswith(
        "cannot read it: File name too long"
    )


@pytest.mark.parametrize("name", ["ZT_DEEPSPEED_CONFIG", "ZT_ACCELERATE_CONFIG"])
def test_input_paths_the_os_refuses_are_config_errors(monkeypatch, tmp_path, name):
    monkeypatch.setenv(name, "/tmp/" + "x" * 5000)
    with pytest.raises(ConfigError, match=f"^{name}=/tmp/x+: cannot read it: File name too long$"):
        read_user_inputs(load_settings())
    config = tmp_path / "zerotuner.yaml"  # a NUL byte can only come from a file
    config.write_text(f'{name.removeprefix("ZT_").lower()}: "/tmp/a\\0b"\n')
    monkeypatch.delenv(name)
    monkeypatch.setenv("ZT_CONFIG_FILE", str(config))
    with pytest.raises(ConfigError, match=f"^{name}: the path contains a NUL byte$"):
        read_user_inputs(load_settings())
