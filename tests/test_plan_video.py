"""The planner on Wan's clips (issue 32): frames x tokens, the activation model per token
(recounted on the meta device), the frame rule and the video settings refused for the image
families, and docs/models.md's table of Wan's clip plans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trainkit as tk

from zerotuner import families
from zerotuner.families import REGISTRY, model_shape, shapes
from zerotuner.machine.hardware import GPU, GiB, Hardware
from zerotuner.preflight.plan import PlanRequest, make_plan

REPO = Path(__file__).resolve().parents[1]
# the transformers of Wan2.1-T2V-1.3B, Wan2.2-TI2V-5B, Wan2.1-T2V-14B (convert_wan_to_diffusers.py)
WIDTHS = ((12, 8960), (24, 14336), (40, 13824))  # (heads of 128, ffn_dim)
GPU80 = Hardware("cuda", (GPU(0, "H100", 80 * GiB, 80 * GiB, (9, 0)),), host_memory=256 * GiB)


def plan(shape, frames: int, resolution: int | None = None, **request):
    return make_plan(
        shape=shape, hardware=GPU80, offload_disk_free=2 * 10**12, require_fit=False,
        request=PlanRequest(resolution=resolution or shape.native_resolution, micro_batch=1,
                            world_size=1, frames=frames, **request),
    )  # fmt: skip


def test_clip_tokens_follow_the_vae_and_the_patch(tmp_path):
    """81 frames at Wan's 480p (832 x 480 fits the 632 px area side): 21 latent frames of
    52 x 30 tokens (Wan 2.1's VAE, 8 px) or 26 x 15 (Wan 2.2 TI2V-5B's, 16 px, read from its
    VAE config's scale_factor_spatial); `plan` reports them."""
    from bench.paper import config_model

    shape = model_shape("wan")
    assert shape.native_resolution == 632 and 832 * 480 <= 632**2 < 832 * 496
    assert (shape.video.temporal, shape.video.spatial, shape.video.patch) == (4, 8, (1, 2, 2))
    assert shape.video.latent_frames(81) == 21 and shape.video.latent_frames(1) == 1
    assert shape.video.tokens(81, 632) == 21 * 52 * 30 == 32760
    five = model_shape("wan", config_model(tmp_path, "wan-5b"))
    assert five.denoiser_params == 4_999_787_712  # the card's "5B"
    assert (five.video.temporal, five.video.spatial, five.video.latent_channels) == (4, 16, 48)
    assert five.video.tokens(81, 632) == 21 * 26 * 15
    inputs = plan(shape, 81).inputs
    assert (inputs.frames, inputs.latent_frames, inputs.tokens) == (81, 21, 32760)
    assert plan(model_shape("sdxl"), 1).inputs.tokens is None  # image families: no clip


def test_activations_scale_with_the_clips_tokens():
    """Activation memory (with and without checkpointing) grows with the clip's tokens: 81
    frames are 21 times one frame's per-token part; an image family's plan ignores frames."""
    shape = model_shape("wan")
    for ckpt in (False, True):
        one, clip = (
            plan(shape, frames, gradient_checkpointing=ckpt).rows[0].parts["device.activations"]
            for frames in (1, 81)
        )
        video = shape.video
        per_token = video.activations(2, ckpt) - video.activations(1, ckpt)
        assert clip - one == per_token * (32760 - 1560)
        assert clip > 15 * one
    sdxl = model_shape("sdxl")
    assert [r.device_bytes for r in plan(sdxl, 81, 1024).rows] == [
        r.device_bytes for r in plan(sdxl, 1, 1024).rows
    ]


def _saved_bytes(heads: int, ffn: int, tokens: int, text: int) -> int:
    """Bytes autograd saves in one WanTransformerBlock (bf16, meta device), SDPA saving what a
    fused kernel does: query, key, value and output (no tokens x tokens matrix)."""
    import torch
    import torch.nn.functional as F
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out = torch.empty_like(q)
            ctx.save_for_backward(q, k, v, out)
            return out

        @staticmethod
        def backward(ctx, grad):
            return tuple(torch.empty_like(t) for t in ctx.saved_tensors[:3])

    def sdpa(query, key, value, *args, **kwargs):
        return Fused.apply(query, key, value)

    dim, saved = heads * 128, {}

    def pack(tensor):
        if not isinstance(tensor, torch.nn.Parameter):  # weights are not activations
            saved[id(tensor)] = tensor.numel() * tensor.element_size()
        return tensor

    real = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = sdpa
    try:
        with torch.device("meta"):
            block = WanTransformerBlock(
                dim, ffn, heads, qk_norm="rms_norm_across_heads", cross_attn_norm=True, eps=1e-6
            ).to(torch.bfloat16)
            bf16 = {"dtype": torch.bfloat16}
            x = torch.randn(1, tokens, dim, requires_grad=True, **bf16)
            temb = torch.randn(1, 6, dim, requires_grad=True, **bf16)
            rope = (torch.randn(1, tokens, 1, 128), torch.randn(1, tokens, 1, 128))
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                block(x, torch.randn(1, text, dim, **bf16), temb, rope)
    finally:
        F.scaled_dot_product_attention = real
    rope_bytes = 2 * tokens * 128 * 4  # RoPE's cos and sin: shared by the layers, not a layer's
    return sum(saved.values()) - rope_bytes


@pytest.mark.parametrize(("heads", "ffn"), WIDTHS)
def test_the_per_token_model_is_what_autograd_saves_in_a_wan_block(heads, ffn):
    """shapes.WAN_* are the saved tensors of diffusers' WanTransformerBlock recounted on the
    meta device: per video token 76 x width + 4 x ffn_dim + 36 bytes, per text token
    16 x width + 4; linear in both (no tokens x tokens term through fused SDPA)."""
    dim = heads * 128
    a, b = _saved_bytes(heads, ffn, 256, 64), _saved_bytes(heads, ffn, 512, 64)
    c = _saved_bytes(heads, ffn, 256, 128)
    per_token = (shapes.WAN_TOKEN_WIDTH_BYTES * dim + shapes.WAN_TOKEN_FFN_BYTES * ffn
                 + shapes.WAN_TOKEN_BYTES)  # fmt: skip
    assert b - a == 256 * per_token
    per_text = shapes.WAN_TEXT_WIDTH_BYTES * dim + shapes.WAN_TEXT_BYTES
    assert c - a == 64 * per_text
    config = {**REGISTRY["wan"].builtin_config, "num_attention_heads": heads, "ffn_dim": ffn}
    video = families.video_shape("wan", config, None)
    assert video.token_bytes == per_token + shapes.LSE_BYTES * heads  # + SDPA's logsumexp
    assert video.text_bytes == per_text * 512  # the cached caption's UMT5 tokens


def test_frames_not_4k_plus_1_and_video_settings_on_images_are_refused(
    tmp_path, monkeypatch, capsys
):
    """`zerotuner config --explain` and `zerotuner plan`: ZT_VIDEO_FRAMES=80 for Wan, and
    ZT_VIDEO_FRAMES / ZT_VIDEO_FPS set for an image family, are one line each, exit 2."""
    from zerotuner.cli import main

    (tmp_path / "data").mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # hub ids: named, not fetched
    common = {"ZT_DATA_DIR": str(tmp_path / "data"), "ZT_OUTPUT_DIR": str(tmp_path / "out")}
    cases = (
        ({"ZT_MODEL": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "ZT_VIDEO_FRAMES": "80"},
         "ZT_VIDEO_FRAMES=80: Wan takes 4k+1 frames (77 or 81)"),
        ({"ZT_MODEL": "stabilityai/stable-diffusion-xl-base-1.0", "ZT_VIDEO_FRAMES": "81"},
         "ZT_VIDEO_FRAMES is set but ZT_MODEL is a sdxl model"),
        ({"ZT_MODEL": "black-forest-labs/FLUX.1-dev", "ZT_VIDEO_FPS": "24"},
         "ZT_VIDEO_FPS is set but ZT_MODEL is a flux model"),
    )  # fmt: skip
    for env, says in cases:
        code, out, err = tk.config_explain(monkeypatch, capsys, tmp_path, **common, **env)
        errors = [line for line in err.splitlines() if line.startswith("zerotuner: error:")]
        assert (code, out, len(errors)) == (2, "", 1), err
        assert says in errors[0]
        assert main(["plan", "--gpus", "0", "--host-memory", "256GiB", "--json"]) == 2
        _, err = capsys.readouterr()
        assert [says in line for line in err.splitlines() if "error" in line] == [True]
        for name in env:
            monkeypatch.delenv(name)
    monkeypatch.setenv("ZT_VIDEO_FRAMES", "33")  # 4k+1: planned, and shown
    what_if = ["--gpus", "0", "--host-memory", "256GiB"]
    assert main(["plan", "--model-family", "wan", *what_if, "--json"]) == 0
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert (inputs["frames"], inputs["latent_frames"], inputs["tokens"]) == (33, 9, 9 * 1560)
    assert main(["plan", "--model-family", "wan", *what_if]) == 0
    assert "632 px x 33 frames (ZT_VIDEO_FRAMES; 9 latent frames, 14040 tokens per clip)" in (
        capsys.readouterr().out
    )


def test_models_page_table_of_wan_clips_is_what_the_planner_says():
    """docs/models.md's Wan clip table (bench/paper.py: 1.3B, 5B and 14B, full and LoRA, 81
    frames at 480p on 1 x 24 GB, 1 x 80 GB, 8 x 80 GB) cannot drift from the planner."""
    from bench.paper import video_plans_markdown

    page = (REPO / "docs/models.md").read_text()
    start = page.index("<!-- video-plans:start -->\n") + len("<!-- video-plans:start -->\n")
    assert page[start : page.index("<!-- video-plans:end -->")] == video_plans_markdown()
