"""A tiny Krea 2 pipeline, built offline from the real diffusers/transformers classes: a
Krea2Transformer2DModel of two blocks (with one layer-wise and one refiner text-fusion block),
a two-layer Qwen3VLModel text encoder (with a one-block vision tower it never uses) whose two
layers' states the pipeline taps (`text_encoder_select_layers` (1, 2); the published pipeline
taps 12 of Qwen3-VL-4B's 36), demo/qwen_image.py's word-level tokenizer (Krea 2's prompt
template is Qwen-Image's: the same 34 tokens before the prompt, 5 after its padding), the small
AutoencoderKLQwenImage of the Qwen-Image demo (latents normalised by their per-channel mean and
std on the demo images) and the flow-matching Euler scheduler with Krea 2's resolution-aware
shift (mu from 0.5 to 1.15) at the demo's sizes. Saved with `save_pretrained`, it loads and
generates through Krea2Pipeline.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen3VLModel

QWEN_WIDTH = 32  # the text states' width: the transformer's text_hidden_dim
TAPPED = (1, 2)  # the encoder's hidden states the pipeline stacks per token


def _text_encoder(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen3VLModel:
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLModel

    ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.pad_token_id,
           "eos_token_id": tokenizer.eos_token_id}  # fmt: skip
    torch.manual_seed(seed)
    return Qwen3VLModel(
        Qwen3VLConfig(
            text_config={
                "vocab_size": len(tokenizer), "hidden_size": QWEN_WIDTH,
                "intermediate_size": QWEN_WIDTH * 2, "num_hidden_layers": len(TAPPED),
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                "max_position_embeddings": 2048, **ids,
                "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2],
                                    "rope_theta": 1000000.0},
            },
            vision_config={
                "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                "out_hidden_size": QWEN_WIDTH, "deepstack_visual_indexes": [0],
            },
            tie_word_embeddings=True,
        )
    )  # fmt: skip


def write_model(model_dir: Path, *, seed: int, corpus: list[str],
                data_dir: Path | None = None) -> Path:  # fmt: skip
    import torch
    from diffusers import Krea2Pipeline, Krea2Transformer2DModel

    from zerotuner.demo.flow import LATENT_CHANNELS, dynamic_scheduler, save_pipeline
    from zerotuner.demo.qwen_image import _vae, write_qwen_tokenizer

    work = Path(tempfile.mkdtemp(prefix="zerotuner-tokenizers-"))
    tokenizer = write_qwen_tokenizer(work / "qwen", corpus)
    text_encoder = _text_encoder(tokenizer, seed + 4)
    torch.manual_seed(seed + 3)
    transformer = Krea2Transformer2DModel(
        in_channels=LATENT_CHANNELS * 4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        timestep_embed_dim=32, text_hidden_dim=QWEN_WIDTH, num_text_layers=len(TAPPED),
        text_num_attention_heads=4, text_num_key_value_heads=4, text_intermediate_size=64,
        num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    scheduler = dynamic_scheduler(shift=1.0, base_shift=0.5, max_shift=1.15)
    return save_pipeline(
        model_dir, work, Krea2Pipeline, transformer=transformer, scheduler=scheduler,
        vae=_vae(seed, data_dir), text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_select_layers=TAPPED,
    )  # fmt: skip
