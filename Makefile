# Two commands for a new user: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint typecheck unit venv bench bench-api bench-leak clean

$(BIN)/gpu-supervisor: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

venv: $(BIN)/gpu-supervisor

## demo: run examples/demo.toml in the foreground (Ctrl-C stops every worker gracefully)
demo: venv
	$(BIN)/gpu-supervisor run -c examples/demo.toml

## test: lint, type-check, layering contracts, then the whole test suite (four at a time on two
## cores: most tests wait on real processes; 5:31 instead of 6:55 three at a time, 2132 tests,
## and 6:55 beside a busy loop). A fixed port a test's workers bind belongs to that test alone
## (tests/unit/test_fixed_ports.py).
test: venv lint typecheck
	$(BIN)/python -m pytest -n 4 --dist loadgroup

lint: venv
	$(BIN)/ruff check supervisor tests bench examples scripts/gpu-smoke
	$(BIN)/ruff format --check supervisor tests examples
	$(BIN)/lint-imports

typecheck: venv
	$(BIN)/mypy

unit: venv
	$(BIN)/python -m pytest tests/unit

## bench: comparative benchmarks (installs supervisord and circus into bench/.venvs)
bench: venv
	$(BIN)/python bench/peers.py

## bench-api: HTTP API under load (64 workers on 8 sim GPUs) and crash recovery during it
bench-api: venv
	$(BIN)/python bench/api_load.py

## bench-leak: leak-detector quality on synthetic caching-allocator traces (figures in docs/)
bench-leak: venv
	$(BIN)/python bench/leak_quality.py

clean:
	rm -rf $(VENV) state .pytest_cache .mypy_cache .ruff_cache
