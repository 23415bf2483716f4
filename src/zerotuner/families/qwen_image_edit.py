"""Qwen-Image-Edit (Qwen/Qwen-Image-Edit): Qwen-Image's transformer (QwenImageTransformer2DModel,
the same config and VAE) trained to edit: it sees the control image's latents beside the noisy
ones, and Qwen2.5-VL reads the control image with the instruction.

A family of its own (`qwenimageedit`) rather than a flag on `qwenimage`: its pipeline
(QwenImageEditPipeline) is what model_index.json names, its hub id says `Edit`, its data are
pairs (Spec.controls 1) and its captions' states depend on each pair's control image. A bare
transformer folder cannot tell the two apart (one class, one config): it reads as Qwen-Image,
and ZT_MODEL_FAMILY=qwenimageedit names the edit model. QwenImageEditPlusPipeline (2509, 2511:
several references, another template) is refused in one line (detection.py).

What it trains on is what QwenImageEditPipeline samples with (diffusers 0.42,
pipelines/qwenimage/pipeline_qwenimage_edit.py, `_get_qwen_prompt_embeds`, `prepare_latents`,
`__call__`), as musubi-tuner's Qwen-Image-Edit training also conditions (kohya-ss/musubi-tuner
at 1852ad34, src/musubi_tuner/qwen_image_train_network.py `call_dit`: the control latents after
the noisy tokens, `img_shapes` listing both, the prediction cut to the target's tokens):
- captions: the prompt in the pipeline's edit template (`prompt_template_encode`, its
  `<|vision_start|><|image_pad|><|vision_end|>` before the prompt), tokenized with the control
  image (resized as the pipeline resizes it, to 1024^2 in area: `control_pixels`) by its
  Qwen2VLProcessor, Qwen2.5-VL's last hidden states of the real tokens with the
  first 64 (`prompt_template_encode_start_idx`) dropped. They depend on the control image (its
  vision tokens are among them), so they are cached per item in its latent entry (and its
  mirror image's, which sees the mirrored control), not per caption: `encode_item_captions`,
  as musubi-tuner caches them per item (src/musubi_tuner/
  qwen_image_cache_text_encoder_outputs.py at 1852ad34, the control resized to 1024^2 in area);
- the control image cropped, flipped and sized with its target (data/loading.py; the pipeline
  resizes its input to 1024^2 in area at its aspect ratio: at ZT_RESOLUTION 1024 a bucket is
  that size; musubi-tuner too resizes controls to the target's bucket unless its dataset's
  `no_resize_control`), encoded by the VAE's mode and normalised as the target's
  (`_encode_vae_image`);
- both packed 2x2, the control's tokens after the noisy ones (`torch.cat([latents,
  image_latents], dim=1)`), `img_shapes` [(1, h/2, w/2), (1, h/2, w/2)] per image: the
  transformer's RoPE places each image in turn (QwenEmbedRope's frame offset);
- the output cut to the noisy tokens (`noise_pred[:, : latents.size(1)]`): the loss is
  Qwen-Image's flow matching (qwen_image.py) on the target alone.

Its Qwen2VLProcessor is built here from the pipeline folder's `processor/` files
(`load_processor`): transformers 5's own loader also builds a video processor, which needs
torchvision; an image editor reads no video, so this one has the PIL image processor and the
tokenizer alone (the same tokens and pixel values: tests/test_edit_qwen_image.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2VLProcessor

from zerotuner.families.qwen_image import QwenImage, QwenImageObjective

TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, "
    "texture, objects, background), then explain how the user's text instruction should alter "
    "or modify the image. Generate a new image that meets the user's requirements while "
    "maintaining consistency with the original input where appropriate.<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)  # QwenImageEditPipeline.prompt_template_encode
TEMPLATE_TOKENS = 64  # its prompt_template_encode_start_idx: the tokens dropped
PIPELINE_AREA = 1024 * 1024  # the area QwenImageEditPipeline resizes its input image to


class ImageProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without a video processor: its signature names the image processor and
    the tokenizer alone, so transformers neither builds nor checks one (its class needs
    torchvision)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None,
                 chat_template: Any = None, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def load_processor(folder: Path, subfolder: str = "processor") -> ImageProcessor:
    """The pipeline's processor from its folder's files: the PIL image processor of its
    preprocessor_config.json and its tokenizer."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    files = Path(folder) / subfolder
    return ImageProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(files),
        tokenizer=AutoTokenizer.from_pretrained(files),
    )


def control_pixels(controls: torch.Tensor) -> list[Any]:
    """The first control image of each item (batch, controls, 3, h, w) in [-1, 1] as the
    pipeline hands its input to the processor: a PIL image resized to 1024^2 in area at its
    aspect ratio, sides multiples of 32 (`calculate_dimensions`, VaeImageProcessor.resize),
    whatever the training resolution."""
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
    from PIL import Image

    pixels = ((controls[:, 0].float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    images = [Image.fromarray(p) for p in pixels.permute(0, 2, 3, 1).cpu().numpy()]
    resizer = VaeImageProcessor()  # its PIL resize: lanczos, as the pipeline's
    sized = []
    for image in images:
        width, height, _ = calculate_dimensions(PIPELINE_AREA, image.width / image.height)
        sized.append(resizer.resize(image, height, width))
    return sized


@dataclass(frozen=True)
class QwenImageEditObjective(QwenImageObjective):
    """Qwen-Image's packed flow matching with the control latents (`control_latents`: batch,
    controls, channels, height, width) packed after the noisy ones."""

    def describe(self) -> str:
        return (
            f"{super().describe()}; the control image's latents packed beside the noisy ones "
            "(img_shapes: the target, then the control), the loss on the target's tokens"
        )

    def reference_inputs(self, extra: dict[str, Any], references: torch.Size) -> dict[str, Any]:
        """QwenImageEditPipeline's `img_shapes`: per image, the target's and each reference's
        (frames, height, width) in 2x2 patches."""
        batch, count, (height, width) = references[0], references[1], references[-2:]
        shapes = [extra["img_shapes"][0], *[(1, height // 2, width // 2)] * count]
        return {"img_shapes": [shapes] * batch}


@dataclass(frozen=True)
class QwenImageEdit(QwenImage):
    """Qwen-Image-Edit: Qwen-Image's conditioning with the control image seen by Qwen2.5-VL
    and packed beside the noisy latents."""

    text_subfolders: tuple[tuple[str, str], ...] = (("text_encoder", "processor"),)

    def load_text(self, source: Path, *, dtype: torch.dtype) -> tuple[list[Any], list[Any]]:
        from transformers import Qwen2_5_VLForConditionalGeneration

        encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            source, subfolder="text_encoder", dtype=dtype
        )
        return [encoder], [load_processor(source)]

    def open_pipeline(self, folder: Path, cls: type | None = None, **kwargs: Any) -> Any:
        """With its processor built by `load_processor` (the pipeline's own loader of it needs
        torchvision)."""
        return super().open_pipeline(folder, cls, processor=load_processor(folder), **kwargs)

    def latent_subfolders(self) -> list[str]:
        """A latent entry holds the captions' states: the text encoder's files are in its key."""
        return [*super().latent_subfolders(), "text_encoder", "processor"]

    def latent_cache_tag(self) -> str:
        return f":edit-captions-{self.max_sequence_length}"

    def prompt_texts(self, captions: list[str], references: int) -> list[str]:
        """Each caption in the pipeline's template (`references`: the control images each
        item's prompt shows Qwen2.5-VL; here one, in the template)."""
        return [TEMPLATE.format(c) for c in captions]

    def prompt_images(self, controls: torch.Tensor) -> list[Any]:
        """The images the processor reads with the captions, each item's in turn."""
        return control_pixels(controls)

    @torch.no_grad()
    def encode_item_captions(
        self, encoders: list[Any], processors: list[Any], captions: list[str],
        controls: torch.Tensor,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """QwenImageEditPipeline._get_qwen_prompt_embeds of each caption with its item's
        control image (`controls`: batch, controls, 3, h, w in [-1, 1]), padded to the control's
        vision tokens and the template's plus max_sequence_length (a bucket's items share the
        length, so its batches stack), with the mask of the real ones."""
        (encoder,), (processor,) = encoders, processors
        images, per_item = self.prompt_images(controls), controls.shape[1]
        inputs = processor(
            text=self.prompt_texts(captions, per_item), images=images, padding=True,
            return_tensors="pt",
        ).to(encoder.device)  # fmt: skip
        out = encoder(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
            pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
            output_hidden_states=True,
        )  # fmt: skip
        empty = processor(text=self.prompt_texts([""], per_item), images=images[:per_item],
                          return_tensors="pt")  # fmt: skip
        length = int(empty["attention_mask"].sum()) - TEMPLATE_TOKENS + self.max_sequence_length
        states, mask = out.hidden_states[-1], inputs["attention_mask"].bool()
        embeds = states.new_zeros(len(captions), length, states.shape[-1])
        kept = torch.zeros(len(captions), length, dtype=self.cache_dtype)
        for i in range(len(captions)):
            real = states[i][mask[i]][TEMPLATE_TOKENS:][:length]
            embeds[i, : real.shape[0]] = real
            kept[i, : real.shape[0]] = 1
        return {"prompt_embeds": embeds.to(self.cache_dtype).cpu(), "text_mask": kept}

    def model_kwargs(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        return {**super().model_kwargs(batch, dtype),
                "control_latents": batch["control_latents"].to(dtype)}  # fmt: skip

    def objective(self, settings: Any, scheduler: Any, model_config: Any) -> Any:
        return QwenImageEditObjective(self.flow_config(settings, scheduler))
