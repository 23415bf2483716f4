"""The image and deployment files: linted, schema-checked and cross-checked against the code.

No Docker engine or cluster exists here, so each file is checked the way its consumer would
read it: hadolint for the Dockerfile, the compose spec for compose.yaml, the Kubernetes
OpenAPI schemas (strict: a misspelt field fails) for core kinds, structure for CRDs. Every
check has a negative control, so a linter that silently accepts everything fails the test.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import yaml

from zerotuner.settings.schema import Settings, env_name, load_settings

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
K8S_DIR = REPO / "config" / "kubernetes"
K8S_VERSION = "1.37.0"
K8S_OLDEST = "1.29.0"  # docs/deploy.md's minimum (podFailurePolicy on by default, schema-stable)
CRD_KINDS = {("kubeflow.org/v1", "PyTorchJob"), ("monitoring.coreos.com/v1", "PodMonitor")}
SETTING_NAMES = {env_name(n) for n in Settings.model_fields}
METRICS_PORT = Settings.model_fields["metrics_port"].default
# apt-packages.txt entries the image deliberately leaves out, and why.
DEV_ONLY_APT = {
    "prometheus": "promtool validates metrics in tests; Prometheus runs beside",
    "chromium": "the browser tests of the builder and run pages; users bring their browser",
}


def run(*cmd: str | Path, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=120, **kwargs
    )


def k8s_docs() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        docs += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def of_kind(kind: str) -> list[dict]:
    return [d for _, d in k8s_docs() if d["kind"] == kind]


def pod_templates() -> list[dict]:
    """Every pod template shipped: Jobs' and the PyTorchJob's replicas'."""
    templates = [j["spec"]["template"] for j in of_kind("Job")]
    for job in of_kind("PyTorchJob"):
        templates += [r["template"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
    return templates


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in (REPO / "Dockerfile").read_text().splitlines():
        if raw.lstrip().startswith("#"):
            continue
        current += raw.rstrip("\\").rstrip() + " " if raw.endswith("\\") else raw
        if not raw.endswith("\\"):
            if current.strip():
                lines.append(current.strip())
            current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def shell_command(run_args: str) -> str:
    """A RUN's shell command: its leading --mount flags (BuildKit's, not the shell's) dropped."""
    return re.sub(r"^(?:--mount=\S+\s+)+", "", run_args)


def dockerfile_default_arg(name: str) -> str:
    """A global ARG's default with the ARGs before it expanded (${NAME} only)."""
    values: dict[str, str] = {}
    for instr, args in dockerfile_instructions():
        if instr == "FROM":
            break
        if instr == "ARG" and "=" in args:
            key, value = args.split("=", 1)
            values[key] = re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], value)
    return values[name]


# --- Dockerfile ------------------------------------------------------------------------------


def test_hadolint_passes_and_catches_unpinned_apt(tmp_path: Path) -> None:
    result = run(BIN / "hadolint", REPO / "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr
    # Negative control: without its justified ignores the same file fails (DL3008).
    stripped = tmp_path / "Dockerfile"
    stripped.write_text(
        "\n".join(
            line
            for line in (REPO / "Dockerfile").read_text().splitlines()
            if "hadolint ignore" not in line
        )
    )
    result = run(BIN / "hadolint", stripped)
    assert result.returncode != 0 and "DL3008" in result.stdout


def makefile_requirement_files() -> set[str]:
    make = (REPO / "Makefile").read_text()
    files = set()
    for line in make.splitlines():
        if "pip install" in line:
            files.update(re.findall(r"-r\s+(\S+)", line))
    return files


def test_image_installs_from_the_makefiles_requirement_files() -> None:
    """One source of truth: the image installs the Makefile's runtime requirement files
    (everything but dev tools), pins nothing of its own, and the package with --no-deps."""
    make_files = makefile_requirement_files()
    assert "requirements.txt" in make_files
    runtime_files = {f for f in make_files if "dev" not in f}

    runs = [args for instr, args in dockerfile_instructions() if instr == "RUN"]
    copies = [args for instr, args in dockerfile_instructions() if instr == "COPY"]
    pip_runs = [r for r in runs if "pip install" in r]
    docker_files = {f for r in pip_runs for f in re.findall(r"-r\s+(\S+)", r)}
    docker_files.discard("/tmp/build-requirements.txt")  # a grep of requirements.txt, below
    assert docker_files == runtime_files
    for name in runtime_files:
        assert any(name in c.split() for c in copies), f"{name} is not copied into the build"
    assert not any("requirements-dev" in r for r in runs + copies)

    # Packages installed before the bulk install come from requirements.txt by grep, so
    # their versions cannot drift; a version pinned in the Dockerfile must not shadow one.
    pins = dict(
        line.split("==", 1)
        for line in (REPO / "requirements.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    grep = next(r for r in runs if "build-requirements.txt" in r)
    grepped = re.search(r"\^\(([^)]*)\)==", grep).group(1).split("|")
    assert set(grepped) <= set(pins) and "torch" in grepped
    for run_args in pip_runs:
        for name, version in re.findall(r"\b([A-Za-z0-9_.-]+)==([0-9][\w.]*)", run_args):
            assert name not in pins, f"{name}=={version} pinned in the Dockerfile too"

    # The package itself: no dependency resolution, so nothing beyond requirements.txt.
    assert any(re.search(r"pip install --no-deps\b.* \.$", r) for r in pip_runs)


def test_image_covers_the_shared_apt_list() -> None:
    lines = (REPO / "apt-packages.txt").read_text().splitlines()
    apt = [p for line in lines if not line.startswith("#") for p in line.split()]  # as make
    installs = " ".join(a for i, a in dockerfile_instructions() if "apt-get install" in a)
    packages = set(installs.split())
    for package in apt:
        assert package in packages or package in DEV_ONLY_APT, (
            f"apt-packages.txt has {package}: install it in the image or list it in "
            "DEV_ONLY_APT with the reason"
        )


def test_dockerfile_prebuilds_the_deepspeed_ops_and_runs_as_uid_1000() -> None:
    text = " ".join(f"{i} {a}" for i, a in dockerfile_instructions())
    for flag in ("DS_BUILD_CPU_ADAM=1", "DS_BUILD_AIO=1", "DS_BUILD_FUSED_ADAM=1"):
        assert flag in text
    assert "DS_ACCELERATOR=cuda" in text  # no GPU during the build: never guess
    froms = [a for i, a in dockerfile_instructions() if i == "FROM"]
    # The bases are build arguments (a CPU stand-in replaces them in `make test-image`); by
    # default the build stage is CUDA's devel image (nvcc) and the runtime its runtime image.
    assert froms[0] == "${BUILD_BASE} AS build" and froms[1].startswith("${RUNTIME_BASE} AS ")
    assert dockerfile_default_arg("BUILD_BASE") == "nvidia/cuda:13.0.1-devel-ubuntu24.04"
    assert dockerfile_default_arg("RUNTIME_BASE") == "nvidia/cuda:13.0.1-runtime-ubuntu24.04"
    assert dockerfile_default_arg("ACCELERATOR") == "cuda"
    stages = re.findall(r"FROM \S+ AS (\S+)", text)
    assert stages[-1] == "runtime", "the default (last) stage must be the non-root image"
    last_stage = text.rsplit("FROM ", 1)[1]
    assert "USER 1000" in last_stage
    assert 'ENTRYPOINT ["tini", "--", "/app/entrypoint"]' in last_stage
    assert f"EXPOSE {METRICS_PORT}" in text
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in text


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("status,healthy", [(200, True), (503, False)])
def test_healthcheck_follows_healthz(status: int, healthy: bool) -> None:
    """The HEALTHCHECK command itself, run against a server answering like /healthz."""
    check = next(a for i, a in dockerfile_instructions() if i == "HEALTHCHECK")
    command = json.loads(check.split(" CMD ", 1)[1])
    assert command[:2] == ["python", "-c"]
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {**os.environ, "ZT_METRICS_PORT": str(server.server_address[1])}
        result = run(sys.executable, "-c", command[2], env=env)
    finally:
        server.shutdown()
    assert (result.returncode == 0) is healthy, result.stderr


def test_healthcheck_is_healthy_when_metrics_are_disabled_and_not_when_nothing_listens() -> None:
    check = next(a for i, a in dockerfile_instructions() if i == "HEALTHCHECK")
    code = json.loads(check.split(" CMD ", 1)[1])[2]
    assert (
        run(sys.executable, "-c", code, env={**os.environ, "ZT_METRICS_PORT": "0"}).returncode == 0
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    env = {**os.environ, "ZT_METRICS_PORT": str(free_port)}
    assert run(sys.executable, "-c", code, env=env).returncode != 0


def dockerignored(path: str, rules: list[str]) -> bool:
    """Docker's .dockerignore semantics: the last matching rule wins; a rule matching a
    parent folder matches everything below it; `**/` matches any depth (including none)."""
    ignored = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for rule in rules:
        negate = rule.startswith("!")
        pattern = rule.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, p) for p in prefixes):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_outputs_venvs_and_caches_out() -> None:
    rules = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for path in [
        ".venv/bin/python",
        ".git/HEAD",
        ".cache/torch_extensions/cpu_adam/x.so",
        "demo/model/model_index.json",
        "output/checkpoints/step-10/x.pt",
        "tests/test_deploy.py",
        "bench/results/a.json",
        "src/zerotuner/__pycache__/cli.cpython-311.pyc",
        ".pytest_cache/v",
        "config/example.env",
    ]:
        assert dockerignored(path, rules), f"{path} would enter the build context"
    copied = []
    for instr, args in dockerfile_instructions():
        if instr == "COPY" and "--from" not in args:
            copied += [a for a in args.split()[:-1] if not a.startswith("--")]
    assert "src" in copied and "requirements.txt" in copied
    for source in copied + ["src/zerotuner/cli.py"]:
        assert not dockerignored(source, rules), f"the Dockerfile copies {source}"


def test_the_build_context_builds_the_package(tmp_path: Path) -> None:
    """What .dockerignore lets through is enough for the Dockerfile's `pip install .`, and the
    grep that feeds the first pip install picks torch and ninja from requirements.txt."""
    rules = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    context = tmp_path / "context"
    for name in run("git", "ls-files", cwd=REPO).stdout.splitlines():
        if not dockerignored(name, rules) and (REPO / name).is_file():
            (context / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, context / name)
    assert not (context / "tests").exists()

    grep = next(a for i, a in dockerfile_instructions() if i == "RUN" and "build-requirements" in a)
    command = shell_command(grep).split("&&")[0]
    command = command.replace("/tmp/build-requirements.txt", str(tmp_path / "b.txt"))
    assert run("bash", "-c", command, cwd=context).returncode == 0
    picked = (tmp_path / "b.txt").read_text().split()
    assert sorted(p.split("==")[0] for p in picked) == ["ninja", "torch"]

    result = run(
        sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
        "-w", tmp_path / "wheel", context,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "wheel").glob("zerotuner-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert "zerotuner/cli.py" in names and "zerotuner/settings/schema.py" in names
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert "zerotuner = zerotuner.cli:main" in archive.read(entry_points).decode()


# --- line endings and executables -----------------------------------------------------------

SCRIPTS = [
    "entrypoint",
    ".ci/run",
    *sorted(str(p.relative_to(REPO)) for p in REPO.glob("config/cloud/**/*.sh")),
]


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_keep_lf_endings_and_are_executable(script: str) -> None:
    path = REPO / script
    attrs = run("git", "check-attr", "eol", "--", script, cwd=REPO).stdout
    assert attrs.strip().endswith("eol: lf"), attrs
    assert b"\r" not in path.read_bytes()
    assert os.access(path, os.X_OK)
    staged = run("git", "ls-files", "-s", "--", script, cwd=REPO).stdout
    if staged:  # committed files: the executable bit must be in git, not only on this disk
        assert staged.startswith("100755"), staged
    assert run("sh", "-n", path).returncode == 0


def test_gitattributes_would_convert_a_crlf_entrypoint(tmp_path: Path) -> None:
    """A CRLF copy of the entrypoint is normalised to LF by git with our .gitattributes."""
    repo = tmp_path / "r"
    repo.mkdir()
    run("git", "init", "-q", cwd=repo)
    (repo / ".gitattributes").write_bytes((REPO / ".gitattributes").read_bytes())
    (repo / "entrypoint").write_bytes((REPO / "entrypoint").read_bytes().replace(b"\n", b"\r\n"))
    run("git", "add", ".", cwd=repo)
    blob = run("git", "show", ":entrypoint", cwd=repo).stdout
    assert blob and "\r" not in blob


# --- compose --------------------------------------------------------------------------------


def test_compose_validates_against_the_compose_spec(tmp_path: Path) -> None:
    check = [BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec"]
    result = run(*check, REPO / "compose.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    broken = tmp_path / "compose.yaml"
    broken.write_text((REPO / "compose.yaml").read_text().replace("shm_size:", "shm_sise:"))
    assert run(*check, broken).returncode != 0


def test_compose_runs_the_appliance_as_documented() -> None:
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    app = compose["services"]["zerotuner"]
    (gpus,) = app["deploy"]["resources"]["reservations"]["devices"]
    assert gpus == {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
    assert app.get("shm_size") or app.get("ipc") == "host"
    assert app["ulimits"]["memlock"] == -1
    assert f"{METRICS_PORT}:{METRICS_PORT}" in app["ports"]
    (env_file,) = app["env_file"]
    assert (REPO / env_file["path"]).is_file()
    targets = {re.search(r":(/[^:]+)(:ro)?$", v).group(1): v for v in app["volumes"]}
    assert set(targets) == {"/data", "/output", "/offload", "/cache", "/config"}
    assert targets["/data"].endswith(":ro")

    monitoring = {
        name: svc
        for name, svc in compose["services"].items()
        if "monitoring" in svc.get("profiles", [])
    }
    assert set(monitoring) == {"prometheus", "grafana"}
    mounts = [v.rsplit(":ro", 1)[0] for svc in monitoring.values() for v in svc["volumes"]]
    assert "./config/monitoring/prometheus.yml:/etc/prometheus/prometheus.yml" in mounts
    assert "./config/monitoring/grafana/provisioning:/etc/grafana/provisioning" in mounts
    assert "./config/monitoring/grafana/dashboards:/var/lib/grafana/dashboards" in mounts


def test_monitoring_profile_wires_prometheus_and_grafana_to_the_compose_services() -> None:
    """The other ends of the mounts: Prometheus scrapes the compose service, Grafana reads the
    compose Prometheus, and the alert rules land where `rule_files` looks."""
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    monitoring = REPO / "config" / "monitoring"
    if not (monitoring / "prometheus.yml").is_file():
        pytest.skip("config/monitoring is not there yet")
    prometheus = yaml.safe_load((monitoring / "prometheus.yml").read_text())
    targets = [
        t
        for job in prometheus["scrape_configs"]
        for c in job["static_configs"]
        for t in c["targets"]
    ]
    assert f"zerotuner:{METRICS_PORT}" in targets and "zerotuner" in compose["services"]
    container_dir = "/etc/prometheus"
    mounts = dict(
        v.removesuffix(":ro").split(":", 1) for v in compose["services"]["prometheus"]["volumes"]
    )
    for pattern in prometheus.get("rule_files", []):
        folder = f"{container_dir}/{Path(pattern).parent}"
        assert folder in mounts.values(), f"rule_files {pattern}: {folder} is not mounted"
        host = REPO / next(h for h, c in mounts.items() if c == folder)
        assert list(host.glob(Path(pattern).name)), f"no rules match {pattern}"
    sources = yaml.safe_load(
        (monitoring / "grafana/provisioning/datasources/prometheus.yaml").read_text()
    )
    (source,) = sources["datasources"]
    assert source["url"] == "http://prometheus:9090"
    assert "9090:9090" in compose["services"]["prometheus"]["ports"]


# --- settings used by the shipped files -----------------------------------------------------


def shipped_env_names() -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    files = [REPO / "compose.yaml", *K8S_DIR.glob("*.yaml"), *REPO.glob("config/cloud/**/*")]
    for path in files:
        if path.is_file():
            code = [ln for ln in path.read_text().splitlines() if not ln.strip().startswith("#")]
            found = set(re.findall(r"\bZT_[A-Z0-9_]+", "\n".join(code)))
            if found:
                names[str(path.relative_to(REPO))] = found
    return names


def test_shipped_files_use_only_real_settings() -> None:
    names = shipped_env_names()
    assert names, "expected ZT_* settings in the deployment files"
    for path, found in names.items():
        assert found <= SETTING_NAMES, f"{path}: unknown {sorted(found - SETTING_NAMES)}"


def test_shipped_config_files_and_env_values_load(tmp_path: Path, monkeypatch) -> None:
    for config_map in of_kind("ConfigMap"):
        for key, text in config_map["data"].items():
            path = tmp_path / key
            path.write_text(text)
            monkeypatch.setenv("ZT_CONFIG_FILE", str(path))
            load_settings()
    monkeypatch.delenv("ZT_CONFIG_FILE")
    template = json.loads((REPO / "config/cloud/runpod/template.json").read_text())
    for key, value in template["env"].items():
        if key.startswith("ZT_"):
            monkeypatch.setenv(key, value)
    settings = load_settings()
    for field in ("data_dir", "output_dir", "offload_dir", "cache_dir"):
        assert str(getattr(settings, field)).startswith(template["volumeMountPath"] + "/")


# --- the CUDA build argument: torch wheel, runtime requirement, driver floor --------------------
