"""The builder page in a real browser (Debian's chromium, Playwright), against a real
`zerotuner builder` process: a change updates the preview and the plan; an illegal pin shows
the CLI's line next to its fields; every export downloads and is checked the way its consumer
reads it; a template saves and loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from browserkit import builder, chromium, clean_env
from test_deploy import BIN, K8S_VERSION

from zerotuner.cli import main

REPO = Path(__file__).resolve().parents[1]
JOB_TEMPLATE = REPO / "src" / "zerotuner" / "web" / "job.yaml"

# deepspeed.initialize with the exported JSON, one CPU rank, two optimizer steps.
DS_INIT = """
import json, sys, deepspeed, torch
config = json.load(open(sys.argv[1]))
deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                       config=config)
for _ in range(2 * config["gradient_accumulation_steps"]):
    loss = engine(torch.randn(config["train_micro_batch_size_per_gpu"], 8)).pow(2).mean()
    engine.backward(loss)
    engine.step()
assert engine.global_steps == 2, engine.global_steps
print("OK", type(engine.optimizer).__name__, engine.zero_optimization_stage())
"""


@pytest.fixture(scope="module")
def page(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("builder")
    cache = str(root / "cache")
    server = builder(root / "templates", root / "builder.log", demo_dir, ZT_CACHE_DIR=cache)
    with server as url, chromium() as browser:
        context = browser.new_context(accept_downloads=True)
        page = context.new_page()
        page.goto(url)
        page.wait_for_function("document.body.dataset.evaluations >= 1")
        page.templates = root / "templates"  # type: ignore[attr-defined]
        yield page
        context.close()


def evaluations(page) -> int:
    return int(page.get_attribute("body", "data-evaluations") or 0)


def change(page, **fields: str) -> None:
    """Set form fields (by id suffix: ZT_ZERO_STAGE, hw-gpus, ds-betas) and wait for the
    server's answer to the last change to be on the page."""
    before = evaluations(page)
    for name, value in fields.items():
        selector = f"#f-{name}"
        if page.eval_on_selector(selector, "e => e.tagName") == "SELECT":
            page.select_option(selector, value)
        else:
            page.fill(selector, value)
    page.wait_for_function(
        f"Number(document.body.dataset.evaluations) > {before} "
        "&& document.body.dataset.pending === '0'"
    )


def preview(page) -> dict:
    return json.loads(page.inner_text("#preview"))


def plan_rows(page) -> list[list[str]]:
    return [r.split("\t") for r in page.locator("#plan-table tbody tr").all_inner_texts()]


def test_a_change_updates_the_preview_and_the_plan(page):
    change(page, **{"hw-gpus": "1", "hw-gpu_memory": "24GiB", "hw-host_memory": "64GiB"})
    assert "1 x what-if GPU 24.0 GiB" in page.inner_text("#plan-hardware")
    assert preview(page)["train_micro_batch_size_per_gpu"] == 1
    first = page.inner_text("#plan-choice")
    rows = plan_rows(page)
    assert len(rows) > 10 and first.startswith("choice: ZeRO-")

    change(page, ZT_TRAIN_BATCH_SIZE="4", ZT_GRADIENT_ACCUMULATION_STEPS="2")
    config = preview(page)
    assert (config["train_micro_batch_size_per_gpu"], config["train_batch_size"]) == (4, 8)
    assert plan_rows(page) != rows  # 4 images per device need more activation memory

    change(page, **{"ds-betas": "0.9, 0.95"})
    assert preview(page)["optimizer"]["params"]["betas"] == [0.9, 0.95]
    assert page.inner_text("#status") == "valid: zerotuner config exits 0"


def test_an_illegal_pin_shows_the_clis_error_next_to_its_fields(page, monkeypatch, capsys):
    change(page, ZT_ZERO_STAGE="2", ZT_OFFLOAD_PARAM="cpu")
    monkeypatch.setenv("ZT_ZERO_STAGE", "2")
    monkeypatch.setenv("ZT_OFFLOAD_PARAM", "cpu")
    monkeypatch.setenv("ZT_TRAIN_BATCH_SIZE", "4")
    monkeypatch.setenv("ZT_GRADIENT_ACCUMULATION_STEPS", "2")
    assert main(["config", "--gpus", "1", "--gpu-memory", "24GiB"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("zerotuner: error: ZT_ZERO_STAGE=2 with")
    shown = page.locator('.field[data-name="ZT_OFFLOAD_PARAM"] .error')
    assert shown.is_visible()
    assert shown.inner_text() == line.removeprefix("zerotuner: ")
    assert page.locator('.field[data-name="ZT_ZERO_STAGE"] .error').inner_text() == (
        line.removeprefix("zerotuner: ")
    )
    assert not page.locator('.field[data-name="ZT_MODEL"] .error').is_visible()
    assert page.inner_text("#status") == "invalid: zerotuner config exits 2"
    assert page.inner_text("#preview") == ""
    page.click('button[data-export="env"]')  # no file for a config `train` would refuse
    page.wait_for_function("document.querySelector('#export-status').textContent.length")
    assert page.inner_text("#export-status") == line.removeprefix("zerotuner: ")

    change(page, ZT_OFFLOAD_PARAM="")
    assert not shown.is_visible()


def download(page, fmt: str, folder: Path) -> Path:
    with page.expect_download() as event:
        page.click(f'button[data-export="{fmt}"]')
    path = folder / event.value.suggested_filename
    event.value.save_as(path)
    return path


def docker_env_file(path: Path) -> dict[str, str]:
    """How `docker run --env-file` reads it: NAME=value taken literally, # lines skipped."""
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            env[name] = value
    return env


def cli_config(monkeypatch, capsys, env: dict[str, str]) -> dict:
    """`zerotuner config` for the exported hardware (the CPU accelerator) with exactly `env`."""
    with monkeypatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("ZT_")]:
            patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        code = main(["config", "--gpus", "0", "--host-memory", "64GiB"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_every_export_is_what_its_consumer_accepts(page, demo_dir, tmp_path, monkeypatch, capsys):
    change(
        page, ZT_MODEL=str(demo_dir / "model"), ZT_TRAIN_BATCH_SIZE="2",
        ZT_GRADIENT_ACCUMULATION_STEPS="1", ZT_ZERO_STAGE="2", ZT_OFFLOAD_PARAM="",
        ZT_LR_SCHEDULER="cosine", ZT_VALIDATION_PROMPTS="a red circle\na blue square",
        **{"hw-gpus": "0", "hw-gpu_memory": "", "hw-host_memory": "64GiB",
           "ds-betas": "0.9, 0.98", "ds-cos_min_ratio": "0.05"},
    )  # fmt: skip
    shown = preview(page)
    assert shown["scheduler"]["params"]["cos_min_ratio"] == 0.05

    env = docker_env_file(download(page, "env", tmp_path))
    assert json.loads(env["ZT_VALIDATION_PROMPTS"]) == ["a red circle", "a blue square"]
    assert cli_config(monkeypatch, capsys, env) == shown  # the env file gives the same config

    compose = download(page, "compose", tmp_path)
    check = [BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec", compose]
    result = subprocess.run(check, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert yaml.safe_load(compose.read_text())["services"]["zerotuner"]["environment"] == env

    config_file = download(page, "yaml", tmp_path)
    assert cli_config(monkeypatch, capsys, {"ZT_CONFIG_FILE": str(config_file)}) == shown

    job = download(page, "kubernetes", tmp_path)
    validate = [BIN / "kubernetes-validate", "--strict", "-k", K8S_VERSION, job]
    result = subprocess.run(validate, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all(job.read_text())}
    mapped = tmp_path / "configmap.yaml"
    mapped.write_text(docs["ConfigMap"]["data"]["zerotuner.yaml"])
    assert cli_config(monkeypatch, capsys, {"ZT_CONFIG_FILE": str(mapped)}) == shown
    container = docs["Job"]["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]  # 0 GPUs: the CPU

    deepspeed = download(page, "deepspeed", tmp_path)
    assert json.loads(deepspeed.read_text()) == shown
    env = clean_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(_free_port()))  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", DS_INIT, str(deepspeed)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr[-3000:]


def _free_port() -> int:
    from zerotuner.launch.ranks import free_port

    return free_port()


def test_a_template_saves_and_loads(page):
    change(page, ZT_ZERO_STAGE="3", ZT_MAX_STEPS="1234", **{"hw-gpus": "2",
           "hw-gpu_memory": "48GiB", "ds-quantized_weights": "true"})  # fmt: skip
    saved = preview(page)
    page.fill("#template-name", "two-48gb")
    page.click("#template-save")
    page.wait_for_function("document.querySelector('#template-status').textContent.length")
    assert page.inner_text("#template-status") == "saved two-48gb"
    assert (page.templates / "two-48gb.json").is_file()

    change(page, ZT_ZERO_STAGE="1", ZT_MAX_STEPS="5", **{"hw-gpus": "1"})
    assert preview(page) != saved
    before = evaluations(page)
    page.select_option("#template-list", "two-48gb")
    page.click("#template-load")
    page.wait_for_function(f"Number(document.body.dataset.evaluations) > {before}")
    assert page.input_value("#f-ZT_MAX_STEPS") == "1234"
    assert page.input_value("#f-hw-gpus") == "2"
    assert preview(page) == saved
    assert saved["zero_optimization"]["zero_quantized_weights"] is True

    page.fill("#template-name", "../outside")
    page.click("#template-save")
    page.wait_for_function(
        "document.querySelector('#template-status').textContent.includes('error')"
    )
    assert "template name '../outside'" in page.inner_text("#template-status")
    assert sorted(p.name for p in page.templates.iterdir()) == ["two-48gb.json"]


def test_the_job_template_is_the_shipped_kubernetes_job():
    assert JOB_TEMPLATE.read_text() == (REPO / "config" / "kubernetes" / "job.yaml").read_text(), (
        "config/kubernetes/job.yaml changed: copy it to src/zerotuner/web/job.yaml"
    )
