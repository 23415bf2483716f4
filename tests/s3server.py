"""A real S3-compatible server on loopback for the tests: moto's server mode, started and stopped
by the test session (nothing else can be reached from here)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from zerotuner.launch.ranks import free_port

KEY_ID, SECRET = "AKIAZEROTUNERTEST", "zerotuner-secret-access-key-for-tests"


def served(*buckets: str):
    """A module's `s3` fixture: one moto server for the module, with these buckets."""
    import pytest

    @pytest.fixture(scope="module")
    def s3():
        server = S3Server().start()
        for bucket in buckets:
            server.create_bucket(bucket)
        yield server
        server.stop()

    return s3


class S3Server:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> S3Server:
        moto = Path(sys.executable).with_name("moto_server")
        self.proc = subprocess.Popen(
            [str(moto), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=1)  # noqa: S310 - loopback
                return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("moto_server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)

    def env(self) -> dict[str, str]:
        """The standard AWS variables a user sets for an S3-compatible endpoint."""
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": KEY_ID,
                "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip

    def create_bucket(self, name: str) -> None:
        import boto3

        client = boto3.client("s3", endpoint_url=self.url, aws_access_key_id=KEY_ID,
                              aws_secret_access_key=SECRET, region_name="us-east-1")  # fmt: skip
        client.create_bucket(Bucket=name)
