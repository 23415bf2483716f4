#!/bin/sh
# zerotuner on a Lambda Cloud instance (or any GPU host with Docker and the NVIDIA Container
# Toolkit): plain `docker run`. Lambda's persistent filesystem is mounted on the host (e.g.
# /lambda/nfs/<name>); point ROOT at it so checkpoints outlive the instance.
#   ROOT=/lambda/nfs/my-fs IMAGE=ghcr.io/YOUR_ORG/zerotuner:latest sh config/cloud/lambda/run.sh
# Put images + captions in $ROOT/data first. Offload goes to the instance's local NVMe
# (OFFLOAD, default /tmp/zerotuner-offload), not the network filesystem.
set -eu
root=${ROOT:?set ROOT to a persistent folder (e.g. /lambda/nfs/<filesystem>)}
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
    "${IMAGE:-zerotuner:latest}" "$@"
