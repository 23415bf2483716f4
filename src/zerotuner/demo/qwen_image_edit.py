"""A tiny Qwen-Image-Edit pipeline and its edit data, built offline from the real
diffusers/transformers classes: qwen_image.py's transformer, VAE and scheduler, its two-layer
Qwen2_5_VLForConditionalGeneration whose one-block vision tower now reads the control image
(its `<|image_pad|>` tokens, one per 2x2 merged 14 px patch), the word-level tokenizer with
Qwen2.5-VL's vision markers, and a Qwen2VLProcessor of it and the PIL image processor (no video
processor: torchvision is not needed; families/qwen_image_edit.py loads it so). Saved as a
QwenImageEditPipeline, which loads, takes an input image and generates.

The edit it learns is flux_kontext.py's recolouring: each demo image gets a control image
beside it, the same shape in the colour before the target's in RECOLOUR's cycle.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

# Qwen2.5-VL's chat and vision markers, as its tokenizer names them
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
            "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")  # fmt: skip
TEMPLATE_WORDS = (
    "system user assistant describe the key features of the input image color shape size "
    "texture objects background then explain how the user s text instruction should alter or "
    "modify generate a new that meets requirements while maintaining consistency with original "
    "where appropriate"
)  # QwenImageEditPipeline.prompt_template_encode's words


def write_model(model_dir: Path, *, seed: int, corpus: list[str],
                data_dir: Path | None = None) -> Path:  # fmt: skip
    """The tiny pipeline in `model_dir` and, with `data_dir`, each demo image's control."""
    from diffusers import QwenImageEditPipeline

    from zerotuner.demo.flux_kontext import write_controls

    return write_edit_model(
        model_dir, QwenImageEditPipeline, seed=seed, corpus=corpus, data_dir=data_dir,
        write_data=write_controls,
    )  # fmt: skip


def write_edit_model(
    model_dir: Path, pipeline: type, *, seed: int, corpus: list[str], data_dir: Path | None,
    write_data: Callable[[Path], object], words: str = TEMPLATE_WORDS,
    marks: tuple[str, ...] = (",", ":", ".", "(", ")", "'"),
) -> Path:  # fmt: skip
    """A tiny Qwen-Image edit `pipeline` (QwenImageEditPipeline or its Plus) in `model_dir`
    and, with `data_dir`, its controls (`write_data`); `words`, `marks`: its template's."""
    import torch
    from diffusers import QwenImageTransformer2DModel
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from zerotuner.demo.flow import LATENT_CHANNELS, dynamic_scheduler, save_pipeline
    from zerotuner.demo.qwen_image import QWEN_WIDTH, _text_encoder, _vae, write_qwen_tokenizer
    from zerotuner.families.qwen_image_edit import ImageProcessor

    work = Path(tempfile.mkdtemp(prefix="zerotuner-tokenizers-"))
    tokenizer = write_qwen_tokenizer(
        work / "qwen", corpus, specials=SPECIALS, words=words, marks=marks
    )
    ids = tokenizer.convert_tokens_to_ids
    vision_ids = {"image_token_id": ids("<|image_pad|>"), "video_token_id": ids("<|video_pad|>"),
                  "vision_start_token_id": ids("<|vision_start|>"),
                  "vision_end_token_id": ids("<|vision_end|>")}  # fmt: skip
    text_encoder = _text_encoder(tokenizer, seed + 4, vision_ids)
    # Qwen-Image-Edit's preprocessor_config.json's patches and pixel bounds
    processor = ImageProcessor(
        image_processor=Qwen2VLImageProcessorPil(
            min_pixels=3136, max_pixels=12845056, patch_size=14, temporal_patch_size=2,
            merge_size=2,
        ),
        tokenizer=tokenizer,
    )  # fmt: skip
    torch.manual_seed(seed + 3)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=LATENT_CHANNELS * 4, out_channels=LATENT_CHANNELS,
        num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=QWEN_WIDTH, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    scheduler = dynamic_scheduler(shift=1.0, shift_terminal=0.02, time_shift_type="exponential")
    save_pipeline(
        model_dir, work, pipeline, transformer=transformer, scheduler=scheduler,
        vae=_vae(seed, data_dir), text_encoder=text_encoder, tokenizer=tokenizer,
        processor=processor,
    )  # fmt: skip
    hub_layout(model_dir)
    if data_dir is not None:
        write_data(data_dir)
    return model_dir


def hub_layout(model_dir: Path) -> None:
    """The processor named as Qwen/Qwen-Image-Edit's files name it (transformers'
    Qwen2VLProcessor), not as the torchvision-free class that saved it."""
    import json

    for path, keys in ((model_dir / "model_index.json", ("processor", 1)),
                       (model_dir / "processor" / "processor_config.json",
                        ("processor_class",))):  # fmt: skip
        config = json.loads(path.read_text())
        if len(keys) == 2:
            config[keys[0]] = ["transformers", "Qwen2VLProcessor"]
        else:
            config[keys[0]] = "Qwen2VLProcessor"
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
