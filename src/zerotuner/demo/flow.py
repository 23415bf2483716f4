"""Tiny SD3 and Flux.1 pipelines, built offline from the real diffusers/transformers classes.

The same parts as the published models at a few hundred thousand parameters: SD3's MMDiT
transformer with CLIP-L + CLIP-G (projected) + T5 encoders, Flux's double/single-stream
transformer with CLIP-L (pooled) + T5 and a guidance embedding, a 16-channel VAE with a shift
factor, and the flow-matching Euler scheduler (SD3: shift 3.0; Flux: dynamic shifting). The
CLIP tokenizer is demo/parts.py's byte-level BPE; the T5 tokenizer a unigram vocabulary of the
corpus's words, built with `tokenizers` (the published one is a SentencePiece download).
Saved with `save_pretrained`, they load through the same code path a hub model takes.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotuner.demo.parts import (
    EXTRA_WORDS,
    exact_vae,
    latent_scaling_factor,
    text_config,
    write_tokenizer,
)
from zerotuner.families.registry import Family

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import T5EncoderModel, T5Tokenizer

LATENT_CHANNELS = 16  # SD3's and Flux's VAEs
T5_WIDTH = 64  # T5's d_model: SD3 pads the CLIP states (32 + 32) to it
T5_MAX_TOKENS = 32


def write_t5_tokenizer(folder: Path, corpus: list[str]) -> T5Tokenizer:
    """A T5 tokenizer over the corpus's words (unigram, `▁` word starts, `</s>` appended)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import T5Tokenizer

    words = sorted(set(re.findall(r"[a-z]+", " ".join([*corpus, EXTRA_WORDS]).lower())))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(f"▁{w}", -1.0) for w in words] + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 1)]
    )
    tokenizer = T5Tokenizer(
        tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        extra_ids=0, model_max_length=T5_MAX_TOKENS,
    )  # fmt: skip
    tokenizer.save_pretrained(folder)
    return tokenizer


def _t5(vocab_size: int, seed: int) -> T5EncoderModel:
    import torch
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    return T5EncoderModel(
        T5Config(
            vocab_size=vocab_size, d_model=T5_WIDTH, d_ff=T5_WIDTH * 2, d_kv=16, num_layers=2,
            num_heads=4, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
        )
    )  # fmt: skip


def _vae(seed: int, data_dir: Path | None) -> AutoencoderKL:
    """demo/parts.py's exact VAE (average-pooling encoder, nearest-upsampling decoder) with 16
    latent channels, scaled to unit variance on the demo images, and a shift factor as SD3's
    and Flux's VAEs have (so the shift path is exercised)."""
    vae = exact_vae(seed, latent_channels=LATENT_CHANNELS)
    scale = latent_scaling_factor(vae, data_dir) if data_dir else 1.0
    vae.register_to_config(scaling_factor=scale, shift_factor=0.0609)
    return vae


def dynamic_scheduler(**config: Any) -> FlowMatchEulerDiscreteScheduler:
    """FLUX.1's flow-matching Euler scheduler (dynamic shifting) at the demo's sizes."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        **{"shift": 3.0, "use_dynamic_shifting": True, "base_image_seq_len": 16,
           "max_image_seq_len": 256, **config}
    )  # fmt: skip


def save_pipeline(model_dir: Path, work: Path, pipeline: type, **parts: Any) -> Path:
    """`pipeline(**parts)` saved into `model_dir`; the tokenizers' scratch folder removed."""
    pipeline(**parts).save_pretrained(model_dir, safe_serialization=True)
    shutil.rmtree(work, ignore_errors=True)
    return model_dir


def write_flow_model(
    model_dir: Path, *, family: Family, seed: int, corpus: list[str],
    data_dir: Path | None = None,
) -> Path:  # fmt: skip
    """Build the tiny `family` pipeline and `save_pretrained` it into `model_dir`
    (`data_dir`: the demo images its VAE's scaling factor is measured on): SD3 and Flux.1, the
    flow families without a demo module of their own."""
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    work = Path(tempfile.mkdtemp(prefix="zerotuner-tokenizers-"))
    clip_tokenizer = write_tokenizer(work / "clip", corpus)
    t5_tokenizer = write_t5_tokenizer(work / "t5", corpus)
    vae = _vae(seed, data_dir)
    t5 = _t5(len(t5_tokenizer), seed + 4)
    if family == "sd3":
        torch.manual_seed(seed + 1)
        clip_l = CLIPTextModelWithProjection(text_config(len(clip_tokenizer), 32))
        torch.manual_seed(seed + 2)
        clip_g = CLIPTextModelWithProjection(text_config(len(clip_tokenizer), 32))
        torch.manual_seed(seed + 3)
        transformer = SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=LATENT_CHANNELS, num_layers=2,
            attention_head_dim=8, num_attention_heads=4, joint_attention_dim=T5_WIDTH,
            caption_projection_dim=32, pooled_projection_dim=32 + 32,
            out_channels=LATENT_CHANNELS, pos_embed_max_size=32,
        )  # fmt: skip
        pipe = StableDiffusion3Pipeline(
            transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=vae, text_encoder=clip_l, tokenizer=clip_tokenizer, text_encoder_2=clip_g,
            tokenizer_2=clip_tokenizer, text_encoder_3=t5, tokenizer_3=t5_tokenizer,
        )  # fmt: skip
        clip_folders: tuple[str, ...] = ("tokenizer", "tokenizer_2")
    else:
        pipe = FluxPipeline(**flux1_parts(seed, clip_tokenizer, t5_tokenizer, vae=vae, t5=t5))
        clip_folders = ("tokenizer",)
    pipe.save_pretrained(model_dir, safe_serialization=True)
    return copy_clip_tokenizer(work, model_dir, clip_folders)


def flux1_parts(
    seed: int, clip_tokenizer: Any, t5_tokenizer: Any, *, vae: AutoencoderKL,
    t5: T5EncoderModel,
) -> dict[str, Any]:  # fmt: skip
    """FLUX.1's parts at the demo's sizes, as FluxPipeline and FluxKontextPipeline take them:
    a transformer of one double- and one single-stream block with the guidance embedding,
    CLIP-L (pooled) and T5, the dynamic-shifting scheduler."""
    import torch
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextModel

    torch.manual_seed(seed + 1)
    clip = CLIPTextModel(text_config(len(clip_tokenizer), 32))
    torch.manual_seed(seed + 3)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=LATENT_CHANNELS * 4, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=T5_WIDTH,
        pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    return {
        "transformer": transformer, "scheduler": dynamic_scheduler(), "vae": vae,
        "text_encoder": clip, "tokenizer": clip_tokenizer, "text_encoder_2": t5,
        "tokenizer_2": t5_tokenizer,
    }  # fmt: skip


def copy_clip_tokenizer(work: Path, model_dir: Path, folders: tuple[str, ...]) -> Path:
    """The slow CLIPTokenizer's two files (as demo.write_model) into each of the saved
    pipeline's tokenizer `folders`; the tokenizers' scratch folder `work` removed."""
    for sub in folders:
        for name in ("vocab.json", "merges.txt"):
            shutil.copyfile(work / "clip" / name, model_dir / sub / name)
    shutil.rmtree(work, ignore_errors=True)
    return model_dir
