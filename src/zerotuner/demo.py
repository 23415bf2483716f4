"""The demo: a tiny diffusion pipeline and a dataset it can learn, written without a download.

`make run` and the tests need a model with the exact layout and classes of a hub checkpoint
(so the same loading, caching, training and export code paths run), but small enough that a
2-rank CPU DeepSpeed step takes well under a second. Every component is a real diffusers /
transformers class with a tiny config, and the CLIP tokenizer's byte-level BPE vocabulary is
trained here on the demo's own words. Everything is deterministic given the seed.
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from PIL import Image, ImageDraw

from zerotuner.families import FLOW_FAMILIES

log = logging.getLogger(__name__)

DemoFamily = Literal["sdxl", "sd1", "sd2", "sd3", "flux"]
DEMO_RESOLUTION = 64  # pixels
# Each VAE block after the first halves the image: the UNet sees 16x16 latents, so a 2-rank CPU
# step is cheap enough for `make run` to train the ~1000 steps the shapes need in 3 minutes.
VAE_BLOCKS = (32, 64, 64)
LATENT_SCALE = 2 ** (len(VAE_BLOCKS) - 1)
MAX_TOKENS = 77  # CLIP's context length; without it tokenization overflows

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220),
           "yellow": (240, 210, 30)}  # fmt: skip
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15), "gray": (128, 128, 128)}
# Words beyond the captions so typical validation prompts tokenize into whole words too.
EXTRA_WORDS = "a an the of on in with and photo picture image small large big shape background"


@dataclass(frozen=True)
class DemoPaths:
    root: Path
    model: Path  # a diffusers pipeline folder (model_index.json at the top)
    data: Path  # images with sidecar .txt captions
    family: DemoFamily
    images: int


def write_demo(
    dir: Path, *, seed: int = 0, family: DemoFamily = "sdxl", images: int = 64
) -> DemoPaths:
    """Write DIR/model and DIR/data. Re-running overwrites only the files it writes."""
    dir = Path(dir)
    data = write_dataset(dir / "data", seed=seed, count=images)
    captions = [p.read_text() for p in sorted(data.glob("*.txt"))]
    if family in FLOW_FAMILIES:
        from zerotuner.demo_flow import write_flow_model

        model = write_flow_model(
            dir / "model", family=family, seed=seed, corpus=captions, data_dir=data
        )
    else:
        model = write_model(dir / "model", family=family, seed=seed, corpus=captions, data_dir=data)
    return DemoPaths(root=dir, model=model, data=data, family=family, images=images)


# --- dataset ------------------------------------------------------------------------------


def write_dataset(data_dir: Path, *, seed: int = 0, count: int = 64) -> Path:
    """Coloured shapes on plain backgrounds with matching captions; a few are not square.

    Shape, colour and background vary independently and the caption names all three, so a
    tiny model's loss falls visibly and samples can be judged by eye.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    combos = [(s, c, b) for s in SHAPES for c in COLOURS for b in BACKGROUNDS]
    for i in range(count):
        shape, colour, background = combos[i % len(combos)]
        # Every 8th image is landscape, every 8th (offset 4) portrait: aspect buckets matter.
        size = (144, 96) if i % 8 == 3 else (96, 144) if i % 8 == 7 else (96, 96)
        image = _draw(rng, size, shape, COLOURS[colour], BACKGROUNDS[background])
        stem = data_dir / f"{i:03d}-{colour}-{shape}-on-{background}"
        image.save(stem.with_suffix(".png"), optimize=False)
        stem.with_suffix(".txt").write_text(f"a {colour} {shape} on a {background} background")
    return data_dir


def _draw(rng: random.Random, size: tuple[int, int], shape: str, fill, background) -> Image.Image:
    """One big shape near the centre: a 4-million-parameter UNet learns it in a few hundred steps
    (small shapes anywhere in the frame take thousands)."""
    w, h = size
    image = Image.new("RGB", size, background)
    draw = ImageDraw.Draw(image)
    side = min(w, h)
    r = rng.randint(side * 30 // 100, side * 35 // 100)
    jitter = side // 16
    cx, cy = w // 2 + rng.randint(-jitter, jitter), h // 2 + rng.randint(-jitter, jitter)
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return image


# --- tokenizer ------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable character table (the base alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def train_bpe(words: list[str]) -> tuple[dict[str, int], list[str]]:
    """A CLIP-layout byte-level BPE vocabulary in which every given word is one token.

    Layout as in openai/clip-vit-large-patch14: 256 byte symbols, the same with `</w>`, the
    merge results in merge order, then the two special tokens. Merges are learned greedily by
    pair frequency (ties broken by the pair itself, so the result is deterministic).
    """
    alphabet = list(_bytes_to_unicode().values())
    counts = Counter(w.lower() for w in words)
    splits = {w: [*w[:-1], w[-1] + "</w>"] for w in counts}
    merges: list[str] = []
    while True:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, symbols in splits.items():
            for pair in zip(symbols, symbols[1:], strict=False):
                pairs[pair] += counts[word]
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(f"{best[0]} {best[1]}")
        for word, symbols in splits.items():
            out, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            splits[word] = out
    tokens = alphabet + [a + "</w>" for a in alphabet] + [m.replace(" ", "") for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(dict.fromkeys(tokens))}, merges


def write_tokenizer(folder: Path, corpus: list[str]):
    """Write vocab.json + merges.txt and load them back as a CLIPTokenizer (77 tokens)."""
    import re

    from transformers import CLIPTokenizer

    words = re.findall(r"[a-z]+", " ".join([*corpus, EXTRA_WORDS]).lower())
    vocab, merges = train_bpe(words)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return CLIPTokenizer(
        vocab=str(folder / "vocab.json"),
        merges=str(folder / "merges.txt"),
        model_max_length=MAX_TOKENS,
    )


# --- model ----------------------------------------------------------------------------------


def _text_config(vocab_size: int, hidden: int, *, layers: int = 2, heads: int = 4):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=MAX_TOKENS,
        projection_dim=hidden,
        hidden_act="gelu",
        bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
    )


def _vae(
    seed: int,
    *,
    blocks: tuple[int, ...] = VAE_BLOCKS,
    sample_size: int = DEMO_RESOLUTION,
    latent_channels: int = 4,
):
    """A tiny AutoencoderKL that reconstructs the demo images by construction (see _exact_vae).

    Each block after the first halves the image (the latent scale). The weights are set, not
    trained: exact, deterministic and instant, so the samples show what the model learned.
    With 16 latent channels (SD3's and Flux's VAEs) it has no quant convs, as theirs; the
    channels past the four colour ones stay zero.
    """
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)  # the weights off the signal path keep their (unused) random init
    vae = AutoencoderKL(
        block_out_channels=blocks,
        down_block_types=("DownEncoderBlock2D",) * len(blocks),
        up_block_types=("UpDecoderBlock2D",) * len(blocks),
        latent_channels=latent_channels,
        layers_per_block=1,
        norm_num_groups=VAE_GROUPS,
        sample_size=sample_size,
        use_quant_conv=latent_channels == 4,
        use_post_quant_conv=latent_channels == 4,
    )
    _exact_vae(vae)
    return vae


# Latent channels: R, G, B and their mean, read from the 2x2 (4x4, ...) average of the pixels.
LATENT_FROM_RGB = ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (1 / 3, 1 / 3, 1 / 3))
VAE_GROUPS = 16  # GroupNorm groups: the decoder's last 32 channels then pair up (see below)
_SIGNAL = 1e-5  # scale of the colours inside the VAE: far below GroupNorm's eps (see below)


def _exact_vae(vae) -> None:
    """Set the weights so that encode = average pooling, decode = nearest upsampling.

    Colour k travels as the channel pair (4k, 4k + 1) holding (+c, -c) * _SIGNAL; every other
    channel is zero. Residual branches (resnet conv2, attention output) are zeroed, so the
    blocks pass their input through; downsamplers average 2x2, upsamplers copy. The two
    nonlinear steps are made exact: (1) each GroupNorm group holds (+c, -c) (mean 0) with
    variance ~1e-10 against eps 1e-6, so it only scales by 1/sqrt(eps) (error < 1e-4); (2) the
    SiLU after it is undone as silu(y) - silu(-y) = y by the next convolution.
    """
    import torch
    from diffusers.models.attention_processor import Attention
    from diffusers.models.resnet import Downsample2D, ResnetBlock2D, Upsample2D

    latent = vae.config.latent_channels
    to_latent = torch.zeros(latent, 3)
    to_latent[: len(LATENT_FROM_RGB)] = torch.tensor(LATENT_FROM_RGB)
    to_rgb = torch.linalg.pinv(to_latent)  # least squares: the 4th channel is redundant
    with torch.no_grad():
        for module in vae.modules():
            if isinstance(module, ResnetBlock2D):
                module.conv2.weight.zero_(), module.conv2.bias.zero_()
                if module.conv_shortcut is not None:
                    _identity(module.conv_shortcut, tap=0)
            elif isinstance(module, Attention):
                module.to_out[0].weight.zero_(), module.to_out[0].bias.zero_()
            elif isinstance(module, Downsample2D):
                conv = module.conv
                conv.weight.zero_(), conv.bias.zero_()
                for c in range(conv.out_channels):
                    conv.weight[c, c, :2, :2] = 0.25  # padding (0, 1, 0, 1), stride 2
            elif isinstance(module, Upsample2D):
                _identity(module.conv, tap=1)  # after nearest-neighbour interpolation
        enc, dec = vae.encoder, vae.decoder
        _pairs_in(enc.conv_in, torch.eye(3) * _SIGNAL)
        _pairs_out(enc.conv_out, to_latent / _SIGNAL * enc.conv_norm_out.eps**0.5)
        enc.conv_out.bias[latent:] = -30.0  # log-variance at its floor: latents are the mean
        for conv in (vae.quant_conv, vae.post_quant_conv):
            if conv is not None:
                _identity(conv, tap=0)
        _pairs_in(dec.conv_in, to_rgb * _SIGNAL)
        _pairs_out(dec.conv_out, torch.eye(3) / _SIGNAL * dec.conv_norm_out.eps**0.5)
        for norm in (enc.conv_norm_out, dec.conv_norm_out):
            norm.weight.fill_(1.0), norm.bias.zero_()


def _identity(conv, *, tap: int) -> None:
    conv.weight.zero_(), conv.bias.zero_()
    for c in range(min(conv.in_channels, conv.out_channels)):
        conv.weight[c, c, tap, tap] = 1.0


def _pairs_in(conv, matrix) -> None:
    """conv(x) puts +/- (matrix @ x) in the channel pairs (4k, 4k + 1), zero elsewhere."""
    conv.weight.zero_(), conv.bias.zero_()
    centre = conv.kernel_size[0] // 2
    for k, row in enumerate(matrix):
        conv.weight[4 * k, :, centre, centre] = row
        conv.weight[4 * k + 1, :, centre, centre] = -row


def _pairs_out(conv, matrix) -> None:
    """conv(silu(y)) = matrix @ (y over the pairs): silu(y) - silu(-y) = y."""
    conv.weight.zero_(), conv.bias.zero_()
    centre = conv.kernel_size[0] // 2
    for k in range(matrix.shape[1]):
        conv.weight[: matrix.shape[0], 4 * k, centre, centre] = matrix[:, k]
        conv.weight[: matrix.shape[0], 4 * k + 1, centre, centre] = -matrix[:, k]


def _unet(
    seed: int, *, cross_attention_dim: int, sdxl: bool, pooled_dim: int = 0, linear: bool = True
):
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    extra = {}
    if sdxl:
        time_dim = 8
        extra = {
            "addition_embed_type": "text_time",
            "addition_time_embed_dim": time_dim,
            # 6 micro-conditioning numbers (original size, crop, target size), each embedded.
            "projection_class_embeddings_input_dim": 6 * time_dim + pooled_dim,
        }
    return UNet2DConditionModel(
        sample_size=DEMO_RESOLUTION // LATENT_SCALE,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        cross_attention_dim=cross_attention_dim,
        use_linear_projection=linear,  # SD 1.x projects with 1x1 convolutions
        norm_num_groups=32,
        **extra,
    )


def _scheduler(family: DemoFamily):
    from diffusers import EulerDiscreteScheduler

    # SD 1.x keeps the published epsilon schedule and SD 2.x (768 px) predicts v. The SDXL demo
    # predicts v on a zero-terminal-SNR schedule (arXiv 2305.08891): sampling starts from the
    # pure noise training saw at t=999, so a tiny UNet gets the background colour right within
    # `make run`'s steps; the epsilon schedule's leak of signal at t=999 leaves it grey.
    zero_snr = family == "sdxl"
    return EulerDiscreteScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        timestep_spacing="trailing" if zero_snr else "leading",
        steps_offset=0 if zero_snr else 1,
        rescale_betas_zero_snr=zero_snr,
        prediction_type="epsilon" if family == "sd1" else "v_prediction",
    )


def _latent_scaling_factor(vae, data_dir: Path) -> float:
    """1 / std of the demo latents, as SD/SDXL chose theirs: the diffusion sees unit variance."""
    import numpy as np
    import torch

    batch = []
    for path in sorted(data_dir.glob("*.png"))[:16]:  # enough for a stable estimate
        with Image.open(path) as image:
            side = min(image.size)
            image = image.convert("RGB").crop((0, 0, side, side))
            image = image.resize((DEMO_RESOLUTION, DEMO_RESOLUTION), Image.Resampling.BICUBIC)
            batch.append(np.asarray(image, dtype=np.float32) / 127.5 - 1.0)
    pixels = torch.from_numpy(np.stack(batch)).permute(0, 3, 1, 2)
    with torch.no_grad():
        latents = vae.encode(pixels).latent_dist.mean
    return round(1.0 / float(latents.std()), 5)


WORD_EMBEDDING_SCALE = 50.0


def _distinct_words(*text_encoders) -> None:
    """Scale the token embeddings so a word outweighs its position and the random layers.

    A freshly initialised CLIP encoder maps "a red circle ..." and "a blue circle ..." to
    nearly the same states (embeddings and positions share one small std), so the UNet could
    not tell the prompts apart; a trained CLIP tells them apart, and so does this one.
    """
    import torch

    with torch.no_grad():
        for encoder in text_encoders:
            encoder.get_input_embeddings().weight.mul_(WORD_EMBEDDING_SCALE)


def write_model(
    model_dir: Path, *, family: DemoFamily, seed: int, corpus: list[str], data_dir: Path
) -> Path:
    """Build the tiny pipeline from the real classes and `save_pretrained` it like a hub model."""
    import shutil
    import tempfile

    import torch
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    bpe_files = Path(tempfile.mkdtemp(prefix="zerotuner-bpe-"))
    tokenizer = write_tokenizer(bpe_files, corpus)
    vocab_size = len(tokenizer)
    vae = _vae(seed)
    vae.register_to_config(scaling_factor=_latent_scaling_factor(vae, data_dir))
    scheduler = _scheduler(family)

    if family == "sdxl":
        torch.manual_seed(seed + 1)
        text_encoder = CLIPTextModel(_text_config(vocab_size, 32))
        torch.manual_seed(seed + 2)
        text_encoder_2 = CLIPTextModelWithProjection(_text_config(vocab_size, 32))
        _distinct_words(text_encoder, text_encoder_2)
        unet = _unet(seed + 3, cross_attention_dim=32 + 32, sdxl=True, pooled_dim=32)
        pipe = StableDiffusionXLPipeline(
            vae=vae,
            text_encoder=text_encoder,
            text_encoder_2=text_encoder_2,
            tokenizer=tokenizer,
            tokenizer_2=tokenizer,
            unet=unet,
            scheduler=scheduler,
            add_watermarker=False,
        )
    else:
        # SD 2.x attends to OpenCLIP-H's 1024-wide states; family detection keys on that width.
        hidden = 1024 if family == "sd2" else 32
        torch.manual_seed(seed + 1)
        text_encoder = CLIPTextModel(
            _text_config(vocab_size, hidden, layers=1 if family == "sd2" else 2, heads=4)
        )
        unet = _unet(seed + 3, cross_attention_dim=hidden, sdxl=False, linear=family == "sd2")
        pipe = StableDiffusionPipeline(
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            unet=unet,
            scheduler=scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    pipe.save_pretrained(model_dir, safe_serialization=True)
    # transformers 5 saves tokenizer.json only; 4.x's slow CLIPTokenizer needs these two.
    for sub in ("tokenizer", "tokenizer_2") if family == "sdxl" else ("tokenizer",):
        for name in ("vocab.json", "merges.txt"):
            shutil.copyfile(bpe_files / name, model_dir / sub / name)
    shutil.rmtree(bpe_files, ignore_errors=True)
    return model_dir
