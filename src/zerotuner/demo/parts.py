"""The parts every demo pipeline shares (demo.py's UNet ones, demo_flow.py's SD3 and Flux):
the CLIP tokenizer's byte-level BPE trained on the demo's own words, tiny CLIP text configs,
and the exact VAE, scaled on the demo images.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from PIL import Image

if TYPE_CHECKING:
    import torch
    from diffusers import AutoencoderKL, AutoencoderKLQwenImage, AutoencoderKLWan
    from transformers import CLIPTextConfig, CLIPTokenizer

    VideoVAE = TypeVar("VideoVAE", AutoencoderKLQwenImage, AutoencoderKLWan)

DEMO_RESOLUTION = 64  # pixels
# Each VAE block after the first halves the image: the UNet sees 16x16 latents, so a 2-rank CPU
# step is cheap enough for `make run` to train the ~1000 steps the shapes need in 3 minutes.
VAE_BLOCKS = (32, 64, 64)
LATENT_SCALE = 2 ** (len(VAE_BLOCKS) - 1)
MAX_TOKENS = 77  # CLIP's context length; without it tokenization overflows
# Words beyond the captions so typical validation prompts tokenize into whole words too.
EXTRA_WORDS = "a an the of on in with and photo picture image small large big shape background"


# --- the CLIP tokenizer ---------------------------------------------------------------------------


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


def write_tokenizer(folder: Path, corpus: list[str]) -> CLIPTokenizer:
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


# --- text encoders and VAE ------------------------------------------------------------------------


def text_config(vocab_size: int, hidden: int, *, layers: int = 2, heads: int = 4) -> CLIPTextConfig:
    """A tiny CLIP text encoder's config over the demo tokenizer's vocabulary."""
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


def exact_vae(
    seed: int,
    *,
    blocks: tuple[int, ...] = VAE_BLOCKS,
    sample_size: int = DEMO_RESOLUTION,
    latent_channels: int = 4,
) -> AutoencoderKL:
    """A tiny AutoencoderKL that reconstructs the demo images by construction (see `_exact_vae`).

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


def _exact_vae(vae: AutoencoderKL) -> None:
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
                _zero(module.conv2)
                if module.conv_shortcut is not None:
                    _identity(module.conv_shortcut, tap=0)
            elif isinstance(module, Attention):
                _zero(module.to_out[0])
            elif isinstance(module, Downsample2D):
                conv = module.conv
                _zero(conv)
                for c in range(conv.out_channels):
                    conv.weight[c, c, :2, :2] = 0.25  # padding (0, 1, 0, 1), stride 2
            elif isinstance(module, Upsample2D) and module.conv is not None:
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


def _zero(layer: Any) -> None:
    """A convolution's or linear layer's weight and bias (diffusers types its blocks' layers
    loosely, and a bias as optional: the demo's all have one)."""
    layer.weight.zero_(), layer.bias.zero_()


def _identity(conv: torch.nn.Conv2d | torch.nn.ConvTranspose2d, *, tap: int) -> None:
    _zero(conv)
    for c in range(min(conv.in_channels, conv.out_channels)):
        conv.weight[c, c, tap, tap] = 1.0


def _pairs_in(conv: torch.nn.Conv2d, matrix: torch.Tensor) -> None:
    """conv(x) puts +/- (matrix @ x) in the channel pairs (4k, 4k + 1), zero elsewhere."""
    _zero(conv)
    centre = conv.kernel_size[0] // 2
    for k, row in enumerate(matrix):
        conv.weight[4 * k, :, centre, centre] = row
        conv.weight[4 * k + 1, :, centre, centre] = -row


def _pairs_out(conv: torch.nn.Conv2d, matrix: torch.Tensor) -> None:
    """conv(silu(y)) = matrix @ (y over the pairs): silu(y) - silu(-y) = y."""
    _zero(conv)
    centre = conv.kernel_size[0] // 2
    for k in range(matrix.shape[1]):
        conv.weight[: matrix.shape[0], 4 * k, centre, centre] = matrix[:, k]
        conv.weight[: matrix.shape[0], 4 * k + 1, centre, centre] = -matrix[:, k]


def demo_pixels(data_dir: Path, count: int = 16) -> torch.Tensor:
    """The first `count` demo images, square and at the demo resolution, in [-1, 1]:
    (count, 3, height, width), what a demo VAE's latent statistics are measured on."""
    import numpy as np
    import torch

    batch = []
    for path in sorted(data_dir.glob("*.png"))[:count]:  # enough for a stable estimate
        with Image.open(path) as file:
            side = min(file.size)
            square = file.convert("RGB").crop((0, 0, side, side))
            square = square.resize((DEMO_RESOLUTION, DEMO_RESOLUTION), Image.Resampling.BICUBIC)
            batch.append(np.asarray(square, dtype=np.float32) / 127.5 - 1.0)
    return torch.from_numpy(np.stack(batch)).permute(0, 3, 1, 2)


def latent_scaling_factor(vae: AutoencoderKL, data_dir: Path) -> float:
    """1 / std of the demo latents, as SD/SDXL chose theirs: the diffusion sees unit variance."""
    import torch

    pixels = demo_pixels(data_dir)
    with torch.no_grad():
        latents = vae.encode(pixels).latent_dist.mean
    return round(1.0 / float(latents.std()), 5)


def normalise_video_latents(vae: VideoVAE, data_dir: Path | None) -> VideoVAE:
    """A video VAE (Qwen-Image's, Wan's) with `latents_mean` / `latents_std` measured on the
    demo images, each a one-frame clip, as the published VAEs carry their own; unchanged
    without data."""
    import torch

    if data_dir is None:
        return vae
    pixels = demo_pixels(data_dir).unsqueeze(2)
    with torch.no_grad():
        latents = vae.encode(pixels).latent_dist.mean
    mean = [round(float(v), 5) for v in latents.mean(dim=(0, 2, 3, 4))]
    std = [round(float(v), 5) for v in latents.std(dim=(0, 2, 3, 4))]
    vae.register_to_config(latents_mean=mean, latents_std=std)
    return vae
