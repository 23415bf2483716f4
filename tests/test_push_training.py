"""`ZT_PUSH_TO` end to end: `./entrypoint train` on 2 CPU ranks pushes its checkpoints, final
export, run records and model card to a real S3-compatible server on loopback; the machine's
output is then deleted and a fresh run resumes from the remote at the next step; a SIGTERM
waits for the upload of the checkpoint it just committed."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from s3server import SECRET, S3Server, served
from trainkit import ENTRYPOINT, entrypoint_env, sigterm_after_steps, steps_done

from zerotuner.publish import push, remote

pytestmark = pytest.mark.slow
PROMPT = "a red circle on a white background"


s3 = served()


def job_env(s3: S3Server, demo_dir: Path, tmp: Path, bucket: str, **overrides: str) -> dict:
    s3.create_bucket(bucket)
    settings = dict(ZT_PUSH_TO=f"s3://{bucket}/sdxl-run", ZT_CHECKPOINT_EVERY_STEPS="2",
                    ZT_CHECKPOINTS_KEEP="1", ZT_RESUME="auto")  # fmt: skip
    return entrypoint_env(demo_dir, tmp, **(settings | s3.env() | overrides))


def remote_store(s3: S3Server, bucket: str, monkeypatch) -> remote.Store:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    return remote.open_store(f"s3://{bucket}/sdxl-run", hf_token=None, secrets_dir=Path("/no"))


def train(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([ENTRYPOINT, "train"], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def test_a_fresh_machine_resumes_from_the_remote(s3, demo_dir, tmp_path, monkeypatch):
    env = job_env(s3, demo_dir, tmp_path, "resume", ZT_MAX_STEPS="4",
                  ZT_VALIDATION_PROMPTS=json.dumps([PROMPT]))  # fmt: skip
    first = train(env)
    log = first.stdout + first.stderr
    assert first.returncode == 0, log[-4000:]
    store = remote_store(s3, "resume", monkeypatch)
    assert store.read_text("checkpoints/latest") == "step-4"
    assert list(push.remote_checkpoints(store)) == ["step-4"]  # ZT_CHECKPOINTS_KEEP=1
    there = store.list("")
    assert "final/model_index.json" in there and "run/steps.jsonl" in there
    assert any(k.startswith("samples/step-4/") for k in there)
    card = store.read_text("README.md")
    assert card.startswith("---\nbase_model:") and "Steps: 4" in card and "run/loss.png" in card
    for text in (log, card, *(p.read_text() for p in (tmp_path / "output" / "run").glob("*.j*"))):
        assert SECRET not in text

    # The machine is gone: a new one with an empty output resumes from the remote.
    pushed = tmp_path / "pushed-step-4"
    shutil.copytree(tmp_path / "output" / "checkpoints" / "step-4", pushed)
    shutil.rmtree(tmp_path / "output")
    second = train({**env, "ZT_MAX_STEPS": "6", "ZT_CHECKPOINTS_KEEP": "2"})
    log = second.stdout + second.stderr
    assert second.returncode == 0, log[-4000:]
    assert "checkpoint step-4 downloaded from s3://resume/sdxl-run/ and verified" in log
    assert [s["step"] for s in steps_done(tmp_path)] == [5, 6]
    assert store.read_text("checkpoints/latest") == "step-6"
    assert sorted(push.remote_checkpoints(store)) == ["step-4", "step-6"]
    # what came down is what went up, bit for bit
    downloaded = tmp_path / "output" / "checkpoints" / "step-4"
    files = sorted(p.relative_to(pushed) for p in pushed.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(downloaded) for p in downloaded.rglob("*") if p.is_file())
    for name in files:
        assert (downloaded / name).read_bytes() == (pushed / name).read_bytes(), name


def test_sigterm_waits_for_the_upload_of_the_last_checkpoint(s3, demo_dir, tmp_path, monkeypatch):
    env = job_env(s3, demo_dir, tmp_path, "stop", ZT_MAX_STEPS="10000",
                  ZT_CHECKPOINT_EVERY_STEPS="0")  # fmt: skip
    code, out = sigterm_after_steps(env, tmp_path)
    assert code == 143, out[-3000:]
    local = (tmp_path / "output" / "checkpoints" / "latest").read_text().strip()
    # pushed in the background as soon as it was committed, or by the stop's wait (up to the
    # grace) when the ranks were quicker: either way before the entrypoint exits
    assert f"push: checkpoint {local} is the remote's latest" in out, out[-3000:]
    store = remote_store(s3, "stop", monkeypatch)
    assert store.read_text("checkpoints/latest") == local
    assert "README.md" not in store.list("")  # a stopped run has no final export to describe
