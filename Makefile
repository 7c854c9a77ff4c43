# The README's two commands: `make run` (install + default pipeline + report) and `make test`;
# `make data` is the DVC step of docs/data.md's "Data versioning (DVC)" section.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)

# every shipped config (the default and one file per experiment): data.dvc tracks their data
CONFIGS := config/config.yaml $(sort $(wildcard config/experiments/*.yaml))

.PHONY: install run test clean data smoke floors gpu-paths

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# default pipeline on embedded data (no network): prepare -> partition -> train -> tables -> plots -> report
run: install
	$(BIN)/snakemake
	$(BIN)/snakemake --report report.html

# data/ for every shipped config, into the DVC cache, so that `dvc push` uploads it. Preparing
# is byte-deterministic and leaves files whose bytes are unchanged alone (their mtimes too, so
# Snakemake reruns nothing), so data.dvc must not change: if it would, it is put back and this
# fails, saying what to do.
data: install
	$(BIN)/fedforget prepare $(addprefix --config ,$(CONFIGS)) >/dev/null
	@cp data.dvc .data.dvc.before
	@$(BIN)/dvc commit -f -q data.dvc
	@if ! cmp -s data.dvc .data.dvc.before; then mv .data.dvc.before data.dvc; \
	  echo "make data: data/ does not match data.dvc. Files that no shipped config prepares (from another" >&2; \
	  echo "  config or an old run)? rm -rf data && make data. A shipped config prepares other data on" >&2; \
	  echo "  purpose? Record them: dvc commit -f data.dvc && git add data.dvc, then dvc push." >&2; exit 1; fi
	@rm -f .data.dvc.before
	@test "$$($(BIN)/dvc status --json data.dvc)" = "{}" || { $(BIN)/dvc status data.dvc >&2; exit 1; }
	@echo "make data: data/ matches data.dvc and is in the DVC cache; 'dvc push' uploads it"

# the whole test suite, end-to-end tests included, on TEST_WORKERS processes (pytest-xdist; the
# end-to-end tests mostly wait on their snakemake subprocesses); pytest's exit 5 (nothing
# collected) is not a failure; worksteal: a worker that is done takes tests from the other
# (the long end-to-end chains would otherwise leave one idle); the 15 slowest tests are listed
# It installs no system packages: the SLURM stage (tests/test_slurm.py) runs where SLURM is
# already installed and is skipped, saying how to run it, elsewhere; FEDFORGET_SLURM_INSTALL=1
# in the environment (or `make test FEDFORGET_SLURM_INSTALL=1`) lets it apt-get install
# slurm-wlm and munge: CI's switch (.ci/run), not for your own machine.
TEST_WORKERS ?= 2
SUITE = -m pytest -n $(TEST_WORKERS) --dist worksteal --durations=15 -m "not long"; rc=$$?; if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc
test: install
	$(BIN)/ruff check
	$(BIN)/python $(SUITE)

# the stage for CI runners with the time: the longest end-to-end chains (tests marked `long`:
# reruns after code, settings and data changes, a killed workflow's resume, three Snakemake
# processes sharing locks, a one-task run's resume after SIGKILL (make test kills a task
# stream's), results adopted through a cluster remote, the
# code-digest migration, a truncated partition, the FedProj pilot table, the figures'
# text-overlap check over the shipped configs, Snakemake's refusal of more bad configs),
# then every paper config (config/experiments/paper/) end to end at
# `scale: smoke` (fedforget.smoke) on native-format files the tests write, then every config on
# embedded data (config/experiments/*.yaml) at smoke scale with up to 20 rounds, where FedAvg
# must beat chance (tests/test_smoke.py, check_learns); each in its own
# temporary directory, one after another on SMOKE_CORES cores (`make test` dry-runs them).
# On your own raw data: snakemake --configfile CONFIG --config scale=smoke
# SMOKE_LOG: one JSON line per config (config, training jobs, seconds, passed).
# A pass of the configs alone, resumable across sittings at one commit: benchmarks/smoke_pass.sh.
SMOKE_CORES ?= $(shell nproc 2>/dev/null || echo 2)
SMOKE_LOG ?= logs/smoke.jsonl
smoke: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal -m long -p no:cacheprovider --durations=0
	mkdir -p $(dir $(SMOKE_LOG)) && rm -f $(SMOKE_LOG)
	FEDFORGET_SMOKE_ALL=1 FEDFORGET_SMOKE_CORES=$(SMOKE_CORES) FEDFORGET_SMOKE_LOG=$(abspath $(SMOKE_LOG)) \
	  $(BIN)/python -m pytest tests/test_smoke.py -k "every_paper_config or every_embedded_config" -p no:cacheprovider --durations=0

# benchmarks/gpu.sh's GPU tests, then every engine and method test, on this CPU along a GPU's
# code paths (FEDFORGET_TEST_GPU_PATHS=1, tests/conftest.py: every stacked step batched, the lr
# a tensor, channels_last stacks, CUDA graphs through the tape, host tensors copied): what a
# device session's tests would meet that a CPU can show, first. benchmarks/gpu_rehearsal.sh
# with ORDER=tests, on a clone of the committed HEAD; about 5 minutes on 2 cores; fails on a
# failure it lists (GPU_PATHS_OUT/failures.txt)
GPU_PATHS_OUT ?= /tmp/gpu-paths
gpu-paths: install
	rm -rf $(GPU_PATHS_OUT)
	ORDER=tests bash benchmarks/gpu_rehearsal.sh $(GPU_PATHS_OUT)
	@test ! -s $(GPU_PATHS_OUT)/failures.txt || { echo "make gpu-paths: failures above ($(GPU_PATHS_OUT))" >&2; exit 1; }

# the suite (as `make test`) at the lowest releases pyproject.toml allows: every dependency of
# the project and its dev extras at its `>=` floor, what they need at its newest (uv's
# lowest-direct resolution of pyproject.toml, written to FLOORS_VENV/floors.txt; `uv pip install
# -e .` would take pyproject's dependencies as the project's, not as direct, and lift some of
# them), in a venv of its own, ahead of the default's on PATH; a failure here is a floor to
# raise (README, "Tests")
FLOORS_VENV ?= .venv-floors
floors:
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/pip install --quiet --upgrade pip uv
	$(FLOORS_VENV)/bin/uv pip compile --quiet --python $(FLOORS_VENV)/bin/python --resolution lowest-direct \
	  pyproject.toml --extra dev -o $(FLOORS_VENV)/floors.txt
	$(FLOORS_VENV)/bin/uv pip install --quiet --python $(FLOORS_VENV)/bin/python -r $(FLOORS_VENV)/floors.txt
	$(FLOORS_VENV)/bin/uv pip install --quiet --python $(FLOORS_VENV)/bin/python --no-deps -e .
	PATH="$(abspath $(FLOORS_VENV))/bin:$$PATH" python $(SUITE)

clean:
	rm -rf results logs .snakemake report.html
