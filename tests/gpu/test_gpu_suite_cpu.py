"""The GPU suite on the CPU (run by `make test`): it collects and skips cleanly without
importing torch, its report writer writes what the checks found, its models have their sizes."""

from __future__ import annotations

import json
import subprocess
import sys

from gpureport import MAX_ERROR_CHARS, CheckResult, write_report
from trainkit import REPO

COLLECT_ONLY = """
import sys, pytest
rc = pytest.main(["-q", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider"])
print("TORCH-IMPORTED" if "torch" in sys.modules else "NO-TORCH")
sys.exit(rc)
"""


def test_gpu_checks_skip_under_make_test_without_importing_torch():
    done = subprocess.run(
        [sys.executable, "-c", COLLECT_ONLY], cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "NO-TORCH" in done.stdout
    assert " passed" not in done.stdout and "failed" not in done.stdout
    assert "run by `make test-gpu` on a CUDA machine" in done.stdout


def test_gpu_report_without_cuda_says_why_every_check_skipped(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "tests/gpu", "-m", "gpu", "-p", "no:cacheprovider",
         "--gpu-report", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads((tmp_path / "gpu-report.json").read_text())
    assert doc["summary"] == {"skipped": len(doc["checks"])} and len(doc["checks"]) >= 10
    assert "CUDA is absent" in doc["note"]
    assert all("CUDA is absent" in (c["error"] or "") for c in doc["checks"])
    names = {c["name"] for c in doc["checks"]}
    assert "bf16 training on one GPU [zero3-nvme]" in names
    assert "Not run on a GPU" in (tmp_path / "gpu-report.md").read_text()


def test_report_writer_json_and_markdown(tmp_path):
    ok = CheckResult(name="ops load", outcome="passed", seconds=1.25)
    ok.expect(True, "FusedAdamBuilder: ready")
    bad = CheckResult(name="planner", outcome="failed", seconds=3.0)
    bad.expect(True, "zero2: plan and peak both read")
    bad.expect(False, "zero3: plan within 25% of the measured peak (+40.0%)")
    bad.table("planned vs measured", {"configuration": "zero2", "planned": 10, "error": "+2%"})
    bad.table("planned vs measured", {"configuration": "zero3|x", "planned": 14, "note": "n"})
    bad.data["seconds"] = [1.5, 2.0]
    bad.set_error("x" * (MAX_ERROR_CHARS + 500))
    json_path, md_path = write_report([ok, bad], tmp_path / "out", {"gpu": "H100"}, note="dry")

    doc = json.loads(json_path.read_text())
    assert doc["summary"] == {"failed": 1, "passed": 1}
    assert doc["environment"] == {"gpu": "H100"} and doc["note"] == "dry"
    planner = doc["checks"][1]
    assert planner["failed"] == ["zero3: plan within 25% of the measured peak (+40.0%)"]
    assert len(planner["tables"]["planned vs measured"]) == 2
    assert len(planner["error"]) < MAX_ERROR_CHARS + 10  # kept small enough to bring back

    md = md_path.read_text()
    assert "| ops load | PASS | 1.2 |" in md and "| planner | FAIL | 3.0 |" in md
    assert "- held: FusedAdamBuilder: ready" in md
    assert "- **did not hold**: zero3: plan within 25% of the measured peak (+40.0%)" in md
    # the union of the rows' columns, a missing cell empty, a pipe escaped
    assert "| configuration | planned | error | note |" in md
    assert "| zero3\\|x | 14 |  | n |" in md
    assert "- seconds: [1.5, 2.0]" in md


def test_check_expect_returns_what_it_recorded():
    result = CheckResult(name="c")
    assert result.expect(1, "one") is True and result.expect([], "empty") is False
    assert result.held == ["one"] and result.failed == ["empty"]


def test_timing_and_medium_models_have_their_sizes_on_the_meta_device():
    from gpumodels import parameters_on_meta, timing_unet_config

    from bench.benchmodel import unet_config  # importable once gpumodels is

    timing = parameters_on_meta(timing_unet_config())
    assert 300e6 < timing < 900e6, timing  # "a few hundred million"
    medium = parameters_on_meta(unet_config())
    assert 80e6 < medium < 110e6, medium  # bench's 95M model


def test_timing_model_is_written_and_its_latents_are_sdxls(tmp_path):
    """The small variant, written for real: 1024 px gives SDXL's 128 px latents, and the UNet
    takes the demo's text states (what train and bench.bare feed it)."""
    import torch
    from diffusers import UNet2DConditionModel
    from gpumodels import DEMO_POOLED_DIM, DEMO_TEXT_DIM, latent_side, write_timing_model

    root = write_timing_model(tmp_path, small=True)
    assert latent_side(root / "model", 1024) == 128
    assert latent_side(root / "model", 512) == 64
    unet = UNet2DConditionModel.from_pretrained(root / "model", subfolder="unet")
    with torch.no_grad():
        out = unet(
            torch.zeros(1, 4, 16, 16), torch.tensor([10]), torch.zeros(1, 77, DEMO_TEXT_DIM),
            added_cond_kwargs={"text_embeds": torch.zeros(1, DEMO_POOLED_DIM),
                               "time_ids": torch.tensor([[128.0, 128, 0, 0, 128, 128]])},
        ).sample  # fmt: skip
    assert out.shape == (1, 4, 16, 16)
    assert write_timing_model(tmp_path, small=True) == root  # kept, not rewritten
