"""A tiny Z-Image pipeline, built offline from the real diffusers/transformers classes: a
ZImageTransformer2DModel of two joint layers and one refiner layer each, a two-layer Qwen3Model
text encoder with a chat-templated tokenizer (a unigram vocabulary of the corpus's words and
Qwen's `<|im_start|>` / `<|im_end|>` markers, built with `tokenizers`; the published one is
Qwen3-4B's byte-level BPE), the demo's exact 16-channel VAE and the flow-matching Euler
scheduler with Z-Image-Turbo's static shift 3.0. Saved with `save_pretrained`, it loads and
generates through ZImagePipeline.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from zerotuner.demo.parts import EXTRA_WORDS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen3Config

# Qwen's chat markup, as Qwen3's template writes a single user turn (no thinking block when
# enable_thinking is true, the pipeline's call).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_WIDTH = 32  # the text states' width: the transformer's cap_feat_dim


def write_qwen_tokenizer(folder: Path, corpus: list[str]) -> PreTrainedTokenizerFast:
    """A fast tokenizer over the corpus's words with Qwen's special tokens and chat template
    (`<|endoftext|>` pads, on the right)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    text = " ".join([*corpus, EXTRA_WORDS, "user assistant"]).lower()  # the template's words too
    words = sorted(set(re.findall(r"[a-z]+", text)))
    vocab = [(token, 0.0) for token in SPECIALS] + [("<unk>", 0.0)]
    vocab += [(f"▁{w}", -1.0) for w in words] + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    tok = Tokenizer(models.Unigram(vocab, unk_id=len(SPECIALS), byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.Replace("\n", " "), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
        unk_token="<unk>", padding_side="right", model_max_length=512,
    )  # fmt: skip
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return tokenizer


def qwen3_config(
    tokenizer: PreTrainedTokenizerFast, width: int, *, layers: int, heads: int
) -> Qwen3Config:
    """A tiny Qwen3's config: `width` wide, heads of 8, half as many key/value heads."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=width, intermediate_size=width * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
        head_dim=8, max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )  # fmt: skip


def write_model(model_dir: Path, *, seed: int, corpus: list[str],
                data_dir: Path | None = None) -> Path:  # fmt: skip
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Model

    from zerotuner.demo.flow import LATENT_CHANNELS, _vae, save_pipeline

    work = Path(tempfile.mkdtemp(prefix="zerotuner-tokenizers-"))
    tokenizer = write_qwen_tokenizer(work / "qwen", corpus)
    torch.manual_seed(seed + 4)
    text_encoder = Qwen3Model(qwen3_config(tokenizer, QWEN_WIDTH, layers=2, heads=4))
    torch.manual_seed(seed + 3)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=LATENT_CHANNELS, dim=64,
        n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=QWEN_WIDTH,
        axes_dims=[8, 12, 12], axes_lens=[1024, 64, 64],
    )  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False
    )
    return save_pipeline(
        model_dir, work, ZImagePipeline, transformer=transformer, scheduler=scheduler,
        vae=_vae(seed, data_dir), text_encoder=text_encoder, tokenizer=tokenizer,
    )  # fmt: skip
