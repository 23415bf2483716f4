"""The newer flow-matching families (issues 30 and 47): Chroma, Z-Image, Qwen-Image, FLUX.2
[dev] and [klein], Krea 2, HiDream-I1. Each family's
tiny demo (real diffusers/transformers classes) loads and generates through its own pipeline and
is told apart by its files and its hub id; the cached captions are the pipeline's own
conditioning; on 2 CPU ranks at ZeRO-3 it trains in full (zero.Init, CPU offload, EMA) and as
LoRA (NVMe offload): the held-out loss falls, the export loads and generates in the family's
pipeline, the adapter loads with `load_lora_weights`, and the full run's checkpoint resumes on
one rank at ZeRO-2 (FLUX.2 [klein], [dev]'s transformer and objective with Qwen3's captions,
trains as LoRA only here). Image-edit models are refused in one line; the planner's table of the
published models is the docs' one.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import trainkit as tk
from test_flow_training import (
    PROMPT,
    SAVED,
    STEPS,
    TOKENS,
    assert_ema_differs,
    assert_trained_and_generates,
    pipeline_parts,
    rendered_side,
    resumes_on_one_rank_at_zero_2,
    run,
    saved_run,
)
from test_flow_training import held_out_loss as family_held_out_loss

from zerotuner import families
from zerotuner.errors import ConfigError
from zerotuner.settings.schema import Settings
from zerotuner.train import model
from zerotuner.weights.checkpoint import read_manifest

NEW = ["chroma", "zimage", "qwenimage", "flux2", "flux2klein", "krea2", "hidream"]
PIPELINES = {"chroma": "ChromaPipeline", "zimage": "ZImagePipeline",
             "qwenimage": "QwenImagePipeline", "flux2": "Flux2Pipeline",
             "flux2klein": "Flux2KleinPipeline", "krea2": "Krea2Pipeline",
             "hidream": "HiDreamImagePipeline"}  # fmt: skip
TRANSFORMERS = {"chroma": "ChromaTransformer2DModel", "zimage": "ZImageTransformer2DModel",
                "qwenimage": "QwenImageTransformer2DModel", "flux2": "Flux2Transformer2DModel",
                "flux2klein": "Flux2Transformer2DModel",
                "krea2": "Krea2Transformer2DModel",
                "hidream": "HiDreamImageTransformer2DModel"}  # fmt: skip
HUB_IDS = {"chroma": "lodestones/Chroma1-HD", "zimage": "Tongyi-MAI/Z-Image-Turbo",
           "qwenimage": "Qwen/Qwen-Image", "flux2": "black-forest-labs/FLUX.2-dev",
           "flux2klein": "black-forest-labs/FLUX.2-klein-4B",
           "krea2": "krea/Krea-2-Raw", "hidream": "HiDream-ai/HiDream-I1-Full"}  # fmt: skip


def image(pipe, prompt: str = PROMPT):
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompt=prompt, num_inference_steps=2, height=64, width=64, output_type="np",
        max_sequence_length=TOKENS, generator=torch.Generator().manual_seed(0),
    ).images[0]  # fmt: skip


# --- the demo, detection, refusals --------------------------------------------------------


@pytest.mark.parametrize("family", NEW)
def test_demo_generates_in_its_pipeline_and_is_detected(family, family_demo_dir, tmp_path):
    """`zerotuner demo --family F` is F's pipeline, which generates prompt-dependent images;
    the family is read from model_index.json, from a bare transformer folder's config, and
    (offline) from the published hub id's name."""
    from diffusers import DiffusionPipeline

    demo = family_demo_dir(family)
    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    assert type(pipe).__name__ == PIPELINES[family]
    first, second = image(pipe), image(pipe, "a blue square on a black background")
    assert first.shape == (rendered_side(pipe), rendered_side(pipe), 3)
    assert abs(first - second).mean() > 0
    assert families.detect_family(demo / "model") == family
    bare = tmp_path / "bare"
    shutil.copytree(demo / "model" / "transformer", bare / "transformer")
    assert families.detect_family(bare) == family
    config = json.loads((bare / "transformer" / "config.json").read_text())
    assert config["_class_name"] == TRANSFORMERS[family]
    assert families.resolve_family(HUB_IDS[family]) == family


def test_krea2_turbo_is_krea2_and_told_to_train_on_raw(family_demo_dir, tmp_path, monkeypatch,
                                                       capsys):  # fmt: skip
    """Krea 2 Turbo (model_index.json's `is_distilled`, or its hub name) is Krea 2's network:
    detected as krea2 and trained with the fixed shift it was distilled at, while `config`
    warns that adapters are trained on Raw and applied on Turbo; Raw gets no warning."""
    from diffusers import DiffusionPipeline

    demo = family_demo_dir("krea2")
    turbo = tmp_path / "turbo"
    shutil.copytree(demo / "model", turbo)
    index = json.loads((turbo / "model_index.json").read_text())
    (turbo / "model_index.json").write_text(json.dumps(index | {"is_distilled": True}))
    assert families.detect_family(turbo) == families.resolve_family("krea/Krea-2-Turbo") == "krea2"
    assert families.distilled_note("krea2", demo / "model", str(demo / "model")) is None
    assert families.distilled_note("krea2", None, "krea/Krea-2-Raw") is None
    assert "train on krea/Krea-2-Raw" in families.distilled_note("krea2", None, "krea/Krea-2-Turbo")
    scheduler = DiffusionPipeline.from_pretrained(demo / "model").scheduler
    for folder, shift in ((demo / "model", "mu 0.5-1.15"), (turbo, "shift exp(1.15), Turbo's")):
        kind = families.get("krea2").configured(Settings(), folder)
        assert shift in kind.objective(Settings(), scheduler, {}).describe()
    code, out, err = tk.config_explain(monkeypatch, capsys, tmp_path, ZT_MODEL=str(turbo),
                                       ZT_DATA_DIR=str(demo / "data"))  # fmt: skip
    assert code == 0 and "train on krea/Krea-2-Raw and apply the adapter" in out + err
    monkeypatch.setenv("ZT_OUTPUT_DIR", str(tmp_path / "output"))
    from zerotuner.cli import main

    main(["check"])  # `check` says it too, as its model step's warning
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if "train on krea/Krea-2-Raw" in x]
    assert line.startswith("WARN") and "model" in line


def test_hidream_presets_name_its_layers_and_its_training_output_is_the_pipelines(
    family_demo_dir, tmp_path, monkeypatch, capsys
):  # fmt: skip
    """The `attention` preset names diffusers' Attention output `to_out.0`; HiDream's is `to_out`:
    the planner sizes, the ranks add and the adapter's metadata name the example's four layers,
    and a preset naming none of its layers (attention+ff's feed-forward) is refused in one line.
    The transformer's training-mode output (its experts' differentiable path, in patches), put
    back by the objective, is its inference output. Dev and Fast are told to train on Full."""
    from diffusers import DiffusionPipeline

    from zerotuner.preflight.trainable import lora_adapter
    from zerotuner.weights import lora

    demo = family_demo_dir("hidream") / "model"
    meta = families.meta_model("hidream", demo)
    targets = lora.parse_targets("attention")
    assert lora.resolve_targets(meta, targets) == ("to_k", "to_q", "to_v", "to_out")
    size, _ = lora.adapter_size(meta, ("to_k", "to_q", "to_v", "to_out"), 4)
    shape = families.model_shape("hidream", demo)
    assert lora_adapter(shape, rank=4, targets=targets, model_dir=demo).trainable_params == size
    settings = Settings(training_type="lora", lora_rank=4)
    assert sorted(lora.lora_config(settings, meta).target_modules) == sorted(
        ("to_k", "to_q", "to_v", "to_out")
    )
    with pytest.raises(ConfigError) as refused:
        lora.check_model_targets(settings.model_copy(update={"lora_targets": "attention+ff"}),
                                 "hidream", demo)  # fmt: skip
    assert "\n" not in str(refused.value) and "ff.net.0.proj, ff.net.2" in str(refused.value)
    assert lora.resolve_targets(families.meta_model("sd3"), targets) == targets  # to_out.0 there

    pipe = DiffusionPipeline.from_pretrained(demo)
    kind = dataclasses.replace(families.get("hidream"), max_sequence_length=TOKENS)
    text = kind.encode_text(pipeline_parts(pipe, "hidream", kind), [PROMPT, "a green circle"])
    kwargs = kind.model_kwargs(text, torch.float32)
    objective = kind.objective(Settings(), pipe.scheduler, pipe.transformer.config)
    assert "shift 3)" in objective.describe()
    latents, t = torch.randn(2, 16, 16, 8), torch.tensor([300.0, 800.0])
    with torch.no_grad():
        served = objective.call(pipe.transformer.eval(), latents, t, kwargs)
        trained = objective.call(pipe.transformer.train(), latents, t, kwargs)
    assert served.shape == latents.shape
    torch.testing.assert_close(trained, served)
    note = families.distilled_note("hidream", None, "HiDream-ai/HiDream-I1-Dev")
    assert note is not None and "train on HiDream-ai/HiDream-I1-Full" in note
    assert families.distilled_note("hidream", None, HUB_IDS["hidream"]) is None
    assert families.resolve_family("HiDream-ai/HiDream-I1-Fast") == "hidream"


@pytest.mark.parametrize(
    ("name", "index"),
    [("HiDream-ai/HiDream-E1-Full", "HiDreamImageEditingPipeline")],
)  # fmt: skip
def test_image_edit_models_are_refused_in_one_line(name, index, tmp_path, monkeypatch, capsys):
    """An image-edit model needs paired images: by hub id (offline) or by its model_index, one
    line naming what zerotuner trains (`config --explain`: exit 2)."""
    with pytest.raises(ConfigError) as by_name:
        families.resolve_family(name)
    folder = tmp_path / "edit"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": index}))
    with pytest.raises(ConfigError) as by_index:
        families.resolve_family(str(folder))
    for error in (by_name.value, by_index.value):
        text = str(error)
        assert "\n" not in text and "image-edit model" in text
        assert "chroma, zimage" in text
    # FLUX.2 is not guessed as FLUX.1 by its name; it edits with reference images: an edit
    # fine-tune's name is its family's (tests/test_edit_flux2.py)
    assert families.resolve_family("black-forest-labs/FLUX.2-dev") == "flux2"
    assert families.resolve_family("someone/FLUX.2-dev-edit") == "flux2"
    assert families.resolve_family("someone/sdxl-credit-cards") == "sdxl"  # a word, not "edit"
    # an edit family's own marker says an edit pipeline that is no family (Kontext's inpainting)
    (folder / "model_index.json").write_text(
        json.dumps({"_class_name": "FluxKontextInpaintPipeline"})
    )
    with pytest.raises(ConfigError, match="image-edit model.*fluxkontext"):
        families.resolve_family(str(folder))
    (tmp_path / "data").mkdir()
    code, out, err = tk.config_explain(monkeypatch, capsys, tmp_path, ZT_MODEL=name,
                                       ZT_DATA_DIR=str(tmp_path / "data"))  # fmt: skip
    errors = [line for line in err.splitlines() if line.startswith("zerotuner: error:")]
    assert (code, out, len(errors)) == (2, "", 1) and "image-edit model" in errors[0]


@pytest.mark.parametrize("family", NEW)
def test_cached_captions_are_the_pipelines_own_conditioning(family, family_demo_dir):
    """What the cache holds for a caption is what the family's pipeline encodes it to (Chroma:
    T5 with the attention mask and its text mask; Z-Image: Qwen3's penultimate states of the
    chat-templated prompt, the real tokens only; Qwen-Image: Qwen2.5-VL's last states after the
    template's 34 tokens, padded to the batch's longest; Krea 2: the pipeline's tapped Qwen3-VL
    layers stacked per token, with its mask; HiDream: T5's states, every Llama layer's and the
    two CLIPs' pooled projections)."""
    from diffusers import DiffusionPipeline

    demo = family_demo_dir(family) / "model"
    pipe = DiffusionPipeline.from_pretrained(demo)
    kind = families.get(family).configured(Settings(), demo)  # Krea 2: the pipeline's taps
    kind = dataclasses.replace(kind, max_sequence_length=TOKENS)
    parts = pipeline_parts(pipe, family, kind)
    captions = [PROMPT, "a blue square on a black background", "a green circle"]
    ours = kind.encode_text(parts, captions)
    assert ours["prompt_embeds"].dtype == torch.bfloat16
    kwargs = kind.model_kwargs(ours, torch.float32)
    if family == "chroma":
        embeds, _, mask, *_ = pipe.encode_prompt(
            captions, None, do_classifier_free_guidance=False, max_sequence_length=TOKENS
        )
        torch.testing.assert_close(ours["prompt_embeds"], embeds.to(torch.bfloat16))
        torch.testing.assert_close(kwargs["text_mask"], mask.float())
    elif family == "qwenimage":
        embeds, mask = pipe.encode_prompt(list(captions), max_sequence_length=TOKENS)
        torch.testing.assert_close(
            kwargs["encoder_hidden_states"], embeds.to(torch.bfloat16).float()
        )
        assert mask is not None  # the captions differ in length
        assert torch.equal(kwargs["encoder_hidden_states_mask"], mask)
    elif family == "krea2":  # the tapped layers stacked per token, the padding masked
        embeds, mask = pipe.encode_prompt(list(captions), max_sequence_length=TOKENS)
        assert embeds.shape[1:3] == (TOKENS, len(pipe.config.text_encoder_select_layers))
        torch.testing.assert_close(
            kwargs["encoder_hidden_states"], embeds.to(torch.bfloat16).float()
        )
        assert mask.dtype == torch.bool and not mask.all()
        assert torch.equal(kwargs["encoder_attention_mask"], mask)
    elif family == "hidream":  # the cache holds Llama's layers batch first, the model layers first
        t5, _, llama, _, pooled, _ = pipe.encode_prompt(
            list(captions), do_classifier_free_guidance=False, max_sequence_length=TOKENS
        )
        assert llama.shape[:3] == (pipe.text_encoder_4.config.num_hidden_layers, 3, TOKENS)
        for key, own in (("encoder_hidden_states_t5", t5), ("encoder_hidden_states_llama3", llama),
                         ("pooled_embeds", pooled)):  # fmt: skip
            # cached in bf16: within its rounding (CPU matmuls need not round alike twice)
            torch.testing.assert_close(kwargs[key], own, rtol=2**-7, atol=1e-6)
    elif family.startswith("flux2"):  # layers (10, 20, 30) / (9, 18, 27) side by side
        embeds, _ = pipe.encode_prompt(list(captions), max_sequence_length=TOKENS)
        assert embeds.shape[1:] == (TOKENS, pipe.transformer.config.joint_attention_dim)
        torch.testing.assert_close(
            kwargs["encoder_hidden_states"], embeds.to(torch.bfloat16).float()
        )
        # [dev]'s 24B encoder streams from host memory while caching (here to the CPU): the
        # weights leave the module (meta), the states stay the same
        parts.text_encoders = [model.streamed(parts.text_encoders[0], torch.device("cpu"))]
        assert {p.device.type for p in parts.text_encoders[0].parameters()} == {"meta"}
        assert torch.equal(kind.encode_text(parts, captions)["prompt_embeds"],
                           ours["prompt_embeds"])  # fmt: skip
    else:
        embeds, _ = pipe.encode_prompt(
            list(captions), do_classifier_free_guidance=False, max_sequence_length=TOKENS
        )
        assert [e.shape for e in kwargs["cap_feats"]] == [e.shape for e in embeds]
        for cached, own in zip(kwargs["cap_feats"], embeds, strict=True):
            torch.testing.assert_close(cached, own.to(torch.bfloat16).float())


# --- training on 2 CPU ranks ------------------------------------------------------------------

FULL = {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu", "ema": True}
LORA = {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme",
        "training_type": "lora", "lora_rank": 4, "lora_alpha": 4, "lora_merge": True,
        "lr": 1e-2}  # fmt: skip
# Qwen-Image's attention adapter moves its tiny model's loss slowly at 1e-2 over 10 steps;
# FLUX.2's adapters are the example's default: the single-stream block's projections too.
LORA_LR = {"qwenimage": 3e-2, "flux2": 3e-2, "flux2klein": 5e-2, "krea2": 3e-2, "hidream": 3e-2}
FLUX2_TARGETS = "attention,to_qkv_mlp_proj,single_transformer_blocks.0.attn.to_out"
# Krea 2's: attention and the SwiGLUs, part of its authors' default (every Linear: musubi-tuner's
# networks/lora_krea2.py); attention alone moves the tiny model's loss slowly. HiDream's:
# the example's attention (`--lora_layers` widens it) and the experts' SwiGLUs, routed and shared
LORA_TARGETS = {"flux2": FLUX2_TARGETS, "flux2klein": FLUX2_TARGETS,
                "krea2": "attention,ff.gate,ff.up,ff.down",
                "hidream": "attention,w1,w2,w3"}  # fmt: skip


@pytest.fixture(scope="session", params=NEW)
def full_run(request, family_demo_dir, tmp_path_factory):
    family = request.param
    demo = family_demo_dir(family)
    return family, demo, *saved_run(tmp_path_factory, demo, family, **FULL)


@pytest.mark.slow
def test_full_fine_tuning_at_zero_3_trains_samples_and_exports(full_run) -> None:
    """ZeRO-3 with the optimizer and parameters on the CPU: every step logged, the held-out
    loss falls, final/ is the family's pipeline and generates, the EMA is another model."""

    family, demo, output, log = full_run
    assert [s["step"] for s in tk.read_steps(output)] == list(range(1, STEPS + 1))
    assert "flow matching (sigmas logit_normal(0, 1)" in log
    final = assert_trained_and_generates(demo, family, output / "final")
    (sample,) = (output / "samples" / f"step-{STEPS}").glob("*.png")
    assert sample.stat().st_size > 0
    manifest = read_manifest(output / "checkpoints" / f"step-{SAVED}")
    assert (manifest["family"], manifest["zero_stage"]) == (family, 3)
    assert_ema_differs(output, final)


@pytest.mark.slow
def test_full_checkpoint_resumes_on_one_rank_at_zero_2(full_run, tmp_path) -> None:
    """From the step-5 checkpoint, 1 rank at ZeRO-2 (the universal checkpoint) trains steps
    6-10, EMA included, and exports the pipeline folder."""
    family, demo, output, _ = full_run
    resumes_on_one_rank_at_zero_2(tmp_path, demo, family, output, PIPELINES[family])


@pytest.mark.slow
@pytest.mark.parametrize("family", NEW)
def test_lora_at_zero_3_loads_in_the_pipeline(family, family_demo_dir, tmp_path) -> None:
    """A LoRA adapter at ZeRO-3 with everything on NVMe: `transformer.` keys that the family's
    pipeline loads with `load_lora_weights`, lowering the held-out loss and changing the
    images; the merged pipeline renders the same images; `export` writes the same adapter."""
    import numpy as np
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    from zerotuner.weights import lora_files
    from zerotuner.weights.export import export_checkpoint

    demo, output = family_demo_dir(family), tmp_path / "output"
    settings = LORA | {"lr": LORA_LR.get(family, LORA["lr"])}
    if family in LORA_TARGETS:
        settings["lora_targets"] = LORA_TARGETS[family]
    run(tmp_path, demo, family, output=output, checkpoint_every_steps=STEPS, **settings)
    final = output / "final"
    adapter = load_file(final / lora_files.ADAPTER_FILE)
    assert adapter and all(k.startswith("transformer.") for k in adapter)
    exported = load_file(
        export_checkpoint(output / "checkpoints" / f"step-{STEPS}", tmp_path / "exported")
        / lora_files.ADAPTER_FILE
    )
    assert exported.keys() == adapter.keys()
    assert all(torch.equal(exported[k], adapter[k]) for k in adapter)
    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    before, loss_before = image(pipe), family_held_out_loss(demo, family, pipe.transformer)
    pipe.load_lora_weights(final)
    adapted = image(pipe)
    assert family_held_out_loss(demo, family, pipe.transformer) < 0.97 * loss_before
    merged = image(DiffusionPipeline.from_pretrained(final / lora_files.MERGED))
    assert np.abs(adapted - before).max() > 1e-3, "the adapter changes nothing"
    assert np.abs(merged - adapted).max() < 1e-3


# --- the planner on the published sizes -------------------------------------------------------


def test_models_page_table_of_the_newer_families_is_what_the_planner_says():
    """docs/models.md's Chroma1-HD / Z-Image-Turbo table (bench/paper.py: full and LoRA on
    1 x 24 GB, 1 x 80 GB, 8 x 80 GB) cannot drift from the planner."""

    repo = Path(__file__).resolve().parents[1]
    from bench.paper import family_plans_markdown

    page = (repo / "docs/models.md").read_text()
    start = page.index("<!-- family-plans:start -->\n") + len("<!-- family-plans:start -->\n")
    assert page[start : page.index("<!-- family-plans:end -->")] == family_plans_markdown()


@pytest.mark.parametrize("family", NEW)
def test_published_sizes_recount_and_the_text_encoder_is_counted_for_caching(family):
    """The registry's counts are what the published configs build to on the meta device (the
    transformer; Z-Image's Qwen3-4B encoder), and the caching phase holds the text encoder:
    a 24 GB GPU's plan says so, and its cached captions are sized at the pipeline's length."""
    from transformers import Qwen3Config, Qwen3Model

    from zerotuner.families import REGISTRY, caption_cache_bytes, model_shape

    shape, counted = model_shape(family), model_shape(family, recount=True)
    assert (counted.denoiser_params, counted.largest_param) == REGISTRY[family].builtin_counts
    assert shape.denoiser_params == counted.denoiser_params
    assert shape.frozen_params == REGISTRY[family].text_params + REGISTRY[family].vae_params
    if family in ("zimage", "flux2klein"):  # Qwen3-4B (klein's Qwen3ForCausalLM ties lm_head)
        from accelerate import init_empty_weights

        with init_empty_weights():
            qwen = Qwen3Model(Qwen3Config(
                hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
            ))  # fmt: skip
        assert sum(p.numel() for p in qwen.parameters()) == REGISTRY[family].text_params
    if family == "qwenimage":
        from accelerate import init_empty_weights
        from diffusers import AutoencoderKLQwenImage
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        text = {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                "tie_word_embeddings": False}  # Qwen2.5-VL-7B-Instruct's config  # fmt: skip
        vision = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                  "out_hidden_size": 3584}  # fmt: skip
        with init_empty_weights():
            vl = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
                text_config=text, vision_config=vision, vocab_size=152064,
                tie_word_embeddings=False,
            ))  # fmt: skip
            vae = AutoencoderKLQwenImage()
        assert sum(p.numel() for p in vl.parameters()) == REGISTRY[family].text_params
        assert sum(p.numel() for p in vae.parameters()) == REGISTRY[family].vae_params
    if family == "krea2":  # Qwen3VLModel of Qwen3-VL-4B-Instruct's config (no lm_head)
        from accelerate import init_empty_weights
        from diffusers import AutoencoderKLQwenImage
        from transformers import Qwen3VLConfig, Qwen3VLModel

        text = {"vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
                "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 128, "tie_word_embeddings": True}  # fmt: skip
        vision = {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
                  "out_hidden_size": 2560, "patch_size": 16,
                  "deepstack_visual_indexes": [5, 11, 17]}  # fmt: skip
        with init_empty_weights():
            vl = Qwen3VLModel(Qwen3VLConfig(text_config=text, vision_config=vision,
                                            tie_word_embeddings=True))  # fmt: skip
            vae = AutoencoderKLQwenImage()
        assert sum(p.numel() for p in vl.parameters()) == REGISTRY[family].text_params
        assert sum(p.numel() for p in vae.parameters()) == REGISTRY[family].vae_params
    if family == "hidream":  # CLIP-L and CLIP-G at 248 positions, T5-XXL, Llama-3.1-8B
        from accelerate import init_empty_weights
        from transformers import (
            CLIPTextConfig,
            CLIPTextModelWithProjection,
            LlamaConfig,
            LlamaForCausalLM,
        )

        from zerotuner.families.registry import T5_XXL_PARAMS, VAE16_PARAMS

        clip = {"vocab_size": 49408, "max_position_embeddings": 248}
        with init_empty_weights():
            clips = [CLIPTextModelWithProjection(CLIPTextConfig(**clip, **sizes)) for sizes in (
                {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                 "num_attention_heads": 12, "projection_dim": 768},
                {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
                 "num_attention_heads": 20, "projection_dim": 1280})]  # fmt: skip
            llama = LlamaForCausalLM(LlamaConfig(
                vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
            ))  # Llama-3.1-8B-Instruct's  # fmt: skip
        counted = sum(p.numel() for m in (*clips, llama) for p in m.parameters())
        assert counted + T5_XXL_PARAMS == REGISTRY[family].text_params
        from zerotuner.families.registry import T5_XXL_KEPT
        from zerotuner.weights.base_precision import stored_layers

        # an 8-bit ZT_TEXT_ENCODER_PRECISION keeps what stored_low keeps (within the biases
        # and norms it counts as stored)
        kept = counted - sum(stored_layers(m).params for m in (*clips, llama)) + T5_XXL_KEPT
        assert abs(kept - REGISTRY[family].text_kept_params) <= 0.001 * counted
        assert REGISTRY[family].vae_params == VAE16_PARAMS
        largest = max(p.numel() for p in llama.parameters())  # its embedding and lm_head
        assert shape.caching_params == REGISTRY[family].vae_params + largest
    if family == "flux2":  # Mistral Small 3.x streams while caching: its largest layer counts
        from accelerate import init_empty_weights
        from diffusers import AutoencoderKLFlux2
        from transformers import Mistral3Config, Mistral3ForConditionalGeneration

        from zerotuner.families.registry import MISTRAL_SMALL_3_LAYER

        text = {
            "model_type": "mistral",
            "head_dim": 128,
            "hidden_size": 5120,
            "intermediate_size": 32768,
            "num_attention_heads": 32,
            "num_hidden_layers": 40,
            "num_key_value_heads": 8,
            "vocab_size": 131072,
        }  # Mistral-Small-3.1-24B's
        vision = {"model_type": "pixtral", "head_dim": 64, "hidden_size": 1024,
                  "image_size": 1540, "patch_size": 14}  # fmt: skip
        with init_empty_weights():
            mistral = Mistral3ForConditionalGeneration(Mistral3Config(
                text_config=text, vision_config=vision, spatial_merge_size=2,
                multimodal_projector_bias=False, tie_word_embeddings=False,
            ))  # fmt: skip
            vae = AutoencoderKLFlux2()
        assert sum(p.numel() for p in mistral.parameters()) == REGISTRY[family].text_params
        assert sum(p.numel() for p in vae.parameters()) == REGISTRY[family].vae_params
        largest = max(
            sum(p.numel() for p in m.parameters(recurse=False)) for m in mistral.modules()
        )
        assert largest == MISTRAL_SMALL_3_LAYER
        assert shape.caching_params == REGISTRY[family].vae_params + largest
    elif family != "hidream":
        assert shape.caching_params is None  # the text encoder loads whole
    width = {"chroma": 4096, "zimage": 2560, "qwenimage": 3584, "flux2": 15360,
             "flux2klein": 7680, "krea2": 12 * 2560,
             "hidream": (1 + 32) * 4096}[family]  # fmt: skip
    tokens = 128 if family == "hidream" else 512  # HiDream's T5 and Llama at 128: 33 MiB
    assert caption_cache_bytes(shape) == tokens * width * 2

    from bench.paper import flow_plan

    phases = flow_plan(family, 1, 24, 128)["load_peak"]
    assert phases["per_node"]["frozen_parts"] == 2 * shape.frozen_params  # bf16, once per node
    caching = phases["phases"]["caching"]["host_bytes"]
    assert caching - phases["phases"]["load"]["host_bytes"] == 2 * shape.frozen_params
