#!/usr/bin/env bash
# Run HERE (a machine with internet) before `make test-gpu` on the lent GPU machine, which can
# reach no package index: downloads into .whl/ (git-ignored through .git/info/exclude) the
# wheels of requirements.txt's pins for that machine's Python 3.12 on x86-64 (minus torch,
# numpy, pillow, matplotlib and pyarrow, which its image has, and av, which the suite never
# imports: tests/gpu/run.sh keeps or skips those), the
# dependencies its image lacks, pytest, DeepSpeed's sdist (built there against its torch) and
# libaio's .deb files (for the async_io op; no apt there). Then carry it: run(carry=[".whl"]).
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${GPU_WHEELS:-.whl}
mkdir -p "$DEST"
EXCLUDE=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$EXCLUDE")"
grep -qx "/$DEST/" "$EXCLUDE" 2>/dev/null || echo "/$DEST/" >>"$EXCLUDE"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform any)
BIN=(--only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}")
# Dependencies of those pins that the device image lacks (KINDS.md's package list).
# pydantic-settings comes with its dependencies, so pydantic-core is the one pydantic pins.
# boto3's, huggingface_hub's and transformers' that it lacks or has too old, read off their
# Requires-Dist (2026-11).
EXTRA="hjson importlib-metadata botocore<1.45 jmespath<2 s3transfer<0.20 httpx2<3 httpcore2
  truststore anyio>=4.10 idna>=3.18 h11 lazy-importer click>=8.4.2 hf-xet>=1.6,<2
  python-dateutil<3 six tokenizers>=0.23.3"
pins=$(grep -E '^[A-Za-z]' requirements.txt | grep -viE '^(torch|numpy|pillow|matplotlib|pyarrow|av|deepspeed)==' | sed 's/ *#.*//')
pytest=$(grep -i '^pytest==' requirements-dev.txt | sed 's/ *#.*//')
pip=(python3 -m pip download -q --disable-pip-version-check --no-deps -d "$DEST")
# shellcheck disable=SC2086
"${pip[@]}" "${BIN[@]}" $pins $pytest $EXTRA
python3 -m pip download -q --disable-pip-version-check -d "$DEST" "${BIN[@]}" \
  "$(grep '^pydantic-settings==' requirements.txt)"
"${pip[@]}" --no-binary=:all: "$(grep '^deepspeed==' requirements.txt)"
(cd "$DEST" && apt-get download libaio1 libaio-dev 2>/dev/null || apt-get download libaio1t64 libaio-dev)
du -sh "$DEST"
