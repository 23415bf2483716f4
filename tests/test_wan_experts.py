"""Wan 2.2 A14B, one expert per run (ZT_EXPERT): a tiny A14B (the Wan demo with its transformer
copied to `transformer_2` and a `boundary_ratio`, which WanPipeline loads) is refused without
ZT_EXPERT, as ZT_EXPERT is for a model with one transformer or another family and a
ZT_TIMESTEP_RANGE outside the expert's part of the schedule, each in one line through
`zerotuner config` and `check`; the objective draws the expert's sigmas only. On 2 CPU ranks at
ZeRO-2 the low-noise expert trains in full (the export's transformer_2 changed, transformer
byte-identical, the pipeline renders a clip, the log names the expert) and a LoRA on the
high-noise expert loads with `WanPipeline.load_lora_weights`; a low-noise expert's adapter
loads with `load_into_transformer_2=True` and merges into transformer_2.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import trainkit as tk
from test_flow_training import PROMPT, TOKENS
from test_wan import clip

from zerotuner import families
from zerotuner.errors import ConfigError
from zerotuner.settings.schema import Settings
from zerotuner.weights.checkpoint import read_manifest
from zerotuner.weights.export import export_checkpoint

BOUNDARY = 0.875
STEPS = 3


@pytest.fixture(scope="module")
def a14b(family_demo_dir, tmp_path_factory) -> Path:
    """The Wan demo as an A14B: model/ with transformer_2 (a copy of transformer) and
    boundary_ratio 0.875 in model_index.json; data/ a few of the demo's images and a clip."""
    demo = family_demo_dir("wan")
    root = tmp_path_factory.mktemp("a14b")
    model = root / "model"
    shutil.copytree(demo / "model", model)
    shutil.copytree(model / "transformer", model / "transformer_2")
    index = json.loads((model / "model_index.json").read_text())
    index |= {"transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": BOUNDARY}
    (model / "model_index.json").write_text(json.dumps(index))
    files = sorted(p for p in (demo / "data").rglob("*") if p.is_file())
    images = [p for p in files if p.suffix == ".png"][:6]
    clips = [p for p in files if p.suffix == ".mp4"][:1]
    for media in images + clips:  # with its caption
        for path in (media, media.with_suffix(".txt")):
            target = root / "data" / path.relative_to(demo / "data")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    return root


def test_the_tiny_a14b_loads_in_wan_pipeline(a14b):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(a14b / "model")
    assert type(pipe).__name__ == "WanPipeline" and pipe.transformer_2 is not None
    assert pipe.config.boundary_ratio == BOUNDARY
    assert families.resolve_family(str(a14b / "model"), expert="low") == "wan"
    shape = families.model_shape("wan", a14b / "model", denoiser="transformer_2")
    assert shape.boundary_ratio == BOUNDARY and shape.source.endswith("transformer_2/config.json")


def _config(monkeypatch, capsys, tmp_path, model: Path, **env: str) -> tuple[int, str]:
    """`zerotuner config --explain`'s exit code and its one error line."""
    (tmp_path / "data").mkdir(exist_ok=True)
    code, out, err = tk.config_explain(
        monkeypatch, capsys, tmp_path, ZT_MODEL=str(model), ZT_DATA_DIR=str(tmp_path / "data"),
        ZT_OUTPUT_DIR=str(tmp_path / "output"), **env,
    )  # fmt: skip
    errors = [line for line in err.splitlines() if line.startswith("zerotuner: error:")]
    assert out == "" and len(errors) == 1, err
    return code, errors[0]


@pytest.mark.parametrize(
    ("model", "env", "says"),
    [("a14b", {}, "set ZT_EXPERT=high or ZT_EXPERT=low"),
     ("a14b", {"ZT_MODEL_FAMILY": "wan"}, "set ZT_EXPERT=high or ZT_EXPERT=low"),
     ("wan", {"ZT_EXPERT": "high"}, "ZT_MODEL has one transformer"),
     ("sdxl", {"ZT_EXPERT": "low"}, "is a sdxl model"),
     ("a14b", {"ZT_EXPERT": "low", "ZT_TIMESTEP_RANGE": "0.5-0.9"}, "outside the low-noise"),
     ("a14b", {"ZT_EXPERT": "high", "ZT_TIMESTEP_RANGE": "0.5-1"}, "outside the high-noise"),
     ("a14b", {"ZT_EXPERT": "middle"}, "ZT_EXPERT='middle': expected 'high' or 'low'")],
)  # fmt: skip
def test_refusals_are_one_line_in_config_and_check(
    model, env, says, a14b, family_demo_dir, demo_dir, tmp_path, monkeypatch, capsys
):
    """Through the real `config` path (exit 2, one line) and `check` (its FAIL line)."""
    from zerotuner.cli import main

    folder = {"a14b": a14b / "model", "wan": family_demo_dir("wan") / "model",
              "sdxl": demo_dir / "model"}[model]  # fmt: skip
    code, line = _config(monkeypatch, capsys, tmp_path, folder, **env)
    assert code == 2 and says in line, line
    if "ZT_EXPERT" in env and env["ZT_EXPERT"] == "middle":
        return  # a settings error: `check` stops before its steps
    assert main(["check"]) == 2
    failed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("FAIL")]
    assert failed and says in failed[0], failed


def test_an_expert_inside_its_range_plans(a14b, tmp_path, monkeypatch, capsys):
    """ZT_EXPERT=low with a ZT_TIMESTEP_RANGE inside 0-0.875 is accepted; the plan counts the
    chosen expert's transformer_2."""
    (tmp_path / "data").mkdir()
    code, out, err = tk.config_explain(
        monkeypatch, capsys, tmp_path, ZT_MODEL=str(a14b / "model"), ZT_EXPERT="low",
        ZT_TIMESTEP_RANGE="0.2-0.8", ZT_DATA_DIR=str(tmp_path / "data"),
        ZT_OUTPUT_DIR=str(tmp_path / "output"),
    )  # fmt: skip
    assert code == 0, err


def _objective(a14b: Path, **settings):
    kind = families.get("wan").configured(Settings(**settings), a14b / "model")
    scheduler = kind.scheduler_class().from_pretrained(a14b / "model", subfolder="scheduler")
    return kind, kind.objective(Settings(**settings), scheduler, {})


def test_the_objective_draws_the_experts_sigmas(a14b):
    """high: sigmas in [0.875, 1], low: in [0, 0.875] (WanPipeline's split: t >= boundary *
    1000 is `transformer`'s), a ZT_TIMESTEP_RANGE inside narrows it, one outside is refused."""
    from zerotuner.families.flow_matching import sample_sigmas

    draws = torch.Generator().manual_seed(0)
    for expert, part, (low, high) in (("high", "transformer", (BOUNDARY, 1.0)),
                                      ("low", "transformer_2", (0.0, BOUNDARY))):  # fmt: skip
        kind, objective = _objective(a14b, expert=expert)
        assert kind.denoiser == part and objective.config.timestep_range == (low, high)
        sigmas = sample_sigmas(4096, objective.config, draws)
        assert low <= sigmas.min() and sigmas.max() <= high
        assert sigmas.max() - sigmas.min() > 0.5 * (high - low)  # all of the range, not a point
        assert objective.describe().startswith(
            f"{expert}-noise expert ({part}), sigmas in {low:g}-{high:g}: flow matching"
        )
    _, narrowed = _objective(a14b, expert="low", timestep_range="0.2-0.5")
    sigmas = sample_sigmas(4096, narrowed.config, draws)
    assert sigmas.min() >= 0.2 and sigmas.max() <= 0.5
    with pytest.raises(ConfigError, match="outside the low-noise expert"):
        _objective(a14b, expert="low", timestep_range="0.5-1")


# The ranks' `flow_matching.sample_sigmas`, wrapped where it is defined: every draw of the run's
# objective appended to $SIGMAS_LOG (a sitecustomize on the ranks' PYTHONPATH).
SIGMAS_HOOK = """
import importlib.abc, importlib.util, os, sys

class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "zerotuner.families.flow_matching":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            draw = module.sample_sigmas

            def logged(*args, **kwargs):
                sigmas = draw(*args, **kwargs)
                with open(os.environ["SIGMAS_LOG"], "a") as out:
                    out.write(" ".join(map(str, sigmas.tolist())) + "\\n")
                return sigmas

            module.sample_sigmas = logged

        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("SIGMAS_LOG"):
    sys.meta_path.insert(0, Hook())
"""


def _train(a14b: Path, tmp: Path, **settings) -> tuple[Path, str]:
    """A14B trained on 2 CPU ranks at ZeRO-2 for STEPS steps; (output, the ranks' log). The
    sigmas its objective drew: tmp/sigmas.txt."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "hook").mkdir()
    (tmp / "hook" / "sitecustomize.py").write_text(SIGMAS_HOOK)
    config = tk.ds_config(2, world=2, steps=STEPS, lr=settings.pop("lr", 3e-3))
    job = tk.write_job(tmp / "job.json", model=a14b / "model", deepspeed=config, family="wan")
    output = tmp / "output"
    env = tk.settings_env(
        model=a14b / "model", data=a14b / "data", output=output, cache=a14b / "cache",
        max_steps=STEPS, log_every_steps=1, max_sequence_length=TOKENS, video_frames=5,
        **settings,
    )  # fmt: skip
    paths = [str(tmp / "hook"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env |= {"PYTHONPATH": os.pathsep.join(paths), "SIGMAS_LOG": str(tmp / "sigmas.txt")}
    proc = tk.run_ranks(tmp, env, job_file=job)
    tk.assert_ok(proc, tmp)
    return output, proc.stdout + proc.stderr


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.slow
def test_low_expert_full_fine_tuning_at_zero_2(a14b, tmp_path):
    """The low-noise expert alone trains: the objective drew sigmas in 0-0.875 only (every
    draw, recorded through the real sampler), the export's transformer_2 changed, its
    transformer is the base's byte for byte, the pipeline renders a clip, and the checkpoint
    records the expert, which `zerotuner export` writes back into transformer_2; it resumes
    on one rank at ZeRO-3."""
    import numpy as np
    from diffusers import DiffusionPipeline

    output, log = _train(a14b, tmp_path / "full", expert="low", checkpoint_every_steps=0)
    assert "low-noise expert (transformer_2), sigmas in 0-0.875" in log
    drawn = [float(x) for x in (tmp_path / "full" / "sigmas.txt").read_text().split()]
    assert len(drawn) >= 2 * STEPS and all(0 <= x <= BOUNDARY for x in drawn), drawn
    assert [s["step"] for s in tk.read_steps(output)] == list(range(1, STEPS + 1))
    final, base = output / "final", a14b / "model"
    for name in sorted(p.name for p in (base / "transformer").iterdir()):
        assert (final / "transformer" / name).read_bytes() == (
            base / "transformer" / name
        ).read_bytes()
    trained, before = _tensors(final / "transformer_2"), _tensors(base / "transformer_2")
    assert trained.keys() == before.keys()
    assert any(not torch.equal(trained[k], before[k]) for k in before)
    pipe = DiffusionPipeline.from_pretrained(final)
    assert type(pipe).__name__ == "WanPipeline" and pipe.config.boundary_ratio == BOUNDARY
    frames = clip(pipe, frames=5)
    assert frames.shape == (5, 64, 64, 3) and np.isfinite(frames).all()
    checkpoint = output / "checkpoints" / f"step-{STEPS}"
    manifest = read_manifest(checkpoint)
    assert (manifest["expert"], manifest["denoiser"]) == ("low", "transformer_2")
    exported = export_checkpoint(checkpoint, tmp_path / "exported")  # `zerotuner export`
    assert _tensors(exported / "transformer_2").keys() == trained.keys()
    assert all(torch.equal(v, trained[k]) for k, v in _tensors(exported / "transformer_2").items())
    assert _tensors(exported / "transformer").keys() == _tensors(base / "transformer").keys()
    with pytest.raises(ConfigError, match="trained with ZT_EXPERT=low"):
        from zerotuner.weights.checkpoint import check_model

        check_model(manifest, family="wan", denoiser_params=None, model="m", path=output,
                    expert="high")  # fmt: skip
    # The expert resumes on one rank at ZeRO-3: another world size and stage.
    resume = tmp_path / "resume"
    resume.mkdir()
    config = tk.ds_config(3, world=1, steps=STEPS + 2)
    job = tk.write_job(resume / "job.json", model=a14b / "model", deepspeed=config, family="wan",
                       world=1)  # fmt: skip
    env = tk.settings_env(
        model=a14b / "model", data=a14b / "data", output=output, cache=a14b / "cache",
        max_steps=STEPS + 2, log_every_steps=1, max_sequence_length=TOKENS, video_frames=5,
        expert="low", checkpoint_every_steps=0,
    )  # fmt: skip
    proc = tk.run_ranks(resume, env, job_file=job, world=1)
    tk.assert_ok(proc, resume, world=1)
    assert f"at step {STEPS}" in proc.stdout + proc.stderr
    assert [s["step"] for s in tk.read_steps(output)][-2:] == [STEPS + 1, STEPS + 2]
    again = _tensors(output / "final" / "transformer_2")
    assert any(not torch.equal(again[k], trained[k]) for k in trained)  # trained on
    for name in sorted(p.name for p in (base / "transformer").iterdir()):  # still the base's
        assert (output / "final" / "transformer" / name).read_bytes() == (
            base / "transformer" / name
        ).read_bytes()


@pytest.mark.slow
def test_high_expert_lora_at_zero_2_loads_in_wan_pipeline(a14b, tmp_path):
    """A LoRA on the high-noise expert (ZeRO-2): `transformer.` keys that
    WanPipeline.load_lora_weights puts on `transformer` and that change the clip; the merged
    pipeline's transformer_2 is the base's."""
    import numpy as np
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    from zerotuner.weights import lora_files

    output, log = _train(
        a14b, tmp_path / "lora", expert="high", training_type="lora", lora_rank=4,
        lora_alpha=4, lr=3e-2, lora_merge=True, checkpoint_every_steps=0,
    )  # fmt: skip
    assert "high-noise expert (transformer), sigmas in 0.875-1" in log
    final = output / "final"
    adapter = load_file(final / lora_files.ADAPTER_FILE)
    assert adapter and all(k.startswith("transformer.") for k in adapter)
    pipe = DiffusionPipeline.from_pretrained(a14b / "model")
    before = clip(pipe, PROMPT)
    pipe.load_lora_weights(final)
    assert np.abs(clip(pipe, PROMPT) - before).max() > 1e-4, "the adapter changes nothing"
    merged = final / lora_files.MERGED  # fused into transformer; transformer_2 the base's
    for name in [p.name for p in (a14b / "model" / "transformer_2").iterdir()]:
        base = (a14b / "model" / "transformer_2" / name).read_bytes()
        assert (merged / "transformer_2" / name).read_bytes() == base
    fused, base1 = _tensors(merged / "transformer"), _tensors(a14b / "model" / "transformer")
    assert any(not torch.equal(fused[k], base1[k]) for k in base1)


def test_a_low_expert_adapter_loads_into_transformer_2(a14b, tmp_path):
    """What a low-expert LoRA run writes (lora_files.write_adapter with its `transformer_2`):
    `transformer.` keys, as WanPipeline.save_lora_weights writes them, that
    `load_lora_weights(..., load_into_transformer_2=True)` puts on transformer_2 alone, and a
    merged pipeline whose transformer_2 is fused and transformer the base's."""
    import numpy as np
    from diffusers import DiffusionPipeline, WanTransformer3DModel
    from safetensors.torch import load_file

    from zerotuner.weights import lora, lora_files

    settings = Settings(training_type="lora", lora_rank=4, lora_alpha=4)
    expert = WanTransformer3DModel.from_pretrained(a14b / "model", subfolder="transformer_2")
    lora.add_adapter(expert, settings)
    draws = torch.Generator().manual_seed(0)
    state = {
        name: torch.randn(p.shape, generator=draws) * 0.5 if "lora_B" in name else p.detach()
        for name, p in expert.named_parameters()
        if p.requires_grad
    }
    out = lora_files.write_adapter(
        "wan", state, lora.shapes(expert), lora.metadata(lora.lora_config(settings)),
        tmp_path / "final", merge_base=a14b / "model", denoiser="transformer_2",
    )  # fmt: skip
    adapter = load_file(out / lora_files.ADAPTER_FILE)
    assert adapter and all(k.startswith("transformer.") for k in adapter)
    pipe = DiffusionPipeline.from_pretrained(a14b / "model")
    before = clip(pipe)
    pipe.load_lora_weights(out, load_into_transformer_2=True)
    assert not any("lora" in n for n, _ in pipe.transformer.named_parameters())
    assert any("lora" in n for n, _ in pipe.transformer_2.named_parameters())
    adapted = clip(pipe)
    assert np.abs(adapted - before).max() > 1e-4, "the adapter changes nothing"
    merged = out / lora_files.MERGED
    for name in [p.name for p in (a14b / "model" / "transformer").iterdir()]:
        base = (a14b / "model" / "transformer" / name).read_bytes()
        assert (merged / "transformer" / name).read_bytes() == base
    fused = DiffusionPipeline.from_pretrained(merged)
    assert np.abs(clip(fused) - adapted).max() < 1e-3
