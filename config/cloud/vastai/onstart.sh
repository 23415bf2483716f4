#!/bin/sh
# vast.ai on-start script for the SSH / Jupyter launch modes, which replace the image's
# entrypoint with vast's own: start training in the background, logs next to the outputs.
# Paste into the template's "On-start script" field (or `vastai create instance ... --onstart
# config/cloud/vastai/onstart.sh --ssh`). Data: copy images + captions to /data first, e.g.
# `vastai copy ./data INSTANCE_ID:/data`, then `touch /data/.ready` in the SSH session.
set -eu
# The image's environment (PATH with /opt/venv/bin, HF_HOME, ...) is kept; be explicit anyway.
export PATH=/opt/venv/bin:$PATH
mkdir -p /output
(
    # Wait for the dataset so training does not start on an empty folder.
    while [ ! -e /data/.ready ]; do sleep 10; done
    exec /app/entrypoint train
) >>/output/zerotuner.log 2>&1 &
echo "zerotuner starts once /data/.ready exists; log: /output/zerotuner.log"
