#!/bin/sh
# List vast.ai offers whose NVIDIA driver can run the image. cuda_vers is the newest CUDA the
# host's driver runs: the default image (CUDA 13.0) needs cuda_vers>=13.0 (driver >= 580); the
# CUDA 12 build (docker build --build-arg CUDA_VERSION=12.8.1) runs on any CUDA 12 driver
# (>= 525.60.13): IMAGE_CUDA=12.0. Extra filters (vast's query syntax) go in the argument:
#   sh config/cloud/vastai/search-offers.sh 'gpu_name=RTX_4090 num_gpus=1'
#   IMAGE_CUDA=12.0 sh config/cloud/vastai/search-offers.sh 'gpu_name=RTX_3090'
set -eu
filters=${1:-num_gpus=1}
exec vastai search offers \
    "cuda_vers>=${IMAGE_CUDA:-13.0} disk_space>=${DISK_GB:-200} inet_down>=500 $filters" \
    -o dph_total
