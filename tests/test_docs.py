"""The generated settings docs: README table and config/example.env match the live model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from zerotuner import docs
from zerotuner.settings import Settings, env_name, load_settings

REPO = Path(__file__).resolve().parents[1]


def test_readme_and_example_env_are_up_to_date() -> None:
    stale = docs.stale_files(REPO)
    assert not stale, f"stale: {stale}; run `python -m zerotuner.docs --write`"


def test_a_settings_change_without_regenerating_is_caught(tmp_path: Path) -> None:
    (tmp_path / "config").mkdir()
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    shutil.copy(REPO / "config/example.env", tmp_path / "config/example.env")
    assert docs.main(["--root", str(tmp_path), "--check"]) == 0
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace("| `ZT_MAX_STEPS` |", "| `ZT_MAX_STEP` |"))
    env = tmp_path / "config/example.env"
    env.write_text(env.read_text().replace("#ZT_SEED=42\n", ""))
    assert set(docs.stale_files(tmp_path)) == {readme, env}
    assert docs.main(["--root", str(tmp_path), "--check"]) == 1
    assert docs.main(["--root", str(tmp_path), "--write"]) == 0
    assert docs.stale_files(tmp_path) == []


def test_readme_without_markers_is_an_error() -> None:
    with pytest.raises(ValueError, match="settings:start"):
        docs.replace_between_markers("# no table here\n", "| x |\n")


def test_table_has_one_row_per_setting_in_declaration_order() -> None:
    rows = [r for r in docs.settings_table_markdown().splitlines()[2:] if r.startswith("| `")]
    names = [row.split("`")[1] for row in rows]
    assert names == [env_name(n) for n in Settings.model_fields]
    for row in rows:  # four cells: pipes inside cells are escaped
        assert row.replace("\\|", "").count("|") == 5, row


def test_example_env_lists_every_setting_with_its_description() -> None:
    text = docs.example_env()
    for name, field in Settings.model_fields.items():
        assert text.count(f"\n#{env_name(name)}=") == 1
        assert f"# {field.description}\n" in text
    # Everything is commented out: as an env_file it changes nothing until edited.
    assert all(line == "" or line.startswith("#") for line in text.splitlines())


def test_uncommented_example_env_loads_as_the_defaults(monkeypatch) -> None:
    """The values written in example.env are valid and mean the defaults."""
    for line in docs.example_env().splitlines():
        if line.startswith("#ZT_") and "=" in line:
            key, value = line[1:].split("=", 1)
            # Empty means "not set"; an explicit ZT_CONFIG_FILE must exist (not here).
            if value and key != "ZT_CONFIG_FILE":
                monkeypatch.setenv(key, value)
    defaults = Settings.model_construct()  # the declared defaults, no source read
    loaded = load_settings()
    for name in Settings.model_fields:
        assert getattr(loaded, name) == getattr(defaults, name), name


def test_generated_docs_never_contain_a_secret(monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_do_not_print_me")
    monkeypatch.setenv("ZT_HF_TOKEN", "hf_do_not_print_me")
    assert "hf_do_not_print_me" not in docs.example_env()
    assert "hf_do_not_print_me" not in docs.settings_table_markdown()
    assert "\n#ZT_HF_TOKEN=\n" in docs.example_env()


def test_type_text_reads_like_the_values_users_type() -> None:
    fields = Settings.model_fields
    assert docs.type_text(fields["zero_stage"].annotation) == "auto | 0 | 1 | 2 | 3"
    assert docs.type_text(fields["gradient_checkpointing"].annotation) == "auto | true | false"
    assert docs.type_text(fields["validation_prompts"].annotation) == "list of text"
    assert docs.bounds_text(fields["resolution"]) == "64..4096"
    assert docs.env_names("hf_token", fields["hf_token"]) == ["ZT_HF_TOKEN", "HF_TOKEN"]
