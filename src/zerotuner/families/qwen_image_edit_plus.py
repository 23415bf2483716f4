"""Qwen-Image-Edit Plus (Qwen/Qwen-Image-Edit-2509, -2511): Qwen-Image-Edit's network trained to
edit from several reference images at once (1 to 3: Spec.controls 3, min_controls 1), each read
by Qwen2.5-VL as "Picture N" and packed beside the noisy latents.

A family of its own (`qwenimageeditplus`) rather than a count on `qwenimageedit`: its pipeline
(QwenImageEditPlusPipeline) is what model_index.json names, its hub ids say `Edit-2509` or
`Edit-2511`, its prompt template and the size Qwen2.5-VL reads each reference at differ. A bare
transformer folder cannot be told from Qwen-Image's (one class, one config): it reads as
`qwenimage`, and ZT_MODEL_FAMILY=qwenimageeditplus names this model.

What it trains on is what QwenImageEditPlusPipeline samples with (diffusers 0.42,
pipelines/qwenimage/pipeline_qwenimage_edit_plus.py, `_get_qwen_prompt_embeds`,
`prepare_latents`, `__call__`); the packing is qwen_image_edit.py's (musubi-tuner's `call_dit`,
cited there), with one packed image per reference:
- captions: "Picture 1: <|vision_start|><|image_pad|><|vision_end|>" for each reference in turn,
  then the prompt, in the pipeline's template (`prompt_template_encode`: no vision markers of
  its own), tokenized with the references each resized to 384^2 in area
  (CONDITION_IMAGE_SIZE: `condition_pixels`), Qwen2.5-VL's last hidden states with the
  template's first 64 tokens dropped; cached per item as qwen_image_edit.py caches them;
- each reference cropped, flipped and sized with its target (data/loading.py; the pipeline
  resizes each to 1024^2 in area at its own aspect ratio, VAE_IMAGE_SIZE: at ZT_RESOLUTION 1024
  a bucket is that size, and the scan keeps only references of the target's aspect ratio),
  encoded by the VAE's mode and normalised as the target's;
- all packed 2x2 after the noisy tokens in the references' order (`torch.cat(all_image_latents,
  dim=1)`), `img_shapes` listing the target, then each reference (qwen_image_edit.py's
  objective: it places any count); the loss on the target's tokens alone.

One run trains every target with the same number of references (a batch stacks them:
data/controls.py refuses a mix); the planner counts the most, 3 (families/shapes.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zerotuner.families.qwen_image_edit import QwenImageEdit, QwenImageEditObjective

TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, "
    "texture, objects, background), then explain how the user's text instruction should alter "
    "or modify the image. Generate a new image that meets the user's requirements while "
    "maintaining consistency with the original input where appropriate.<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)  # QwenImageEditPlusPipeline.prompt_template_encode
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"  # its img_prompt_template
CONDITION_AREA = 384 * 384  # the pipeline's CONDITION_IMAGE_SIZE: what Qwen2.5-VL reads


def condition_pixels(controls: torch.Tensor) -> list[Any]:
    """Every control image of each item (batch, controls, 3, h, w) in [-1, 1], item after item,
    as the pipeline hands them to the processor: PIL images resized to 384^2 in area at their
    aspect ratio, sides multiples of 32 (`calculate_dimensions`, VaeImageProcessor.resize)."""
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions
    from PIL import Image

    pixels = ((controls.flatten(0, 1).float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    resizer = VaeImageProcessor()  # its PIL resize: lanczos, as the pipeline's
    sized = []
    for array in pixels.permute(0, 2, 3, 1).cpu().numpy():
        image = Image.fromarray(array)
        width, height = calculate_dimensions(CONDITION_AREA, image.width / image.height)
        sized.append(resizer.resize(image, height, width))
    return sized


@dataclass(frozen=True)
class QwenImageEditPlusObjective(QwenImageEditObjective):
    """Qwen-Image-Edit's objective with each of the references packed in turn."""

    def describe(self) -> str:
        return (
            f"{super(QwenImageEditObjective, self).describe()}; each reference image's latents "
            "packed beside the noisy ones in order (img_shapes: the target, then each "
            "reference), the loss on the target's tokens"
        )


@dataclass(frozen=True)
class QwenImageEditPlus(QwenImageEdit):
    """Qwen-Image-Edit Plus: the edit model's conditioning with 1 to 3 references, each a
    "Picture N" of the prompt and a packed image beside the noisy latents."""

    def latent_cache_tag(self) -> str:
        return f":edit-plus-captions-{self.max_sequence_length}"

    def prompt_texts(self, captions: list[str], references: int) -> list[str]:
        """QwenImageEditPlusPipeline's prompt: a "Picture N" per reference, then the caption."""
        pictures = "".join(PICTURE.format(n + 1) for n in range(references))
        return [TEMPLATE.format(pictures + c) for c in captions]

    def prompt_images(self, controls: torch.Tensor) -> list[Any]:
        return condition_pixels(controls)

    def objective(self, settings: Any, scheduler: Any, model_config: Any) -> Any:
        return QwenImageEditPlusObjective(self.flow_config(settings, scheduler))
