"""ZT_BASE_PRECISION in the training ranks: a LoRA run of the tiny demo SDXL on 2 CPU ranks at
ZeRO-2 with its base stored in fp8 and in int8 (real torchrun, DeepSpeed, peft, torchao), and
one Flux.1 transformer run.

Each run is made once (module fixtures) and asked several things: the log says how the base is
stored, the checkpoints record it and hold the adapter alone (no base weight, quantized or not),
final/ holds the adapter files only and they load with `load_lora_weights` on the unquantized
pipeline, the run's samples are rendered on the stored base, and a resume re-derives that base
from the model's files or is refused in one line when the precision changed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import trainkit as tk
from lorakit import (
    ALPHA,
    PROMPT,
    RANK,
    SHORT,
    TARGETS,
    assert_only_the_adapter_trained,
    held_out_loss,
    plain_pipeline,
    train,
    unet_output,
)  # fmt: skip
from safetensors.torch import load_file

from zerotuner.weights import lora_files
from zerotuner.weights.checkpoint import read_manifest

pytest_plugins = ["lorakit"]  # lora_cache
pytestmark = pytest.mark.slow

PRECISIONS = ("fp8", "int8")
STORED_DTYPES = (torch.float8_e4m3fn, torch.int8)
SAVED = 2  # the checkpoint a resume starts from; the run's last is at SHORT


@pytest.fixture(scope="module", params=PRECISIONS)
def low_run(request, tmp_path_factory, demo_dir: Path, lora_cache: Path):
    """SHORT steps at ZeRO-2 on a base stored at the precision, a checkpoint at SAVED, samples
    at the end: (precision, output folder, the ranks' log)."""
    precision = request.param
    tmp = tmp_path_factory.mktemp(f"base-{precision}")
    proc, output = train(
        tmp, demo_dir, lora_cache, stage=2, steps=SHORT, checkpoint_every_steps=SAVED,
        validation_prompts=[PROMPT], base_precision=precision,
    )  # fmt: skip
    tk.assert_ok(proc, tmp)
    return precision, output, proc.stdout + proc.stderr


def test_the_ranks_store_the_base_low_and_train_the_adapter(low_run, demo_dir: Path) -> None:
    precision, output, log = low_run
    # every rank quantized its base; rank 0 logs what it decided and measured
    assert f"frozen base stored at {precision}: " in log, log[-3000:]
    assert "kept at the run's precision" in log
    assert [s["step"] for s in tk.read_steps(output)] == list(range(1, SHORT + 1))
    for step in (SAVED, SHORT):
        manifest = read_manifest(output / "checkpoints" / f"step-{step}")
        assert manifest["lora"]["base_precision"] == precision
        assert manifest["lora"]["rank"] == RANK
    assert_only_the_adapter_trained(output, demo_dir, SHORT)


def test_no_base_weight_is_saved(low_run) -> None:
    """Every tensor in a checkpoint is the adapter's or its optimizer state's: as many elements
    as four times the adapter (module state, fp32 masters, two Adam moments), none 8-bit. And
    final/ holds the adapter's files only."""
    _, output, _ = low_run
    adapter = load_file(output / "final" / lora_files.ADAPTER_FILE)
    adapter_elements = sum(t.numel() for t in adapter.values())
    for step in (SAVED, SHORT):
        tensors = list(_tensors(output / "checkpoints" / f"step-{step}"))
        assert tensors and not [t for t in tensors if t.dtype in STORED_DTYPES]
        assert not [t for t in tensors if type(t).__module__.startswith("torchao")]
        elements = sum(t.numel() for t in tensors if t.is_floating_point())
        assert elements <= 4 * adapter_elements * 1.05, (elements, adapter_elements)
    # the adapter in its three layouts (diffusers', kohya's, ComfyUI's), each the adapter alone
    files = {p.name for p in (output / "final").iterdir()}
    assert files == {lora_files.ADAPTER_FILE, lora_files.KOHYA_FILE, lora_files.COMFY_FILE}
    for name in files:
        layout = load_file(output / "final" / name)
        assert sum(t.numel() for t in layout.values() if t.dim()) == adapter_elements, name


def _tensors(checkpoint: Path):
    """Every tensor in a DeepSpeed checkpoint's files, however nested."""
    for path in sorted(checkpoint.rglob("*.pt")):
        yield from _walk(torch.load(path, map_location="cpu", weights_only=False))


def _walk(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _walk(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _walk(item)


def test_the_adapter_loads_on_the_full_precision_pipeline(low_run, demo_dir: Path) -> None:
    """diffusers' own loader on the unquantized pipeline: the held-out loss falls, and it
    generates."""
    _, output, _ = low_run
    pipe = plain_pipeline(demo_dir)
    base, before = unet_output(pipe.unet), held_out_loss(pipe, demo_dir)
    pipe.load_lora_weights(output / "final")
    assert not torch.allclose(unet_output(pipe.unet), base, atol=1e-4)
    assert held_out_loss(pipe, demo_dir) < before
    image = pipe(
        PROMPT, height=64, width=64, num_inference_steps=2, output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images[0]  # fmt: skip
    assert image.shape == (64, 64, 3) and np.isfinite(image).all()


def test_the_run_samples_on_its_stored_base(low_run, demo_dir: Path, tmp_path: Path) -> None:
    """The run's sample is what the adapter draws on the base stored as the run stores it,
    and close to what it draws on the full-precision base."""
    from PIL import Image

    from zerotuner.train import samples

    precision, output, _ = low_run
    (made,) = sorted((output / "samples" / f"step-{SHORT}").glob("*.png"))
    drawn = {
        stored: samples.render(
            demo_dir / "model", None, [PROMPT], tmp_path / stored, family="sdxl", resolution=64,
            inference_steps=2, seed=42, lora_dir=output / "final", compare=False,
            base_precision=stored,
        )[0]
        for stored in (precision, "auto")
    }  # fmt: skip
    pixels = {k: np.asarray(Image.open(p), dtype=np.int16) for k, p in drawn.items()}
    run = np.asarray(Image.open(made), dtype=np.int16)
    # The rank rendered with its own thread count: float sums may round a pixel differently.
    assert np.abs(run - pixels[precision]).max() <= 2
    # the 8-bit base's rounding through 2 sampler steps (measured: fp8 2.4, int8 0.36 of 255)
    apart = np.abs(run - pixels["auto"]).mean()
    assert 0 < apart < 5, apart


def _resume_env(demo_dir: Path, tmp: Path, precision: str) -> dict[str, str]:
    return tk.entrypoint_env(
        demo_dir, tmp, ZT_TRAINING_TYPE="lora", ZT_LORA_RANK=str(RANK),
        ZT_LORA_ALPHA=str(ALPHA), ZT_LORA_TARGETS=TARGETS, ZT_BASE_PRECISION=precision,
        ZT_ZERO_STAGE="2", ZT_MAX_STEPS=str(SHORT), ZT_RESUME="auto",
    )  # fmt: skip


def test_a_resume_on_another_base_precision_is_refused_before_the_ranks(
    low_run, demo_dir: Path, tmp_path: Path
) -> None:
    precision, output, _ = low_run
    other = {"fp8": "int8", "int8": "auto"}[precision]
    shutil.copytree(output / "checkpoints", tmp_path / "output" / "checkpoints")
    step = tmp_path / "output" / "checkpoints" / f"step-{SHORT}"
    done = subprocess.run(
        [tk.ENTRYPOINT, "train"], env=_resume_env(demo_dir, tmp_path, other),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = done.stdout + done.stderr
    errors = [line for line in out.splitlines() if line.startswith("zerotuner: error: ")]
    assert done.returncode == 2 and errors == [
        f"zerotuner: error: ZT_BASE_PRECISION={other}: the checkpoint to resume ({step}) "
        f"trained its adapter on a base stored at {precision}; set it back to continue, or "
        "ZT_RESUME=never or another ZT_OUTPUT_DIR to start afresh"
    ], out[-3000:]
    assert "Traceback" not in out and "launching" not in out
    assert (step / "zerotuner.json").is_file()  # the checkpoint is kept


def test_a_resume_on_the_same_precision_ends_where_the_run_did(
    low_run, demo_dir: Path, lora_cache: Path, tmp_path: Path
) -> None:
    """From the step-SAVED checkpoint in a fresh folder: the base quantized again from the
    model's files, the last step's loss and the adapter bit for bit the run's."""
    precision, output, _ = low_run
    again = tmp_path / "output"
    (again / "checkpoints").mkdir(parents=True)
    saved = output / "checkpoints" / f"step-{SAVED}"
    shutil.copytree(saved, again / "checkpoints" / saved.name)
    proc, resumed = train(
        tmp_path, demo_dir, lora_cache, stage=2, steps=SHORT, checkpoint_every_steps=SAVED,
        base_precision=precision, output=again,
    )  # fmt: skip
    tk.assert_ok(proc, tmp_path)
    assert "resumed from" in proc.stdout + proc.stderr
    assert [s["step"] for s in tk.read_steps(resumed)] == [SHORT]
    assert tk.read_steps(resumed)[0]["loss"] == tk.read_steps(output)[-1]["loss"]
    final = load_file(output / "final" / lora_files.ADAPTER_FILE)
    again_final = load_file(resumed / "final" / lora_files.ADAPTER_FILE)
    assert again_final.keys() == final.keys()
    assert all(torch.equal(again_final[k], final[k]) for k in final)


# --- a transformer family -------------------------------------------------------------------


def test_a_flux_transformer_trains_on_an_fp8_base(flow_demo_dirs, tmp_path: Path) -> None:
    """Flux.1's transformer at ZeRO-2 on 1 rank with an fp8 base and its captions cached by
    CLIP-L and T5 stored in fp8 (ZT_TEXT_ENCODER_PRECISION): its blocks' Linear layers stored
    so, the adapter file loads into the unquantized pipeline and changes its images."""
    from diffusers import DiffusionPipeline

    demo, output, steps = flow_demo_dirs["flux"], tmp_path / "output", 4  # 2 warm up from 0
    config = tk.ds_config(2, world=1, steps=steps, lr=1e-2)
    job = tk.write_job(tmp_path / "job.json", model=demo / "model", deepspeed=config,
                       family="flux", world=1)  # fmt: skip
    env = tk.settings_env(
        model=demo / "model", data=demo / "data", output=output, cache=tmp_path / "cache",
        max_steps=steps, max_sequence_length=16, training_type="lora", lora_rank=4,
        base_precision="fp8", text_encoder_precision="fp8",
    )  # fmt: skip
    proc = tk.run_ranks(tmp_path, env, job_file=job, world=1)
    tk.assert_ok(proc, tmp_path, world=1)
    log = proc.stdout + proc.stderr
    assert "frozen base stored at fp8: " in log
    assert "text encoder 1 (CLIPTextModel) stored at fp8: " in log
    assert "text encoder 2 (T5EncoderModel) stored at fp8: " in log
    manifest = read_manifest(output / "checkpoints" / f"step-{steps}")
    assert manifest["lora"]["base_precision"] == "fp8"
    adapter = load_file(output / "final" / lora_files.ADAPTER_FILE)
    assert adapter and all(k.startswith("transformer.") for k in adapter)
    assert all(t.abs().max() > 0 for k, t in adapter.items() if ".lora_B." in k)  # trained

    def image(pipe) -> np.ndarray:
        pipe.set_progress_bar_config(disable=True)
        return pipe(
            prompt=PROMPT, num_inference_steps=2, height=64, width=64, output_type="np",
            max_sequence_length=16, generator=torch.Generator().manual_seed(0),
        ).images[0]  # fmt: skip

    pipe = DiffusionPipeline.from_pretrained(demo / "model")
    before = image(pipe)
    pipe.load_lora_weights(output / "final")
    assert np.abs(image(pipe) - before).max() > 1e-3, "the adapter changes nothing"
