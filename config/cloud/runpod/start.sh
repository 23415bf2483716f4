#!/bin/sh
# RunPod entrypoint (image target `runpod`, started by tini). RunPod mounts the pod volume at
# /workspace owned by root and cannot run a container as another user: start as root, create
# the folders the ZT_* settings point at, give them to uid 1000, and run zerotuner as uid 1000.
#
# RunPod restarts a container that exits, which would start training again (and again).
# ZEROTUNER_KEEP_ALIVE=1 (the template sets it) keeps the pod up after zerotuner exits, so the
# exit code and logs stay visible and /workspace/output can be downloaded; stop the pod then.
set -u
entrypoint=${ZEROTUNER_ENTRYPOINT:-/app/entrypoint}
if [ "$(id -u)" -eq 0 ]; then
    for dir in "${ZT_OUTPUT_DIR:-/output}" "${ZT_OFFLOAD_DIR:-/offload}" "${ZT_CACHE_DIR:-/cache}" \
        "${HF_HOME:-/cache/huggingface}" "${TORCH_EXTENSIONS_DIR:-/cache/torch_extensions}"; do
        mkdir -p "$dir" && chown 1000:0 "$dir" || exit 3
    done
    export HOME=/home/zerotuner
    # The image's user 1000 has no supplementary groups: clearing them needs no passwd lookup.
    set -- setpriv --reuid=1000 --regid=0 --clear-groups "$entrypoint" "$@"
else
    set -- "$entrypoint" "$@"
fi

if [ "${ZEROTUNER_KEEP_ALIVE:-0}" != 1 ]; then
    exec "$@"
fi

# Run zerotuner as a child and forward SIGTERM/SIGINT to it, so it still checkpoints and
# exits 143 when the pod is stopped.
stopping=0
trap 'stopping=1; kill -TERM "$child" 2>/dev/null' TERM INT
"$@" &
child=$!
status=0
while kill -0 "$child" 2>/dev/null; do
    wait "$child"
    status=$?
done
sleeper=""
trap 'kill $sleeper 2>/dev/null; exit "$status"' TERM INT
if [ "$stopping" = 1 ]; then
    exit "$status"
fi
echo "zerotuner exited with status $status; the pod stays up (ZEROTUNER_KEEP_ALIVE=1):" \
    "download /workspace/output, then stop the pod" >&2
sleep infinity &
sleeper=$!
wait "$sleeper"
exit "$status"
