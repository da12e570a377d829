# dtm_mpi — `make help` lists the targets. `make test` and `make demo` work on a fresh machine.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV    ?= .venv
PY      := $(VENV)/bin/python
RANKS   ?= 2 3 4
# Per-run bound for an mpirun job (seconds): a hung job is killed, never waited on forever.
MPI_JOB_TIMEOUT ?= 900
# Seconds a rank whose test failed waits for its peers before aborting the whole job.
DTM_TEST_AGREE_TIMEOUT ?= 10

# Open MPI as root needs these; more ranks than cores needs oversubscription. Set here, not in
# the user's shell. Harmless under other MPIs and non-root users.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1
# Quiet Open MPI's shared-memory CMA warnings inside containers.
export OMPI_MCA_btl_vader_single_copy_mechanism := none
# Compiled bytecode goes to one tree inside the venv, not into __pycache__ folders of the checkout:
# every Python process (a test run starts hundreds: mpirun ranks, CLI runs) then loads dtm_mpi and
# the tests compiled instead of compiling them again (about 0.2 s a process; 3 s a collection).
unexport PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX := $(abspath $(VENV))/pycache
export DTM_TEST_AGREE_TIMEOUT

# The single-process suite runs on every core (pytest-xdist), two workers a core: the long tests
# mostly wait (for the timeouts and failures they provoke, for launchers), so a core serves two.
# WORKERS=0 runs it in this process, in order. Tests of a module that builds one costly thing (a
# Slurm cluster, network namespaces) share an xdist_group and run on one worker.
WORKERS ?= $(shell echo $$(( 2 * $$(nproc 2>/dev/null || echo 1) )))

MPIRUN  := mpirun --timeout $(MPI_JOB_TIMEOUT) --bind-to none
# More pytest arguments for both suites (`make test-unit PYTEST_ARGS="--junitxml=unit.xml -x"`).
PYTEST_ARGS ?=
PYTEST_1 := $(PY) -m pytest -q -m "not mpi" -n $(WORKERS) --dist loadgroup --durations=30 $(PYTEST_ARGS)
PYTEST_MPI := $(PY) -m mpi4py -m pytest -q --with-mpi -m mpi --timeout-method=thread $(PYTEST_ARGS)

.PHONY: help setup test test-unit test-mpi test-deep coverage lint type demo demo-gpt gpu-check gpu-features clean
help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

setup: ## build .venv: system MPI + parallel HDF5 if missing, mpi4py, h5py (mpio), dtm_mpi [test,dev,train,interop]
	@bash tools/setup.sh

test: ## setup, the single-process suite, then the MPI suite at 2, 3 and 4 ranks (each timed)
	@bash tools/timed.sh setup $(MAKE) --no-print-directory setup
	@bash tools/timed.sh "single-process suite" $(MAKE) --no-print-directory test-unit
	@for n in $(RANKS); do \
	  bash tools/timed.sh "MPI suite, $$n ranks" $(MAKE) --no-print-directory test-mpi RANKS=$$n || exit 1; \
	done

# The suite's processes (its workers, and the ranks and commands its tests launch) each run one
# BLAS and OpenMP thread, as the runtime gives each rank of a shared node: left alone, every
# process's OpenBLAS and torch start a thread per core that spin-waits, on cores the other
# workers need (measured: the in-process numeric tests take 11-13% less time and CPU).
UNIT_THREADS := OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 BLIS_NUM_THREADS=1

test-unit: ## the single-process suite only (needs setup)
	@echo "== single-process suite"
	@$(UNIT_THREADS) $(PYTEST_1) tests

test-mpi: ## the MPI suite at $(RANKS) ranks (needs setup)
	@for n in $(RANKS); do \
	  echo "== MPI suite, $$n ranks"; \
	  $(MPIRUN) -n $$n $(PYTEST_MPI) tests || exit 1; \
	done

test-deep: setup ## the property tests (hypothesis) with ten times the examples of `make test`
	@$(PY) -m pytest -q -m "hypothesis and not mpi" -n $(WORKERS) --hypothesis-profile=deep tests

coverage: setup ## line coverage of dtm_mpi/ over both suites, every process (coverage-out/)
	@bash tools/coverage.sh

lint: setup ## ruff
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check .

type: setup ## mypy --strict on dtm_mpi
	@$(VENV)/bin/mypy

demo: setup ## the main job on 4 local ranks
	@bash jobs/demo.sh

demo-gpt: setup ## the character-level GPT: 4 ranks (2x2), resumed on 3 (1x3), validation vs bigram
	@bash jobs/gpt.sh

gpu-check: ## on a machine with a GPU: gpu tests, dtm bench kernels, dtm bench comm on device buffers
	@bash jobs/gpu-check.sh

gpu-features: ## on a machine with a GPU, after gpu-check: the run features on the GPU backend
	@bash jobs/gpu-features.sh

clean: ## remove build outputs and caches (keeps .venv; `make clean-all` removes it too)
	@rm -rf build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis
	@find . -path ./$(VENV) -prune -o -name __pycache__ -type d -print0 | xargs -0 rm -rf

.PHONY: clean-all
clean-all: clean ## also remove .venv
	@rm -rf $(VENV)
