# The README's two commands: `make run` (install + default pipeline + report) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: install run test report clean

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

# the whole test suite, end-to-end tests included; pytest's exit 5 (nothing collected) is not a failure
test: install
	$(BIN)/ruff check
	$(BIN)/python -m pytest; rc=$$?; if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

clean:
	rm -rf results logs .snakemake report.html
