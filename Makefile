# Every target sets up what it needs: `make serve` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: setup serve test lint format bench chaos system-deps clean deploy-check e2e

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first, with the exact pin: it takes the CPU wheel; a looser spec pulls CUDA.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e .
	touch $@

# test extras, and AllenNLP (no deps) for the parity tests
$(TEST_STAMP): $(STAMP) $(wildcard tests/install_parity_deps.sh)
	$(BIN)/pip install --quiet -e ".[test]"
	bash tests/install_parity_deps.sh $(BIN)/pip
	touch $@

setup: $(TEST_STAMP)

# redis-server is needed by the cache and job tests (a real server, on loopback).
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; \
	  else echo "redis-server is required for the tests: install it (apt-get install redis-server)"; exit 1; fi; }

serve: $(STAMP)
	$(BIN)/elmo-service serve --host $(HOST) --port $(PORT)

test: $(TEST_STAMP) system-deps
	$(BIN)/python -m pytest -q

lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(TEST_STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(TEST_STAMP)
	$(BIN)/python bench/bench_embedder.py

# the fault suite: load-shaped attacks on real processes (loopback, a real redis-server),
# a few minutes; prints attack -> outcomes and fails on any 5xx, wrong vector or lost step.
# See docs/reliability.md.
chaos: $(TEST_STAMP) system-deps
	$(BIN)/python bench/chaos.py

deploy-check: $(TEST_STAMP)
	$(BIN)/python -m pytest -q tests/test_deploy.py

# needs a Docker engine; see docker/README.md
e2e:
	PATH="$(CURDIR)/$(BIN):$$PATH" docker/e2e.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
