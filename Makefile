# The two commands: `make demo` and `make test`. Both run scripts/setup first (idempotent).
VENV := .venv
BIN := $(VENV)/bin
PYTEST := $(BIN)/python -m pytest

.PHONY: setup demo demo-gym agent-demo bench-trl test test-slow test-all lint format clean

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
