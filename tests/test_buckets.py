"""One bucket rule (families.bucket_step): `check`'s latent-cache line lists exactly the buckets
train builds. An image family at 1024 px steps its buckets by 64 px, which its VAE scale alone
(the tiny demo's 2 px) would not; the video family's case is in test_wan.py (its trained run)."""

from __future__ import annotations

import pytest
import trainkit as tk


@pytest.mark.slow
def test_check_lists_the_buckets_an_image_run_builds_at_1024_px(demo_dir, tmp_path, capsys):
    config = tk.ds_config(0, world=1, steps=1)
    job = tk.write_job(tmp_path / "job.json", model=demo_dir / "model", deepspeed=config,
                       resolution=1024, world=1)  # fmt: skip
    settings = dict(model=demo_dir / "model", data=demo_dir / "data", output=tmp_path / "output",
                    cache=tmp_path / "cache", resolution=1024, upscale="false")  # fmt: skip
    env = tk.settings_env(**settings, max_steps=1, checkpoint_every_steps=0)
    proc = tk.run_ranks(tmp_path, env, job_file=job, world=1)
    tk.assert_ok(proc, tmp_path, world=1)
    trained = set(tk.read_json(tmp_path / "output" / "run" / "dataset.json")["buckets"])
    assert trained == {"64x64", "128x64", "64x128"}  # the 96 px demo images, 64 px steps
    assert tk.checked_buckets(capsys, **settings, offload_dir=tmp_path / "offload") == trained
