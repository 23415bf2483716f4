"""Outputs that outlive the machine: the remote stores and the pusher against a real
S3-compatible server (moto's server mode on loopback) and the stand-in Hub (tests/fakehub.py,
which takes commits the way the Hub API does), with checkpoints committed by the checkpoint
module's own commit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fakehub import FakeHub
from s3server import S3Server

from zerotuner.errors import ConfigError, EnvironmentUnfit
from zerotuner.publish import push, remote
from zerotuner.settings import push_url
from zerotuner.weights import checkpoint


@pytest.fixture(scope="module")
def s3():
    server = S3Server().start()
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    yield server
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.stop()


@pytest.fixture
def bucket(s3, request) -> str:
    test = request.node.name.split("[")[0]
    name = f"zt-{test.lower().replace('_', '-')[:40]}".rstrip("-")
    s3.create_bucket(name)
    return name


HUB_TOKEN = "hf_pushtestsecrettoken"


def store(url: str) -> remote.Store:
    return remote.open_store(url, hf_token=HUB_TOKEN, secrets_dir=Path("/nonexistent"))


@pytest.fixture
def hub(monkeypatch):
    with FakeHub(token=HUB_TOKEN) as hub:
        hub.use_in_this_process(monkeypatch)
        yield hub


@pytest.fixture(params=["s3", "hf"])
def where(request) -> remote.Store:
    """An empty remote of each kind: a new S3 bucket (prefix run/), or a Hub repo not yet made."""
    if request.param == "s3":
        return store(f"s3://{request.getfixturevalue('bucket')}/run")
    request.getfixturevalue("hub")
    return store(f"hf://me/{request.node.name.split('[')[0][5:40].replace('_', '-')}")


def commit(
    output: Path, step: int, *, keep: int = 2, size: int = 300_000, keep_step: int | None = None
) -> Path:
    """A committed checkpoint: shards as DeepSpeed lays them out, then the real commit
    (`keep_step`: the best evaluated step an early stop would export)."""
    root = checkpoint.checkpoints_dir(output)
    folder = root / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(os.urandom(size))
    (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(os.urandom(size // 3))
    meta = {"zero_stage": 2, "world_size": 1, **({"keep_step": keep_step} if keep_step else {})}
    checkpoint._commit(root, step, meta, ema=None, ema_updates=0, keep=keep,
                       keep_step=keep_step)  # fmt: skip
    return folder


@pytest.mark.parametrize(
    "url, parsed",
    [("s3://my-bucket/runs/sdxl", ("s3", "my-bucket", "runs/sdxl/")),
     ("s3://my-bucket", ("s3", "my-bucket", "")),
     ("hf://me/my-lora", ("hf", "me/my-lora", ""))],
)  # fmt: skip
def test_remote_urls(url, parsed) -> None:
    assert push_url.parse(url) == parsed


@pytest.mark.parametrize("url", ["s3:/bucket", "gs://bucket/x", "hf://just-a-name", "s3://A/x"])
def test_a_malformed_remote_is_one_line_naming_the_setting(url) -> None:
    with pytest.raises(ConfigError, match=r"^ZT_PUSH_TO=.*s3://bucket/prefix.*hf://user/repo"):
        push_url.parse(url)


def test_probe_writes_and_cleans_up_and_refuses_a_missing_bucket(bucket) -> None:
    good = store(f"s3://{bucket}/run")
    remote.probe(good)
    assert good.list("") == {}  # the probe object is gone
    with pytest.raises(EnvironmentUnfit, match=r"^ZT_PUSH_TO=s3://no-such-bucket/run/: cannot"):
        remote.probe(store("s3://no-such-bucket/run"))


def test_probe_refuses_a_hub_token_that_cannot_write(hub) -> None:
    good = store("hf://me/probe")
    remote.probe(good)
    assert good.list("") == {".gitattributes": good.list("")[".gitattributes"]}  # as made
    hub.read_only = True
    with pytest.raises(EnvironmentUnfit, match=r"^ZT_PUSH_TO=hf://me/probe: cannot .*403"):
        remote.probe(good)


def test_pusher_uploads_each_commit_moves_latest_and_keeps_n(where, tmp_path) -> None:
    output = tmp_path / "output"
    pusher = push.Pusher(where, output, keep=1)
    assert pusher.push_latest_checkpoint()  # nothing committed yet: nothing to do
    assert where.read_text("checkpoints/latest") is None
    first = commit(output, 2)
    assert pusher.push_latest_checkpoint()
    assert where.read_text("checkpoints/latest") == "step-2"
    sizes = {f"checkpoints/step-2/{p.name}": p.stat().st_size for p in first.iterdir()}
    assert push.remote_checkpoints(where) == {"step-2": sizes}
    commit(output, 4, keep=1)
    assert pusher.push_latest_checkpoint()
    assert where.read_text("checkpoints/latest") == "step-4"
    assert list(push.remote_checkpoints(where)) == ["step-4"]  # keep=1, after the pointer moved
    assert pusher.stats.last_step == 4 and pusher.stats.failures == 0
    assert pusher.stats.bytes > 2 * 400_000


def test_the_best_evaluated_step_outlives_both_rotations(where, tmp_path) -> None:
    """ZT_EARLY_STOP_PATIENCE: the best step (the manifest's keep_step) stays, locally and on
    the remote, whatever ZT_CHECKPOINTS_KEEP says, until a later step is the best."""
    output = tmp_path / "output"
    pusher = push.Pusher(where, output, keep=1)
    for step, best in ((2, 2), (4, 2), (6, 6)):
        commit(output, step, keep=1, keep_step=best, size=1000)
        assert pusher.push_latest_checkpoint()
        kept = ["step-2", "step-4"] if step == 4 else [f"step-{step}"]
        assert sorted(push.remote_checkpoints(where)) == kept
        local = checkpoint.committed_checkpoints(checkpoint.checkpoints_dir(output))
        assert sorted(p.name for p in local) == kept


class TornAfterFirstFile:
    """The real store, cut off after one object: what a dying network or machine leaves."""

    def __init__(self, inner: remote.Store) -> None:
        self.inner, self.url = inner, inner.url

    def upload(self, files, message) -> None:
        self.inner.upload(files[:1], message)
        raise remote.RemoteError("connection reset by peer")

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_torn_upload_never_becomes_the_remote_latest(where, tmp_path) -> None:
    output = tmp_path / "output"
    pushed = commit(output, 2)
    assert push.Pusher(where, output, keep=3).push_latest_checkpoint()
    commit(output, 4)
    torn = push.Pusher(TornAfterFirstFile(where), output, keep=3)
    assert not torn.push_latest_checkpoint()
    assert torn.stats.failures == 1
    assert where.read_text("checkpoints/latest") == "step-2"
    assert "step-4" in push.remote_checkpoints(where)  # part of it is there, unreferenced

    # A fresh machine: the verified step-2 comes down, bit for bit, and is what resumes.
    fresh = tmp_path / "fresh"
    assert push.fetch_latest(where, fresh) == "step-2"
    got = checkpoint.find_resume("auto", fresh)
    assert got is not None and got.name == "step-2"
    for file in pushed.iterdir():
        assert (got / file.name).read_bytes() == file.read_bytes(), file.name
    # a machine with its own committed checkpoint keeps it
    assert push.fetch_latest(where, output) is None


def test_a_corrupt_remote_checkpoint_falls_back_to_the_one_before(where, tmp_path) -> None:
    output = tmp_path / "output"
    commit(output, 2)
    pusher = push.Pusher(where, output, keep=3)
    assert pusher.push_latest_checkpoint()
    bad = commit(output, 4)
    assert pusher.push_latest_checkpoint()
    shard = bad / "mp_rank_00_model_states.pt"
    flipped = bytearray(shard.read_bytes())
    flipped[100] ^= 0xFF  # same size, other bytes: only the sha256 can tell
    (tmp_path / "evil").write_bytes(bytes(flipped))
    where.upload([(tmp_path / "evil", f"checkpoints/step-4/{shard.name}")], "corrupt")
    assert push.fetch_latest(where, tmp_path / "fresh") == "step-2"


def test_check_probes_the_remote_before_any_gpu_time(demo_job_env, bucket, capsys) -> None:
    from zerotuner import cli

    def remote_line() -> list[str]:
        [line] = [s for s in capsys.readouterr().out.splitlines() if "push remote" in s]
        return line.split(maxsplit=3)

    demo_job_env.setenv("ZT_PUSH_TO", f"s3://{bucket}/run")
    assert cli.main(["check"]) == 0
    status, _, _, detail = remote_line()
    assert status == "OK" and detail.startswith(f"s3://{bucket}/run/: writable (a probe object")
    demo_job_env.setenv("ZT_PUSH_TO", "s3://absent-bucket/run")
    assert cli.main(["check"]) == 3
    status, _, _, detail = remote_line()
    assert status == "FAIL" and "NoSuchBucket" in detail
    assert detail.startswith("ZT_PUSH_TO=s3://absent-bucket/run/: cannot write there: write ")


def test_push_metrics_are_exposed(where, tmp_path) -> None:
    from prometheus_client import CollectorRegistry

    output = tmp_path / "output"
    pusher = push.Pusher(where, output, keep=2)
    registry = CollectorRegistry()
    registry.register(push.PushCollector(pusher.stats))
    names = {s.name for family in registry.collect() for s in family.samples}
    assert names == set(push.METRICS)
    assert registry.get_sample_value("zerotuner_push_last_step") == -1
    commit(output, 3)
    assert pusher.push_latest_checkpoint()
    assert registry.get_sample_value("zerotuner_push_last_step") == 3
    assert registry.get_sample_value("zerotuner_push_failures_total") == 0
    assert registry.get_sample_value("zerotuner_push_seconds_total") > 0
    sent = sum(p.stat().st_size for p in (output / "checkpoints" / "step-3").iterdir())
    assert registry.get_sample_value("zerotuner_push_bytes_total") == sent


PUSH_ONCE = """
import sys
from pathlib import Path
from zerotuner.publish import push
from zerotuner.publish import remote
store = remote.open_store(sys.argv[1], hf_token=None, secrets_dir=Path("/nonexistent"))
push.Pusher(store, Path(sys.argv[2]), keep=3).push_latest_checkpoint()
"""


def test_a_pusher_killed_mid_upload_leaves_the_previous_latest(s3, bucket, tmp_path) -> None:
    """SIGKILL while a checkpoint's objects go up (a vanished machine): the remote's latest
    stays on the one before, and that is what a fresh machine resumes from."""
    import signal
    import subprocess
    import sys
    import time

    output, url = tmp_path / "output", f"s3://{bucket}/run"
    where = store(url)
    commit(output, 2, size=1000)
    assert push.Pusher(where, output, keep=3).push_latest_checkpoint()
    folder = commit(output, 4, size=1000)
    for i in range(40):  # many objects: the upload takes long enough to be caught midway
        (folder / f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt").write_bytes(os.urandom(2**20))
    proc = subprocess.Popen([sys.executable, "-c", PUSH_ONCE, url, str(output)])
    deadline = time.monotonic() + 120
    while "step-4" not in push.remote_checkpoints(where) and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert 0 < len(push.remote_checkpoints(where).get("step-4", {})) < 42, "not caught midway"
    assert where.read_text("checkpoints/latest") == "step-2"
    assert push.fetch_latest(where, tmp_path / "fresh") == "step-2"


def test_local_rotation_keeps_what_the_remote_does_not_have(where, tmp_path) -> None:
    """ZT_CHECKPOINTS_KEEP=1 while the remote fails: nothing newer than the remote's latest is
    deleted locally; once an upload succeeds, rotation catches up."""
    output = tmp_path / "output"
    root = checkpoint.checkpoints_dir(output)
    commit(output, 2, keep=1)
    pusher = push.Pusher(where, output, keep=1).start()
    pusher.finish(succeeded=False, timeout=60)  # pushes step-2, stops the thread
    assert where.read_text("checkpoints/latest") == "step-2"
    failing = push.Pusher(TornAfterFirstFile(where), output, keep=1)
    failing._pushed = "step-2"
    commit(output, 4, keep=1)
    assert not failing.push_latest_checkpoint()
    commit(output, 6, keep=1)
    assert [p.name for p in sorted(checkpoint.committed_checkpoints(root))] == [
        "step-4", "step-6"]  # fmt: skip
    assert pusher.push_latest_checkpoint()  # the remote is back: step-6 goes up
    commit(output, 8, keep=1)
    assert [p.name for p in checkpoint.committed_checkpoints(root)] == ["step-8"]


def test_s3_credentials_come_from_secret_files_or_the_probe_says_none(
    bucket, tmp_path, monkeypatch
) -> None:
    from s3server import KEY_ID, SECRET

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance metadata here
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    url = f"s3://{bucket}/run"
    with pytest.raises(
        EnvironmentUnfit, match=r"^ZT_PUSH_TO=.*: cannot write there: .*credentials"
    ):
        remote.probe(remote.open_store(url, hf_token=None, secrets_dir=secrets))
    (secrets / "aws_access_key_id").write_text(KEY_ID + "\n")
    (secrets / "aws_secret_access_key").write_text(SECRET + "\n")
    remote.probe(remote.open_store(url, hf_token=None, secrets_dir=secrets))
