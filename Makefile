# redumix: `make harvest train eval` runs the pipeline; `make test` runs the suite.
RECIPE ?= recipes/tiny.yaml
RUN_DIR ?=
NPROC ?= 1
ARGS ?=
ROUNDS ?=
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUN_DIR_FLAG := $(if $(RUN_DIR),--run-dir $(RUN_DIR),)
# Multi-process stages go through torchrun, which starts exactly NPROC ranks on CPU or GPU alike.
LAUNCH := $(if $(filter 1,$(NPROC)),$(BIN)/redumix,$(BIN)/torchrun --standalone --nproc_per_node $(NPROC) -m redumix.pipeline.cli)

.PHONY: install base harvest train eval export calibrate rounds bench test test-all lint clean
install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned to the CPU wheel on this machine's disk; installing it first keeps pip from pulling a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

base: install
	$(BIN)/redumix base --recipe $(RECIPE) $(RUN_DIR_FLAG) $(ARGS)
harvest: install
	$(LAUNCH) harvest --recipe $(RECIPE) $(RUN_DIR_FLAG) $(ARGS)
train: install
	$(LAUNCH) train --recipe $(RECIPE) $(RUN_DIR_FLAG) $(ARGS)
eval: install
	$(LAUNCH) eval --recipe $(RECIPE) $(RUN_DIR_FLAG) $(ARGS)
export: install
	$(BIN)/redumix export --recipe $(RECIPE) $(RUN_DIR_FLAG) $(ARGS)
calibrate: install
	$(BIN)/redumix calibrate --recipe $(RECIPE) $(RUN_DIR_FLAG) $(ARGS)
# Harvest -> train -> eval, ROUNDS times (default: the recipe's rounds.count), each round from the last one's model.
rounds: install
	$(LAUNCH) rounds --recipe $(RECIPE) $(RUN_DIR_FLAG) $(if $(ROUNDS),rounds.count=$(ROUNDS),) $(ARGS)

bench: install
	$(BIN)/python -m bench.run

test: install
	$(BIN)/python -m pytest -q
test-all: install
	$(BIN)/python -m pytest -q -m ""
lint: install
	$(BIN)/ruff check .

clean:
	rm -rf runs/ .pytest_cache
