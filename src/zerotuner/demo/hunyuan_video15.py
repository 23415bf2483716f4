"""A tiny HunyuanVideo 1.5 pipeline, built offline from the real diffusers/transformers classes:
a HunyuanVideo15Transformer3DModel of two dual-stream blocks (a one-block token refiner), a
three-layer Qwen2_5_VLTextModel with a word-level tokenizer carrying Qwen's chat template (the
pipeline crops the template's first 108 tokens: the demo's system turn splits into about as
many), a two-layer ByT5 encoder with the byte-level ByT5Tokenizer, a small
AutoencoderKLHunyuanVideo15 (8 pixels and 2 frames per latent cell, 8 channels, its
scaling_factor measured on the demo images), the flow-matching Euler scheduler and
classifier-free guidance. Saved with `save_pretrained`, it loads and generates clips through
HunyuanVideo15Pipeline.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotuner.demo.parts import latent_scaling_factor

if TYPE_CHECKING:
    from diffusers import AutoencoderKLHunyuanVideo15

QWEN_WIDTH, BYT5_WIDTH, IMAGE_WIDTH = 32, 16, 16  # text_embed_dim, text_embed_2_dim, image's
LATENT_CHANNELS = 8
# Qwen's chat template as Qwen2.5-VL's tokenizer applies it to text turns
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# the pipeline's system message, so that it splits into whole words
TEMPLATE_WORDS = (
    "system user assistant you are a helpful describe the video by detailing following aspects "
    "main content and theme of color shape size texture quantity text spatial relationships "
    "objects actions events behaviors temporal physical movement changes background "
    "environment light style atmosphere camera angles movements transitions used in"
)


def write_qwen_tokenizer(folder: Path, corpus: list[str]) -> Any:
    """Word-level with Qwen's chat template: lower-cased words, each digit, punctuation mark and
    newline one token, and four spaces one token (the system message's indents: its turn and
    the user's marker come to the 108 tokens the pipeline crops, as with Qwen's own)."""
    import re

    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from zerotuner.demo.parts import EXTRA_WORDS
    from zerotuner.demo.z_image import SPECIALS

    text = " ".join([*corpus, EXTRA_WORDS, TEMPLATE_WORDS]).lower()
    words = sorted(set(re.findall(r"[a-z]+", text)))
    tokens = [*SPECIALS, "<unk>", "\n", " " * 4, *",:.\"'0123456789", *words]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    # the pieces kept: everything else (single spaces) is dropped
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("\n| {4}|[a-z]+|[^a-z \n]"), "removed",
                                             invert=True)  # fmt: skip
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
        unk_token="<unk>", padding_side="right", model_max_length=4096,
        chat_template=CHAT_TEMPLATE,
    )  # fmt: skip
    tokenizer.save_pretrained(folder)
    return tokenizer


def _qwen(tokenizer: Any, seed: int) -> Any:
    """Three layers: the pipeline reads the third-to-last hidden state (the first layer's)."""
    import torch
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    torch.manual_seed(seed)
    return Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer), hidden_size=QWEN_WIDTH, intermediate_size=QWEN_WIDTH * 2,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2],
                             "rope_theta": 1000000.0},
        )
    ).eval()  # fmt: skip


def _byt5(seed: int) -> Any:
    import torch
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    return T5EncoderModel(
        T5Config(
            vocab_size=384, d_model=BYT5_WIDTH, d_ff=BYT5_WIDTH * 2, d_kv=8, num_layers=2,
            num_heads=2, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
        )
    ).eval()  # fmt: skip


def _vae(seed: int, data_dir: Path | None) -> AutoencoderKLHunyuanVideo15:
    """Three spatial halvings (the last also in time): 8 pixels and 2 frames per latent cell;
    its scaling_factor 1 / std of the demo images' latents."""
    import torch
    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(seed)
    config = {"latent_channels": LATENT_CHANNELS, "block_out_channels": (16, 16, 16, 16),
              "layers_per_block": 1, "spatial_compression_ratio": 8,
              "temporal_compression_ratio": 2}  # fmt: skip
    vae = AutoencoderKLHunyuanVideo15(**config)
    if data_dir is not None:
        frames = _FramesVAE(vae)
        vae.register_to_config(scaling_factor=latent_scaling_factor(frames, data_dir))
    return vae


class _FramesVAE:
    """The video VAE seen as an image VAE: images encoded as one-frame clips."""

    def __init__(self, vae: Any) -> None:
        self.vae = vae

    def encode(self, pixels: Any) -> Any:
        """The images' latent distribution's mean, one at a time (hunyuan_video15_latents)."""
        from types import SimpleNamespace

        from zerotuner.families.hunyuan_video15 import hunyuan_video15_latents

        mean = hunyuan_video15_latents(self.vae, pixels) / float(self.vae.config.scaling_factor)
        return SimpleNamespace(latent_dist=SimpleNamespace(mean=mean))


def write_model(model_dir: Path, *, seed: int, corpus: list[str],
                data_dir: Path | None = None) -> Path:  # fmt: skip
    from diffusers import HunyuanVideo15Pipeline

    return write_hunyuan_video15(model_dir, HunyuanVideo15Pipeline, seed=seed, corpus=corpus,
                                 data_dir=data_dir)  # fmt: skip


def write_hunyuan_video15(
    model_dir: Path, pipeline: type, *, seed: int, corpus: list[str],
    data_dir: Path | None = None, task_type: str = "t2v", **parts: Any,
) -> Path:  # fmt: skip
    """The tiny parts saved as `pipeline` (`parts`: its others, image-to-video's encoder)."""
    import torch
    from diffusers import (
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import ByT5Tokenizer

    from zerotuner.demo.flow import save_pipeline

    work = Path(tempfile.mkdtemp(prefix="zerotuner-tokenizers-"))
    tokenizer = write_qwen_tokenizer(work / "qwen", corpus)
    torch.manual_seed(seed + 3)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=2 * LATENT_CHANNELS + 1, out_channels=LATENT_CHANNELS, num_attention_heads=2,
        attention_head_dim=16, num_layers=2, num_refiner_layers=1, mlp_ratio=2.0,
        text_embed_dim=QWEN_WIDTH, text_embed_2_dim=BYT5_WIDTH, image_embed_dim=IMAGE_WIDTH,
        rope_axes_dim=(4, 6, 6), target_size=64, task_type=task_type,
    )  # fmt: skip
    # the 480p pipelines' scheduler (the published one infers at shift 5) and guider
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    return save_pipeline(
        model_dir, work, pipeline, transformer=transformer, scheduler=scheduler,
        vae=_vae(seed, data_dir), text_encoder=_qwen(tokenizer, seed + 4), tokenizer=tokenizer,
        text_encoder_2=_byt5(seed + 5), tokenizer_2=ByT5Tokenizer(),
        guider=ClassifierFreeGuidance(guidance_scale=6.0), **parts,
    )  # fmt: skip
