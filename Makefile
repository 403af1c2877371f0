# Both targets set up .venv themselves, so a fresh clone needs nothing else.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
GPUS := $(shell nvidia-smi -L 2>/dev/null | grep -c GPU)
# 8 CPU processes, or one per GPU: 8+ GPUs run the 8-process layout, 1-7 GPUs one process
NPROC ?= $(if $(filter 0,$(GPUS)),8,$(if $(shell test $(GPUS) -ge 8 && echo y),8,1))
# test files run on this many pytest processes (pytest-xdist, a file per process): the
# suite's ranks wait on each other's collectives, and a second stream fills those waits
TEST_PROCS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -lt 2 ] && n=2; [ $$n -gt 4 ] && n=4; echo $$n)
DEMO_CONFIG ?= $(if $(filter 8,$(NPROC)),demos/gpt/configs/demo.py,demos/gpt/configs/demo_gpu1.py)

.PHONY: demo test test-gpu lint format venv clean

$(STAMP): requirements.txt setup.py scripts/install_venv.sh
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	scripts/install_venv.sh $(VENV)
	touch $(STAMP)

venv: $(STAMP)

## make demo: GPT on the embedded corpus, dp x tp x pp on CPU processes (GPU if present)
demo: $(STAMP)
	$(BIN)/gridtrain run --nproc_per_node $(NPROC) --config $(DEMO_CONFIG) demos/gpt/train.py

## make test: lint, the import layers (pyproject.toml), then the whole test suite on gloo processes
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n $(TEST_PROCS) --dist loadfile tests

## make test-gpu: the CUDA paths on one GPU (tests/gpu); every test skips without CUDA
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q tests/gpu

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .import_linter_cache
