# The two commands: `make demo` and `make test`. Both run scripts/setup first (idempotent).
VENV := .venv
BIN := $(VENV)/bin
PYTEST := $(BIN)/python -m pytest

.PHONY: setup demo demo-gym agent-demo bench-trl gpu-trainer-check test test-slow test-all lint format clean

setup:
	@./scripts/setup

demo: setup
	@PATH=$(CURDIR)/$(BIN):$$PATH ./scripts/demo

demo-gym: setup
	@PATH=$(CURDIR)/$(BIN):$$PATH ./scripts/demo_gym

agent-demo: setup
	@PATH=$(CURDIR)/$(BIN):$$PATH ./scripts/agent_demo

test: setup
	$(BIN)/ruff check trident tests benchmarks
	$(BIN)/ruff format --check trident tests benchmarks
	$(BIN)/lint-imports
	$(BIN)/basedpyright
	$(PYTEST) -m "not slow" --timeout=900 --durations=15 tests

bench-trl: setup
	$(BIN)/python -m pip install --disable-pip-version-check -q -e ".[bench]"
	$(BIN)/python benchmarks/vs_trl.py

# On a GPU machine without vLLM, Ray or an index (docs/gpu.md): the wheels scripts/gpu_wheels
# downloaded into .whl/, then the trainer check; no setup (its python3 is the image's).
gpu-trainer-check:
	python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl
	PYTHONPATH=$(CURDIR)/.site:$(CURDIR) python3 scripts/gpu_trainer_check.py --out "$${OUT:-benchmarks/results}"

test-slow: setup
	$(PYTEST) -m "slow" --timeout=3600 tests

lint: setup
	$(BIN)/ruff check trident tests benchmarks
	$(BIN)/lint-imports
	$(BIN)/basedpyright

format: setup
	$(BIN)/ruff format trident tests benchmarks
	$(BIN)/ruff check --fix trident tests benchmarks

clean:
	rm -rf runs .pytest_cache
