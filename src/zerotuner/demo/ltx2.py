"""A tiny LTX-2 pipeline, built offline from the real diffusers/transformers classes: an
LTX2VideoTransformer3DModel of two audio-video blocks, a two-layer Gemma3ForConditionalGeneration
(a tiny SigLIP tower beside it, as the published Gemma 3 12B has) with a Gemma-layout tokenizer
over the corpus's words (`<bos>` first, padded on the left by the pipeline), LTX2TextConnectors,
a small AutoencoderKLLTX2Video (8 pixels and 2 frames per latent cell, 16 channels, its
per-channel `latents_mean` / `latents_std` buffers measured on the demo images), the audio VAE
and vocoder at diffusers' own test sizes, and the flow-matching Euler scheduler LTX-2 ships
(dynamic shifting). Saved with `save_pretrained`, it loads and generates clips through
LTX2Pipeline.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotuner.demo.parts import EXTRA_WORDS, demo_pixels

if TYPE_CHECKING:
    from diffusers import AutoencoderKLLTX2Video
    from transformers import GemmaTokenizer

GEMMA_WIDTH, GEMMA_LAYERS = 32, 2  # the text states' width; the connectors stack layers + 1
LATENT_CHANNELS = 16
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")


def write_gemma_tokenizer(folder: Path, corpus: list[str]) -> GemmaTokenizer:
    """A Gemma-layout fast tokenizer over the corpus's words: `<bos>` before each text."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from transformers import GemmaTokenizer

    words = sorted(set(re.findall(r"[a-z]+", " ".join([*corpus, EXTRA_WORDS]).lower())))
    vocab = [(token, 0.0) for token in SPECIALS]
    vocab += [(f"▁{w}", -1.0) for w in words] + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    tok = Tokenizer(models.Unigram(vocab, unk_id=SPECIALS.index("<unk>"), byte_fallback=False))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", SPECIALS.index("<bos>"))]
    )
    tokenizer = GemmaTokenizer(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", padding_side="left", model_max_length=1024,
    )  # fmt: skip
    tokenizer.save_pretrained(folder)
    return tokenizer


def _gemma(vocab_size: int, seed: int) -> Any:
    """A two-layer Gemma 3 with a one-layer SigLIP tower (Gemma3ForConditionalGeneration's)."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    config = Gemma3Config(
        text_config={"vocab_size": vocab_size, "hidden_size": GEMMA_WIDTH,
                     "intermediate_size": 64, "num_hidden_layers": GEMMA_LAYERS,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                     "sliding_window": 16, "pad_token_id": 0, "eos_token_id": 1,
                     "bos_token_id": 2},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 16, "patch_size": 8},
        mm_tokens_per_image=4, boi_token_index=vocab_size - 3, eoi_token_index=vocab_size - 2,
        image_token_index=vocab_size - 1,
    )  # fmt: skip
    return Gemma3ForConditionalGeneration(config).eval()


def _vae(seed: int, data_dir: Path | None) -> AutoencoderKLLTX2Video:
    """One spatio-temporal halving after 4x4 pixel patches: 8 pixels and 2 frames per latent
    cell; `latents_mean` / `latents_std` measured on the demo images (one-frame clips)."""
    import torch
    from diffusers import AutoencoderKLLTX2Video

    torch.manual_seed(seed)
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS, block_out_channels=(16,),
        decoder_block_out_channels=(16,), layers_per_block=(1,), decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False), downsample_type=("spatiotemporal",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False,
        patch_size=4, patch_size_t=1, encoder_causal=True, decoder_causal=False,
    )  # fmt: skip
    if data_dir is not None:
        with torch.no_grad():
            latents = vae.encode(demo_pixels(data_dir).unsqueeze(2)).latent_dist.mean
        vae.latents_mean.copy_(latents.mean(dim=(0, 2, 3, 4)))
        vae.latents_std.copy_(latents.std(dim=(0, 2, 3, 4)))
    return vae


def _audio_parts(seed: int) -> tuple[Any, Any]:
    """The audio VAE and vocoder, at diffusers' own LTX-2 test sizes (frozen here: zerotuner
    trains the video path)."""
    import torch
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(seed)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None,
        in_channels=2, resolution=32, latent_channels=2, norm_type="pixel",
        causality_axis="height", dropout=0.0, mid_block_add_attention=False, sample_rate=16000,
        mel_hop_length=160, is_causal=True, mel_bins=8,
    )  # fmt: skip
    vocoder = LTX2Vocoder(
        in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1, output_sampling_rate=16000,
    )  # fmt: skip
    return audio_vae, vocoder


def write_model(model_dir: Path, *, seed: int, corpus: list[str],
                data_dir: Path | None = None) -> Path:  # fmt: skip
    from diffusers import LTX2Pipeline

    return write_ltx2(model_dir, LTX2Pipeline, seed=seed, corpus=corpus, data_dir=data_dir)


def write_ltx2(model_dir: Path, pipeline: type, *, seed: int, corpus: list[str],
               data_dir: Path | None = None) -> Path:  # fmt: skip
    """The tiny LTX-2 parts saved as a `pipeline` folder (LTX2Pipeline, or the image-to-video
    one: the same parts)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    from zerotuner.demo.flow import save_pipeline

    work = Path(tempfile.mkdtemp(prefix="zerotuner-tokenizers-"))
    tokenizer = write_gemma_tokenizer(work / "gemma", corpus)
    text_encoder = _gemma(len(tokenizer), seed + 4)
    torch.manual_seed(seed + 3)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, patch_size=1, patch_size_t=1,
        num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
        vae_scale_factors=(2, 8, 8), audio_in_channels=4, audio_out_channels=4,
        audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8,
        num_layers=2, caption_channels=GEMMA_WIDTH, rope_double_precision=False,
        rope_type="split",
    )  # fmt: skip
    torch.manual_seed(seed + 5)
    connectors = LTX2TextConnectors(
        caption_channels=GEMMA_WIDTH, text_proj_in_factor=GEMMA_LAYERS + 1,
        video_connector_num_attention_heads=4, video_connector_attention_head_dim=8,
        video_connector_num_layers=1, video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1, audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32, rope_double_precision=False, rope_type="split",
    )  # fmt: skip
    audio_vae, vocoder = _audio_parts(seed + 6)
    # LTX-2's scheduler_config.json: dynamic shifting by the clip's tokens, at the demo's sizes
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=64,
        max_image_seq_len=1024,
    )  # fmt: skip
    return save_pipeline(
        model_dir, work, pipeline, transformer=transformer, scheduler=scheduler,
        vae=_vae(seed, data_dir), audio_vae=audio_vae, text_encoder=text_encoder,
        tokenizer=tokenizer, connectors=connectors, vocoder=vocoder,
    )  # fmt: skip
