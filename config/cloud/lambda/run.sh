#!/bin/sh
# zerotuner on a Lambda Cloud instance (or any GPU host with Docker and the NVIDIA Container
# Toolkit): plain `docker run`. Lambda's persistent filesystem is mounted on the host (e.g.
# /lambda/nfs/<name>); point ROOT at it so checkpoints outlive the instance.
#   ROOT=/lambda/nfs/my-fs IMAGE=ghcr.io/YOUR_ORG/zerotuner:latest sh config/cloud/lambda/run.sh
# Put images + captions in $ROOT/data first. Offload goes to the instance's local NVMe
# (OFFLOAD, default /tmp/zerotuner-offload), not the network filesystem.
# NVIDIA driver: Lambda Stack ships its own, and its version moves with Lambda's releases, so it
# is read here before anything is pulled. The default image (CUDA 13.0) needs >= 580; the CUDA 12
# build (docker build --build-arg CUDA_VERSION=12.8.1) needs >= 525.60.13: MIN_DRIVER=525.60.13.
set -eu
root=${ROOT:?set ROOT to a persistent folder (e.g. /lambda/nfs/<filesystem>)}
image=${IMAGE:-zerotuner:latest}
need=${MIN_DRIVER:-580}
have=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1) || have=""
if [ -n "$have" ] && [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -n 1)" != "$need" ]; then
    echo "NVIDIA driver $have is older than $need, which $image needs: use an instance with a" \
        "newer driver, or the CUDA 12 build with MIN_DRIVER=525.60.13" >&2
    exit 3
fi
offload=${OFFLOAD:-/tmp/zerotuner-offload}
if [ "$#" -eq 0 ]; then set -- train; fi
mkdir -p "$root/data" "$root/output" "$root/cache" "$offload"
exec docker run --rm --name zerotuner \
    --gpus all --shm-size 16g --ulimit memlock=-1 --stop-timeout 900 \
    --user "$(id -u):0" \
    -p 9464:9464 \
    --env-file "${ENV_FILE:-config/example.env}" \
    -v "$root/data:/data:ro" -v "$root/output:/output" -v "$root/cache:/cache" \
    -v "$offload:/offload" \
    "$image" "$@"
