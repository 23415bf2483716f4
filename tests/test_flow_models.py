"""The tiny SD3 and Flux.1 pipelines (demo_flow.py): real diffusers/transformers classes built
offline, T5 tokenizer included, that load and generate through their own pipelines; and what
zerotuner says about them today (not trainable yet: one line, exit 2, not a wrong family)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trainkit as tk

from zerotuner.demo.flow import T5_MAX_TOKENS


@pytest.fixture(scope="session")
def flow_models(flow_demo_dirs) -> dict[str, Path]:
    return {family: root / "model" for family, root in flow_demo_dirs.items()}


@pytest.mark.parametrize(
    ("family", "pipeline", "t5"),
    [("sd3", "StableDiffusion3Pipeline", "tokenizer_3"), ("flux", "FluxPipeline", "tokenizer_2")],
)
def test_tiny_flow_pipelines_load_and_generate(flow_models, family, pipeline, t5):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(flow_models[family])
    pipe.set_progress_bar_config(disable=True)
    assert type(pipe).__name__ == pipeline
    assert pipe.vae.config.latent_channels == 16 and pipe.vae.config.shift_factor
    ids = getattr(pipe, t5)(["a red circle"], padding="max_length", max_length=T5_MAX_TOKENS)
    words, eos, pad = ids.input_ids[0][:3], ids.input_ids[0][3], ids.input_ids[0][4:]
    assert len(set(words)) == 3 and 2 not in words, "a word is unknown to the T5 tokenizer"
    assert (eos, set(pad)) == (1, {0})  # </s>, then <pad> to the length
    images = [
        pipe(prompt, num_inference_steps=2, height=64, width=64, output_type="np",
             max_sequence_length=T5_MAX_TOKENS,
             generator=torch.Generator().manual_seed(0)).images[0]
        for prompt in ("a red circle", "a blue square")
    ]  # fmt: skip
    assert images[0].shape == (64, 64, 3)
    assert abs(images[0] - images[1]).mean() > 0, "the prompt does not reach the transformer"


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_transformer_pipelines_are_detected_and_foreign_settings_refused(
    flow_models, family, demo_dir, monkeypatch, capsys, tmp_path
):
    """SD3's model_index has a text_encoder_2 like SDXL's: it must not pass as SDXL. A DDPM
    setting with a flow-matching model (and the reverse) is one line, exit 2."""
    from zerotuner.families import detect_family

    assert detect_family(flow_models[family]) == family
    code, out, err = tk.config_explain(
        monkeypatch, capsys, tmp_path, ZT_MODEL=str(flow_models[family]), ZT_SNR_GAMMA="5"
    )
    lines = [line for line in err.splitlines() if line.startswith("zerotuner: error:")]
    assert code == 2 and out == "" and "Traceback" not in err
    assert lines == [
        f"zerotuner: error: ZT_SNR_GAMMA is set but ZT_MODEL is a {family} model, trained by "
        "flow matching (a transformer family): unset ZT_SNR_GAMMA (it applies to the UNet "
        "families only)"
    ]
    monkeypatch.delenv("ZT_SNR_GAMMA")
    code, out, err = tk.config_explain(
        monkeypatch, capsys, tmp_path, ZT_MODEL=str(demo_dir / "model"), ZT_LOGIT_STD="1.5"
    )
    assert code == 2 and "ZT_LOGIT_STD is set but ZT_MODEL is a sdxl model" in err


def test_demo_command_writes_a_flow_demo_and_its_config_passes(monkeypatch, capsys, tmp_path):
    """`zerotuner demo DIR --family flux` prints a command whose config (demo-flow.yaml: no
    DDPM settings) passes `config --explain` for that model."""
    from zerotuner.cli import main

    repo = Path(__file__).resolve().parents[1]
    assert main(["demo", str(tmp_path / "demo"), "--family", "flux"]) == 0
    printed = capsys.readouterr().out
    assert "train the whole transformer on it" in printed and "demo-flow.yaml" in printed
    code, out, err = tk.config_explain(
        monkeypatch, capsys, tmp_path, ZT_MODEL=str(tmp_path / "demo" / "model"),
        ZT_CONFIG_FILE=str(repo / "config" / "demo-flow.yaml"),
    )  # fmt: skip
    assert code == 0, err
    assert "flux" in out + err


def test_models_page_table_of_flow_plans_is_what_the_planner_says():
    """docs/models.md's SD3.5 Large / FLUX.1-dev table (bench/paper.py) cannot drift from the
    planner."""

    repo = Path(__file__).resolve().parents[1]
    from bench.paper import flow_plans_markdown

    page = (repo / "docs/models.md").read_text()
    start = page.index("<!-- flow-plans:start -->\n") + len("<!-- flow-plans:start -->\n")
    assert page[start : page.index("<!-- flow-plans:end -->")] == flow_plans_markdown()


def test_the_t5_length_is_part_of_a_cached_captions_key(tmp_path):
    """ZT_MAX_SEQUENCE_LENGTH changes the cached tensor: another length is another entry."""
    import dataclasses

    from zerotuner.families import get
    from zerotuner.train.feature_cache import FeatureCache

    def path(length: int) -> Path:
        kind = dataclasses.replace(get("flux"), max_sequence_length=length)
        cache = FeatureCache(
            tmp_path, vae_key="v", text_key="t" + kind.text_cache_tag(), flip=False
        )
        return cache.text_path("a red circle")

    assert path(16) == path(16) != path(32)


def test_flux_full_fine_tuning_on_4_x_80_gb_lands_on_zero_3():
    """Users report FLUX.1 full fine-tuning out of memory at ZeRO-2 on 4 x 80 GB and running at
    ZeRO-3: the planner's estimate agrees."""
    from zerotuner.families import model_shape
    from zerotuner.machine.hardware import GPU, GiB, Hardware
    from zerotuner.preflight.plan import PlanRequest, make_plan

    memory = 80 * GiB
    node = Hardware(
        "cuda", tuple(GPU(i, "H100", memory, memory, (9, 0)) for i in range(4)),
        host_memory=512 * GiB, cpu_count=64,
    )  # fmt: skip
    request = PlanRequest(resolution=1024, micro_batch=1, world_size=4, mixed_precision="bf16")
    plan = make_plan(
        shape=model_shape("flux"), hardware=node, request=request, offload_disk_free=2 * 10**12
    )
    assert plan.choice.zero_stage == 3 and plan.choice.offload_optimizer == "none"
    zero2 = [r for r in plan.rows if r.zero_stage == 2 and r.offload_optimizer == "none"]
    assert zero2 and not any(r.fits for r in zero2)
