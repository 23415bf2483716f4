"""pytorch_lora_weights_comfyui.safetensors for every family (issue 41): the adapter in the key
layout ComfyUI's loader maps for the model, at diffusers' strength (alpha != rank here).

ComfyUI itself is not installed: each family's file goes through diffusers' own reader for it
(`load_lora_weights`: its kohya converter for the UNet families, its Wan converter for Wan's
original names, its own format for the transformer families whose diffusers names ComfyUI
maps) and must give the diffusers file's weights, every tensor used. Wan's names are checked
against diffusers' conversion of the original checkpoint too, and DoRA's `dora_scale` against
ComfyUI's DoRA formula.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lorakit import perturb_adapter
from safetensors.torch import load_file

from zerotuner import families
from zerotuner.errors import ConfigError
from zerotuner.families import REGISTRY
from zerotuner.settings.schema import Settings
from zerotuner.weights import lora, lora_files, lora_from, lora_layouts
from zerotuner.weights.pipeline_folder import load_part

RANK, ALPHA = 4, 2  # alpha != rank: a file without diffusers' scale is off by 2x
UNET_TARGETS = "attention+ff,proj_in,proj_out,conv1,conv2,conv_in,conv_out,time_emb_proj"
TARGETS = {
    "sdxl": UNET_TARGETS, "sd1": UNET_TARGETS, "sd2": UNET_TARGETS,
    "sd3": "attention+ff", "flux": "attention+ff", "fluxkontext": "attention+ff",
    "chroma": "attention,proj_mlp,proj_out",
    "zimage": "attention", "qwenimage": "attention,img_mlp.net.2",
    "qwenimageedit": "attention,img_mlp.net.2", "qwenimageeditplus": "attention,img_mlp.net.2",
    "flux2": "attention,to_qkv_mlp_proj,single_transformer_blocks.0.attn.to_out",
    "flux2klein": "attention,to_qkv_mlp_proj",
    # every kind of layer Wan's original names rename
    "wan": "attention,ffn.net.0.proj,ffn.net.2,proj_out,time_proj,linear_1,linear_2",
    # every kind of layer Krea 2's original names rename
    # HiDream's: the example's (the preset's `to_out.0` is its `to_out`), both streams' attention
    "hidream": "attention,to_q_t,to_k_t,to_v_t,to_out_t",
    "krea2": "attention,to_gate,ff.gate,ff.up,ff.down,img_in,final_layer.linear,linear_1,"
             "linear_2,time_mod_proj,projector",
    # Wan's, and the image cross-attention's projections (Wan 2.1 I2V's `k_img`, `v_img`)
    "wani2v": "attention,ffn.net.0.proj,ffn.net.2,proj_out,time_proj,linear_1,linear_2,"
              "add_k_proj,add_v_proj",
    # every kind of layer LTX-2's original names rename, and its feed-forward
    "ltx2": "attention+ff,proj_in,proj_out,linear_1,linear_2,linear",
    "ltx2i2v": "attention+ff,proj_in,proj_out,linear_1,linear_2,linear",  # LTX-2's network
    # every kind of layer HunyuanVideo 1.5's original names rename: both streams' and the token
    # refiner's attention (q, k, v fused in ComfyUI's model) and feed-forward, the modulations
    "hunyuanvideo15": "attention+ff,add_q_proj,add_k_proj,add_v_proj,to_add_out,"
                      "ff_context.net.0.proj,ff_context.net.2,norm1.linear,norm1_context.linear,"
                      "refiner_blocks.0.norm_out.linear,proj_in,proj_out",
    # HunyuanVideo 1.5's network: image-to-video's checkpoints are its weights
    "hunyuanvideo15i2v": "attention+ff,add_q_proj,add_k_proj,add_v_proj,to_add_out,"
                         "ff_context.net.0.proj,ff_context.net.2,norm1.linear,"
                         "norm1_context.linear,refiner_blocks.0.norm_out.linear,proj_in,proj_out",
}  # fmt: skip
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # fp32; folding the scale into lora_B rounds once
# ComfyUI's HunyuanVideo (1.0 and 1.5: model_base.HunyuanVideo15 subclasses it), read in
# Comfy-Org/ComfyUI: its model's weights are a checkpoint's layers renamed by these parts
# (supported_models.py at 01f03bbd, `HunyuanVideo.process_unet_state_dict`, HunyuanVideo15's
# too), and its LoRA key map (lora.py at 17358c8f, `model_lora_keys_unet`) names each weight
# `diffusion_model.<model name>` (any model) and, in its HunyuanVideo branch,
# `transformer.<model name with these parts spelled back>` (diffusion-pipe's LoRAs)
HUNYUAN_MODEL_NAMES = (
    ("_attn_qkv.", "_attn.qkv."), ("_attn_proj.", "_attn.proj."), ("_mod.linear.", "_mod.lin."),
    ("mlp.fc1.", "mlp.0."), ("mlp.fc2.", "mlp.2."),
)  # fmt: skip


def test_every_registered_family_has_its_targets():
    """The round trip below runs for each family in the registry: a new one needs its targets
    here, and this names it rather than a KeyError in the middle of the run."""
    assert set(TARGETS) == set(REGISTRY), set(REGISTRY) ^ set(TARGETS)


def adapted(demo: Path, family: str, **variant):
    """The family's demo denoiser with an adapter whose every weight matters (B moved off 0)."""
    kind = families.get(family)
    denoiser = load_part(demo / "model", kind.denoiser)
    settings = Settings(
        training_type="lora", lora_rank=RANK, lora_alpha=ALPHA, lora_targets=TARGETS[family],
        **variant,
    )  # fmt: skip
    lora.add_adapter(denoiser, settings)
    perturb_adapter(denoiser, 0.05)
    return denoiser, settings


def write(module, settings, family: str, out: Path, **kwargs) -> Path:
    state = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    config = lora.metadata(lora.lora_config(settings, module))  # the targets as it spells them
    return lora_files.write_adapter(family, state, lora.shapes(module), config, out, **kwargs)


def fused(demo: Path, family: str, folder: Path, weight_name: str) -> tuple[dict, int]:
    """The pipeline's denoiser weights with the file fused in, and how many layers it adapted."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    pipe = families.get(family).open_pipeline(demo / "model")
    pipe.load_lora_weights(folder, weight_name=weight_name)
    denoiser = getattr(pipe, families.get(family).denoiser)
    layers = sum(isinstance(m, BaseTunerLayer) for m in denoiser.modules())
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    return {k: v.clone() for k, v in denoiser.state_dict().items()}, layers


def comfyui_hunyuan_key_map(checkpoint: set[str]) -> dict[str, str]:
    """{LoRA key: checkpoint layer} of ComfyUI's key map for a HunyuanVideo model loaded from a
    checkpoint with these layer names (HUNYUAN_MODEL_NAMES)."""
    keys = {}
    for name in checkpoint:
        model = f"{name}."
        for theirs, ours in HUNYUAN_MODEL_NAMES:
            model = model.replace(theirs, ours)
        spelled = model
        for theirs, ours in HUNYUAN_MODEL_NAMES:
            spelled = spelled.replace(ours, theirs)
        keys[f"diffusion_model.{model[:-1]}"] = keys[f"transformer.{spelled[:-1]}"] = name
    return keys


def comfyui_hunyuan_applied(demo: Path, comfy: dict) -> tuple[dict, int]:
    """HunyuanVideo 1.5's transformer weights with the ComfyUI file applied as ComfyUI applies
    it, and how many diffusers layers it changed. ComfyUI adds B @ A (strength 1, no `.alpha`)
    to the weight its key map names; diffusers' converter of HunyuanVideo checkpoints
    (`convert_hunyuan_video_transformer_to_diffusers`, single-file loading) takes that layer to
    diffusers' names, a fused q, k, v split by rows. Diffusers' LoRA converter for these names
    is not used: it splits the refiner's fused `lora_A` as if it were a weight."""
    from diffusers.loaders.single_file_utils import (
        convert_hunyuan_video_transformer_to_diffusers as to_diffusers,
    )

    key_map = comfyui_hunyuan_key_map({k.split(".lora_")[0].split(".", 1)[1] for k in comfy})
    deltas = {
        f"{key_map[key]}.weight": comfy[f"{key}.lora_B.weight"] @ comfy[f"{key}.lora_A.weight"]
        for key in {k.split(".lora_")[0] for k in comfy}
    }
    converted = to_diffusers(deltas)
    weights = load_part(demo / "model", "transformer").state_dict()
    assert converted.keys() <= weights.keys(), sorted(converted.keys() - weights.keys())
    applied = {k: v + converted[k] if k in converted else v for k, v in weights.items()}
    return applied, len(converted)


@pytest.mark.parametrize("family", list(REGISTRY))
def test_comfyui_file_loads_as_the_diffusers_adapter(family, family_demo_dir, tmp_path) -> None:
    """Read by diffusers' loader for that layout (HunyuanVideo 1.5's: applied as ComfyUI applies
    it, comfyui_hunyuan_applied), the ComfyUI file gives the diffusers adapter's weights
    (TOLERANCE), with every tensor of the file used: one adapted layer per lora_A / lora_B pair
    (and kohya's `.alpha`; a fused q, k, v's pair three), none left unmatched."""
    demo = family_demo_dir(family)
    denoiser, settings = adapted(demo, family)
    out = write(denoiser, settings, family, tmp_path / "final")
    modules = {n.split(".lora_")[0] for n, p in denoiser.named_parameters() if p.requires_grad}
    comfy = load_file(out / lora_files.COMFY_FILE)
    kind = families.get(family)
    layout = kind.comfy_lora
    per_layer = 3 if layout.kohya else 2  # kohya's `.alpha`; the others fold the scale in
    names = {lora_layouts.comfy_name(layout, kind.denoiser, m) for m in modules}
    assert len(comfy) == per_layer * len(names)
    if layout.kohya:
        assert {float(t) for k, t in comfy.items() if k.endswith(".alpha")} == {float(ALPHA)}
    else:
        assert all(k.startswith(layout.prefix) for k in comfy)
    expected, _ = fused(demo, family, out, lora_files.ADAPTER_FILE)
    loaded, layers = (
        comfyui_hunyuan_applied(demo, comfy) if family.startswith("hunyuanvideo15")
        else fused(demo, family, out, lora_files.COMFY_FILE)
    )  # fmt: skip
    assert layers == len(modules)
    base = load_part(demo / "model", families.get(family).denoiser).state_dict()
    assert sum(not torch.equal(expected[k], base[k]) for k in base) >= len(modules)
    assert expected.keys() == loaded.keys()
    for key in expected:
        torch.testing.assert_close(loaded[key], expected[key], **TOLERANCE, msg=key)


def test_wan_comfyui_names_are_the_original_checkpoints(family_demo_dir, tmp_path) -> None:
    """Wan's file names modules as the original checkpoint does (ComfyUI's model): diffusers'
    conversion of an original Wan checkpoint (`convert_wan_transformer_to_diffusers`, as
    scripts/convert_wan_to_diffusers.py) turns each back into the diffusers module trained; the
    low-noise expert's (A14B `transformer_2`) file is named alike."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    demo = family_demo_dir("wan")
    denoiser, settings = adapted(demo, "wan")
    high = load_file(write(denoiser, settings, "wan", tmp_path / "a") / lora_files.COMFY_FILE)
    low = write(denoiser, settings, "wan", tmp_path / "b", denoiser="transformer_2")
    assert load_file(low / lora_files.COMFY_FILE).keys() == high.keys()
    theirs = {k.removeprefix("diffusion_model.").split(".lora_")[0] for k in high}
    ours = {n.split(".lora_")[0] for n, p in denoiser.named_parameters() if p.requires_grad}
    assert "head.head" in theirs and "blocks.0.self_attn.q" in theirs
    converted = convert_wan_transformer_to_diffusers({f"{m}.weight": 0 for m in theirs})
    assert {k.removesuffix(".weight") for k in converted} == ours


def test_hunyuanvideo15_comfyui_names_are_in_comfyuis_key_map(family_demo_dir, tmp_path) -> None:
    """HunyuanVideo 1.5's file names each layer as ComfyUI's key map does for its model
    (`transformer.` + the checkpoint's name, HUNYUAN_MODEL_NAMES), q, k and v as the one fused
    layer ComfyUI's model has (Flux's DoubleStreamBlock, `img_attn.qkv`), not diffusers'."""
    denoiser, settings = adapted(family_demo_dir("hunyuanvideo15"), "hunyuanvideo15")
    comfy = load_file(write(denoiser, settings, "hunyuanvideo15", tmp_path) / lora_files.COMFY_FILE)
    keys = {k.split(".lora_")[0] for k in comfy}
    key_map = comfyui_hunyuan_key_map({k.removeprefix("transformer.") for k in keys})
    assert keys <= key_map.keys()
    assert {"transformer.double_blocks.0.img_attn_qkv", "transformer.double_blocks.0.txt_attn_qkv",
            "transformer.txt_in.individual_token_refiner.blocks.0.self_attn_qkv",
            "transformer.double_blocks.0.img_mlp.fc1"} <= keys  # fmt: skip
    assert "diffusion_model.double_blocks.0.img_attn.qkv" in key_map  # the model's own name
    assert not any(".to_q" in k or "transformer_blocks" in k for k in keys)
    # diffusers' reader would split the fused lora_A as a weight: ZT_LORA_FROM says which file
    with pytest.raises(ConfigError, match=r"ComfyUI's layout \(its q, k and v fused\).*"
                       r"pytorch_lora_weights\.safetensors"):  # fmt: skip
        lora_from.read(str(tmp_path / lora_files.COMFY_FILE), "hunyuanvideo15", cache_dir=tmp_path)
    assert lora_from.read(str(tmp_path / lora_files.ADAPTER_FILE), "hunyuanvideo15",
                          cache_dir=tmp_path).state  # fmt: skip


def test_hunyuanvideo15_comfyui_file_of_part_of_a_fused_layer(family_demo_dir, tmp_path, caplog):
    """An adapter on q alone: its fused layer's LoRA leaves k and v as they are (zero rows of
    B), so ComfyUI still applies the diffusers adapter's weights; with DoRA there is no ComfyUI
    file (ComfyUI scales the fused weight whole), and the log says why."""
    demo = family_demo_dir("hunyuanvideo15")
    for dora in (False, True):
        denoiser = load_part(demo / "model", "transformer")
        settings = Settings(training_type="lora", lora_rank=RANK, lora_alpha=ALPHA,
                            lora_targets="to_q", lora_dora=dora)  # fmt: skip
        lora.add_adapter(denoiser, settings)
        perturb_adapter(denoiser, 0.05)
        out = write(denoiser, settings, "hunyuanvideo15", tmp_path / f"dora-{dora}",
                    base=demo / "model")  # fmt: skip
        if dora:
            assert not (out / lora_files.COMFY_FILE).exists()
            assert "only some of the layers ComfyUI holds fused" in caplog.text
            continue
        expected, _ = fused(demo, "hunyuanvideo15", out, lora_files.ADAPTER_FILE)
        loaded, _ = comfyui_hunyuan_applied(demo, load_file(out / lora_files.COMFY_FILE))
        for key in expected:
            torch.testing.assert_close(loaded[key], expected[key], **TOLERANCE, msg=key)


def test_ltx2_comfyui_names_are_the_original_checkpoints(family_demo_dir, tmp_path) -> None:
    """LTX-2's file names modules as the original checkpoint does (ComfyUI's model, the
    reference trainer's adapters): `diffusion_model.patchify_proj`, `adaln_single`..., which
    diffusers' reader of such adapters turns back into the diffusers modules trained."""
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_ltx2_lora_to_diffusers as to_diffusers,
    )

    denoiser, settings = adapted(family_demo_dir("ltx2"), "ltx2")
    comfy = load_file(write(denoiser, settings, "ltx2", tmp_path) / lora_files.COMFY_FILE)
    theirs = {k.split(".lora_")[0] for k in comfy}
    assert {"diffusion_model.patchify_proj", "diffusion_model.adaln_single.linear"} <= theirs
    assert not any(".proj_in." in f"{k}." or "time_embed" in k for k in theirs)
    ours = {n.split(".lora_")[0] for n, p in denoiser.named_parameters() if p.requires_grad}
    converted = to_diffusers({f"{m}.weight": 0 for m in theirs})
    assert {k.removeprefix("transformer.").removesuffix(".weight") for k in converted} == ours


def comfyui_dora(dora_scale, weight, lora_diff):
    """ComfyUI's DoRA at strength 1 with no `.alpha` (comfy/weight_adapter/base.py
    `weight_decompose`, v0.3.77): an output-axis scale divides by the base weight's row norm."""
    weight_calc = weight + lora_diff
    if dora_scale.shape[0] == weight_calc.shape[0]:
        norm = weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True)
        norm = norm.reshape(weight.shape[0], *[1] * (weight.dim() - 1))
    else:
        norm = weight_calc.transpose(0, 1).reshape(weight_calc.shape[1], -1).norm(dim=1)
        norm = norm.reshape(weight_calc.shape[1], *[1] * (weight_calc.dim() - 1)).transpose(0, 1)
    return weight_calc * (dora_scale / (norm + torch.finfo(weight.dtype).eps))


@pytest.mark.parametrize("family", ["sdxl", "flux", "wan", "hunyuanvideo15"])
def test_dora_comfyui_file_gives_peft_weights_in_comfyuis_formula(
    family, family_demo_dir, tmp_path
) -> None:
    """DoRA + rsLoRA: every layer's `dora_scale`, applied by ComfyUI's formula to the base
    weight, gives peft's merged weight (that of the merged pipeline); a layer ComfyUI holds
    fused (HunyuanVideo's q, k, v) gives its parts' merged weights, stacked."""
    demo = family_demo_dir(family)
    denoiser, settings = adapted(demo, family, lora_dora=True, lora_rslora=True)
    out = write(denoiser, settings, family, tmp_path / "final", base=demo / "model")
    comfy = load_file(out / lora_files.COMFY_FILE)
    layout = families.get(family).comfy_lora
    base = load_part(demo / "model", families.get(family).denoiser).state_dict()
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers: dict[str, list] = {}  # ComfyUI's layer: its diffusers parts, in their stacked order
    for name, module in denoiser.named_modules():
        if isinstance(module, BaseTunerLayer):
            key = lora_layouts.comfy_name(layout, families.get(family).denoiser, name)
            layers.setdefault(key, []).append((name, module))
    assert len(comfy) == 3 * len(layers) + (len(layers) if layout.kohya else 0)
    for key, parts in layers.items():
        parts.sort(key=lambda part: (lora_layouts.fused_position(layout, part[0]) or (0,))[0])
        up, down = (
            comfy[f"{key}.lora_up.weight" if layout.kohya else f"{key}.lora_B.weight"],
            (comfy[f"{key}.lora_down.weight" if layout.kohya else f"{key}.lora_A.weight"]),
        )
        weight = torch.cat([base[f"{name}.weight"] for name, _ in parts])
        diff = (up.flatten(1) @ down.flatten(1)).reshape(weight.shape)
        if layout.kohya:  # `.alpha` / rank
            diff = diff * float(comfy[f"{key}.alpha"]) / down.shape[0]
        theirs = comfyui_dora(comfy[f"{key}.dora_scale"], weight, diff)
        for _, module in parts:
            module.merge(adapter_names=[lora.ADAPTER])
        merged = torch.cat([module.get_base_layer().weight for _, module in parts])
        torch.testing.assert_close(theirs, merged, rtol=1e-5, atol=1e-6)
        for _, module in parts:
            module.unmerge()


@pytest.mark.parametrize("family", ["sdxl", "wan"])
def test_export_converts_an_adapter_file(family, family_demo_dir, tmp_path, capsys) -> None:
    """`zerotuner export FINAL OUT --family F` writes the files a run's final/ holds from its
    diffusers file alone; an adapter without --family, or not an adapter, is one line, exit 2."""
    from zerotuner.cli import main

    demo = family_demo_dir(family)
    denoiser, settings = adapted(demo, family)
    final = write(denoiser, settings, family, tmp_path / "final")
    assert main(["export", str(final), str(tmp_path / "out"), "--family", family]) == 0
    written = sorted(p.name for p in final.iterdir())
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == written
    for name in written:
        ours, theirs = load_file(final / name), load_file(tmp_path / "out" / name)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name
    capsys.readouterr()
    adapter = str(final / lora_files.ADAPTER_FILE)
    (tmp_path / "junk.safetensors").write_text("not one")
    for argv, said in (
        ([adapter, str(tmp_path / "o")], "pass --family"),
        ([str(tmp_path / "junk.safetensors"), str(tmp_path / "o"), "--family", family],
         "not a readable safetensors file"),
        ([adapter, str(tmp_path / "o"), "--family", "sd3"], "pass the --family"),
    ):  # fmt: skip
        assert main(["export", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_model_card_says_which_file_each_tool_loads(tmp_path) -> None:
    from zerotuner.publish.model_card import model_card

    final = tmp_path / "final"
    final.mkdir()
    for name in (lora_files.ADAPTER_FILE, lora_files.COMFY_FILE):
        (final / name).write_bytes(b"")
    card = model_card(Settings(training_type="lora", model="some/model"), tmp_path, "sdxl")
    assert f"ComfyUI (LoraLoader): `final/{lora_files.COMFY_FILE}`" in card
    assert f"diffusers: `final/{lora_files.ADAPTER_FILE}`" in card
    assert lora_files.KOHYA_FILE not in card  # not written (a transformer family, or DoRA)


@pytest.mark.parametrize("family", ["sdxl", "sd1"])
def test_text_encoder_adapters_keep_kohyas_text_model_names(family, family_demo_dir, tmp_path):
    """With ZT_LORA_TEXT_ENCODER the kohya and ComfyUI files name CLIP's layers
    `lora_te1_text_model_encoder_layers_...` (transformers 5's CLIP has no `text_model` level):
    diffusers' kohya converter loads every one to the diffusers file's text encoders."""
    from diffusers import DiffusionPipeline
    from peft.tuners.tuners_utils import BaseTunerLayer

    from zerotuner.weights import lora_text

    demo = family_demo_dir(family)
    unet, settings = adapted(demo, family)
    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    names = [f for f, _ in families.get(family).text_subfolders]
    encoders = [getattr(pipe, n) for n in names]
    lora_text.add_text_adapters(encoders, lora.adapter_settings(settings), seed=0)
    state = {f"unet.{n}": p.detach() for n, p in unet.named_parameters() if p.requires_grad}
    for name, encoder in zip(names, encoders, strict=True):
        for n, p in encoder.named_parameters():
            if "lora_B" in n:
                p.data.normal_(0, 0.05)
            if p.requires_grad:
                state[f"{name}.{n}"] = p.detach()
    config = lora.metadata(lora.lora_config(settings))
    text = lora.metadata(lora_text.text_config(lora.adapter_settings(settings)))
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    out = lora_files.write_adapter(
        family, state, shapes, config, tmp_path / "f", text_metadata=text
    )
    comfy = load_file(out / lora_files.COMFY_FILE)
    te = [k for k in comfy if k.startswith("lora_te")]
    layers = sum(isinstance(m, BaseTunerLayer) for e in encoders for m in e.modules())
    assert len(te) == 3 * layers and all("_text_model_encoder_layers_" in k for k in te)
    assert load_file(out / lora_files.KOHYA_FILE).keys() == comfy.keys()

    def text_weights(weight_name):
        p = DiffusionPipeline.from_pretrained(demo / "model")
        p.load_lora_weights(out, weight_name=weight_name)
        loaded = sum(isinstance(m, BaseTunerLayer) for n in names for m in getattr(p, n).modules())
        p.fuse_lora()
        p.unload_lora_weights()
        return {n: getattr(p, n).state_dict() for n in names}, loaded

    (expected, _), (got, loaded) = (
        text_weights(lora_files.ADAPTER_FILE),
        text_weights(lora_files.COMFY_FILE),
    )
    assert loaded == layers
    for name in names:
        for key in expected[name]:
            torch.testing.assert_close(got[name][key], expected[name][key], **TOLERANCE)
