"""A tiny Chroma pipeline, built offline from the real diffusers/transformers classes: a
ChromaTransformer2DModel of one double- and one single-stream block (with its approximator),
the T5 encoder and tokenizer of the SD3/Flux demos (flow.py), their 16-channel exact VAE and
the flow-matching Euler scheduler with dynamic shifting (Chroma1-HD's, as FLUX.1's). Saved
with `save_pretrained`, it loads and generates through ChromaPipeline.
"""

from __future__ import annotations

import tempfile
from pathlib import Path


def write_model(model_dir: Path, *, seed: int, corpus: list[str],
                data_dir: Path | None = None) -> Path:  # fmt: skip
    import torch
    from diffusers import ChromaPipeline, ChromaTransformer2DModel

    from zerotuner.demo.flow import (
        LATENT_CHANNELS,
        T5_WIDTH,
        _t5,
        _vae,
        dynamic_scheduler,
        save_pipeline,
        write_t5_tokenizer,
    )  # fmt: skip

    work = Path(tempfile.mkdtemp(prefix="zerotuner-tokenizers-"))
    tokenizer = write_t5_tokenizer(work / "t5", corpus)
    t5 = _t5(len(tokenizer), seed + 4)
    torch.manual_seed(seed + 3)
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=LATENT_CHANNELS * 4, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=T5_WIDTH,
        axes_dims_rope=(4, 6, 6), approximator_num_channels=16, approximator_hidden_dim=32,
        approximator_layers=1,
    )  # fmt: skip
    return save_pipeline(
        model_dir, work, ChromaPipeline, transformer=transformer, scheduler=dynamic_scheduler(),
        vae=_vae(seed, data_dir), text_encoder=t5, tokenizer=tokenizer,
    )  # fmt: skip
