# One set of commands for README, CI and the image. Every target sets itself up.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# DeepSpeed JIT-compiles cpu_adam / async_io on first use: keep them between runs.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
# The demo and tests run on DeepSpeed's CPU accelerator.
DEMO_DIR ?= $(CURDIR)/demo
APT_PACKAGES := $(shell grep -v '^\#' apt-packages.txt)

.PHONY: setup run run-lora test test-fast lint bench image clean docs

setup: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml apt-packages.txt
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages: $$missing"; \
	  SUDO=$$( [ $$(id -u) -eq 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt -r requirements-dev.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	@echo "building DeepSpeed's CPU ops once (minutes on 2 cores; cached in $(TORCH_EXTENSIONS_DIR))"
	DS_ACCELERATOR=cpu $(BIN)/python -m zerotuner.machine.ops
	touch $(STAMP)

DEMO_JOB = ZT_DEVICE=cpu ZT_MODEL=$(DEMO_DIR)/model ZT_DATA_DIR=$(DEMO_DIR)/data \
	ZT_CACHE_DIR=$(DEMO_DIR)/cache ZT_OFFLOAD_DIR=$(DEMO_DIR)/offload ZT_CONFIG_FILE=config/demo.yaml

run: setup
	$(BIN)/zerotuner demo $(DEMO_DIR)
	$(DEMO_JOB) ZT_OUTPUT_DIR=$(DEMO_DIR)/output ./entrypoint train

# A LoRA adapter teaches the UNet `make run` trained a new concept (config/demo-lora.yaml): it
# reuses demo/output/final when `make run` left one, and runs `make run` first otherwise.
run-lora: setup
	test -f $(DEMO_DIR)/output/final/model_index.json || $(MAKE) run
	$(BIN)/zerotuner demo $(DEMO_DIR) >/dev/null
	ZT_DEVICE=cpu ZT_MODEL=$(DEMO_DIR)/output/final ZT_DATA_DIR=$(DEMO_DIR)/data-lora \
	  ZT_CACHE_DIR=$(DEMO_DIR)/cache ZT_OFFLOAD_DIR=$(DEMO_DIR)/offload \
	  ZT_CONFIG_FILE=config/demo-lora.yaml ZT_OUTPUT_DIR=$(DEMO_DIR)/output-lora ./entrypoint train

test: setup
	$(BIN)/mypy
	# two workers, a test file each (its module fixtures stay in one process): a run's ranks
	# leave a core idle for a third of the time (rank 0 alone caches, samples, exports)
	$(BIN)/pytest -q -n 2 --dist loadfile --durations=30 tests  # the slowest 30: where the time goes

test-fast: setup
	$(BIN)/pytest -q -n 2 --dist loadfile -m "not slow" tests

lint: setup
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy

bench: setup
	$(BIN)/python -m bench

docs: setup
	$(BIN)/python -m zerotuner.docs --write

image:
	docker build -t zerotuner:latest .

# The image built for real against a local CPU stand-in for its CUDA bases, and run: docker
# run, stop and resume, HEALTHCHECK, the commands, the RunPod target, compose with Prometheus
# (tests/image/run.sh; docs/development.md "Image test"). Needs root; about 30 minutes the
# first time on 2 cores (DeepSpeed's CPU ops), 7 once cached, so not part of `make test`.
.PHONY: test-image
test-image: setup
	bash tests/image/run.sh

clean:
	rm -rf $(DEMO_DIR) .pytest_cache

# The GPU acceptance suite (tests/gpu, docs/development.md): sets itself up from
# requirements.txt (on the lent GPU machine from the wheels tests/gpu/wheels.sh brought), runs
# the checks and writes $(GPU_REPORT)/gpu-report.json and .md. Skips, saying why, without CUDA.
GPU_REPORT ?= $(CURDIR)/bench/results/gpu/$(shell date +%Y-%m-%d)
.PHONY: test-gpu
test-gpu:
	GPU_REPORT=$(GPU_REPORT) bash tests/gpu/run.sh
