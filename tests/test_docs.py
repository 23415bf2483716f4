"""The generated settings docs (docs/configuration.md's table, README's short table and
config/example.env) match the live model, and every relative link in README and docs/ resolves."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from zerotuner import docs
from zerotuner.settings.schema import Settings, env_name, load_settings

REPO = Path(__file__).resolve().parents[1]


def test_settings_docs_and_example_env_are_up_to_date() -> None:
    stale = docs.stale_files(REPO)
    assert not stale, f"stale: {stale}; run `python -m zerotuner.docs --write`"


def test_a_settings_change_without_regenerating_is_caught(tmp_path: Path) -> None:
    for name in (docs.SETTINGS_PAGE, docs.README, docs.EXAMPLE_ENV, docs.METRICS_PAGE):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    assert docs.main(["--root", str(tmp_path), "--check"]) == 0
    page, readme = tmp_path / docs.SETTINGS_PAGE, tmp_path / docs.README
    page.write_text(page.read_text().replace("| `ZT_SEED` |", "| `ZT_SEEDS` |"))
    readme.write_text(readme.read_text().replace("| `ZT_MAX_STEPS` |", "| `ZT_MAX_STEP` |"))
    env = tmp_path / docs.EXAMPLE_ENV
    env.write_text(env.read_text().replace("#ZT_SEED=42\n", ""))
    assert set(docs.stale_files(tmp_path)) == {page, readme, env}
    assert docs.main(["--root", str(tmp_path), "--check"]) == 1
    assert docs.main(["--root", str(tmp_path), "--write"]) == 0
    assert docs.stale_files(tmp_path) == []


def test_readme_without_markers_is_an_error() -> None:
    with pytest.raises(ValueError, match="settings:start"):
        docs.replace_between_markers("# no table here\n", "| x |\n")


def test_the_full_table_is_on_its_page_and_readme_shows_the_key_settings() -> None:
    readme = (REPO / docs.README).read_text()
    assert docs.TABLE_START not in readme  # one full table, on docs/configuration.md
    assert docs.TABLE_START in (REPO / docs.SETTINGS_PAGE).read_text()
    assert set(docs.KEY_SETTINGS) <= set(Settings.model_fields)
    short = docs.settings_table_markdown(docs.KEY_SETTINGS)
    rows = [r for r in short.splitlines()[2:] if r.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [
        env_name(n) for n in Settings.model_fields if n in docs.KEY_SETTINGS
    ]
    assert short in readme and str(docs.SETTINGS_PAGE) in readme  # and it links the full one


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


# [text](target) and ![alt](target), not inside inline code; reference definitions `[x]: target`.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
REFERENCE = re.compile(r"^\[[^\]]+\]:\s+(\S+)", re.MULTILINE)


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lowercased, punctuation dropped, spaces to hyphens."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(markdown: str) -> list[str]:
    text = re.sub(r"```.*?```", "", markdown, flags=re.DOTALL)  # code blocks
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    return LINK.findall(text) + REFERENCE.findall(text)


def test_every_relative_link_in_readme_and_docs_resolves() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert len(pages) > 5
    broken = []
    for page in pages:
        for target in _links(page.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_readme_stays_a_front_door() -> None:
    """README: what it is, how to run it, the key settings, exit codes and links (issue 28)."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert "## Exit codes" in readme and "make run" in readme and "docker run" in readme
