# syntax=docker/dockerfile:1
# zerotuner: DeepSpeed fine-tuning appliance for diffusion models (SD 1.x/2.x, SDXL, SD3, Flux.1).
#   docker build -t zerotuner:latest .        (or `make image`)
#   docker run --gpus all --shm-size 16g --ulimit memlock=-1 -p 9464:9464 \
#     -v "$PWD/data:/data:ro" -v "$PWD/output:/output" zerotuner:latest
#
# Why these bases: torch==2.13.0 (requirements.txt) is built against CUDA 13.0 by default (its
# wheel requires cuda-toolkit 13.0.x), and torch.utils.cpp_extension refuses to compile
# DeepSpeed's CUDA ops with an nvcc of another major version. Ubuntu 24.04 ships Python 3.12,
# so no third-party PPA is needed.
#
# NVIDIA driver floor: CUDA 13.x needs a driver >= 580. For hosts on an older driver (R525 to
# R575, CUDA 12.x) build the CUDA 12 image; the torch wheel then comes from PyTorch's cu128 index:
#   docker build --build-arg CUDA_VERSION=12.8.1 -t zerotuner:cuda12 .
# CUDA_VERSION names the nvidia/cuda tag (12.8 or newer: older nvcc lacks the Blackwell targets
# below); the build fails if PyTorch publishes no wheel for its CUDA. docs/deploy.md "One GPU host".
#
# For byte-for-byte reproducible builds pin the digests, e.g.
#   docker buildx imagetools inspect nvidia/cuda:13.0.1-devel-ubuntu24.04
# and append @sha256:... to BUILD_BASE and RUNTIME_BASE (digests are not invented here: verify them).
#
# Offline or air-gapped builds (docs/deploy.md "Building the image offline"): wheels downloaded
# into wheelhouse/ beside this file are bind-mounted, never copied into a layer, and installed
# with --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=/wheelhouse. A CPU stand-in for
# the two CUDA bases (ACCELERATOR=cpu, BUILD_BASE/RUNTIME_BASE a local Debian image,
# PYTHON_VERSION its Python) builds everything else in this file without nvcc or a driver:
# `make test-image` builds and runs it (tests/image/run.sh).
ARG CUDA_VERSION=13.0.1
ARG UBUNTU_VERSION=ubuntu24.04
ARG BUILD_BASE=nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU_VERSION}
ARG RUNTIME_BASE=nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU_VERSION}
ARG PYTHON_VERSION=3.12
# cuda: DeepSpeed's CUDA ops prebuilt with nvcc, the driver floor set for NVIDIA's runtime.
# cpu: the stand-in; neither (no nvcc, no driver), DeepSpeed's CPU ops built for the CPU instead.
ARG ACCELERATOR=cuda

# ---------------------------------------------------------------------------------------------
# Build stage: a CUDA *devel* image (has nvcc) compiles DeepSpeed's ops ahead of time, because
# the runtime image has no nvcc and a JIT build there would fail at the first optimizer step.
FROM ${BUILD_BASE} AS build

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG DEBIAN_FRONTEND=noninteractive
ARG PYTHON_VERSION
ARG ACCELERATOR

# Ubuntu's package versions move with security updates and old ones leave the archive, so
# pinning them would break the build within weeks; the base tag pins the release instead.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-dev" "python${PYTHON_VERSION}-venv" \
        build-essential libaio-dev \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN "python${PYTHON_VERSION}" -m venv "$VIRTUAL_ENV"

WORKDIR /src
# The same dependency file `make setup` installs: one source of truth for versions.
COPY requirements.txt ./

# DeepSpeed's setup.py imports torch to compile its ops, so torch (and ninja) go in first, at
# the versions requirements.txt pins; setuptools because the build runs without isolation.
# The torch wheel must be built for the base image's CUDA: PyTorch's index for it (cu130, cu128)
# is searched beside PyPI, where pip prefers its build (2.13.0+cu128 sorts above 2.13.0), and the
# check after it fails the build when they still differ. The later `pip install -r` keeps it:
# ==2.13.0 accepts 2.13.0+cu128. At run time zerotuner reads torch.version.cuda for the floor.
# The CPU stand-in's torch is a CPU build: no CUDA to compare.
# PIP_NO_INDEX / PIP_FIND_LINKS: unset by default; offline builds set them (top of this file).
ARG CUDA_VERSION
ARG TORCH_INDEX=https://download.pytorch.org/whl
ARG PIP_NO_INDEX
ARG PIP_FIND_LINKS
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    grep -E '^(torch|ninja)==' requirements.txt > /tmp/build-requirements.txt \
    && cuda="${CUDA_VERSION%.*}" \
    && pip install --extra-index-url "${TORCH_INDEX}/cu${cuda%.*}${cuda#*.}" \
        -r /tmp/build-requirements.txt setuptools==84.2.1 \
    && if [ "${ACCELERATOR:-cuda}" = cpu ]; then exit 0; fi \
    && python -c 'import sys, torch; built = torch.version.cuda; \
sys.exit(None if built == sys.argv[1] else f"torch {torch.__version__} is built for CUDA {built}, the base image has {sys.argv[1]}")' "$cuda"

# Ops compiled into the DeepSpeed install:
#   cpu_adam (DeepSpeedCPUAdam for optimizer offload), async_io (NVMe offload via libaio),
#   fused_adam (GPU Adam without offload).
# TORCH_CUDA_ARCH_LIST: no GPU is visible during `docker build`, so the targets are listed:
#   7.5 T4/RTX 20xx, 8.0 A100/A30, 8.6 A10/A40/RTX 30xx/A6000, 8.9 L4/L40S/RTX 40xx,
#   9.0 H100/H200, 10.0 B200/GB200, 12.0 RTX 50xx/RTX PRO 6000 Blackwell;
#   +PTX lets newer GPUs JIT-compile from PTX.
#   CUDA 13 dropped Volta (7.0) and older. Each entry adds compile time: trim with
#   --build-arg TORCH_CUDA_ARCH_LIST="8.9" for a single GPU model.
# DS_ACCELERATOR=cuda: without a visible GPU DeepSpeed would pick its CPU accelerator and build
# the wrong op set.
ARG TORCH_CUDA_ARCH_LIST="7.5;8.0;8.6;8.9;9.0;10.0;12.0+PTX"
# The CPU stand-in installs the same requirements without them (it has no nvcc).
ARG MAX_JOBS=4
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    if [ "${ACCELERATOR:-cuda}" = cpu ]; then \
        pip install --no-build-isolation -r requirements.txt || exit 1; \
        exit 0; \
    fi \
    && DS_ACCELERATOR=cuda DS_BUILD_OPS=0 DS_ENABLE_NINJA=1 \
    DS_BUILD_CPU_ADAM=1 DS_BUILD_AIO=1 DS_BUILD_FUSED_ADAM=1 \
    TORCH_CUDA_ARCH_LIST="$TORCH_CUDA_ARCH_LIST" MAX_JOBS="$MAX_JOBS" \
    pip install --no-build-isolation -r requirements.txt \
    # DeepSpeed skips a requested op it finds incompatible with only a warning: fail instead.
    && python -c "import importlib.util, pathlib; \
spec = importlib.util.find_spec('deepspeed'); \
info = {}; \
exec(pathlib.Path(spec.origin).with_name('git_version_info_installed.py').read_text(), info); \
missing = [op for op in ('cpu_adam', 'async_io', 'fused_adam') if not info['installed_ops'].get(op)]; \
assert info['accelerator_name'] == 'cuda' and not missing, (info['accelerator_name'], missing); \
print('prebuilt DeepSpeed ops:', sorted(op for op, on in info['installed_ops'].items() if on))"

# The CPU stand-in's ops instead (cpu_adam, async_io, shm comm, ...): DeepSpeed JIT-builds them
# for its CPU accelerator, as `make setup` does, into the folder the runtime stage copies to its
# TORCH_EXTENSIONS_DIR (same venv path, so they load without a rebuild). Before the package:
# a change to src/ does not rebuild them. The CUDA build skips this.
RUN --mount=type=bind,source=src/zerotuner/machine/ops.py,target=/tmp/ops.py \
    if [ "${ACCELERATOR:-cuda}" = cpu ]; then \
        DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=/cache/torch_extensions MAX_JOBS="$MAX_JOBS" \
            python /tmp/ops.py \
        && chmod -R g=u /cache; \
    fi

# The package itself, without dependencies: they came from requirements.txt above.
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-deps --no-build-isolation .

# ---------------------------------------------------------------------------------------------
# Runtime stage: the matching CUDA *runtime* image (libcudart, no nvcc) plus the venv.
FROM ${RUNTIME_BASE} AS runtime-common

# OCI labels; pass the build facts: --build-arg REVISION=$(git rev-parse HEAD) \
#   --build-arg CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ) --build-arg SOURCE=https://...
ARG RUNTIME_BASE
ARG PYTHON_VERSION
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
ARG SOURCE=unknown
LABEL org.opencontainers.image.title="zerotuner" \
      org.opencontainers.image.description="DeepSpeed ZeRO fine-tuning appliance for SDXL and SD 1.x/2.x, configured by ZT_* environment variables" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.base.name="${RUNTIME_BASE}"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG DEBIAN_FRONTEND=noninteractive

# libaio-dev brings libaio (libaio1t64 on Ubuntu 24.04, libaio1 on Debian 12): the prebuilt
# async_io op (NVMe offload). tini: PID 1 that forwards SIGTERM and reaps zombies. g++ /
# python3.X-dev / libaio-dev: Triton builds its launcher with the host compiler, and on
# ZT_DEVICE=cpu DeepSpeed JIT-compiles its CPU ops (a few hundred MB on a ~10 GB image).
# Versions unpinned for the reason given in the build stage.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-dev" libaio-dev g++ tini \
        ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# A non-root user with uid 1000 (Ubuntu 24.04 images ship `ubuntu` with that uid: replace it).
# Group 0 owns the writable paths too, so platforms that run an arbitrary uid in group 0
# (OpenShift) can write them.
RUN if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && useradd --uid 1000 --gid 0 --create-home --shell /bin/bash zerotuner \
    && mkdir -p /data /output /offload /config /cache/huggingface /cache/torch_extensions /app \
    && chown -R 1000:0 /output /offload /cache /app \
    && chmod -R g=u /output /offload /cache /app

COPY --from=build /opt/venv /opt/venv
COPY --chmod=0755 entrypoint /app/entrypoint

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/cache/huggingface \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions \
    TRITON_CACHE_DIR=/cache/triton \
    MPLCONFIGDIR=/cache/matplotlib \
    CUDA_CACHE_PATH=/cache/nv/ComputeCache \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# The driver floor exists on a CUDA base only (the CPU stand-in has no NVIDIA_REQUIRE_CUDA to
# rewrite, and the ${VAR%%...} forms need Dockerfile frontend 1.7, which an offline engine's
# built-in frontend may predate); BuildKit skips the stage ACCELERATOR does not pick.
FROM runtime-common AS runtime-cuda
ARG CUDA_VERSION
# NVIDIA's container runtime refuses to start the container on a driver that fails
# NVIDIA_REQUIRE_CUDA (space-separated clauses are alternatives). The base image asks for its own
# minor (cuda>=12.8); the wheels run on any driver of their major (minor-version compatibility),
# so the first clause becomes the major's floor; the base's brand clauses after it (forward
# compatibility on data-centre GPUs) stay. zerotuner's probe applies the same floor.
ENV NVIDIA_REQUIRE_CUDA="cuda>=${CUDA_VERSION%%.*}.0 ${NVIDIA_REQUIRE_CUDA#* }"
# A CUDA 12 build drops the forward-compatibility libraries: every 12.x driver runs it anyway,
# and NVIDIA's runtime loads them whenever the driver is older than they are, which on a GPU
# without forward-compatibility support (GeForce) ends CUDA with error 804.
RUN case "$NVIDIA_REQUIRE_CUDA" in "cuda>=${CUDA_VERSION%%.*}.0 "*) ;; \
        *) echo "unexpected NVIDIA_REQUIRE_CUDA=$NVIDIA_REQUIRE_CUDA" >&2; exit 1 ;; esac \
    && if [ "${CUDA_VERSION%%.*}" -lt 13 ]; then rm -rf /usr/local/cuda-*/compat; fi

# The CPU stand-in: the CPU ops the build stage built, so no run JIT-compiles them (minutes).
FROM runtime-common AS runtime-cpu
COPY --from=build --chown=1000:0 /cache/torch_extensions /cache/torch_extensions

# ---------------------------------------------------------------------------------------------
# runtime-cuda or runtime-cpu above: a stage of this file, not an image to tag.
# hadolint ignore=DL3006
FROM runtime-${ACCELERATOR} AS runtime-base
WORKDIR /app

# /metrics, /healthz, /readyz (ZT_METRICS_PORT).
EXPOSE 9464

# /healthz turns 503 when no step finished for ZT_HANG_TIMEOUT_SECONDS. The start period covers
# model download and the first step. Python's urllib: no curl in the image.
HEALTHCHECK --interval=30s --timeout=10s --start-period=15m --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; port = os.environ.get('ZT_METRICS_PORT', '9464'); sys.exit(0) if port == '0' else urllib.request.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=8)"]

# ---------------------------------------------------------------------------------------------
# RunPod variant (`docker build --target runpod -t zerotuner:runpod .`): RunPod mounts its
# volume at /workspace owned by root and offers no way to choose the container user, so this
# variant starts as root, hands the ZT_* folders to uid 1000 and drops to it with setpriv.
FROM runtime-base AS runpod
COPY --chmod=0755 config/cloud/runpod/start.sh /app/runpod-start
ENTRYPOINT ["tini", "--", "/app/runpod-start"]
CMD ["train"]

# ---------------------------------------------------------------------------------------------
# The default image (last stage): runs as uid 1000 from the first instruction.
FROM runtime-base AS runtime
USER 1000
# tini as PID 1; the entrypoint execs the zerotuner CLI, which maps failures to exit 0/1/2/3/4/143.
ENTRYPOINT ["tini", "--", "/app/entrypoint"]
CMD ["train"]
