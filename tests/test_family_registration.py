"""A family is one home (issue 39): a throwaway family, installed as another package's entry
point (`zerotuner.families`, families/registry.installed_families) and edited nowhere in
zerotuner, is found everywhere a built-in one is: ZT_MODEL_FAMILY takes it, the settings docs
and the builder list it, a hub id's name says it, `zerotuner demo` writes its pipeline through
its own writer, `plan` plans it and `./entrypoint train` trains and exports it. A built-in
family keeps the pipeline class it shares with the toy.

The toy is Flux.1 under another name (its Spec a copy of flux's, its trainer a `Flux`
subclass, its demo writer Flux.1's), so what is tested is the registration, not a model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trainkit as tk

from zerotuner.families.registry import BUILTIN

REPO = Path(__file__).resolve().parents[1]
TOY_PACKAGE = {
    "toy_family/__init__.py": '''
        """A family outside zerotuner: its Spec, named by this package's entry point."""
        import dataclasses

        from zerotuner.families.registry import BUILTIN

        SPEC = dataclasses.replace(
            BUILTIN["flux"], module="toy_family.trainer", cls="Toy", hub_markers=("toyfam",),
            guess_order=-9, demo="toy_family.demo:write_model",
        )
    ''',
    "toy_family/trainer.py": '''
        from zerotuner.families.flow import Flux


        class Toy(Flux):
            """Flux.1's objective and conditioning under the toy's name."""
    ''',
    "toy_family/demo.py": """
        def write_model(model_dir, *, seed, corpus, data_dir=None):
            from zerotuner.demo.flow import write_flow_model

            return write_flow_model(model_dir, family="flux", seed=seed, corpus=corpus,
                                    data_dir=data_dir)
    """,
    "toy_family-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: toy-family\nVersion: 1.0\n",
    "toy_family-1.0.dist-info/entry_points.txt": "[zerotuner.families]\ntoy = toy_family:SPEC\n",
}

# What the toy must be found in, asked in one interpreter with the toy installed.
FOUND_EVERYWHERE = """
import json

from zerotuner import families
from zerotuner.builder.form import form_fields
from zerotuner.docs import settings_table_markdown

row = next(r for r in settings_table_markdown().splitlines() if "`ZT_MODEL_FAMILY`" in r)
field = next(f for s in form_fields() for f in s["fields"] if f["name"] == "ZT_MODEL_FAMILY")
print(json.dumps({
    "families": list(families.FAMILIES),
    "flow": "toy" in families.FLOW_FAMILIES,
    "docs_row": row,
    "builder_choices": field["choices"],
    "guessed": families.guess_family("someone/toyfam-v1"),
    "trainer": type(families.get("toy")).__name__,
    "known": families.known_family("toy"),
}))
"""


@pytest.fixture(scope="module")
def toy_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a process that has the toy family's package installed."""
    site = tmp_path_factory.mktemp("site")
    for name, text in TOY_PACKAGE.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(textwrap.dedent(text).lstrip())
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def zerotuner(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zerotuner", *args], env=env, capture_output=True,
        text=True, timeout=600, cwd=REPO,
    )  # fmt: skip


def test_an_installed_family_is_listed_wherever_families_are(toy_env):
    proc = subprocess.run(
        [sys.executable, "-c", FOUND_EVERYWHERE], env=toy_env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout)
    assert found["families"][-1] == "toy" and "sdxl" in found["families"]
    assert found["flow"] and "toy" in found["docs_row"] and "toy" in found["builder_choices"]
    assert found["guessed"] == "toy" and found["trainer"] == "Toy" and found["known"] == "toy"


def test_without_its_package_the_family_is_refused_in_one_line(tmp_path):
    env = tk.entrypoint_env(tmp_path, tmp_path, ZT_MODEL_FAMILY="toy", ZT_MODEL="someone/x")
    proc = zerotuner(env, "plan")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"zerotuner: error: ZT_MODEL_FAMILY=toy: expected one of auto, {', '.join(BUILTIN)}"
    ]


def test_an_installed_family_writes_its_demo_plans_trains_and_exports(toy_env, tmp_path):
    demo = tmp_path / "demo"
    written = zerotuner(toy_env, "demo", str(demo), "--family", "toy")
    assert written.returncode == 0, written.stderr[-3000:]
    assert "demo model (toy, " in written.stdout
    index = json.loads((demo / "model" / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"  # its own writer's pipeline

    env = toy_env | tk.entrypoint_env(
        demo, tmp_path, ZT_CONFIG_FILE=str(REPO / "config" / "demo-flow.yaml"),
        ZT_MODEL_FAMILY="toy", ZT_NUM_PROCESSES="1", ZT_MAX_STEPS="2",
        ZT_CHECKPOINT_EVERY_STEPS="2",
    )  # fmt: skip
    env["PYTHONPATH"] = toy_env["PYTHONPATH"]
    plan = zerotuner(env, "plan")
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "job: toy transformer" in plan.stdout
    # its pipeline's class is Flux.1's: without ZT_MODEL_FAMILY the folder is Flux.1's still
    detected = zerotuner(env | {"ZT_MODEL_FAMILY": "auto"}, "plan")
    assert "job: flux transformer" in detected.stdout, detected.stderr[-3000:]

    trained = subprocess.run(
        [str(REPO / "entrypoint"), "train"], env=env, capture_output=True, text=True,
        timeout=900, cwd=REPO,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-6000:]
    assert [s["step"] for s in tk.steps_done(tmp_path)] == [1, 2]
    final = tmp_path / "output" / "final"
    assert json.loads((final / "model_index.json").read_text())["_class_name"] == "FluxPipeline"
