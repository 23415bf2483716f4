"""Tiny FLUX.2 [dev] and [klein] pipelines, built offline from the real diffusers/transformers
classes: a Flux2Transformer2DModel of one double- and one single-stream block (with the guidance
embedding for [dev], without for [klein]), an AutoencoderKLFlux2 with the demo's exact encoder
and decoder weights (flow.py's 16-channel VAE) and its batch norm's statistics measured on the
demo images, and the flow-matching Euler scheduler with dynamic shifting.

[dev]'s text encoder is a Mistral3ForConditionalGeneration of 30 tiny layers (the pipeline
reads layers 10, 20 and 30) with a one-layer Pixtral tower it never uses, and a fast tokenizer
with Mistral's chat markers whose chat template renders the pipeline's list-of-parts messages;
the pipeline's long system message is one token of it, so a caption fits the tests' 16 tokens
(the published tokenizer is Mistral Small's PixtralProcessor). [klein]'s is a Qwen3ForCausalLM
of 27 tiny layers (it reads 9, 18 and 27) with z_image.py's Qwen tokenizer. Saved with
`save_pretrained`, each loads and generates through Flux2Pipeline / Flux2KleinPipeline.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from zerotuner.demo.parts import EXTRA_WORDS, demo_pixels

if TYPE_CHECKING:
    from diffusers import AutoencoderKLFlux2
    from transformers import (
        Mistral3ForConditionalGeneration,
        PreTrainedModel,
        PreTrainedTokenizerFast,
        Qwen3ForCausalLM,
    )

TEXT_WIDTH = 16  # the encoders' hidden size: the transformer takes 3 layers' states side by side
MARKERS = ("<s>", "</s>", "<unk>", "<pad>", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]",
           "[/INST]")  # fmt: skip
# Mistral's chat layout, each message's content a list of {"type": "text", "text": ...} parts
CHAT_TEMPLATE = (
    "<s>{% for message in messages %}{% if message['role'] == 'system' %}[SYSTEM_PROMPT]"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}[/SYSTEM_PROMPT]"
    "{% else %}[INST]{% for part in message['content'] %}{{ part['text'] }}{% endfor %}[/INST]"
    "{% endif %}{% endfor %}"
)


def write_mistral_tokenizer(folder: Path, corpus: list[str]) -> PreTrainedTokenizerFast:
    """A unigram tokenizer over the corpus's words with Mistral's markers; Flux2Pipeline's
    system message is one added token."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted(set(re.findall(r"[a-z]+", " ".join([*corpus, EXTRA_WORDS]).lower())))
    vocab = [(token, 0.0) for token in MARKERS]
    vocab += [(f"▁{w}", -1.0) for w in words] + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    tok = Tokenizer(models.Unigram(vocab, unk_id=MARKERS.index("<unk>"), byte_fallback=False))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    specials = [AddedToken(t, special=True, normalized=False) for t in MARKERS]
    tok.add_special_tokens([*specials, AddedToken(SYSTEM_MESSAGE, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", padding_side="right", model_max_length=512,
    )  # fmt: skip
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return tokenizer


def _mistral(tokenizer: PreTrainedTokenizerFast, seed: int) -> Mistral3ForConditionalGeneration:
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(seed)
    return Mistral3ForConditionalGeneration(
        Mistral3Config(
            text_config={
                "model_type": "mistral", "vocab_size": len(tokenizer), "hidden_size": TEXT_WIDTH,
                "intermediate_size": TEXT_WIDTH * 2, "num_hidden_layers": 30,
                "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                "max_position_embeddings": 1024, "pad_token_id": tokenizer.pad_token_id,
            },
            vision_config={
                "model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32,
                "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 8,
                "image_size": 28, "patch_size": 14,
            },
            spatial_merge_size=2, multimodal_projector_bias=False, image_token_index=0,
        )
    )  # fmt: skip


def _qwen3(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen3ForCausalLM:
    import torch
    from transformers import Qwen3ForCausalLM

    from zerotuner.demo.z_image import qwen3_config

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(qwen3_config(tokenizer, TEXT_WIDTH, layers=27, heads=2))


def _vae(seed: int, data_dir: Path | None) -> AutoencoderKLFlux2:
    """flow.py's exact 16-channel VAE as an AutoencoderKLFlux2, its batch norm's running mean
    and variance those of the demo images' 2x2 latent patches."""
    import torch
    from diffusers import AutoencoderKLFlux2, Flux2Pipeline

    from zerotuner.demo.flow import LATENT_CHANNELS
    from zerotuner.demo.parts import DEMO_RESOLUTION, VAE_BLOCKS, VAE_GROUPS, exact_vae

    exact = exact_vae(seed, latent_channels=LATENT_CHANNELS)
    vae = AutoencoderKLFlux2(
        block_out_channels=VAE_BLOCKS, down_block_types=("DownEncoderBlock2D",) * len(VAE_BLOCKS),
        up_block_types=("UpDecoderBlock2D",) * len(VAE_BLOCKS), layers_per_block=1,
        latent_channels=LATENT_CHANNELS, norm_num_groups=VAE_GROUPS, sample_size=DEMO_RESOLUTION,
        use_quant_conv=False, use_post_quant_conv=False,
    )  # fmt: skip
    missing, unexpected = vae.load_state_dict(exact.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("bn.") for k in missing), (missing, unexpected)
    if data_dir is not None:
        with torch.no_grad():
            latents = vae.encode(demo_pixels(data_dir)).latent_dist.mode()
        patches = Flux2Pipeline._patchify_latents(latents)
        vae.bn.running_mean.copy_(patches.mean(dim=(0, 2, 3)))
        vae.bn.running_var.copy_(patches.var(dim=(0, 2, 3)))
    return vae


def write_model(model_dir: Path, *, seed: int, corpus: list[str], data_dir: Path | None = None,
                klein: bool = False) -> Path:  # fmt: skip
    import torch
    from diffusers import Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel

    from zerotuner.demo.flow import LATENT_CHANNELS, dynamic_scheduler, save_pipeline
    from zerotuner.demo.z_image import write_qwen_tokenizer

    work = Path(tempfile.mkdtemp(prefix="zerotuner-tokenizers-"))
    text_encoder: PreTrainedModel
    if klein:
        tokenizer = write_qwen_tokenizer(work / "qwen", corpus)
        text_encoder = _qwen3(tokenizer, seed + 4)
    else:
        tokenizer = write_mistral_tokenizer(work / "mistral", corpus)
        text_encoder = _mistral(tokenizer, seed + 4)
    torch.manual_seed(seed + 3)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=LATENT_CHANNELS * 4, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=3 * TEXT_WIDTH,
        timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=not klein,
    )  # fmt: skip
    extra = {"is_distilled": False} if klein else {}
    return save_pipeline(
        model_dir, work, Flux2KleinPipeline if klein else Flux2Pipeline,
        transformer=transformer, scheduler=dynamic_scheduler(), vae=_vae(seed, data_dir),
        text_encoder=text_encoder, tokenizer=tokenizer, **extra,
    )  # fmt: skip


def write_klein_model(model_dir: Path, *, seed: int, corpus: list[str],
                      data_dir: Path | None = None) -> Path:  # fmt: skip
    return write_model(model_dir, seed=seed, corpus=corpus, data_dir=data_dir, klein=True)
