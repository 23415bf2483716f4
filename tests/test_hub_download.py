"""A hub id the cache does not hold, served by a local stand-in for the hub (tests/fakehub.py).

The entrypoint reads the model's configs (a few KB) to learn its family and size, never its
weights; the ranks download the weights once per node, at the commit the plan was made for.
The repo is the tiny SDXL under a name that does not say XL, as fine-tunes are often named.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest
from fakehub import SHA, FakeHub
from trainkit import ENTRYPOINT, entrypoint_env

REPO_ID = "acme/juggernaut-x"
TOKEN = "hf_fakehubtoken123456"
CONFIGS = {
    "model_index.json",
    "unet/config.json",
    "vae/config.json",
    "text_encoder/config.json",
    "text_encoder_2/config.json",
}


def hub_env(demo_dir: Path, out: Path, endpoint: str, **overrides: str) -> dict[str, str]:
    """The demo's environment naming the hub repo, online against `endpoint`."""
    online = dict(ZT_MODEL=REPO_ID, ZT_HF_TOKEN=TOKEN, HF_ENDPOINT=endpoint,
                  HF_HUB_OFFLINE="0", HF_HUB_DISABLE_TELEMETRY="1")  # fmt: skip
    return entrypoint_env(demo_dir, out, **(online | overrides))


def zerotuner(env: dict[str, str], *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [ENTRYPOINT, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_plan_sizes_an_uncached_hub_model_from_its_configs_without_its_weights(demo_dir, tmp_path):
    with FakeHub({REPO_ID: demo_dir / "model"}, token=TOKEN) as hub:
        result = zerotuner(hub_env(demo_dir, tmp_path, hub.url), "plan")
    assert result.returncode == 0, result.stderr[-3000:]
    # the name would guess SD 1.x (860M params): the configs say SDXL, and how small
    assert "job: sdxl UNet 0.001B params" in result.stdout, result.stdout
    assert set(hub.fetched()) == CONFIGS
    assert TOKEN not in result.stdout + result.stderr


def test_check_reports_the_hub_model_by_its_configs(demo_dir, tmp_path):
    with FakeHub({REPO_ID: demo_dir / "model"}, token=TOKEN) as hub:
        result = zerotuner(hub_env(demo_dir, tmp_path, hub.url), "check")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (line,) = [x for x in result.stdout.splitlines() if x.split()[1:2] == ["model"]]
    assert line.startswith(f"OK   model            hub id {REPO_ID}; sdxl (detected from its ")
    assert f"configs at commit {SHA[:12]}); denoiser 1.0M params" in line


def test_a_token_the_hub_refuses_is_exit_2_naming_the_setting(demo_dir, tmp_path):
    with FakeHub({REPO_ID: demo_dir / "model"}, token="hf_another_token") as hub:
        result = zerotuner(hub_env(demo_dir, tmp_path, hub.url), "plan")
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors == [
        f"zerotuner: error: ZT_MODEL={REPO_ID}: no such local folder, and not a hub repository "
        "this token can read (RepositoryNotFoundError); check the id and ZT_HF_TOKEN"
    ]
    assert "Traceback" not in result.stderr and TOKEN not in result.stderr


def test_an_unreachable_hub_leaves_the_family_to_the_ids_name(demo_dir, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    env = hub_env(demo_dir, tmp_path, closed, ZT_MODEL="acme/some-xl-finetune")
    result = zerotuner(env, "config", "--explain")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model family sdxl (guessed from the hub id 'acme/some-xl-finetune' (not cached; " \
        "the hub could not be reached: " in result.stderr, result.stderr[-3000:]  # fmt: skip


@pytest.mark.slow
def test_train_downloads_the_weights_once_per_node_at_the_planned_commit(demo_dir, tmp_path):
    env = hub_env(demo_dir, tmp_path, "", ZT_NUM_PROCESSES="2", ZT_MAX_STEPS="2")
    with FakeHub({REPO_ID: demo_dir / "model"}, token=TOKEN) as hub:
        env["HF_ENDPOINT"] = hub.url
        result = zerotuner(env, "train", timeout=900)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "phase: downloading" in out and "model family sdxl (detected from" in out
    weights = [f for f in hub.fetched() if f.endswith(".safetensors")]
    assert sorted(weights) == sorted(set(weights))  # each file once: one download per node
    assert "unet/diffusion_pytorch_model.safetensors" in weights
    # every request after the plan's is pinned to the commit the plan read
    resolved = [p for _, p in hub.requests if "/resolve/" in p]
    assert resolved and all(f"/resolve/{SHA}/" in p for p in resolved)
    assert (tmp_path / "output" / "final" / "model_index.json").is_file()
    assert TOKEN not in out
