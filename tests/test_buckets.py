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


def _read_as_diffusers(family: str, config: dict) -> int:
    """The denoiser's cells per bucket step from `config` with the class's defaults under it:
    the config diffusers builds the model from."""
    import inspect
    from types import SimpleNamespace

    from zerotuner import families

    trainer = families.get(family)
    init = inspect.signature(trainer.denoiser_class().__init__).parameters.values()
    defaults = {p.name: p.default for p in init if p.default is not inspect.Parameter.empty}
    return trainer.latent_multiple(SimpleNamespace(**{**defaults, **config}))


@pytest.mark.parametrize("family", ["sd1", "sdxl", "flux", "wan"])
def test_the_step_reads_a_saved_config_alone_and_defaults_what_it_lacks(
    family, tmp_path, monkeypatch
):
    """A config save_pretrained wrote names every field the rule reads, so `check` need not
    import diffusers' model classes (seconds) for their defaults; a config that leaves the
    field out (sd1's built-in one, a trimmed file) takes the class's default, as diffusers
    reads it. Either way the step is what the model diffusers builds says."""
    import json

    from zerotuner import families
    from zerotuner.families.registry import REGISTRY
    from zerotuner.families.shapes import VAE_SCALE

    config = REGISTRY[family].builtin_config
    full = {**config, **{k: v for k, v in _full_fields(family).items() if k not in config}}
    trimmed = {k: v for k, v in full.items() if k not in ("block_out_channels", "patch_size")}
    model = tmp_path / "model"
    (model / "unet").mkdir(parents=True)
    (model / "unet" / "config.json").write_text(json.dumps(trimmed))
    step = families.bucket_step(family, model, resolution=256)
    assert step == VAE_SCALE * _read_as_diffusers(family, trimmed)
    # a complete config: the class is never asked
    (model / "unet" / "config.json").write_text(json.dumps(full))
    expected = VAE_SCALE * _read_as_diffusers(family, full)
    trainer = type(families.get(family))
    monkeypatch.setattr(trainer, "denoiser_class", lambda self: pytest.fail("class imported"))
    assert families.bucket_step(family, model, resolution=256) == expected


def _full_fields(family: str) -> dict:
    """Every field of the family's denoiser, defaults included (what save_pretrained writes)."""
    import inspect

    from zerotuner import families

    init = inspect.signature(families.get(family).denoiser_class().__init__).parameters.values()
    return {p.name: p.default for p in init if p.default is not inspect.Parameter.empty}
