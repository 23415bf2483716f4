#!/bin/sh
# Rent a vast.ai GPU and train in "entrypoint" launch mode: vast runs the image as built
# (tini -> /app/entrypoint), with the arguments after --args as its command.
#   sh config/cloud/vastai/search-offers.sh 'gpu_name=RTX_4090 num_gpus=1'   (driver >= 580)
#   IMAGE=ghcr.io/YOUR_ORG/zerotuner:latest sh config/cloud/vastai/create-instance.sh OFFER_ID
# /output, /offload and /cache live on the instance disk (--disk, GB): they survive stopping
# the instance, not destroying it. Set ZT_PUSH_TO (s3://... or hf://...) and its credentials in
# this shell and they are passed on: outputs then outlive the instance, and a new instance with
# the same settings resumes from there. Otherwise copy results out with `vastai copy`.
# The metrics port is mapped to a random public port: `vastai show instance ID` lists it.
# Training starts at once, so the dataset must already be in the image: for a few GB, build
#   printf 'FROM ghcr.io/YOUR_ORG/zerotuner:latest\nCOPY data/ /data/\n' | docker build -t X -f- .
# and pass IMAGE=X. For larger datasets use the SSH launch mode with onstart.sh (it waits for
# the upload).
set -eu
offer=${1:?usage: create-instance.sh OFFER_ID (from vastai search offers)}
# docker create options: the metrics port and the settings (add more -e ZT_...=... here).
options="-p 9464:9464"
options="$options -e ZT_MODEL=${ZT_MODEL:-stabilityai/stable-diffusion-xl-base-1.0}"
options="$options -e ZT_MAX_STEPS=${ZT_MAX_STEPS:-2000}"
options="$options -e ZT_DATA_DIR=/data -e ZT_OUTPUT_DIR=/output"
options="$options -e ZT_OFFLOAD_DIR=/offload -e ZT_CACHE_DIR=/cache"
for name in ZT_PUSH_TO AWS_ENDPOINT_URL AWS_DEFAULT_REGION AWS_ACCESS_KEY_ID \
    AWS_SECRET_ACCESS_KEY HF_TOKEN; do
    eval "value=\${$name:-}"
    if [ -n "$value" ]; then options="$options -e $name=$value"; fi
done
exec vastai create instance "$offer" \
    --image "${IMAGE:-ghcr.io/YOUR_ORG/zerotuner:latest}" \
    --disk "${DISK_GB:-200}" \
    --label zerotuner \
    --env "$options" \
    --args train
