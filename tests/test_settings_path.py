"""One settings path: `config`, `plan`, `check`, `train` and the builder read the user's
settings through the same steps (zerotuner.settings.effective), so a refusal added there reaches all
five with the same line, and what one accepts the others read alike."""

from __future__ import annotations

import pytest

from zerotuner import cli
from zerotuner.builder.evaluate import evaluate
from zerotuner.errors import ConfigError
from zerotuner.settings.effective import SettingsPath, effective_settings

REFUSAL = "ZT_MAX_STEPS=13: refused by a step added to the settings path"


@pytest.fixture
def demo_env(monkeypatch, demo_dir, tmp_path):
    for name, value in {
        "ZT_MODEL": str(demo_dir / "model"), "ZT_DATA_DIR": str(demo_dir / "data"),
        "ZT_OUTPUT_DIR": str(tmp_path / "output"), "ZT_CACHE_DIR": str(tmp_path / "cache"),
        "ZT_OFFLOAD_DIR": str(tmp_path / "offload"), "ZT_DEVICE": "cpu",
        "ZT_METRICS_PORT": "0", "ZT_CONFIG_FILE": str(tmp_path / "none.yaml"),
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    (tmp_path / "none.yaml").write_text("{}\n")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return monkeypatch


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_a_refusal_added_to_the_path_reaches_all_five(demo_env, capsys, demo_dir):
    def unlucky(path: SettingsPath) -> str:
        if path.settings.max_steps == 13:
            raise ConfigError(REFUSAL)
        return "not 13 steps"

    demo_env.setattr(SettingsPath, "STEPS", (*SettingsPath.STEPS, ("unlucky", unlucky)))
    demo_env.setenv("ZT_MAX_STEPS", "13")
    for command in ("config", "plan", "train"):
        code, out = _run(capsys, command)
        assert code == 2 and f"zerotuner: error: {REFUSAL}" in out.splitlines(), (command, out)
    code, out = _run(capsys, "check")
    assert code == 2 and any(
        line.startswith("FAIL unlucky") and line.endswith(REFUSAL) for line in out.splitlines()
    ), out
    form = {"settings": {"ZT_MODEL": str(demo_dir / "model"), "ZT_MAX_STEPS": "13"}}
    page = evaluate(form)
    assert [e["line"] for e in page["errors"]] == [REFUSAL]
    assert [e["line"] for e in page["plan_errors"]] == [REFUSAL]
    demo_env.setenv("ZT_MAX_STEPS", "12")  # the step passes: every command goes on
    code, out = _run(capsys, "config")
    assert code == 0, out


def test_plan_refuses_folders_config_and_train_refuse(demo_env, capsys, demo_dir, tmp_path):
    """`plan` walked its own copy of the path and planned an output folder inside the data
    (which `train` would then scan as training data)."""
    demo_env.setenv("ZT_OUTPUT_DIR", str(demo_dir / "data" / "output"))
    lines = {}
    for command in ("config", "plan"):
        code, out = _run(capsys, command)
        assert code == 2, (command, out)
        lines[command] = [ln for ln in out.splitlines() if ln.startswith("zerotuner: error:")]
    assert lines["config"] == lines["plan"] and "is inside ZT_DATA_DIR" in lines["plan"][0]


def test_a_mapping_is_read_instead_of_the_process_environment(demo_env, tmp_path):
    """The builder's way in: variables given as a mapping, the process's left alone (its
    config file and secrets folder are the mapping's too)."""
    config = tmp_path / "zt.yaml"
    config.write_text("max_steps: 21\n")
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "hf_token").write_text("hf_from_the_mapping\n")
    demo_env.setenv("ZT_MAX_STEPS", "5")
    mapping = {"ZT_CONFIG_FILE": str(config), "ZT_SECRETS_DIR": str(secrets),
               "HF_HUB_OFFLINE": "1"}  # fmt: skip
    effective = effective_settings(mapping)
    assert effective.settings.max_steps == 21 and effective.hub_offline
    assert effective.settings.hf_token.get_secret_value() == "hf_from_the_mapping"
    assert effective_settings().settings.max_steps == 5  # the process's, as before
    with pytest.raises(ConfigError, match="ZT_MAX_STEPZ: unknown setting"):
        effective_settings({"ZT_MAX_STEPZ": "3"})
