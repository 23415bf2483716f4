"""Which family a model is: read from a pipeline's files (model_index.json, the denoiser's
config), from ZT_MODEL_FAMILY, or guessed from a hub id's name; and the models zerotuner does
not train, refused in one line (image-edit models that are no edit family here, Wan's
conditioned variants in wan_variants).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from zerotuner.errors import ConfigError
from zerotuner.families.registry import (
    FAMILIES,
    PIPELINES,
    REGISTRY,
    TRANSFORMERS,
    Family,
    known_family,
)
from zerotuner.families.stored import model_json, unet_config_path
from zerotuner.families.wan_variants import refuse_wan_variant, takes_first_frame

# A hub model's files the planner reads (a few KB): the pipeline index and each part's config.
HUB_CONFIG_FILES = ("model_index.json", "*/config.json")


def hub_cache_dir(cache_dir: Path) -> Path:
    """Where hub downloads go: HF_HOME's hub folder, else ZT_CACHE_DIR/huggingface/hub."""
    return Path(os.environ.get("HF_HOME") or cache_dir / "huggingface") / "hub"


def detect_family(model_dir: Path, expert: str | None = None) -> Family:
    """SDXL has a second text encoder and `text_time` conditioning; SD2 attends with 1024 dims.
    `expert`: ZT_EXPERT (Wan 2.2 A14B is refused without it)."""
    index = model_dir / "model_index.json"
    if index.is_file():
        components = model_json(index)
        pipeline = str(components.get("_class_name", ""))
        if pipeline not in PIPELINES:  # an edit model zerotuner trains is a family of its own
            refuse_edit_model(model_dir, pipeline)
        refuse_wan_variant(model_dir, pipeline, components, expert)
        refuse_ltx2_variant(model_dir, pipeline)
        refuse_hunyuan_video15_variant(model_dir, pipeline)
        if pipeline in PIPELINES:
            return PIPELINES[pipeline]
        foreign = pipeline and not pipeline.startswith("StableDiffusion")
        if foreign or "transformer" in components or "unet" not in components and pipeline:
            raise ConfigError(
                f"ZT_MODEL={model_dir}: a {pipeline or 'transformer'} pipeline; zerotuner "
                f"trains {', '.join(FAMILIES)} pipelines ({', '.join(PIPELINES)} and the "
                "Stable Diffusion 1.x/2.x/XL ones)"
            )
        if "text_encoder_2" in components or "XL" in pipeline:
            return "sdxl"
    config = unet_config_path(model_dir)
    if config is None:
        raise ConfigError(
            f"ZT_MODEL={model_dir}: no model_index.json or unet/config.json; "
            f"set ZT_MODEL_FAMILY to one of {', '.join(FAMILIES)}"
        )
    unet = model_json(config)
    name = unet.get("_class_name", "")
    refuse_wan_variant(model_dir, name, unet)
    if name in TRANSFORMERS:  # a transformer without its pipeline's model_index.json
        return transformer_family(name, unet)
    if "Transformer" in name:
        raise ConfigError(
            f"ZT_MODEL={model_dir}: a {name} model; zerotuner trains the "
            f"{', '.join(TRANSFORMERS)} transformers and the UNets of "
            f"{', '.join(f for f, spec in REGISTRY.items() if not spec.flow)}"
        )
    if unet.get("addition_embed_type") == "text_time":
        return "sdxl"
    return "sd2" if unet.get("cross_attention_dim") == 1024 else "sd1"


def refuse_ltx2_variant(model: Any, name: str) -> None:
    """An LTX-2 pipeline other than text-to-video and image-to-video (LTX2ConditionPipeline,
    the IC-LoRA, HDR, DFR and upsampling ones) is one line, exit 2, naming the two it trains."""
    trained = (REGISTRY["ltx2"].pipeline, REGISTRY["ltx2i2v"].pipeline)
    if name.startswith("LTX2") and name.endswith("Pipeline") and name not in trained:
        raise ConfigError(
            f"ZT_MODEL={model}: {name} is an LTX-2 pipeline zerotuner does not train "
            f"(conditioned on video, keyframes or references, or an upsampler); it trains "
            f"LTX-2 text-to-video ({trained[0]}, ltx2) and image-to-video ({trained[1]}, "
            f"ltx2i2v: ZT_MODEL_FAMILY=ltx2i2v on an LTX-2 checkpoint), their video path, on "
            f"captioned clips and images"
        )


def refuse_hunyuan_video15_variant(model: Any, name: str) -> None:
    """A HunyuanVideo 1.5 pipeline other than text-to-video and image-to-video (its
    super-resolution ones), or a hub id naming an image-to-video checkpoint that is not a
    diffusers 480p or 720p one, is one line, exit 2, naming the two it trains."""
    t2v, i2v = REGISTRY["hunyuanvideo15"], REGISTRY["hunyuanvideo15i2v"]
    lower = name.lower()
    hub_i2v = any(m in lower for m in t2v.hub_markers) and "i2v" in lower
    other = name.startswith("HunyuanVideo15") and name.endswith("Pipeline")
    if (hub_i2v and not any(m in lower for m in i2v.hub_markers)) or (
        other and name not in (t2v.pipeline, i2v.pipeline)
    ):
        raise ConfigError(
            f"ZT_MODEL={model}: {name} is a HunyuanVideo 1.5 model zerotuner does not train; it "
            f"trains HunyuanVideo 1.5 text-to-video ({t2v.pipeline}, the *_t2v checkpoints, "
            f"hunyuanvideo15) and image-to-video ({i2v.pipeline}, the Diffusers-480p_i2v and "
            f"-720p_i2v checkpoints, hunyuanvideo15i2v) on captioned clips and images"
        )


def refuse_missing_parts(family: Family, model_dir: Path, name: str) -> None:
    """A folder whose model_index.json lacks a part the family needs (Spec.required_parts:
    ZT_MODEL_FAMILY=hunyuanvideo15i2v on a text-to-video folder, which has no SigLIP) is one
    line, exit 2, before anything is cached."""
    needed = REGISTRY[family].required_parts
    index = model_dir / "model_index.json"
    components = model_json(index) if index.is_file() else {}
    missing = [part for part in needed if not components.get(part)]
    if missing:
        raise ConfigError(
            f"{name}: {family} needs the pipeline's {' and '.join(missing)}, which its "
            f"model_index.json does not name; point it at a {REGISTRY[family].pipeline} folder "
            f"or set ZT_MODEL_FAMILY to the folder's own family"
        )


def transformer_family(name: str, config: dict[str, Any]) -> Family:
    """The family of a transformer config of class `name`: FLUX.2 [klein] shares [dev]'s
    class and has no guidance embedding; Wan's image-to-video transformer shares text-to-video's
    and takes 36 channels."""
    if name == "Flux2Transformer2DModel" and not config.get("guidance_embeds", True):
        return "flux2klein"
    if name == REGISTRY["wan"].transformer and takes_first_frame(config):
        return "wani2v"  # Wan's image-to-video transformer: the first frame's latents in too
    return TRANSFORMERS[name]


def resolve_family(model: str, family_setting: str = "auto", expert: str | None = None) -> Family:
    """ZT_MODEL_FAMILY, else read from a local folder, else guessed from a hub id's name.
    `expert`: ZT_EXPERT (Wan 2.2 A14B is refused without it)."""
    if known_family(family_setting, auto=True) != "auto":
        return family_setting
    path = Path(model)
    if path.is_dir():
        return detect_family(path, expert)
    family = guess_family(model, expert)
    if family is None:
        raise ConfigError(
            f"ZT_MODEL={model}: cannot tell the model family from the name; set ZT_MODEL_FAMILY "
            f"to one of {', '.join(FAMILIES)}"
        )
    return family


# Words of pipelines (and hub names) of image-edit models, which train on (source, target)
# image pairs; the edit families' own markers (FLUX.1 Kontext's "kontext") join them.
EDIT_WORDS = ("edit", "editing")
# hub names of edit models whose words do not say it (HiDream-E1, HiDreamImageEditingPipeline)
EDIT_NAMES = ("hidream-e1",)


def refuse_edit_model(model: Any, name: str) -> None:
    """An image-edit model that is no family here (a pipeline or hub name that says so:
    HiDream-E1, Kontext's inpainting) is one line, exit 2, naming what zerotuner trains (the
    edit families, FLUX.1 Kontext, Qwen-Image-Edit and FLUX.2 with its references, are
    detected before this is asked)."""
    import re

    supported = (f"zerotuner trains text-to-image models from captioned images: "
                 f"{', '.join(FAMILIES)}")  # fmt: skip
    # words of a class or hub name: QwenImageEditPipeline, Qwen-Image-Edit-2509 (not "credit")
    words = {w.lower() for w in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+", name)}
    edit = [family for family, spec in REGISTRY.items() if spec.controls]
    markers = {*EDIT_WORDS, *(m for family in edit for m in REGISTRY[family].hub_markers)}
    if words & markers or any(n in name.lower() for n in EDIT_NAMES):
        raise ConfigError(
            f"ZT_MODEL={model}: {name} is an image-edit model, trained on paired (source, "
            f"edited) images, which zerotuner takes for {', '.join(edit)} alone; "
            f"{supported}"
        )


def guess_family(hub_id: str, expert: str | None = None) -> Family | None:
    """The family a hub id's name says (when its configs cannot be read), or None; an
    image-edit model's name is refused (refuse_edit_model), as a Wan variant's
    (refuse_wan_variant; `expert`: ZT_EXPERT)."""
    name = hub_id.lower()
    for family, spec in sorted(REGISTRY.items(), key=lambda item: item[1].guess_order):
        if any(marker in name for marker in spec.hub_markers):
            if not spec.controls:  # an edit family's name says edit: it is no refusal
                refuse_edit_model(hub_id, hub_id.rsplit("/", 1)[-1])
            refuse_wan_variant(hub_id, hub_id, expert=expert)
            refuse_hunyuan_video15_variant(hub_id, hub_id)
            return family
    refuse_edit_model(hub_id, hub_id.rsplit("/", 1)[-1])
    refuse_wan_variant(hub_id, hub_id, expert=expert)
    return None


def distilled_note(family: Family, model_dir: Path | None, model: str) -> str | None:
    """A distilled checkpoint of a family whose adapters are trained on its base (Krea 2
    Turbo, HiDream-I1 Dev and Fast: model_index.json's `is_distilled`, or the family's
    `distilled_markers` in a hub id read by its name alone): what the run is told. None: not
    one."""
    base = REGISTRY[family].base_model
    index = model_dir / "model_index.json" if model_dir is not None else None
    if index is not None and index.is_file():
        distilled = bool(model_json(index).get("is_distilled"))
    else:
        name = model.rsplit("/", 1)[-1].lower()
        distilled = any(marker in name for marker in REGISTRY[family].distilled_markers)
    if not base or not distilled:
        return None
    return (
        f"ZT_MODEL={model} is a distilled (few-step) {family} checkpoint: training wears its "
        f"distillation away; train on {base} and apply the adapter or weights on the "
        "distilled one, as its makers advise (docs/models.md)"
    )
