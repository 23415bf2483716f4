"""The image's CUDA build: the torch wheel index follows the base image's CUDA, the runtime's
driver requirement is the floor zerotuner's probe applies, and docs/deploy.md documents both
builds (README names the floor and the CUDA 12 build too)."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
from test_deploy import REPO, dockerfile_instructions, run, shell_command

FAKE_TORCH = '__version__ = "2.13.0+cu{tag}"\nversion = type("version", (), {{"cuda": "{cuda}"}})\n'


def dockerfile_arg(name: str) -> str:
    return next(
        a.split("=", 1)[1] for i, a in dockerfile_instructions() if i == "ARG" and "=" in a
        and a.split("=", 1)[0] == name
    )  # fmt: skip


@pytest.mark.parametrize(
    ("cuda_version", "wheel_cuda", "index"),
    [("13.0.1", "13.0", "cu130"), ("12.8.1", "12.8", "cu128"), ("12.8.1", "13.0", "cu128")],
)
def test_the_torch_wheel_follows_the_base_images_cuda(tmp_path, cuda_version, wheel_cuda, index):
    """The Dockerfile's torch install, run with pip and torch stood in: the index comes from
    CUDA_VERSION, and a wheel built for another CUDA fails the build with one line."""
    command = shell_command(
        next(a for i, a in dockerfile_instructions() if i == "RUN" and "build-requirements" in a)
    )
    bin_dir, site = tmp_path / "bin", tmp_path / "site" / "torch"
    bin_dir.mkdir()
    site.mkdir(parents=True)
    (bin_dir / "pip").write_text('#!/bin/sh\necho "$@" > "$PIP_ARGS"\n')
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    tag = wheel_cuda.replace(".", "")
    (site / "__init__.py").write_text(FAKE_TORCH.format(tag=tag, cuda=wheel_cuda))
    shutil.copy(REPO / "requirements.txt", tmp_path)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(site.parent),
        "PIP_ARGS": str(tmp_path / "pip-args"), "CUDA_VERSION": cuda_version,
        "TORCH_INDEX": dockerfile_arg("TORCH_INDEX"),
    }  # fmt: skip
    result = run("bash", "-o", "pipefail", "-c", command, cwd=tmp_path, env=env)
    pip_args = (tmp_path / "pip-args").read_text().split()
    assert f"https://download.pytorch.org/whl/{index}" in pip_args
    assert "/tmp/build-requirements.txt" in pip_args
    if index.endswith(tag):
        assert result.returncode == 0, result.stderr
    else:
        assert result.returncode != 0
        assert result.stderr.strip().splitlines()[-1] == (
            f"torch 2.13.0+cu{tag} is built for CUDA {wheel_cuda}, the base image has "
            f"{cuda_version.rsplit('.', 1)[0]}"
        )


BASE_REQUIRE = (  # the shape of nvidia/cuda:12.8.1's own NVIDIA_REQUIRE_CUDA, shortened
    "cuda>=12.8 brand=tesla,driver>=535,driver<536 brand=tesla,driver>=550,driver<551"
)


@pytest.mark.parametrize("cuda_version", ["12.8.1", "13.0.1"])
def test_the_runtime_requirement_is_the_majors_floor_the_probe_applies(cuda_version):
    """NVIDIA_REQUIRE_CUDA as the image sets it (POSIX expansion, which BuildKit's Dockerfile
    frontend 1.7+ implements): the first clause drops to the major, the brand clauses stay,
    and the RUN after it accepts the result. zerotuner's probe lets the same drivers through."""
    from zerotuner.machine.driver import Driver, driver_runs, min_driver

    value = next(
        a.split("=", 1)[1] for i, a in dockerfile_instructions()
        if i == "ENV" and a.startswith("NVIDIA_REQUIRE_CUDA=")
    )  # fmt: skip
    base = BASE_REQUIRE.replace("cuda>=12.8", f"cuda>={cuda_version[:4]}")
    env = {**os.environ, "CUDA_VERSION": cuda_version, "NVIDIA_REQUIRE_CUDA": base}
    expanded = run("bash", "-c", f"echo {value}", env=env).stdout.strip()
    major = int(cuda_version.split(".")[0])
    brands = BASE_REQUIRE.split(" ", 1)[1]
    assert expanded == f"cuda>={major}.0 {brands}"

    check = next(a for i, a in dockerfile_instructions() if i == "RUN" and "NVIDIA_REQUIRE" in a)
    case, compat = check.split(" && ", 1)
    env["NVIDIA_REQUIRE_CUDA"] = expanded
    assert run("bash", "-c", case, env=env).returncode == 0
    env["NVIDIA_REQUIRE_CUDA"] = base  # had the expansion not happened
    assert run("bash", "-c", case, env=env).returncode != 0 or cuda_version.startswith("13.0")
    assert compat.startswith('if [ "${CUDA_VERSION%%.*}" -lt 13 ]; then rm -rf ')

    # The runtime admits any driver of the major: so does zerotuner, from the floor table up.
    image = (major, int(cuda_version.split(".")[1]))
    floor = ".".join(str(p) for p in min_driver(image))
    assert driver_runs(Driver(floor, (major, 0), 1), image)


def test_the_default_image_and_its_cuda_12_build_are_documented_with_their_floor():
    from zerotuner.machine.driver import CUDA12_BUILD, MIN_DRIVER, dotted

    default = dockerfile_arg("CUDA_VERSION")
    assert default.split(".")[0] == "13"
    readme = (REPO / "README.md").read_text()
    deploy = (REPO / "docs/deploy.md").read_text()
    dockerfile = (REPO / "Dockerfile").read_text()
    for text in (readme, deploy, dockerfile):
        assert CUDA12_BUILD.split(" -t ")[0] in text
        assert f">= {dotted(MIN_DRIVER[13])}" in text
    one_host = deploy.split("## One GPU host", 1)[1].split("\n## ", 1)[0]
    cloud = deploy.split("## Cloud GPUs", 1)[1].split("\n## ", 1)[0]
    for section in (readme, one_host, cloud):
        assert f">= {dotted(MIN_DRIVER[13])}" in section
        assert dotted(MIN_DRIVER[12]) in section
