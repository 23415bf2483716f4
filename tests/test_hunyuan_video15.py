"""The HunyuanVideo 1.5 family (text-to-video; issue 47).

The tiny demo (real HunyuanVideo15Transformer3DModel, AutoencoderKLHunyuanVideo15, Qwen2.5-VL's
text model, ByT5) loads and generates clips through HunyuanVideo15Pipeline and is told apart by
its files and its hub id; its other variants are refused in one line (image-to-video is
tests/test_hunyuan_video15_i2v.py); the cached captions are HunyuanVideo15Pipeline's own
conditioning and the objective calls the transformer as the pipeline does; the published sizes
recount on the meta device. On 2 CPU ranks at ZeRO-3 (zero.Init, CPU offload) it trains in
full: the held-out loss falls, the export generates in HunyuanVideo15Pipeline, the checkpoint
resumes on one rank at ZeRO-2; a LoRA at ZeRO-3 on NVMe loads with `load_lora_weights`.
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
    STEPS,
    TOKENS,
    held_out_loss,
    pipeline_parts,
    resumes_on_one_rank_at_zero_2,
    run,
    saved_run,
)

from zerotuner import families
from zerotuner.errors import ConfigError
from zerotuner.settings.schema import Settings

FAMILY = "hunyuanvideo15"
PIPELINE = "HunyuanVideo15Pipeline"
FULL = {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}
LORA = {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme",
        "training_type": "lora", "lora_rank": 4, "lora_alpha": 4, "lr": 3e-2,
        "param_buffer": 2048 * 2048}  # its ByT5 projection's 2048 x 2048, even tiny  # fmt: skip


@pytest.fixture(scope="module")
def demo(family_demo_dir) -> Path:
    """`zerotuner demo DIR --family hunyuanvideo15` (the session's, read-only)."""
    return family_demo_dir(FAMILY)


def clip(pipe, prompt: str = PROMPT, frames: int = 5):
    """A short clip (frames, 64, 64, 3) in [0, 1], two steps with the demo's guidance."""
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompt=prompt, num_inference_steps=2, height=64, width=64, num_frames=frames,
        output_type="np", generator=torch.Generator().manual_seed(0),
    ).frames[0]  # fmt: skip


def test_demo_generates_clips_in_its_pipeline_and_is_detected(demo, tmp_path):
    """The demo is a HunyuanVideo15Pipeline that renders prompt-dependent clips; the family is
    read from model_index.json, from a bare transformer folder and (offline) from hub ids; its
    clips train 2k + 1 frames (its VAE's 2x in time) in buckets of 8 pixels; the planner counts
    every frozen part of its configs."""
    from diffusers import DiffusionPipeline

    from zerotuner.families.shapes import frozen_params

    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    assert type(pipe).__name__ == PIPELINE
    first, other = clip(pipe), clip(pipe, "a blue square on a black background")
    assert first.shape == (5, 64, 64, 3) and abs(first - other).mean() > 0
    assert families.detect_family(demo / "model") == FAMILY
    bare = tmp_path / "bare"
    shutil.copytree(demo / "model" / "transformer", bare / "transformer")
    assert families.detect_family(bare) == FAMILY
    for hub in ("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
                "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v"):  # fmt: skip
        assert families.resolve_family(hub) == FAMILY
    assert families.get(FAMILY).frame_step(demo / "model") == pipe.vae_scale_factor_temporal == 2
    assert families.vae_scale(demo / "model") == pipe.vae_scale_factor_spatial == 8
    parts = ("text_encoder", "text_encoder_2", "vae")
    configs = tmp_path / "configs"
    for part in parts:
        (configs / part).mkdir(parents=True)
        shutil.copy(demo / "model" / part / "config.json", configs / part / "config.json")
    shutil.copy(demo / "model" / "model_index.json", configs / "model_index.json")
    counted = sum(p.numel() for part in parts for p in getattr(pipe, part).parameters())
    assert frozen_params(configs) == counted


@pytest.mark.parametrize(
    "model",
    ["HunyuanVideo15SuperResolutionPipeline", "tencent/HunyuanVideo-1.5-i2v-sr"],
)  # fmt: skip
def test_other_variants_are_refused_in_one_line(model, tmp_path, monkeypatch, capsys):
    """A HunyuanVideo 1.5 pipeline other than text- and image-to-video (image-to-video is
    `hunyuanvideo15i2v`: tests/test_hunyuan_video15_i2v.py), as a folder or a hub id naming
    an i2v checkpoint that is not a published diffusers one (not taken for Wan I2V's `_i2v`):
    one line naming both pipelines it trains, exit 2 through `config --explain`."""
    if "/" in model:
        where = model
    else:
        where = str(tmp_path / "model")
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "model_index.json").write_text(json.dumps({"_class_name": model}))
    with pytest.raises(ConfigError) as error:
        families.resolve_family(where)
    text = str(error.value)
    assert "\n" not in text and "image-to-video" in text and PIPELINE in text
    assert "HunyuanVideo15ImageToVideoPipeline, the Diffusers-480p_i2v" in text
    (tmp_path / "data").mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = tk.config_explain(monkeypatch, capsys, tmp_path, ZT_MODEL=where,
                                       ZT_DATA_DIR=str(tmp_path / "data"),
                                       ZT_OUTPUT_DIR=str(tmp_path / "output"))  # fmt: skip
    errors = [line for line in err.splitlines() if line.startswith("zerotuner: error:")]
    assert (code, out, len(errors)) == (2, "", 1) and "image-to-video" in errors[0]


def test_cached_captions_and_objective_are_the_pipelines(demo):
    """What the cache holds for a caption is HunyuanVideo15Pipeline.encode_prompt's output
    (Qwen's cropped states and ByT5's glyph states, with their masks; a quoted text has glyph
    states); the objective's prediction is the transformer's call as the pipeline makes it; a
    full fine-tuning trains exactly what the loss reaches."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    kind = families.get(FAMILY)
    captions = [PROMPT, ' a sign that says "open" ', "a green circle"]
    ours = kind.encode_text(pipeline_parts(pipe, FAMILY, kind), captions)
    theirs = pipe.encode_prompt(captions, device=torch.device("cpu"), batch_size=3)
    names = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
    for name, value in zip(names, theirs, strict=True):
        assert ours[name].dtype == torch.bfloat16
        torch.testing.assert_close(ours[name], value.to(torch.bfloat16), msg=name)
    assert ours["prompt_embeds"].shape[1] == 1000  # the pipeline's Qwen length, template cropped
    assert ours["prompt_embeds_mask_2"][1].sum() > 0 == ours["prompt_embeds_mask_2"][0].sum()
    short = dataclasses.replace(kind, max_sequence_length=TOKENS)
    kwargs = short.model_kwargs(short.encode_text(pipeline_parts(pipe, FAMILY, kind), captions),
                                torch.float32)  # fmt: skip
    objective = kind.objective(Settings(), pipe.scheduler, pipe.transformer.config)
    assert "shift 3" in objective.describe()  # the reference trainer's, not the scheduler's 5
    latents = torch.randn(3, 8, 3, 8, 8)
    sigmas = torch.tensor([0.2, 0.5, 0.9])
    with torch.no_grad():
        pred = objective.predict(pipe.transformer, latents, sigmas, kwargs,
                                 device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
        condition, mask = pipe.prepare_cond_latents_and_mask(latents, torch.float32, "cpu")
        own = pipe.transformer(
            hidden_states=torch.cat([latents, condition, mask], dim=1),
            image_embeds=torch.zeros(3, pipe.vision_num_semantic_tokens, pipe.vision_states_dim),
            timestep=sigmas * 1000, return_dict=False, **kwargs,
        )[0]  # fmt: skip
    torch.testing.assert_close(pred, own)
    pipe.transformer.zero_grad()
    objective.predict(pipe.transformer, latents, sigmas, kwargs, device=torch.device("cpu"),
                      dtype=torch.float32).square().mean().backward()  # fmt: skip
    # the last block's text output is read by nothing: its text-only layers get no gradient,
    # in the published model too (weight decay alone moves them); the rest is `trains`
    last = f"transformer_blocks.{pipe.transformer.config.num_layers - 1}."
    dead = tuple(last + p for p in ("attn.add_q_proj", "attn.norm_added_q", "attn.to_add_out",
                                    "ff_context"))  # fmt: skip
    for name, param in pipe.transformer.named_parameters():
        reached = param.grad is not None and bool(param.grad.abs().sum() > 0)
        assert reached == (kind.trains(name) and not name.startswith(dead)), name


def test_published_sizes_recount_on_the_meta_device():
    """HunyuanVideo 1.5's transformer (HunyuanVideo15Transformer3DModel's defaults, the
    published 480p and 720p shapes: 8.33B) recounts to the registry's, as its frozen parts do;
    a cached caption is Qwen's 1000 x 3584 and ByT5's 256 x 1472 bf16 values; the planner's
    121 frames at 640 px are 31 latent frames of 40 x 40 tokens."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLHunyuanVideo15
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    from zerotuner.families import REGISTRY, caption_cache_bytes, model_shape

    spec = REGISTRY[FAMILY]
    counted = model_shape(FAMILY, recount=True)
    assert (counted.denoiser_params, counted.largest_param) == spec.builtin_counts
    with init_empty_weights():
        qwen = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(  # Qwen2.5-VL-7B-Instruct's text
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4))  # fmt: skip
        byt5 = T5EncoderModel(T5Config(  # google/byt5-small's
            vocab_size=384, d_model=1472, d_ff=3584, d_kv=64, num_layers=12, num_heads=6,
            feed_forward_proj="gated-gelu"))  # fmt: skip
        vae = AutoencoderKLHunyuanVideo15()
    byt5.tie_weights()
    assert sum(p.numel() for m in (qwen, byt5) for p in m.parameters()) == spec.text_params
    assert sum(p.numel() for p in vae.parameters()) == spec.vae_params
    shape = model_shape(FAMILY)
    assert caption_cache_bytes(shape) == (1000 * 3584 + 256 * 1472) * 2
    assert shape.video is not None and (shape.video.temporal, shape.video.spatial) == (4, 16)
    assert shape.video.tokens(121, 640) == 31 * 40 * 40
    assert shape.video.latent_channels == 32
    from zerotuner.preflight import trainable

    full = trainable.for_settings(Settings(), shape)  # the image projection frozen
    frozen = sum(n for n in (1152 * 2 + 1152 * 1152 + 1152, 1152 * 2048 + 2048, 2048 * 2))
    assert full.trainable_params == spec.builtin_counts[0] - frozen


def _saved_bytes(heads: int, tokens: int, text: int, *, bias: bool = False) -> int:
    """Bytes autograd saves in one HunyuanVideo15TransformerBlock (bf16, meta device), SDPA
    saving what a fused kernel does (query, key, value, output) and, with `bias`, the 16-bit
    bias the memory-efficient kernel makes of the dense boolean mask; less the weights."""
    import torch.nn.functional as F
    from diffusers.models.transformers.transformer_hunyuan_video15 import (
        HunyuanVideo15TransformerBlock,
    )

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, mask):
            out = torch.empty_like(q)
            kept = torch.zeros(mask.shape, dtype=q.dtype, device=q.device) if bias else None
            ctx.save_for_backward(q, k, v, out, *([kept] if bias else []))
            return out

        @staticmethod
        def backward(ctx, grad):
            return (*(torch.empty_like(t) for t in ctx.saved_tensors[:3]), None)

    def sdpa(query, key, value, attn_mask=None, **kwargs):
        return Fused.apply(query, key, value, attn_mask)

    saved: dict[int, int] = {}
    real = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = sdpa
    try:
        with torch.device("meta"):
            block = HunyuanVideo15TransformerBlock(heads, 128, 4.0).to(torch.bfloat16)
            weights = {id(p) for p in block.parameters()}
            bf16 = {"dtype": torch.bfloat16, "requires_grad": True}
            x = torch.randn(1, tokens, heads * 128, **bf16)
            context = torch.randn(1, text, heads * 128, **bf16)
            rope = (torch.randn(tokens, 128), torch.randn(tokens, 128))
            mask = torch.ones(1, text, dtype=torch.bool)

            def pack(tensor):
                base = tensor._base if tensor._base is not None else tensor  # a weight's view
                if id(base) not in weights:  # weights are not activations
                    saved[id(tensor)] = tensor.numel() * tensor.element_size()
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                block(x, context, torch.randn(1, heads * 128, **bf16), mask, rope)
    finally:
        F.scaled_dot_product_attention = real
    return sum(saved.values())


def test_the_per_token_model_is_what_autograd_saves_in_its_block():
    """shapes.HV15_* are the saved tensors of diffusers' HunyuanVideo15TransformerBlock
    recounted on the meta device (at width 1024 and 2048): per video token and per text token
    linear in the width, and the mask's bias quadratic in the joint sequence."""
    from zerotuner.families import REGISTRY

    for heads in (8, 16):
        config = {**REGISTRY[FAMILY].builtin_config, "num_attention_heads": heads}
        video = families.video_shape(FAMILY, config, None)
        a, b = _saved_bytes(heads, 256, 64), _saved_bytes(heads, 512, 64)
        c = _saved_bytes(heads, 256, 128)
        lse = 4 * heads  # SDPA's logsumexp, which the fused stand-in does not save
        assert b - a == 256 * (video.token_bytes - lse + video.rope_bytes)  # RoPE: per layer here
        assert c - a == 64 * (video.text_bytes // video.joint_text - lse)
        pairs = _saved_bytes(heads, 256, 64, bias=True) - a
        assert pairs == video.pair_bytes * (256 + 64) ** 2


# --- training on 2 CPU ranks ------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_run(demo, tmp_path_factory):
    return saved_run(tmp_path_factory, demo, FAMILY, **FULL)


@pytest.mark.slow
def test_full_fine_tuning_at_zero_3_trains_and_exports_its_pipeline(demo, full_run):
    """ZeRO-3 (zero.Init, optimizer and parameters on the CPU) on 2 ranks: every step logged
    with the reference's shift, the held-out loss falls, final/ is a HunyuanVideo15Pipeline
    that renders a clip with the image projection as it was, the validation sample is a clip."""
    import numpy as np
    from diffusers import DiffusionPipeline

    output, log = full_run
    assert [s["step"] for s in tk.read_steps(output)] == list(range(1, STEPS + 1))
    assert "shift 3" in log
    base = DiffusionPipeline.from_pretrained(demo / "model")
    final = DiffusionPipeline.from_pretrained(output / "final")
    assert type(final).__name__ == PIPELINE
    before = held_out_loss(demo, FAMILY, base.transformer)
    assert held_out_loss(demo, FAMILY, final.transformer) < 0.97 * before
    frames = clip(final)
    assert frames.shape == (5, 64, 64, 3) and np.isfinite(frames).all()
    kind, kept = families.get(FAMILY), base.transformer.state_dict()
    for name, param in final.transformer.named_parameters():
        if not kind.trains(name):
            assert torch.equal(param, kept[name]), name
    assert list((output / "samples" / f"step-{STEPS}").glob("*.mp4"))


@pytest.mark.slow
def test_full_checkpoint_resumes_on_one_rank_at_zero_2(demo, full_run, tmp_path) -> None:
    """From the step-SAVED checkpoint, 1 rank at ZeRO-2 trains on and exports its pipelines."""
    output, _ = full_run
    resumes_on_one_rank_at_zero_2(tmp_path, demo, FAMILY, output, PIPELINE)


@pytest.mark.slow
def test_lora_at_zero_3_loads_with_load_lora_weights(demo, tmp_path) -> None:
    """A LoRA adapter at ZeRO-3 with everything on NVMe: `transformer.` keys that the family's
    pipeline class (HunyuanVideo15Pipeline with diffusers' HunyuanVideo LoRA loader) loads with
    `load_lora_weights`, lowering the held-out loss and changing the clip; its validation
    samples are clips (ZT_VALIDATION_GUIDANCE_SCALE set on the pipeline's guider). The model
    card's line loads the same adapter onto the folder's own class (it has no loader)."""
    import numpy as np
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    from zerotuner.publish.model_card import model_card
    from zerotuner.weights import lora_files

    output = tmp_path / "output"
    run(tmp_path, demo, FAMILY, output=output, checkpoint_every_steps=0,
        validation_prompts=[PROMPT], validation_inference_steps=2,
        validation_guidance_scale=2.0, **LORA)  # fmt: skip
    final = output / "final"
    adapter = load_file(final / lora_files.ADAPTER_FILE)
    assert adapter and all(k.startswith("transformer.") for k in adapter)
    pipe = families.get(FAMILY).pipeline_class().from_pretrained(demo / "model")
    before, loss_before = clip(pipe), held_out_loss(demo, FAMILY, pipe.transformer)
    pipe.load_lora_weights(final)
    assert held_out_loss(demo, FAMILY, pipe.transformer) < 0.97 * loss_before
    assert np.abs(clip(pipe) - before).max() > 1e-3, "the adapter changes nothing"
    assert list((output / "samples" / f"step-{STEPS}").glob("*.mp4"))

    card = model_card(Settings(training_type="lora", model="x"), output, FAMILY)
    line = card.split("```python\n")[1].split("\n```")[0]
    plain = DiffusionPipeline.from_pretrained(demo / "model")
    assert not hasattr(plain, "load_lora_weights")
    exec(line.replace("<this repo>", str(output)), {"pipe": plain})  # noqa: S102
    ours = {n: p for n, p in plain.transformer.named_parameters() if ".lora_" in n}
    theirs = {n: p for n, p in pipe.transformer.named_parameters() if ".lora_" in n}
    assert ours.keys() == theirs.keys() and ours
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
