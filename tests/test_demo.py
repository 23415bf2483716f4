"""The demo model loads and runs like a hub checkpoint; the demo data is what training needs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from zerotuner import cli
from zerotuner.data.buckets import assign_buckets
from zerotuner.data.scan import scan
from zerotuner.demo.parts import DEMO_RESOLUTION, LATENT_SCALE, MAX_TOKENS, train_bpe
from zerotuner.families import detect_family
from zerotuner.settings.schema import load_settings


def _generate(pipe, prompt: str):
    generator = torch.Generator().manual_seed(0)
    return pipe(
        prompt,
        num_inference_steps=2,
        height=DEMO_RESOLUTION,
        width=DEMO_RESOLUTION,
        generator=generator,
        output_type="np",
    ).images[0]


def test_sdxl_demo_loads_as_a_hub_pipeline_and_generates(demo_dir: Path) -> None:
    from diffusers import DiffusionPipeline, StableDiffusionXLPipeline

    pipe = DiffusionPipeline.from_pretrained(demo_dir / "model")
    assert isinstance(pipe, StableDiffusionXLPipeline)
    assert detect_family(demo_dir / "model") == "sdxl"
    vae_scale = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    assert pipe.vae_scale_factor == vae_scale == LATENT_SCALE
    assert pipe.unet.config.sample_size * vae_scale == DEMO_RESOLUTION
    assert pipe.unet.config.cross_attention_dim == (
        pipe.text_encoder.config.hidden_size + pipe.text_encoder_2.config.hidden_size
    )
    image = _generate(pipe, "a red circle on a white background")
    assert image.shape == (DEMO_RESOLUTION, DEMO_RESOLUTION, 3)
    assert image.min() >= 0.0 and image.max() <= 1.0 and image.std() > 0


def test_demo_vae_reconstructs_the_demo_images(demo_dir: Path) -> None:
    """Encode + decode gives the image back (the old random VAE's error was ~0.7 of 2), and
    the latents are the image's colours, pooled LATENT_SCALE x LATENT_SCALE: samples show what
    the UNet learned."""
    import numpy as np
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(demo_dir / "model" / "vae")
    images = []
    for path in sorted((demo_dir / "data").glob("*.png"))[:16]:
        with Image.open(path) as image:
            side = min(image.size)
            square = image.convert("RGB").crop((0, 0, side, side))
            square = square.resize((DEMO_RESOLUTION,) * 2, Image.Resampling.BICUBIC)
            images.append(np.asarray(square, dtype=np.float32) / 127.5 - 1.0)
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2)
    with torch.no_grad():
        latents = vae.encode(pixels).latent_dist.mean
        decoded = vae.decode(latents).sample
    assert latents.shape[-1] == DEMO_RESOLUTION // LATENT_SCALE
    pooled = torch.nn.functional.avg_pool2d(pixels, LATENT_SCALE)
    assert torch.allclose(latents[:, :3], pooled, atol=1e-3)
    # Decoding repeats each pooled colour: exact inside the shapes, off only along their edges
    # (pixels span 2).
    upsampled = torch.nn.functional.interpolate(pooled, scale_factor=LATENT_SCALE)
    assert torch.allclose(decoded, upsampled, atol=1e-3)
    assert (decoded - pixels).abs().mean() < 0.05


def test_tokenizers_cover_every_caption_without_overflow(demo_dir: Path, tmp_path: Path) -> None:
    from transformers import CLIPTokenizer

    captions = [p.read_text() for p in sorted((demo_dir / "data").glob("*.txt"))]
    for sub in ("tokenizer", "tokenizer_2"):
        tokenizer = CLIPTokenizer.from_pretrained(demo_dir / "model" / sub)
        # The BPE files alone (what transformers 4.x's slow tokenizer reads) say the same.
        for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
            shutil.copy(demo_dir / "model" / sub / name, tmp_path / name)
        from_bpe = CLIPTokenizer.from_pretrained(tmp_path)
        assert from_bpe(captions).input_ids == tokenizer(captions).input_ids
        assert tokenizer.model_max_length == MAX_TOKENS
        for caption in captions:
            tokens = tokenizer.tokenize(caption)
            assert tokens == [w + "</w>" for w in caption.split()]  # one known token per word
            assert tokenizer.unk_token_id not in tokenizer(caption).input_ids[1:-1]
        long = tokenizer(
            "a red circle " * 100, padding="max_length", truncation=True, max_length=MAX_TOKENS
        )
        assert len(long.input_ids) == MAX_TOKENS


def test_bpe_turns_each_training_word_into_one_token() -> None:
    vocab, merges = train_bpe(["triangle", "red", "red", "tri"])
    assert {"triangle</w>", "red</w>", "tri</w>"} <= set(vocab)
    assert len(vocab) == 512 + len(merges) + 2  # bytes, bytes + </w>, merges, specials
    assert list(vocab.values()) == list(range(len(vocab)))
    assert train_bpe(["triangle", "red", "tri"]) == train_bpe(["triangle", "red", "tri"])


def test_demo_data_has_captions_and_several_aspect_buckets(demo_dir: Path) -> None:
    dataset = scan(demo_dir / "data")
    assert len(dataset) == 64 and not dataset.skipped
    assert all(item.caption.startswith("a ") for item in dataset.items)
    assert {"red", "green", "blue"} <= {item.caption.split()[1] for item in dataset.items}
    buckets = assign_buckets(dataset.items, DEMO_RESOLUTION, multiple=4)
    assert len(buckets) == 3 and (DEMO_RESOLUTION, DEMO_RESOLUTION) in buckets


def test_cli_rewrites_identically_and_keeps_user_files(
    demo_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "demo"
    shutil.copytree(demo_dir, target)
    (target / "mine.txt").write_text("keep me")
    (target / "model" / "notes.md").write_text("keep me too")

    assert cli.main(["demo", str(target)]) == 0

    out = capsys.readouterr().out
    assert str(target / "model") in out
    # The two commands it prints (full UNet and LoRA) name valid settings and their own outputs.
    commands = [line.split() for line in out.splitlines() if line.endswith("./entrypoint train")]
    assert len(commands) == 2
    for words, training_type in zip(commands, ("full", "lora"), strict=True):
        env = dict(w.split("=", 1) for w in words if w.startswith("ZT_"))
        with pytest.MonkeyPatch.context() as mp:
            for name, value in env.items():
                mp.setenv(name, value)
            assert load_settings().training_type == training_type
    assert commands[0][-3] != commands[1][-3]  # ZT_OUTPUT_DIR
    assert (target / "mine.txt").read_text() == "keep me"
    assert (target / "model" / "notes.md").read_text() == "keep me too"
    # Same seed, same bytes: weights, tokenizer, configs and images are deterministic.
    written = sorted(p.relative_to(demo_dir) for p in demo_dir.rglob("*") if p.is_file())
    assert any(p.suffix == ".safetensors" for p in written)
    for rel in written:
        assert (target / rel).read_bytes() == (demo_dir / rel).read_bytes(), rel


@pytest.mark.parametrize("family", ["sd1", "sd2"])
def test_sd1_and_sd2_demos_load_and_generate(family: str, request: pytest.FixtureRequest) -> None:
    from diffusers import DiffusionPipeline, StableDiffusionPipeline

    root: Path = request.getfixturevalue(f"{family}_demo_dir")
    pipe = DiffusionPipeline.from_pretrained(root / "model")
    assert isinstance(pipe, StableDiffusionPipeline)
    assert detect_family(root / "model") == family
    expected = "v_prediction" if family == "sd2" else "epsilon"
    assert pipe.scheduler.config.prediction_type == expected
    image = _generate(pipe, "a blue square on a black background")
    assert image.shape == (DEMO_RESOLUTION, DEMO_RESOLUTION, 3)


def test_validation_writes_base_vs_trained_side_by_side(demo_dir: Path, tmp_path: Path) -> None:
    """The base row uses the same prompts and seeds: with the base weights it is the same image;
    it is rendered once and reused by the next validation."""
    from safetensors.torch import load_file

    from zerotuner.train import samples

    state = load_file(demo_dir / "model" / "unet" / "diffusion_pytorch_model.safetensors")
    prompts = ["a red circle on a white background", "a blue square on a black background"]
    how = dict(family="sdxl", resolution=DEMO_RESOLUTION, inference_steps=2, seed=7)
    written = samples.render(demo_dir / "model", state, prompts, tmp_path / "step-1", **how)

    base = sorted((tmp_path / "base").glob("*.png"))
    assert [p.name for p in base] == [p.name for p in written]
    for ours, theirs in zip(base, written, strict=True):
        assert Image.open(ours).tobytes() == Image.open(theirs).tobytes()
    with Image.open(tmp_path / samples.COMPARISON) as sheet:
        assert sheet.width > 2 * 4 * DEMO_RESOLUTION and sheet.height > 2 * 4 * DEMO_RESOLUTION
    stamp = (tmp_path / "base" / "render.json").stat().st_mtime_ns
    samples.render(demo_dir / "model", state, prompts, tmp_path / "step-2", **how)
    assert (tmp_path / "base" / "render.json").stat().st_mtime_ns == stamp


def test_demo_text_encoders_tell_one_word_apart(demo_dir: Path) -> None:
    """Prompts that differ in one word reach the UNet clearly apart at that word (a fresh CLIP
    encoder without the demo's embedding scale gives states ~0.86 alike, and the UNet learned
    each prompt's colours but not its shape)."""
    from diffusers import StableDiffusionXLPipeline

    from zerotuner import families
    from zerotuner.train import model

    pipe = StableDiffusionXLPipeline.from_pretrained(demo_dir / "model")
    parts = model.Components(
        family="sdxl", source=demo_dir / "model", denoiser=None, scheduler=pipe.scheduler,
        vae=pipe.vae, text_encoders=[pipe.text_encoder, pipe.text_encoder_2],
        tokenizers=[pipe.tokenizer, pipe.tokenizer_2],
    )  # fmt: skip
    prompts = ["a red circle on a white background", "a blue circle on a white background",
               "a red square on a white background"]  # fmt: skip
    states = families.get("sdxl").encode_text(parts, prompts)["prompt_embeds"]
    alike = torch.nn.functional.cosine_similarity
    # token 0 is <|startoftext|>: the colour is token 2, the shape token 3
    assert alike(states[0, 2], states[1, 2], dim=0) < 0.5
    assert alike(states[0, 3], states[2, 3], dim=0) < 0.5
    assert alike(states[0, 3], states[1, 3], dim=0) > 0.9  # same word, same place
