"""ZT_BASE_PRECISION=fp8 in every family: a LoRA on each built-in family's demo trains at ZeRO-2
on its base stored in fp8, and the adapter loads on the family's full-precision pipeline.

One lone rank (DeepSpeed's CPU accelerator, gloo, a world of 1) runs the worker's phases (`Run`:
load, cache, engine, train, finish) family after family, so the imports and the group are paid
once: about a second a family after the first. The SDXL demo's 2-rank runs at fp8 and int8, their
checkpoints, resume and samples are tests/test_base_precision_training.py's; ZeRO-3 with a stored
base is refused before the ranks (tests/test_base_precision.py).
"""

from __future__ import annotations

import json
import math
import textwrap

import pytest
import trainkit as tk
from test_flow_training import TOKENS

from zerotuner.families.registry import BUILTIN

pytestmark = pytest.mark.slow

STEPS = 3  # the ds_config warms up over 2: the first steps run at lr 0 and half
# the fixture that writes each family's demo (the others: family_demo_dir's)
DEMOS = {"sdxl": "demo_dir", "sd1": "sd1_demo_dir", "sd2": "sd2_demo_dir"}

SCRIPT = textwrap.dedent(
    """
    import json
    from pathlib import Path

    from zerotuner import families
    from zerotuner.launch import distributed
    from zerotuner.launch.job import Job
    from zerotuner.settings.schema import Settings
    from zerotuner.train import samples
    from zerotuner.train.run import Run
    from zerotuner.weights import training_type

    class Losses:
        def __init__(self):
            self.losses = []

        def __getattr__(self, hook):  # the other hooks: nothing to record
            return lambda *args, **kwargs: None

        def on_step(self, record):
            self.losses.append(record.loss)

    world = distributed.init_distributed(device="cpu", master_addr="127.0.0.1", master_port=0)
    result = {}
    for case in json.loads(Path(CASES).read_text()):
        family, job = case["family"], Job.from_json(Path(case["job"]).read_text())
        settings = Settings(**case["settings"])
        weights = training_type.for_settings(settings, family, None)
        sink = Losses()
        run = Run(settings, job, sinks=[sink], world=world, weights=weights, resume=None)
        run.load()
        run.cache()
        run.engine()
        stored = sorted({type(m.weight).__name__ for m in run.engine_.module.modules()
                         if type(getattr(m, "weight", None)).__module__.startswith("torchao")})
        layers = sum(type(getattr(m, "weight", None)).__module__.startswith("torchao")
                     for m in run.engine_.module.modules())
        run.train()
        run.finish()
        # as the run's samples load it: load_lora_weights on the full-precision pipeline
        final = Path(settings.output_dir) / "final"
        pipe = samples.load_pipeline(Path(settings.model), None, family=family, device="cpu",
                                     lora_dir=final)
        denoiser = getattr(pipe, families.get(family).denoiser)
        loaded = sum(".lora_B." in name and bool(p.abs().sum() > 0)
                     for name, p in denoiser.named_parameters())
        result[family] = {"losses": sink.losses, "stored": stored, "layers": layers,
                          "loaded": loaded,
                          "pipelines": [c.__name__ for c in type(pipe).__mro__]}
    print("RESULT " + json.dumps(result))
    """
)


@pytest.fixture(scope="module")
def fp8_runs(request, family_demo_dir, tmp_path_factory) -> dict:
    """Every built-in family's fp8 LoRA, STEPS steps at ZeRO-2 in one lone rank."""
    tmp = tmp_path_factory.mktemp("fp8-families")
    cases = []
    for family, spec in BUILTIN.items():
        fixture = DEMOS.get(family)
        if fixture:
            demo = request.getfixturevalue(fixture)
        elif family in ("sd3", "flux"):
            demo = request.getfixturevalue("flow_demo_dirs")[family]
        else:
            demo = family_demo_dir(family)
        job = tk.write_job(tmp / f"{family}.json", model=demo / "model", family=family,
                           deepspeed=tk.ds_config(2, world=1, steps=STEPS), world=1)  # fmt: skip
        settings = {
            "model": str(demo / "model"), "data_dir": str(demo / "data"),
            "output_dir": str(tmp / family), "cache_dir": str(tmp / "cache"),
            "training_type": "lora", "lora_rank": 4, "lora_alpha": 4, "base_precision": "fp8",
            "max_steps": STEPS, "checkpoint_every_steps": 0, "log_every_steps": 1,
            **({"max_sequence_length": TOKENS} if spec.flow else {}),
        }  # fmt: skip
        cases.append({"family": family, "job": str(job), "settings": settings})
    (tmp / "cases.json").write_text(json.dumps(cases))
    return tk.lone_rank_result(tmp, f"CASES = {str(tmp / 'cases.json')!r}\n" + SCRIPT, timeout=900)


@pytest.mark.parametrize("family", list(BUILTIN))
def test_a_lora_trains_on_the_familys_fp8_base_and_loads_on_its_pipeline(family, fp8_runs):
    """The denoiser's linear layers were stored in fp8 (torchao's Float8Tensor), the steps' losses
    are finite, and the adapter written to final/ loads with `load_lora_weights` on the family's
    full-precision pipeline (as `samples.load_pipeline` loads it: Qwen-Image-Edit's processor
    built without torchvision), its lora_B weights trained away from zero."""
    seen = fp8_runs[family]
    assert seen["stored"] == ["Float8Tensor"] and seen["layers"] > 0, seen
    assert len(seen["losses"]) == STEPS and all(math.isfinite(x) for x in seen["losses"]), seen
    # the family's pipeline, or a class built on it (HunyuanVideo 1.5's with a LoRA loader)
    assert not BUILTIN[family].pipeline or BUILTIN[family].pipeline in seen["pipelines"], seen
    assert seen["loaded"] > 0, seen
