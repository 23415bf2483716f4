"""A tiny Qwen-Image pipeline, built offline from the real diffusers/transformers classes: a
QwenImageTransformer2DModel of two blocks, a two-layer Qwen2_5_VLForConditionalGeneration (with
a one-block vision tower it never uses), a word-level tokenizer with Qwen's chat markers that
splits the pipeline's prompt template into the same 34 tokens before the prompt as Qwen's own
(words, punctuation and newlines one token each), a small AutoencoderKLQwenImage (random
weights: its latents are normalised by their per-channel mean and std on the demo images, as
the published VAE's `latents_mean` / `latents_std` do) and the flow-matching Euler scheduler
with dynamic shifting. Saved with `save_pretrained`, it loads and generates through
QwenImagePipeline.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotuner.demo.parts import EXTRA_WORDS, normalise_video_latents
from zerotuner.demo.z_image import SPECIALS

if TYPE_CHECKING:
    from diffusers import AutoencoderKLQwenImage
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLForConditionalGeneration

TEMPLATE_WORDS = (
    "system user assistant describe the image by detailing color shape size texture quantity "
    "text spatial relationships of objects and background"
)
QWEN_WIDTH = 32  # the text states' width: the transformer's joint_attention_dim


def write_qwen_tokenizer(
    folder: Path, corpus: list[str], *, specials: tuple[str, ...] = SPECIALS,
    words: str = TEMPLATE_WORDS, marks: tuple[str, ...] = (",", ":", "."),
) -> PreTrainedTokenizerFast:  # fmt: skip
    """Word-level: lower-cased words, each punctuation mark and each newline one token
    (`specials`, `words`, `marks`: what its prompt template holds besides the corpus)."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    text = " ".join([*corpus, EXTRA_WORDS, words]).lower()
    tokens = [*specials, "<unk>", "\n", *marks, *sorted(set(re.findall(r"[a-z]+", text)))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("\n"), "isolated"),
        pre_tokenizers.Split(Regex(" +"), "removed"),
        pre_tokenizers.Split(Regex("[^a-z\n]"), "isolated"),
    ])  # fmt: skip
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
        unk_token="<unk>", padding_side="right", model_max_length=2048,
    )  # fmt: skip
    tokenizer.save_pretrained(folder)
    return tokenizer


def _text_encoder(
    tokenizer: PreTrainedTokenizerFast, seed: int, vision_ids: dict[str, Any] | None = None
) -> Qwen2_5_VLForConditionalGeneration:
    """`vision_ids`: the tokenizer's ids of the image markers (image_token_id,
    vision_start_token_id ...) where its vision tower reads images (Qwen-Image-Edit)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.pad_token_id,
           "eos_token_id": tokenizer.eos_token_id}  # fmt: skip
    torch.manual_seed(seed)
    # A top-level vocab_size as Qwen-Image's own text encoder config has: outside transformers'
    # signature, the config keeps it as an attribute.
    return Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(  # type: ignore[call-arg]
            text_config={
                "vocab_size": len(tokenizer), "hidden_size": QWEN_WIDTH,
                "intermediate_size": QWEN_WIDTH * 2, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 2048, **ids,
                "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2],
                                    "rope_theta": 1000000.0},
            },
            vision_config={
                "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                "out_hidden_size": QWEN_WIDTH, "fullatt_block_indexes": [0],
            },
            vocab_size=len(tokenizer), **ids, **(vision_ids or {}),
        )
    )  # fmt: skip


def _vae(seed: int, data_dir: Path | None) -> AutoencoderKLQwenImage:
    """A small video VAE (4 pixels per latent cell, 16 channels), its latents' per-channel
    mean and std measured on the demo images."""
    import torch
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1,
        temperal_downsample=[False, True], latents_mean=[0.0] * 16, latents_std=[1.0] * 16,
    )  # fmt: skip
    return normalise_video_latents(vae, data_dir)


def write_model(model_dir: Path, *, seed: int, corpus: list[str],
                data_dir: Path | None = None) -> Path:  # fmt: skip
    import torch
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

    from zerotuner.demo.flow import LATENT_CHANNELS, dynamic_scheduler, save_pipeline

    work = Path(tempfile.mkdtemp(prefix="zerotuner-tokenizers-"))
    tokenizer = write_qwen_tokenizer(work / "qwen", corpus)
    text_encoder = _text_encoder(tokenizer, seed + 4)
    torch.manual_seed(seed + 3)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=LATENT_CHANNELS * 4, out_channels=LATENT_CHANNELS,
        num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=QWEN_WIDTH, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    scheduler = dynamic_scheduler(shift=1.0, shift_terminal=0.02, time_shift_type="exponential")
    return save_pipeline(
        model_dir, work, QwenImagePipeline, transformer=transformer, scheduler=scheduler,
        vae=_vae(seed, data_dir), text_encoder=text_encoder, tokenizer=tokenizer,
    )  # fmt: skip
