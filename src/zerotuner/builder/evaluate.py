"""The config builder's computing side: the form's settings -> what `config` and `plan` say.

`evaluate` takes preflight's steps once per form (preflight.what_if.answer_what_if, as
`zerotuner config --explain` and `zerotuner plan --json` do), on variables that hold exactly
the form's settings (builder.form.compose, form_environ): the same settings path as every
command (zerotuner.settings.effective), given a mapping, so the page cannot disagree with the
CLI (tests/test_builder_cli.py compares them on a table of cases) and the process's
environment is never touched. The one answer gives both the DeepSpeed config and the plan.

A form never reaches the network nor the process's credentials: it is evaluated offline
(HF_HUB_OFFLINE, which no form can undo: a form sets ZT_* names only), with no token and no
secrets folder, so a hub id is judged from the local cache or by its name. Nor does it read a
file of the machine's: the server passes the one folder its operator chose (`files_under`),
and a path a form names outside it is refused before anything opens it (an answer carries the
DeepSpeed JSON read, and error lines may quote a file's keys).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from zerotuner.builder.form import DEEPSPEED, compose, shown
from zerotuner.errors import EXIT_CONFIG, ConfigError, ZeroTunerError
from zerotuner.preflight.what_if import WhatIf, answer_what_if, plan_json

# Where this machine keeps the hub cache: the server's own, unless the form says.
MACHINE_SETTINGS = ("ZT_CACHE_DIR",)
# A config file that holds nothing (a regular file: the config reader takes no device).
EMPTY_CONFIG = str(Path(__file__).resolve().parents[1] / "web" / "empty.yaml")


def form_environ(env: dict[str, str]) -> dict[str, str]:
    """The variables a form is evaluated with, in place of the process's: exactly its ZT_*
    settings (the server's own hidden, but for MACHINE_SETTINGS); no config file unless the
    form names one (the form is the whole configuration); offline, and with no token or
    secrets folder whatever the form says (compose lets only ZT_* names in, no secret)."""
    machine = {k: v for k, v in os.environ.items() if k.upper() in MACHINE_SETTINGS}
    return {
        **machine,
        "ZT_CONFIG_FILE": EMPTY_CONFIG,
        **env,
        "ZT_SECRETS_DIR": os.devnull,  # no file can be under it
        "HF_HUB_OFFLINE": "1",
    }


def what_if(hardware: dict[str, str]) -> WhatIf:
    """The machine the form's hardware fields describe, as `config` and `plan` take it from
    their flags."""
    gpus = hardware.get("gpus")
    if gpus is not None and not re.fullmatch(r"\d+", gpus):
        raise ConfigError(f"--gpus={gpus}: expected a whole number (0 = CPU accelerator)")
    bf16 = hardware.get("bf16")
    if bf16 not in (None, "true", "false"):
        raise ConfigError(f"--bf16={bf16}: expected true or false")
    return WhatIf(
        gpus=int(gpus) if gpus is not None else None,
        gpu_memory=hardware.get("gpu_memory"),
        host_memory=hardware.get("host_memory"),
        offload_disk=hardware.get("offload_disk"),
        nodes=None,  # the form sets ZT_NNODES, which --nodes stands for
        bf16=None if bf16 is None else bf16 == "true",
    )


def named_paths(env: dict[str, str]) -> list[tuple[str, str]]:
    """(setting, path) for each file or folder the form's settings make the evaluation read: a
    DeepSpeed JSON that is not inline, the datasets file, a local model, a checkpoint."""
    from zerotuner.preflight.steps import model_looks_local

    paths = []
    for name, value in env.items():
        text = value.strip()
        if name == DEEPSPEED:
            read = not text.startswith("{")  # else inline JSON
        elif name == "ZT_MODEL":  # else a hub id, read from the machine's hub cache only
            read = model_looks_local(text) or Path(text).expanduser().exists()
        elif name == "ZT_RESUME":
            read = text not in ("auto", "never")
        else:
            read = name == "ZT_DATASETS_FILE"
        if read and text:
            paths.append((name, text))
    return paths


def outside(env: dict[str, str], folder: Path) -> list[str]:
    """One line per path the form names outside `folder` (links and `..` resolved first)."""
    root = Path(os.path.realpath(folder))
    lines = []
    for name, value in named_paths(env):
        if not Path(os.path.realpath(Path(value).expanduser())).is_relative_to(root):
            lines.append(
                f"{name}={shown(value, 200)}: the builder reads only files under --files={root} "
                f"(the folder its operator chose); put the file there"
                + (", or paste the JSON" if name == DEEPSPEED else "")
            )
    return lines


def evaluate(form: dict[str, Any], *, files_under: Path | None = None) -> dict[str, Any]:
    """What `zerotuner config --explain` and `zerotuner plan --json` answer for this form.
    `files_under`: the only folder whose files the form may name (the server's --files); None
    for a caller whose forms are its own (tests comparing the page with the CLI)."""
    out: dict[str, Any] = {"settings": {}, "notes": [], "errors": [], "plan": None}
    try:
        composed = compose(form)
        what = what_if(composed.hardware)
    except ConfigError as error:
        return out | {"exit_code": error.exit_code, "errors": _located(error.problems)}
    out["settings"] = composed.env
    out["hardware"] = composed.hardware
    out["notes"] = [{"level": "info", "message": n} for n in composed.notes]
    refused = _located(outside(composed.env, files_under)) if files_under is not None else []
    if refused:  # nothing was opened: no line can quote the file
        return out | {"config": None, "exit_code": EXIT_CONFIG, "errors": refused,
                      "plan_exit_code": EXIT_CONFIG, "plan_errors": refused}  # fmt: skip
    answer = answer_what_if(what, form_environ(composed.env))
    try:
        result = answer.preflight()
        out["config"] = result.normalized.config
        out["described"] = answer.described
        out["notes"] += [{"level": n.level, "message": n.message} for n in result.notes]
        out["exit_code"] = 0
    except ZeroTunerError as error:
        out |= {"config": None, "exit_code": error.exit_code}
        out["errors"] = _located(error.problems)
    try:
        plan, hardware = answer.plan()
        out["plan"] = plan_json(plan, hardware)
        out["plan_exit_code"] = 0
    except ZeroTunerError as error:
        out["plan_exit_code"] = error.exit_code
        out["plan_errors"] = _located(error.problems)
    return out


def _located(lines: list[str]) -> list[dict[str, Any]]:
    return [{"line": line, "fields": fields_named(line)} for line in lines]


# DeepSpeed keys and words an error may name instead of a setting, and the field that sets it.
_KEY_FIELDS = (
    (r"^optimizer\b|optimizer\.", "ZT_OPTIMIZER"),
    (r"^scheduler\b|scheduler\.", "ZT_LR_SCHEDULER"),
    (r"\btrain_batch_size\b|train_micro_batch_size_per_gpu", "ZT_TRAIN_BATCH_SIZE"),
    (r"\bgradient_accumulation_steps\b", "ZT_GRADIENT_ACCUMULATION_STEPS"),
    (r"\b(bf16|fp16)\b", "ZT_MIXED_PRECISION"),
    (r"zero_optimization\.stage\b", "ZT_ZERO_STAGE"),
    (r"\boffload_optimizer\b", "ZT_OFFLOAD_OPTIMIZER"),
    (r"\boffload_param\b", "ZT_OFFLOAD_PARAM"),
    (r"\bnvme_path\b", "ZT_OFFLOAD_DIR"),
    (r"DeepSpeed rejects", DEEPSPEED),
)


def fields_named(line: str) -> list[str]:
    """The form fields an error line names: its ZT_* settings and what-if flags, else the field
    that sets the DeepSpeed key it names; [] for a line about the whole job."""
    names = []
    for match in re.finditer(r"\b(ZT_[A-Z0-9_]+)", line):
        if match.group(1) not in names:
            names.append(match.group(1))
    for match in re.finditer(r"--(gpus|gpu-memory|host-memory|offload-disk|bf16)\b", line):
        names.append("hw." + match.group(1).replace("-", "_"))
    for match in re.finditer(r"\bds\.([a-z0-9_]+)", line):
        names.append(f"ds.{match.group(1)}")
    if names:
        return list(dict.fromkeys(names))
    for pattern, name in _KEY_FIELDS:
        if re.search(pattern, line):
            return [name]
    return []
