#!/usr/bin/env bash
# `make test-gpu`: set up from requirements.txt and run the GPU acceptance suite, writing
# $GPU_REPORT/gpu-report.{json,md}. Works on three kinds of machine:
# - one where `make setup` worked (.venv/.installed) and its torch sees CUDA: that venv;
# - the lent GPU machine (no internet, no apt, a CUDA torch in its python3): a venv in
#   .cache/gpu-venv on top of that python's packages (its CUDA torch is kept: PyPI's CPU/CUDA
#   torch wheels are GBs and the machine cannot fetch them), the rest of requirements.txt at
#   its pins from the wheels in $GPU_WHEELS (default .whl, made here by tests/gpu/wheels.sh and
#   carried), libaio from the .deb files there unpacked into .cache/gpu-sysroot (DeepSpeed's
#   async_io op compiles against it; nothing is unpacked into /);
# - a machine without CUDA: the same, and the report says every check was skipped and why.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
REPORT=${GPU_REPORT:-$REPO/bench/results/gpu/$(date +%Y-%m-%d)}
WHEELS=${GPU_WHEELS:-$REPO/.whl}
# Only the image's big, API-stable packages may stay at the machine's version; every other pin
# of requirements.txt is installed exactly (the report lists the versions that ran).
KEEP_MACHINE_VERSION="torch numpy pillow matplotlib pyarrow"
# Imported lazily and only by video clips, which the suite does not train: left out, so the
# carried wheels fit the device tool's 64 MiB.
NOT_FOR_THE_SUITE="av"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$REPO/.cache/torch_extensions}
export DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1

cuda_python() {  # a python whose torch is a CUDA build
  "$1" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null
}

# `make setup`'s venv when its torch has CUDA, or when no python here has a CUDA torch (a CPU
# machine: the suite then only reports why it skipped).
if [ -f .venv/.installed ] && { cuda_python .venv/bin/python || ! cuda_python python3; }; then
  PY=.venv/bin/python
else
  VENV=$REPO/.cache/gpu-venv
  if [ ! -f "$VENV/.installed" ]; then
    base=python3
    cuda_python "$base" || base=$(command -v python3.12 || command -v python3.11 || echo python3)
    echo "test-gpu: a venv on $($base -c 'import sys; print(sys.executable)') (system packages kept)" >&2
    "$base" -m venv --system-site-packages "$VENV"
    # When $base is itself a venv's python (the lent machine's /opt/torch/.venv), the new venv's
    # "system" packages are the base interpreter's, without that venv's torch: a .pth puts
    # $base's own site-packages on the path, after the new venv's (the pins below win).
    "$base" -c 'import site; print("\n".join(site.getsitepackages()))' \
      >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/zz-machine.pth"
    reqs=$(mktemp)
    for name in $KEEP_MACHINE_VERSION; do
      "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('$name'.replace('pillow', 'PIL')) else 1)" \
        && echo "^$name==" || true
    done >"$reqs.keep"
    for name in $NOT_FOR_THE_SUITE; do echo "^$name=="; done >>"$reqs.keep"
    grep -v -i -f "$reqs.keep" requirements.txt | grep -v '^#' >"$reqs" || true
    echo "pytest$(grep -i '^pytest==' requirements-dev.txt | sed 's/^pytest//')" >>"$reqs"
    pip_from=()
    if [ -d "$WHEELS" ]; then pip_from=(--no-index --find-links "$WHEELS"); fi
    # --no-build-isolation: DeepSpeed is an sdist whose setup.py imports the machine's torch.
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-build-isolation "${pip_from[@]}" -r "$reqs" || {
      echo "test-gpu: installing requirements.txt failed; without internet, run tests/gpu/wheels.sh on a machine with it and bring $WHEELS along" >&2
      exit 2
    }
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
    rm -f "$reqs" "$reqs.keep"
    touch "$VENV/.installed"
  fi
  PY=$VENV/bin/python
fi

# libaio for DeepSpeed's async_io op: the system's, else the carried .deb files (no apt here).
if ! ldconfig -p 2>/dev/null | grep -q 'libaio\.so\b' && compgen -G "$WHEELS/libaio*.deb" >/dev/null; then
  ROOT=$REPO/.cache/gpu-sysroot
  for deb in "$WHEELS"/libaio*.deb; do dpkg-deb -x "$deb" "$ROOT" 2>/dev/null || (cd "$ROOT" && ar p "$deb" data.tar.xz | tar -xJ); done
  lib=$ROOT/usr/lib/x86_64-linux-gnu
  [ -e "$lib/libaio.so" ] || ln -sf "$(ls "$lib"/libaio.so.1* | head -1)" "$lib/libaio.so"
  export CFLAGS="-I$ROOT/usr/include ${CFLAGS:-}" LDFLAGS="-L$lib ${LDFLAGS:-}"
  export CPATH="$ROOT/usr/include${CPATH:+:$CPATH}" LIBRARY_PATH="$lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

export PATH="$(dirname "$PY"):$PATH"  # ./entrypoint finds this venv's zerotuner
echo "test-gpu: $PY, report in $REPORT" >&2
set +e
"$PY" -m pytest -q -p no:cacheprovider tests/gpu -m gpu --gpu-report "$REPORT" "$@"
code=$?
set -e
exit $code
