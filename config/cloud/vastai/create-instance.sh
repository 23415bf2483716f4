#!/bin/sh
# Rent a vast.ai GPU and train in "entrypoint" launch mode: vast runs the image as built
# (tini -> /app/entrypoint), with the arguments after --args as its command.
#   vastai search offers 'gpu_name=RTX_4090 num_gpus=1 disk_space>=200 inet_down>=500'
#   IMAGE=ghcr.io/YOUR_ORG/zerotuner:latest sh config/cloud/vastai/create-instance.sh OFFER_ID
# /output, /offload and /cache live on the instance disk (--disk, GB): they survive stopping
# the instance, not destroying it. Copy results out with `vastai copy` before destroying.
# The metrics port is mapped to a random public port: `vastai show instance ID` lists it.
# (SSH/Jupyter launch modes replace the entrypoint: use onstart.sh there instead.)
set -eu
offer=${1:?usage: create-instance.sh OFFER_ID (from vastai search offers)}
exec vastai create instance "$offer" \
    --image "${IMAGE:-ghcr.io/YOUR_ORG/zerotuner:latest}" \
    --disk "${DISK_GB:-200}" \
    --label zerotuner \
    --env "-p 9464:9464 -e ZT_MODEL=${ZT_MODEL:-stabilityai/stable-diffusion-xl-base-1.0} -e ZT_DATA_DIR=/data -e ZT_OUTPUT_DIR=/output -e ZT_OFFLOAD_DIR=/offload -e ZT_CACHE_DIR=/cache" \
    --args train
