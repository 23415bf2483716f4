"""One preflight path (issue 39): `plan`, `config` and the builder take the steps `train` takes.

- the builder's answer to a form comes from one pass of preflight's steps: the planner runs
  once per request, and the plan and the DeepSpeed config are read off that one pass;
- what `plan` and `config` say for a job is what `train`'s preflight decides for it, down to
  the settings an adapter file (ZT_LORA_FROM) gives the run.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from lorakit import lora_settings

from zerotuner.launch.ranks import resolve_topology
from zerotuner.machine.probe import probe
from zerotuner.preflight import steps
from zerotuner.preflight.steps import decisions_from, preflight
from zerotuner.preflight.what_if import WhatIf, answer_what_if
from zerotuner.settings.effective import effective_settings
from zerotuner.weights import lora, lora_files
from zerotuner.weights.pipeline_folder import load_part

GPU24 = {"gpus": "1", "gpu_memory": "24GiB", "host_memory": "64GiB"}


@pytest.fixture
def plans(monkeypatch) -> list[object]:
    """The requests the planner is asked to size, in order: the real planner, counted."""
    asked: list[object] = []
    make_plan = steps.make_plan

    def counted(**kwargs):
        asked.append(kwargs["request"])
        return make_plan(**kwargs)

    monkeypatch.setattr(steps, "make_plan", counted)
    return asked


def _evaluate(url: tuple[str, int], form: dict) -> dict:
    connection = http.client.HTTPConnection(*url, timeout=120)
    try:
        connection.request(
            "POST", "/api/evaluate", json.dumps(form), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        body = response.read()
        assert response.status == 200, body
        return json.loads(body)
    finally:
        connection.close()


def test_the_builder_plans_once_per_request(plans, monkeypatch, tmp_path):
    from zerotuner.builder.server import BuilderServer

    monkeypatch.setenv("ZT_CACHE_DIR", str(tmp_path / "cache"))  # the server's: nothing cached
    server = BuilderServer("127.0.0.1", 0, templates=tmp_path / "templates", files=tmp_path)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = server.server_address[:2]
    settings = {"ZT_MODEL_FAMILY": "sdxl"}
    try:
        answer = _evaluate(url, {"settings": settings | {"ZT_ZERO_STAGE": "2"}, "hardware": GPU24})
        assert len(plans) == 1
        assert (answer["exit_code"], answer["plan_exit_code"]) == (0, 0)
        assert answer["config"]["zero_optimization"]["stage"] == 2
        assert answer["plan"]["choice"]["zero_stage"] == 2
        # A config refused after the plan (its optimizer) still shows that one plan.
        answer = _evaluate(url, {"settings": settings | {"ZT_OPTIMIZER": "OneBitAdam"},
                                 "hardware": GPU24})  # fmt: skip
        assert len(plans) == 2
        assert (answer["exit_code"], answer["config"], answer["plan_exit_code"]) == (2, None, 0)
        assert answer["plan"]["rows"]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def adapter_file(demo_dir: Path, tmp_path_factory) -> Path:
    """A LoRA adapter file of the demo's UNet: rank 4 on more layers than the default's."""
    unet = load_part(demo_dir / "model", "unet")
    settings = lora_settings()
    lora.add_adapter(unet, settings)
    state = {n: p.detach().clone() for n, p in unet.named_parameters() if p.requires_grad}
    folder = lora_files.write_adapter(
        "sdxl", state, lora.shapes(unet), lora.metadata(lora.lora_config(settings)),
        tmp_path_factory.mktemp("adapter") / "final",
    )  # fmt: skip
    return folder / lora_files.ADAPTER_FILE


@pytest.mark.parametrize("job", ["full", "lora", "lora from a file"])
def test_plan_and_config_decide_what_trains_preflight_decides(job, demo_job_env, request):
    """The what-if answer for this machine (no hardware described, as `plan` and `config`
    without flags) against `preflight` as `train` calls it, on the tiny demo model."""
    if job != "full":
        demo_job_env.setenv("ZT_TRAINING_TYPE", "lora")
    if job == "lora from a file":
        demo_job_env.setenv("ZT_LORA_FROM", str(request.getfixturevalue("adapter_file")))
    effective = effective_settings()
    hardware = probe(effective.settings.device)
    topology = resolve_topology(effective.settings, hardware, os.environ)
    trains = preflight(effective, hardware=hardware, topology=topology)

    answer = answer_what_if(WhatIf())
    plan, _ = answer.plan()
    config = answer.preflight()
    assert decisions_from(plan) == config.decisions == trains.decisions
    assert (plan.choice, plan.rows, plan.reasons) == (
        trains.plan.choice, trains.plan.rows, trains.plan.reasons,
    )  # fmt: skip
    # the disk's free bytes are measured twice: a byte written between them is no difference
    assert replace(plan.inputs, offload_disk_free_bytes=0) == replace(
        trains.plan.inputs, offload_disk_free_bytes=0
    )
    assert config.normalized.config == trains.normalized.config
    assert [n.message for n in config.notes] == [n.message for n in trains.notes]
    if job == "lora from a file":  # the file's rank, as train runs it, not ZT_LORA_RANK's
        assert config.settings.lora_rank == 4 != effective.settings.lora_rank
