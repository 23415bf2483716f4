"""The builder's exports: one job's settings as an env file, a compose override, a Kubernetes
Job with its ConfigMap, the DeepSpeed JSON and the YAML config file.

Every export starts from the same `Composed` settings the page evaluated, so what a file holds
is what the page showed. Secrets never come in: the form has none.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import resources
from typing import Any

import yaml

from zerotuner.builder.evaluate import form_environ
from zerotuner.builder.form import DEEPSPEED, SETTING_NAME, Composed
from zerotuner.errors import ConfigError
from zerotuner.settings.schema import Settings, env_name, field_of, load_settings

FORMATS = {
    "env": ("zerotuner.env", "text/plain"),
    "compose": ("compose.override.yaml", "application/yaml"),
    "kubernetes": ("zerotuner-job.yaml", "application/yaml"),
    "deepspeed": ("deepspeed.json", "application/json"),
    "yaml": ("zerotuner.yaml", "application/yaml"),
}
# Every character a reader of lines may split on (docker's env file: LF; str.splitlines: all
# of these) and NUL: an env file's value is taken literally (no quoting), so they are refused.
LINE_BREAKS = frozenset("\n\r\x00\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")
# Folders the container's mounts fix (docs/deploy.md; DESIGN): a Job's config leaves them out.
MOUNTED = ("data_dir", "output_dir", "cache_dir", "offload_dir", "config_file", "secrets_dir")
SERVICE = "zerotuner"  # compose.yaml's service


def export(fmt: str, composed: Composed, config: dict[str, Any] | None) -> tuple[str, str, str]:
    """(file name, media type, text). `config`: the normalized DeepSpeed config, when valid."""
    if fmt not in FORMATS:
        raise ConfigError(f"export format {fmt!r}: expected one of {', '.join(FORMATS)}")
    name, media = FORMATS[fmt]
    if fmt == "deepspeed":
        if config is None:
            raise ConfigError("no DeepSpeed config to export: fix the errors first")
        return name, media, json.dumps(config, indent=2) + "\n"
    settings = _ordered(composed.env)
    _validated(settings)
    writers: dict[str, Callable[[dict[str, str]], str]] = {
        "env": env_file,
        "compose": compose_override,
        "yaml": yaml_config,
        "kubernetes": lambda s: kubernetes_job(s, gpus=_gpus(composed.hardware)),
    }
    text = writers[fmt](settings)
    return name, media, text


def _ordered(env: dict[str, str]) -> dict[str, str]:
    """Settings in declaration order (the settings table's), so exports read like example.env."""
    order = {env_name(n): i for i, n in enumerate(Settings.model_fields)}
    return dict(sorted(env.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))


def _validated(env: dict[str, str]) -> Settings:
    """The settings the file will give: an export of settings that do not load is refused with
    the same lines `config` prints."""
    for key, value in env.items():
        if not SETTING_NAME.fullmatch(key):  # compose lets no other name in; a file never has one
            raise ConfigError(f"{key!r}: not a setting name")
        if any(c in LINE_BREAKS for c in value):
            raise ConfigError(
                f"{key}: a line break (or NUL) cannot go in an env file; use one line"
            )
    return load_settings(form_environ(env))


def _gpus(hardware: dict[str, str]) -> int | None:
    gpus = hardware.get("gpus")
    return int(gpus) if gpus and gpus.isdigit() else None


def env_file(env: dict[str, str]) -> str:
    """`docker run --env-file`: NAME=value, taken literally (no quotes, no expansion)."""
    head = [
        "# zerotuner settings from `zerotuner builder`.",
        "# docker run --env-file zerotuner.env ...   (unset settings keep their defaults)",
    ]
    return "\n".join([*head, *(f"{k}={v}" for k, v in env.items())]) + "\n"


def compose_override(env: dict[str, str]) -> str:
    """Beside compose.yaml, `docker compose up` merges it in; `environment` wins over the
    env_file compose.yaml names. `$` is doubled: compose would interpolate it."""
    doc = {
        "services": {SERVICE: {"environment": {k: v.replace("$", "$$") for k, v in env.items()}}}
    }
    head = (
        "# zerotuner settings from `zerotuner builder`: save as compose.override.yaml next to\n"
        "# compose.yaml; `docker compose up` merges it in.\n"
    )
    return head + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=100)


def config_mapping(env: dict[str, str], *, leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """The settings as a config file holds them: setting names, typed values, the DeepSpeed
    JSON as a `deepspeed_config` block."""
    settings = load_settings(form_environ(env))
    names = [field_of(k.lower().removeprefix("zt_")) for k in env]
    data = settings.model_dump(mode="json", include={n for n in names if n not in leave_out})
    raw = env.get(DEEPSPEED, "").strip()
    if "deepspeed_config" in data and raw.startswith("{"):
        data["deepspeed_config"] = json.loads(raw)
    return {n: data[n] for n in names if n in data}


def yaml_config(env: dict[str, str], *, leave_out: tuple[str, ...] = ()) -> str:
    head = (
        "# zerotuner settings from `zerotuner builder`: mount as /config/zerotuner.yaml\n"
        "# (or point ZT_CONFIG_FILE at it). Environment variables override it.\n"
    )
    body = config_mapping(env, leave_out=leave_out)
    return head + (
        yaml.safe_dump(body, sort_keys=False, allow_unicode=True, width=100) if body else "{}\n"
    )


def kubernetes_job(env: dict[str, str], *, gpus: int | None) -> str:
    """config/kubernetes/job.yaml (PVCs, ConfigMap, Job) with this config in the ConfigMap and
    the described GPUs per node in the Job's limit. Comments kept: the text is edited."""
    template = resources.files("zerotuner.web").joinpath("job.yaml").read_text()
    # An s3:// or hf:// dataset is no mount: the Job's config keeps it.
    remote = "://" in env.get("ZT_DATA_DIR", "")
    body = config_mapping(env, leave_out=tuple(m for m in MOUNTED if not remote or m != "data_dir"))
    config = (
        yaml.safe_dump(body, sort_keys=False, allow_unicode=True, width=100) if body else "{}\n"
    )
    start = template.index("  zerotuner.yaml: |\n") + len("  zerotuner.yaml: |\n")
    end = template.index("---\n", start)
    block = "".join(f"    {line}\n" for line in config.splitlines())
    text = template[:start] + block + template[end:]
    limit = "nvidia.com/gpu: 1\n"
    if limit not in text:
        raise RuntimeError("the Job template lost its GPU limit")  # tests/test_builder_exports
    if gpus is not None:
        text = text.replace(limit, f"nvidia.com/gpu: {gpus}\n") if gpus else _cpu_only(text)
    nodes = env.get("ZT_NNODES")
    head = (
        "# From `zerotuner builder`: kubectl apply -f zerotuner-job.yaml. The settings are in\n"
        "# the ConfigMap; folders are the Job's mounts (/data, /output, ...). Below:\n"
        "# config/kubernetes/job.yaml with its comments.\n"
    )
    if nodes and nodes != "1":
        head += f"# {nodes} nodes: use config/kubernetes/indexed-job.yaml with this ConfigMap.\n"
    return head + text


def _cpu_only(text: str) -> str:
    """GPUs 0 (DeepSpeed's CPU accelerator): no GPU limit and no GPU toleration."""
    lines = text.splitlines(keepends=True)
    out = [line for line in lines if "nvidia.com/gpu: 1" not in line]
    joined = "".join(out)
    toleration = (
        "      tolerations:\n"
        "        - key: nvidia.com/gpu\n"
        "          operator: Exists\n"
        "          effect: NoSchedule\n"
    )
    return joined.replace(toleration, "")
