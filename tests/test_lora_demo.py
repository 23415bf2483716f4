"""`make run-lora`'s demo: a LoRA adapter teaches a trained base a concept it did not know.

The base is the demo UNet trained as `make run` trains it, for half its steps and without its
samples: the adapter's claims need a base that knows the demo's colours and shapes, which 500
steps teach (its held-out loss on them 0.29; 0.16 after the 1000 steps, which cost the suite
~80 s more). The adapter learns magenta shapes behind the trigger word "sks"
(zerotuner.demo.concept) through `./entrypoint train` with config/demo-lora.yaml, at ZeRO-2 as
`make run-lora` runs it, on the base as saved and on the base stored in fp8 (ZT_BASE_PRECISION;
the coarser of the two 8-bit formats: int8's adapter measured as close, 0.3089 against fp8's
0.3083, and its 2-rank runs, resume and loading are tests/test_base_precision_training.py's).
(LoRA at ZeRO-3 trains and resumes in tests/test_lora.py and tests/test_new_families.py; on the
1000-step base its concept check measured the same 44 % as at ZeRO-2.)
The held-out checks draw new images of the concept and of the base's own colours and
measure the denoising loss with the exported base UNet, without and with the adapter, on the
same noise and timesteps.
"""

from __future__ import annotations

import colorsys
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import trainkit as tk
from PIL import Image

from zerotuner.demo.concept import COLOUR, TRIGGER, concept_caption, write_concept_dataset
from zerotuner.demo.pipelines import BACKGROUNDS, COLOURS, SHAPES, draw_shape
from zerotuner.weights.checkpoint import last_committed, read_manifest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# The base's steps: config/demo.yaml's 1000 halved (its schedule over these 500).
BASE_STEPS = 500
# The adapter's held-out loss on the concept falls by at least this fraction of the base's
# (measured: 32 %, 0.471 -> 0.318, config/demo-lora.yaml's 250 steps on the 500-step base;
# 34 % after 500 steps, which cost the suite ~2 minutes more; a 300-step base: 14 %).
CONCEPT_GAIN = 0.28
# ... while the base's own colours keep their loss within this fraction of the base's
# (measured: -0.3 %, 0.286 -> 0.285).
PRIOR_DRIFT = 0.10
# An adapter trained on a base stored in 8 bits (ZT_BASE_PRECISION), on the full-precision
# pipeline: its held-out concept loss within this fraction of the full-precision base's adapter
# (issue 42; measured: fp8 0.3188 against 0.3184; after 500 steps fp8 0.3083, int8 0.3089
# against 0.3086), and its images within this
# mean pixel difference of the run's own, drawn on the 8-bit base (measured: fp8 0.3 to 0.5,
# int8 0.05 to 0.15, of 255).
LOW_BASE_LOSS = 0.05
LOW_BASE_PIXELS = 2.0


def _entrypoint(env: dict[str, str], log: Path) -> None:
    proc = subprocess.run(
        [str(REPO / "entrypoint"), "train"], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    log.write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="module")
def base(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo UNet trained as `make run` does for BASE_STEPS, exported to final/ (a
    diffusers pipeline)."""
    out = tmp_path_factory.mktemp("lora-demo-base")
    env = tk.entrypoint_env(demo_dir, out, ZT_MAX_STEPS=str(BASE_STEPS),
                            ZT_CHECKPOINT_EVERY_STEPS="0", ZT_LOG_EVERY_STEPS="100")  # fmt: skip
    _entrypoint(env, out / "train.log")
    return out / "output" / "final"


@pytest.fixture(scope="module")
def concept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_concept_dataset(tmp_path_factory.mktemp("lora-demo") / "data-lora")


# The runs of config/demo-lora.yaml: ZeRO stage and ZT_BASE_PRECISION (the base's storage).
RUNS = {"zero2": (2, "auto"), "zero2-fp8": (2, "fp8")}


@pytest.fixture(scope="module")
def adapters(base: Path, concept: Path, tmp_path_factory):
    """`adapters(name)`: the output folder of the run RUNS names (as `make run-lora`, at its
    stage and base precision) on the trained base, made on first use."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            stage, precision = RUNS[name]
            out = tmp_path_factory.mktemp(f"lora-demo-{name}")
            env = tk.entrypoint_env(
                concept.parent, out, ZT_MODEL=str(base), ZT_DATA_DIR=str(concept),
                ZT_CONFIG_FILE=str(REPO / "config" / "demo-lora.yaml"),
                ZT_ZERO_STAGE=str(stage), ZT_BASE_PRECISION=precision,
                ZT_CHECKPOINT_EVERY_STEPS="0", ZT_VALIDATION_EVERY_STEPS="0",
                ZT_LOG_EVERY_STEPS="100",
            )  # fmt: skip
            del env["ZT_VALIDATION_PROMPTS"]  # the config's: two with the trigger word, one without
            _entrypoint(env, out / "train.log")
            made[name] = out / "output"
        return made[name]

    return get


@pytest.fixture(scope="module", params=list(RUNS))
def adapter(request, adapters) -> Path:
    return adapters(request.param)


def _precision(output: Path) -> str:
    """The base precision the run in `output` trained on (its last checkpoint's manifest)."""
    last = last_committed(output)
    assert last is not None
    return read_manifest(last)["lora"]["base_precision"]


def _pipeline(base: Path, adapter: Path | None = None):
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        pipe.load_lora_weights(adapter)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _held_out(colour_of) -> list[tuple[Image.Image, str]]:
    """Eighteen images drawn anew (a seed neither dataset used): every shape on every
    background, twice; `colour_of(i)` -> (word, RGB)."""
    rng, images = random.Random(4242), []
    combos = [(s, b) for s in SHAPES for b in BACKGROUNDS]
    for i in range(2 * len(combos)):
        shape, background = combos[i % len(combos)]
        word, fill = colour_of(i)
        image = draw_shape(rng, (96, 96), shape, fill, BACKGROUNDS[background])
        images.append((image, f"a {word} {shape} on a {background} background"))
    return images


CONCEPT = _held_out(lambda i: (TRIGGER, COLOUR))
PRIOR = _held_out(lambda i: (name := list(COLOURS)[i % len(COLOURS)], COLOURS[name]))


@torch.no_grad()
def held_out_loss(pipe, images: list[tuple[Image.Image, str]]) -> float:
    """The v-prediction loss of the pipeline's UNet on these images, on fixed noise at nine
    timesteps across the schedule (the same for every pipeline)."""
    from diffusers import DDPMScheduler

    schedule = DDPMScheduler.from_config(pipe.scheduler.config)
    pixels = torch.stack([
        torch.from_numpy(np.asarray(im.resize((64, 64)), dtype=np.float32) / 127.5 - 1)
        .permute(2, 0, 1) for im, _ in images
    ])  # fmt: skip
    latents = pipe.vae.encode(pixels).latent_dist.mean * pipe.vae.config.scaling_factor
    states, _, pooled, _ = pipe.encode_prompt(
        [caption for _, caption in images], do_classifier_free_guidance=False
    )
    time_ids = torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]]).repeat(len(images), 1)
    gen, losses = torch.Generator().manual_seed(0), []
    for t in range(100, 1000, 100):
        noise = torch.randn(latents.shape, generator=gen)
        steps = torch.full((len(images),), t)
        noisy = schedule.add_noise(latents, noise, steps)
        target = schedule.get_velocity(latents, noise, steps)
        pred = pipe.unet(
            noisy, steps, states, added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}
        ).sample
        losses.append(torch.nn.functional.mse_loss(pred, target).item())
    return sum(losses) / len(losses)


@pytest.fixture(scope="module")
def base_losses(base: Path) -> dict[str, float]:
    pipe = _pipeline(base)
    return {"concept": held_out_loss(pipe, CONCEPT), "prior": held_out_loss(pipe, PRIOR)}


def test_the_adapter_learns_the_concept_and_keeps_what_the_base_knew(
    adapter: Path, base: Path, base_losses: dict[str, float]
) -> None:
    pipe = _pipeline(base, adapter / "final")
    concept, prior = held_out_loss(pipe, CONCEPT), held_out_loss(pipe, PRIOR)
    print(f"held-out loss, base -> adapter: concept {base_losses['concept']:.4f} -> {concept:.4f}"
          f", prior {base_losses['prior']:.4f} -> {prior:.4f}")  # fmt: skip
    assert concept <= (1 - CONCEPT_GAIN) * base_losses["concept"]
    assert prior <= (1 + PRIOR_DRIFT) * base_losses["prior"]


def test_a_plain_pipeline_with_the_adapter_draws_the_run_samples(adapter: Path, base: Path):
    """diffusers' own loader, the run's prompts and seeds (prompts.txt): the same pictures (on
    an 8-bit base the run drew them on that base: close ones); the trigger word's are magenta
    where the base's were not, the third prompt's unchanged."""
    (run,) = adapter.glob("samples/step-*")
    seeds_prompts = [line.split("\t") for line in (run / "prompts.txt").read_text().splitlines()]
    assert sum(TRIGGER in p for _, p in seeds_prompts) == 2 and len(seeds_prompts) == 3
    pipe = _pipeline(base, adapter / "final")
    low = _precision(adapter) != "auto"
    changes = {}
    made = [np.asarray(Image.open(p), dtype=np.int16) for p in sorted(run.glob("*.png"))]
    based = [
        np.asarray(Image.open(p), dtype=np.int16)
        for p in sorted((adapter / "samples" / "base").glob("*.png"))
    ]
    for (seed, prompt), image, before in zip(seeds_prompts, made, based, strict=True):
        again = pipe(
            prompt, height=64, width=64, num_inference_steps=25, guidance_scale=1.0,
            generator=torch.Generator().manual_seed(int(seed)),
        ).images[0]  # fmt: skip
        apart = np.abs(np.asarray(again, dtype=np.int16) - image)
        if low:  # 25 sampler steps through a base rounded to 8 bits
            assert apart.mean() <= LOW_BASE_PIXELS, (prompt, apart.mean())
        else:  # The rank rendered with its own thread count: a float sum may round apart.
            assert apart.max() <= 2, prompt
        changes[prompt] = np.abs(image - before).mean()
        if TRIGGER in prompt:
            # measured: +0.15 to +0.26 (the adapter draws a pinkish magenta)
            assert _magenta(image) > _magenta(before) + 0.05, prompt
    kept = min(v for p, v in changes.items() if TRIGGER not in p)
    learned = min(v for p, v in changes.items() if TRIGGER in p)
    assert kept < learned / 2, f"mean pixel change without / with the trigger: {changes}"


def test_an_8_bit_base_teaches_the_concept_as_well(adapters, base: Path) -> None:
    """The adapter trained on a base stored in fp8, loaded on the full-precision
    pipeline: its held-out concept loss within LOW_BASE_LOSS of the same run's on the
    full-precision base (and on the base stored so, as the run trained, printed beside)."""
    from zerotuner.train import samples

    precision = "fp8"
    full = held_out_loss(_pipeline(base, adapters("zero2") / "final"), CONCEPT)
    low = adapters(f"zero2-{precision}") / "final"
    loss = held_out_loss(_pipeline(base, low), CONCEPT)
    on_stored = held_out_loss(
        samples.load_pipeline(
            base, None, family="sdxl", device="cpu", lora_dir=low, base_precision=precision
        ),
        CONCEPT,
    )
    print(f"held-out concept loss, adapter of the full-precision base {full:.4f}; of the "
          f"{precision} base {loss:.4f} (on that base {on_stored:.4f})")  # fmt: skip
    assert loss <= (1 + LOW_BASE_LOSS) * full


def _magenta(image: np.ndarray) -> float:
    """The fraction of pixels of the concept's hue (within 28 degrees) and clearly coloured."""
    hsv = np.asarray(Image.fromarray(image.astype(np.uint8)).convert("HSV"), dtype=np.int32)
    hue = round(colorsys.rgb_to_hsv(*(c / 255 for c in COLOUR))[0] * 255)
    apart = np.abs(hsv[..., 0] - hue)
    return float(((np.minimum(apart, 255 - apart) <= 20) & (hsv[..., 1] >= 64)).mean())


def test_the_concept_dataset_holds_the_concept_and_as_many_prior_images(concept: Path) -> None:
    captions = [p.read_text() for p in sorted(concept.glob("*.txt"))]
    with_trigger = [c for c in captions if TRIGGER in c.split()]
    assert len(with_trigger) == len(captions) // 2 == 27
    assert concept_caption("square", "white") in captions
