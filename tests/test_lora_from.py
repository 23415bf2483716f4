"""ZT_LORA_FROM (issue 41): a run trains on from an adapter file in the diffusers, kohya or
ComfyUI layout, local or fetched from S3 or the hub. The source adapter is the demo SDXL UNet's
with every weight moved off its start (B != 0) at alpha != rank; its three files are what a LoRA
run's final/ holds, and a fourth is kohya's with SDXL's original SGM names (`sgm_kohya`).

Shown: each layout, read as diffusers reads it, gives the source adapter's denoiser output
(TOLERANCE); a 2-rank ZeRO-3 run from the SGM kohya file in a bucket (fetched as the entrypoint
fetches it; the ranks get no S3 credentials) and a 1-rank ZeRO-2 run from the ComfyUI file draw
the source adapter's samples at step 1, whose learning rate is 0 (the warm-up starts there, so
its samples show the start), then train on; `s3://` and `hf://` files are fetched once into the
cache (moto's S3 server, the fake hub); bad files, URLs and conflicting settings are one line
(exit 2; exit 3 for a store that cannot be reached), from `config` and `check`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import trainkit as tk
from fakehub import FakeHub
from lorakit import PROMPT, RANK, lora_settings, unet_output
from PIL import Image
from s3server import KEY_ID, SECRET, S3Server, served
from safetensors.torch import load_file, save_file

from zerotuner.settings.schema import Settings
from zerotuner.weights import lora, lora_files, lora_from
from zerotuner.weights.pipeline_folder import load_part

pytest_plugins = ["lorakit"]

BUCKET = "adapters"
s3 = served(BUCKET)
TOKEN = "hf_zerotuner_test_token_for_the_fake_hub"

TARGETS = "attention,proj_in,conv1"  # linear and conv layers
ALPHA = 2.0  # != RANK: a reader that drops the alpha is off by 2x
# fp32 throughout; measured: 0.0 (the same weights, the same arithmetic)
TOLERANCE = {"rtol": 0, "atol": 1e-6}
LAYOUTS = {
    "diffusers": lora_files.ADAPTER_FILE,
    "kohya": lora_files.KOHYA_FILE,
    "comfyui": lora_files.COMFY_FILE,
}


@pytest.fixture(scope="module")
def source(demo_dir: Path, tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """The source adapter's files (a final/ folder) and its UNet's output on a fixed input."""
    unet = load_part(demo_dir / "model", "unet")
    settings = lora_settings(lora_targets=TARGETS, lora_alpha=ALPHA)
    lora.add_adapter(unet, settings)
    gen = torch.Generator().manual_seed(3)
    for name, param in unet.named_parameters():
        if "lora_B" in name:
            param.data.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    state = {n: p.detach().clone() for n, p in unet.named_parameters() if p.requires_grad}
    out = lora_files.write_adapter(
        "sdxl", state, lora.shapes(unet), lora.metadata(lora.lora_config(settings)),
        tmp_path_factory.mktemp("lora-from") / "final",
    )  # fmt: skip
    return out, unet_output(unet)


def _sgm(module: str, layers_per_block: int) -> str:
    """A diffusers UNet module's name in the original SGM/LDM UNet, as ComfyUI's
    comfy/utils.py `unet_to_diffusers` maps them (read backwards; ComfyUI 00728eb2): the names
    kohya's sd-scripts gives SDXL's layers. Resnets, attentions and the middle block: what the
    source adapter's targets reach."""
    inner = {"conv1": "in_layers.2", "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
             "conv_shortcut": "skip_connection"}  # fmt: skip
    block, *rest = module.split(".")
    if block == "mid_block":
        kind, index, *layer = rest
        sgm = {("resnets", "0"): "0", ("attentions", "0"): "1", ("resnets", "1"): "2"}
        number = f"middle_block.{sgm[kind, index]}"
    else:
        b, kind, index, *layer = rest
        per_level = layers_per_block + 1  # a down level: its layers and a downsampler
        n = int(b) * per_level + int(index) + (1 if block == "down_blocks" else 0)
        number = f"{'input' if block == 'down_blocks' else 'output'}_blocks.{n}"
        number += ".1" if kind == "attentions" else ".0"
    if kind == "resnets":
        layer = [inner[layer[0]]]
    return ".".join([number, *layer])


@pytest.fixture(scope="module")
def sgm_kohya(source, demo_dir, tmp_path_factory) -> Path:
    """The source adapter's kohya file with SDXL's SGM names (`lora_unet_input_blocks_4_1_...`),
    as kohya's sd-scripts writes an SDXL LoRA: its tensors and alphas, renamed."""
    folder, _ = source
    config = load_part(demo_dir / "model", "unet").config
    modules = {k.split(".lora_")[0].removeprefix("unet.")
               for k in load_file(folder / lora_files.ADAPTER_FILE)}  # fmt: skip
    names = {
        "lora_unet_" + m.replace(".", "_"): "lora_unet_" + _sgm(m, config.layers_per_block)
        .replace(".", "_") for m in modules
    }  # fmt: skip
    kohya = load_file(folder / lora_files.KOHYA_FILE)
    renamed = {names[k.split(".")[0]] + k[k.index(".") :]: v for k, v in kohya.items()}
    path = tmp_path_factory.mktemp("sgm") / "sdxl_lora_sgm.safetensors"
    save_file(renamed, str(path))
    return path


def test_a_kohya_file_with_sdxls_sgm_names_starts_at_the_source_adapters_output(
    sgm_kohya, source, demo_dir
) -> None:
    """diffusers' converter maps SGM block numbers by the model's layers_per_block (the demo's
    1, SDXL's 2): read with this model's config, the file is the source adapter."""
    _, expected = source
    keys = load_file(sgm_kohya).keys()
    assert {k.split("_blocks_")[0] for k in keys if "_blocks_" in k} >= {
        "lora_unet_input",
        "lora_unet_output",
    } and any(k.startswith("lora_unet_middle_block_") for k in keys)
    settings = Settings(training_type="lora", lora_from=str(sgm_kohya), model=str(demo_dir))
    run, adapter = lora_from.apply(settings, "sdxl", model_dir=demo_dir / "model")
    assert adapter is not None and (run.lora_rank, run.lora_alpha) == (RANK, ALPHA)
    assert len(adapter.state) * 3 // 2 == len(keys)  # every down, up and alpha read
    unet = load_part(demo_dir / "model", "unet")
    lora.add_adapter(unet, run)
    lora_from.load_into(unet, adapter)
    torch.testing.assert_close(unet_output(unet), expected, **TOLERANCE)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_starts_at_the_source_adapters_output(layout, source, demo_dir) -> None:
    """Read through the family pipeline's `lora_state_dict`, the file gives the run the
    source's rank, alpha and layers, and the UNet with it the source's output."""
    folder, expected = source
    settings = Settings(training_type="lora", lora_from=str(folder / LAYOUTS[layout]))
    settings, adapter = lora_from.apply(settings, "sdxl", model_dir=demo_dir / "model")
    assert adapter is not None
    assert (settings.lora_rank, settings.lora_alpha) == (RANK, ALPHA)
    written = {k.split(".lora_")[0] for k in load_file(folder / lora_files.ADAPTER_FILE)}
    assert {f"unet.{m}" for m in adapter.modules} == written
    unet = load_part(demo_dir / "model", "unet")
    lora.add_adapter(unet, settings)
    lora_from.load_into(unet, adapter)
    torch.testing.assert_close(unet_output(unet), expected, **TOLERANCE)


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_transformer_families_comfyui_files_give_the_adapter(
    family, family_demo_dir, tmp_path
) -> None:
    """The ComfyUI layouts of the transformer families (Flux: peft names, the scale folded into
    lora_B; Wan: the original checkpoint's names) give the source adapter's weight change,
    s B A, on every layer (alpha becomes the rank: the scale is in the weights)."""
    from test_lora_comfyui import adapted, write

    from zerotuner import families

    demo = family_demo_dir(family)
    denoiser, settings = adapted(demo, family)
    folder = write(denoiser, settings, family, tmp_path / "final")
    source = Settings(training_type="lora", lora_from=str(folder / lora_files.COMFY_FILE))
    run, adapter = lora_from.apply(source, family, model_dir=demo / "model")
    assert adapter is not None and run.lora_rank == run.lora_alpha == settings.lora_rank
    module = load_part(demo / "model", families.get(family).denoiser)
    lora.add_adapter(module, run)
    lora_from.load_into(module, adapter)
    expected, loaded = _deltas(denoiser, settings), _deltas(module, run)
    assert loaded.keys() == expected.keys()
    for name, change in loaded.items():
        torch.testing.assert_close(change, expected[name], **TOLERANCE, msg=name)


def _deltas(module: torch.nn.Module, settings: Settings) -> dict[str, torch.Tensor]:
    """Each adapted layer's weight change, alpha / rank * B A."""
    params = dict(module.named_parameters())
    scale = lora.alpha(settings) / settings.lora_rank
    changes = {}
    for name, a in params.items():
        if ".lora_A." in name:
            b = params[name.replace(".lora_A.", ".lora_B.")]
            changes[name.split(".lora_A.")[0]] = scale * b.flatten(1) @ a.flatten(1)
    return changes


def _run(tmp: Path, demo: Path, cache: Path, *, adapter: Path | str, stage: int, world: int = 1,
         steps: int = 3):  # fmt: skip
    """`steps` steps on `world` CPU ranks from `adapter`, samples at every step; the ranks get
    the ZT_* settings and no S3 or hub credentials."""
    config = tk.ds_config(stage, world=world, steps=steps, lr=1e-2)
    job = tk.write_job(tmp / "job.json", model=demo / "model", deepspeed=config, world=world)
    output = tmp / "output"
    env = tk.settings_env(
        model=demo / "model", data=demo / "data", output=output, cache=cache, max_steps=steps,
        log_every_steps=1, training_type="lora", lora_from=adapter,
        validation_prompts=[PROMPT], validation_every_steps=1, validation_inference_steps=2,
    )  # fmt: skip
    proc = tk.run_ranks(tmp, env, job_file=job, world=world)
    tk.assert_ok(proc, tmp, world=world)
    return output, proc.stdout + proc.stderr


def _pixels(folder: Path) -> list[np.ndarray]:
    return [np.asarray(Image.open(p), dtype=np.int16) for p in sorted(folder.glob("*.png"))]


@pytest.mark.parametrize(("layout", "stage", "world"), [("sgm_kohya", 3, 2), ("comfyui", 2, 1)])
def test_a_run_from_a_file_starts_at_its_samples_and_trains_on(
    layout, stage, world, source, sgm_kohya, s3, demo_dir, lora_cache, monkeypatch, tmp_path
) -> None:
    """sgm_kohya: 2 ranks at ZeRO-3 (the adapter copied in before DeepSpeed partitions it),
    from the SGM-named kohya file in a bucket, fetched by the entrypoint's step into the job's
    cache (the feature cache's folder here, as ZT_CACHE_DIR holds both)."""
    from zerotuner.train import samples

    folder, _ = source
    adapter: Path | str = folder / LAYOUTS.get(layout, "")
    if layout == "sgm_kohya":
        adapter = f"s3://{BUCKET}/sdxl/{sgm_kohya.name}"
        _put(s3, f"sdxl/{sgm_kohya.name}", sgm_kohya.read_bytes())
        _fetch(s3, monkeypatch, adapter, lora_cache)
    output, log = _run(tmp_path, demo_dir, lora_cache, adapter=adapter, stage=stage, world=world)
    assert "the adapter starts from" in log
    steps = tk.read_steps(output)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[0]["lr"] == 0 and steps[-1]["lr"] > 0  # step 1 left the weights as loaded
    assert all(s["loss"] is not None for s in steps)
    reference = tmp_path / "reference"
    samples.render(
        demo_dir / "model", None, [PROMPT], reference, family="sdxl", resolution=64,
        inference_steps=2, seed=Settings().seed, lora_dir=folder, compare=False,
    )  # fmt: skip
    run, ours = _pixels(output / "samples" / "step-1"), _pixels(reference)
    trained = _pixels(output / "samples" / "step-3")
    assert len(run) == len(ours) == len(trained) == 1
    # uint8 pixels, measured: 1 at step 1 (every layout), 25 at step 3 (trained on)
    assert np.abs(run[0] - ours[0]).max() <= 1
    assert np.abs(trained[0] - ours[0]).max() > 1
    start, end = (
        load_file(folder / lora_files.ADAPTER_FILE),
        load_file(output / "final" / lora_files.ADAPTER_FILE),
    )
    assert start.keys() == end.keys()
    moved = [k for k in start if "lora_B" in k and not torch.allclose(start[k], end[k])]
    assert moved, "the adapter did not train on"
    if layout == "comfyui":  # a resume wins over the file, and says so
        _, log = _run(tmp_path, demo_dir, lora_cache, adapter=adapter, stage=stage, steps=4)
        assert "ZT_LORA_FROM: not loaded, the checkpoint resumed continues it" in log
        assert "at step 3" in log and "the adapter starts from" not in log


def _refused(monkeypatch, capsys, tmp_path, **env: str) -> str:
    code, out, err = tk.config_explain(monkeypatch, capsys, tmp_path, **env)
    lines = [line for line in err.splitlines() if line.startswith("zerotuner: error")]
    assert code == 2 and out == "" and len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ({"ZT_LORA_RANK": "8"}, "ZT_LORA_RANK=8: ZT_LORA_FROM="),
        ({"ZT_LORA_ALPHA": "4"}, "ZT_LORA_ALPHA=4: ZT_LORA_FROM="),
        ({"ZT_LORA_TARGETS": "attention"}, "ZT_LORA_TARGETS=attention: names"),
        ({"ZT_LORA_INIT": "pissa"}, "ZT_LORA_INIT=pissa: ZT_LORA_FROM starts"),
    ],
)
def test_a_setting_the_file_contradicts_is_one_line(
    setting, expected, source, demo_dir, monkeypatch, capsys, tmp_path
) -> None:
    folder, _ = source
    line = _refused(
        monkeypatch, capsys, tmp_path, ZT_TRAINING_TYPE="lora", ZT_MODEL=str(demo_dir / "model"),
        ZT_LORA_FROM=str(folder / lora_files.KOHYA_FILE), **setting,
    )  # fmt: skip
    assert line.startswith(f"zerotuner: error: {expected}"), line


def test_the_same_values_as_the_file_pass(source, demo_dir, monkeypatch, capsys, tmp_path):
    folder, _ = source
    code, _, err = tk.config_explain(
        monkeypatch, capsys, tmp_path, ZT_TRAINING_TYPE="lora", ZT_MODEL=str(demo_dir / "model"),
        ZT_LORA_FROM=str(folder / lora_files.COMFY_FILE), ZT_LORA_RANK=str(RANK),
        ZT_LORA_ALPHA="2", ZT_LORA_TARGETS=TARGETS,
    )  # fmt: skip
    assert code == 0, err
    assert f"LoRA rank {RANK}, alpha 2 on " in err and "layers of" in err


def _bad_files(folder: Path, tmp: Path) -> dict[str, Path]:
    """Adapter files that must be refused: not one, another family's, another size's."""
    kohya = load_file(folder / lora_files.KOHYA_FILE)
    files = {"garbage": tmp / "garbage.safetensors", "missing": tmp / "absent.safetensors"}
    files["garbage"].write_bytes(b"not a safetensors file")
    # another size: the same layers, one wider than this model's
    wide = dict(kohya)
    key = next(k for k in wide if k.endswith("to_k.lora_down.weight"))
    wide[key] = torch.zeros(wide[key].shape[0], wide[key].shape[1] + 8)
    # another family's UNet: a block this one lacks (SD 1.x has a fourth)
    deeper = {k.replace("down_blocks_1_", "down_blocks_3_"): v for k, v in kohya.items()}
    # another family's transformer (Flux's names, the diffusers layout)
    flux = {
        f"transformer.single_transformer_blocks.0.attn.to_q.lora_{x}.weight": torch.zeros(4, 4)
        for x in "AB"
    }
    for name, state in (("size", wide), ("family", deeper), ("transformer", flux)):
        files[name] = tmp / f"{name}.safetensors"
        save_file(state, str(files[name]))
    return files


def test_bad_adapter_files_are_one_line_from_config_and_check(
    source, demo_dir, monkeypatch, capsys, tmp_path
) -> None:
    from zerotuner.cli import main

    folder, _ = source
    files = _bad_files(folder, tmp_path)
    expected = {
        "garbage": "not a readable safetensors file",
        "missing": "not a readable safetensors file",
        "size": "an adapter for another model family or size",
        "family": "an adapter for another model family",
        "transformer": "not a sdxl model's unet: an adapter for another model family",
    }
    base = {"ZT_TRAINING_TYPE": "lora", "ZT_MODEL": str(demo_dir / "model")}
    for name, path in files.items():
        line = _refused(monkeypatch, capsys, tmp_path, **base, ZT_LORA_FROM=str(path))
        assert line.startswith(f"zerotuner: error: ZT_LORA_FROM={path}: "), line
        assert expected[name] in line, line
    # `check` refuses with the same line (the model step), before anything starts
    monkeypatch.setenv("ZT_DATA_DIR", str(demo_dir / "data"))
    monkeypatch.setenv("ZT_OUTPUT_DIR", str(tmp_path / "output"))
    monkeypatch.setenv("ZT_LORA_FROM", str(files["family"]))
    assert main(["check"]) == 2
    out, err = capsys.readouterr()
    assert "an adapter for another model family" in out + err
    assert "Traceback" not in out + err


def test_lora_from_with_full_training_is_an_error(monkeypatch, capsys, tmp_path) -> None:
    line = _refused(monkeypatch, capsys, tmp_path, ZT_LORA_FROM="/x.safetensors")
    assert line == (
        "zerotuner: error: ZT_LORA_FROM is set but ZT_TRAINING_TYPE=full: set "
        "ZT_TRAINING_TYPE=lora or unset ZT_LORA_FROM"
    )


# --- s3:// and hf:// ---------------------------------------------------------------------------


def _put(s3: S3Server, key: str, body: bytes) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=s3.url, aws_access_key_id=KEY_ID,
                          aws_secret_access_key=SECRET, region_name="us-east-1")  # fmt: skip
    client.put_object(Bucket=BUCKET, Key=key, Body=body)


def _fetch(s3: S3Server, monkeypatch, url: str, cache: Path) -> Path:
    """What the entrypoint does before the ranks start (preflight.fetch.fetch_adapter), with S3
    credentials that go no further than this call."""
    from zerotuner.preflight.fetch import fetch_adapter

    with monkeypatch.context() as env:
        for key, value in s3.env().items():
            env.setenv(key, value)
        settings = Settings(training_type="lora", lora_from=url, cache_dir=cache)
        path = fetch_adapter(settings)
    assert path is not None
    return path


def test_an_s3_file_is_fetched_once_into_the_cache_and_the_ranks_read_that_copy(
    s3, source, demo_dir, monkeypatch, capsys, tmp_path
) -> None:
    folder, _ = source
    body = (folder / lora_files.COMFY_FILE).read_bytes()
    url = f"s3://{BUCKET}/loras/me/{lora_files.COMFY_FILE}"
    _put(s3, "loras/me/" + lora_files.COMFY_FILE, body)
    base = {"ZT_TRAINING_TYPE": "lora", "ZT_MODEL": str(demo_dir / "model"), **s3.env()}
    code, out, err = tk.config_explain(monkeypatch, capsys, tmp_path, **base, ZT_LORA_FROM=url)
    assert code == 0, err
    assert f"LoRA rank {RANK}, alpha 2 on " in err
    assert KEY_ID not in out + err and SECRET not in out + err
    copy = lora_from.remote(url).copy_path(tmp_path / "cache")
    assert copy.is_relative_to(tmp_path / "cache" / "adapters") and copy.read_bytes() == body
    written = copy.stat().st_mtime_ns
    assert _fetch(s3, monkeypatch, url, tmp_path / "cache") == copy
    assert copy.stat().st_mtime_ns == written  # unchanged in the bucket: not fetched again
    # a rank: no credentials, no endpoint; it reads the node's copy
    for key in s3.env():
        monkeypatch.delenv(key)
    rank = Settings(training_type="lora", lora_from=url, cache_dir=tmp_path / "cache",
                    model=str(demo_dir / "model"))  # fmt: skip
    settings, adapter = lora_from.apply(rank, "sdxl", check=False)
    assert adapter is not None and adapter.path == copy and settings.lora_rank == RANK
    # not fetched on this node: one line, not a network call
    with pytest.raises(lora_from.ConfigError, match="not fetched into ZT_CACHE_DIR"):
        lora_from.apply(rank.model_copy(update={"cache_dir": tmp_path / "other"}), "sdxl",
                        check=False)  # fmt: skip


def test_bad_s3_urls_and_keys_are_one_line_and_write_nothing_outside_the_cache(
    s3, monkeypatch, capsys, tmp_path
) -> None:
    base = {"ZT_TRAINING_TYPE": "lora", **s3.env()}
    cases = {
        f"s3://{BUCKET}/loras/absent.safetensors": "no such object in the bucket; check the URL",
        "s3://no-such-bucket/x.safetensors": "no such bucket; check the URL",
        f"s3://{BUCKET}/a/../../../escaped.safetensors": "the key is a . or .. part, not a file",
        f"s3://{BUCKET}//tmp/escaped.safetensors": "the key is an absolute name, not a file",
        f"s3://{BUCKET}/loras/": "the key is a folder or hidden name, not a file",
        "s3://bucket": "not an adapter file's location; give a local file, s3://bucket/key or",
        "ftp://host/x.safetensors": "not an adapter file's location",
        "hf://me/lora": "not an adapter file's location",
    }
    for url, expected in cases.items():
        line = _refused(monkeypatch, capsys, tmp_path, **base, ZT_LORA_FROM=url)
        assert line.startswith(f"zerotuner: error: ZT_LORA_FROM={url}: {expected}"), line
    assert not list(tmp_path.parent.glob("**/escaped.safetensors"))
    line = _refused(monkeypatch, capsys, tmp_path, **base,
                    ZT_LORA_FROM=f"s3://{KEY_ID}:{SECRET}@{BUCKET}/x.safetensors")  # fmt: skip
    assert "credentials do not go in the URL" in line and SECRET not in line
    # a store that cannot be reached: EnvironmentUnfit, exit 3 from `train` and `check` (`config`
    # says 2: a machine problem there is one of the machine it was asked about)
    from zerotuner.errors import EnvironmentUnfit
    from zerotuner.preflight.fetch import fetch_adapter

    nowhere = f"http://127.0.0.1:{tk.free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", nowhere)
    url = f"s3://{BUCKET}/x.safetensors"
    with pytest.raises(EnvironmentUnfit, match=rf"^ZT_LORA_FROM={url}: cannot fetch it: ") as info:
        fetch_adapter(Settings(training_type="lora", lora_from=url, cache_dir=tmp_path))
    assert info.value.exit_code == 3 and "\n" not in str(info.value)
    # through `config`: exit 2, without the hint to describe other hardware (the machine is fine)
    line = _refused(monkeypatch, capsys, tmp_path, **base | {"AWS_ENDPOINT_URL": nowhere},
                    ZT_LORA_FROM=url)  # fmt: skip
    assert f"ZT_LORA_FROM={url}: cannot fetch it: " in line and "--gpus N" not in line, line


def test_a_hub_file_is_fetched_into_the_hub_cache_with_the_token(
    source, demo_dir, monkeypatch, capsys, tmp_path
) -> None:
    folder, _ = source
    base = {"ZT_TRAINING_TYPE": "lora", "ZT_MODEL": str(demo_dir / "model"),
            "HF_HUB_OFFLINE": "0", "ZT_HF_TOKEN": TOKEN}  # fmt: skip
    url = f"hf://me/lora/{lora_files.KOHYA_FILE}"
    with FakeHub({"me/lora": folder}, token=TOKEN) as hub:
        hub.use_in_this_process(monkeypatch)
        code, out, err = tk.config_explain(monkeypatch, capsys, tmp_path, **base, ZT_LORA_FROM=url)
        assert code == 0, err
        assert f"LoRA rank {RANK}, alpha 2 on " in err and TOKEN not in out + err
        assert hub.fetched() == [lora_files.KOHYA_FILE]
        for bad in ("hf://me/lora/absent.safetensors", f"hf://me/other/{lora_files.KOHYA_FILE}"):
            line = _refused(monkeypatch, capsys, tmp_path, **base, ZT_LORA_FROM=bad)
            assert line.startswith(
                f"zerotuner: error: ZT_LORA_FROM={bad}: not a file of a repository (or "
                "revision) this token can read ("
            ) and line.endswith("NotFoundError); check the URL and ZT_HF_TOKEN"), line
        line = _refused(monkeypatch, capsys, tmp_path, **(base | {"ZT_HF_TOKEN": "hf_wrong"}),
                        ZT_LORA_FROM=url.replace("kohya", "comfyui"))  # fmt: skip
        assert "this token can read" in line and "hf_wrong" not in line
    # a rank reads the hub cache's copy, offline
    rank = Settings(training_type="lora", lora_from=url, cache_dir=tmp_path / "cache",
                    model=str(demo_dir / "model"))  # fmt: skip
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, adapter = lora_from.apply(rank, "sdxl", check=False)
    assert adapter is not None and adapter.path.name == lora_files.KOHYA_FILE
