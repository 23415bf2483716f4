"""A tiny HiDream-I1 pipeline, built offline from the real diffusers/transformers classes: a
HiDreamImageTransformer2DModel of one double- and one single-stream block (each a mixture of 4
routed experts, 2 active, and a shared one), its four text encoders (CLIP-L and CLIP-G with
projections and, as the published ones, 248 positions; the T5 encoder and tokenizer of the
SD3/Flux demos; a two-layer LlamaForCausalLM whose two layers' states the blocks read,
`llama_layers` [0, 1], with demo/qwen_image.py's word-level tokenizer), the 16-channel exact VAE
of the flow demos and the flow-matching Euler scheduler at shift 3. Saved with
`save_pretrained`, it loads and generates through HiDreamImagePipeline.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

CLIP_WIDTH = 32  # each CLIP's projection: the pooled vector is both side by side
CLIP_POSITIONS = 248  # the published CLIPs' (the pipeline reads up to 218 tokens)
LLAMA_WIDTH, LLAMA_LAYERS = 32, 2


def _llama(tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=LLAMA_WIDTH, intermediate_size=LLAMA_WIDTH * 2,
            num_hidden_layers=LLAMA_LAYERS, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048, pad_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )  # fmt: skip


def _clip(vocab_size: int, seed: int) -> Any:
    import torch
    from transformers import CLIPTextModelWithProjection

    from zerotuner.demo.parts import text_config

    config = text_config(vocab_size, CLIP_WIDTH)
    config.max_position_embeddings = CLIP_POSITIONS
    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(config)


def write_model(model_dir: Path, *, seed: int, corpus: list[str],
                data_dir: Path | None = None) -> Path:  # fmt: skip
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        HiDreamImagePipeline,
        HiDreamImageTransformer2DModel,
    )

    from zerotuner.demo.flow import (
        LATENT_CHANNELS,
        T5_WIDTH,
        _t5,
        _vae,
        copy_clip_tokenizer,
        write_t5_tokenizer,
    )  # fmt: skip
    from zerotuner.demo.parts import write_tokenizer
    from zerotuner.demo.qwen_image import write_qwen_tokenizer

    work = Path(tempfile.mkdtemp(prefix="zerotuner-tokenizers-"))
    clip_tokenizer = write_tokenizer(work / "clip", corpus)
    t5_tokenizer = write_t5_tokenizer(work / "t5", corpus)
    llama_tokenizer = write_qwen_tokenizer(work / "llama", corpus)
    torch.manual_seed(seed + 3)
    transformer = HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=1,
        num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        caption_channels=[T5_WIDTH, LLAMA_WIDTH], text_emb_dim=2 * CLIP_WIDTH,
        num_routed_experts=4, num_activated_experts=2, axes_dims_rope=(8, 4, 4),
        max_resolution=(32, 32), llama_layers=list(range(LLAMA_LAYERS)),
    )  # fmt: skip
    HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=_vae(seed, data_dir),
        text_encoder=_clip(len(clip_tokenizer), seed + 1), tokenizer=clip_tokenizer,
        text_encoder_2=_clip(len(clip_tokenizer), seed + 2), tokenizer_2=clip_tokenizer,
        text_encoder_3=_t5(len(t5_tokenizer), seed + 4), tokenizer_3=t5_tokenizer,
        text_encoder_4=_llama(llama_tokenizer, seed + 5), tokenizer_4=llama_tokenizer,
        transformer=transformer,
    ).save_pretrained(model_dir, safe_serialization=True)  # fmt: skip
    return copy_clip_tokenizer(work, model_dir, ("tokenizer", "tokenizer_2"))
