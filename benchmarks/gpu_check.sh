#!/usr/bin/env bash
# The checks that need a GPU, in four parts of about ten minutes each (not yet timed; no ray, no gguf needed):
#
#   bash benchmarks/gpu_check.sh correctness   # kernel + CUDA-graph tests on CUDA, kernel benchmark, HF parity
#   bash benchmarks/gpu_check.sh throughput    # launches that wait for the GPU; host work per step (streamed and
#                                              # final-only outputs, the served step loop); the sampler; 256 requests
#                                              # vs HF generate and generate_batch, async scheduling on and off
#   bash benchmarks/gpu_check.sh tune          # the kernels' tile shapes, warps, stages and split counts, timed
#   bash benchmarks/gpu_check.sh large         # 128 requests on a Llama-3-8B-shaped model vs HF generate
#
# Logs and JSON land in $GPU_CHECK_OUT (default /tmp/gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${GPU_CHECK_OUT:-/tmp/gpu_check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
status=0
step() {  # step NAME CMD...: run, log to $out/NAME.log, remember a failure, go on
    local name=$1
    shift
    echo "=== $name: $*"
    "$@" 2>&1 | tee "$out/$name.log" | grep -v -E "Loading|Writing model shards|it/s\]$"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc"
    [ "$rc" -eq 0 ] || status=1
}

case "${1:-}" in
correctness | throughput | tune | large) ;;
*)
    echo "usage: $0 correctness|throughput|tune|large" >&2
    exit 2
    ;;
esac
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"

case "${1:-}" in
correctness)
    step tests python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_cuda_graph.py
    step kernels python3 benchmarks/kernels.py
    step parity python3 benchmarks/gpu_parity.py
    step parity_graphs python3 benchmarks/gpu_parity.py --cuda-graphs
    ;;
throughput)
    step syncs python3 benchmarks/gpu_syncs.py
    step host_overhead python3 benchmarks/host_overhead.py
    step host_overhead_final python3 benchmarks/host_overhead.py --final-only --rounds 1
    step host_overhead_streams python3 benchmarks/host_overhead.py --streams 0 100 --rounds 1
    step sampler python3 benchmarks/sampler.py --vocab 151936 --device cuda
    step throughput python3 benchmarks/throughput.py --random qwen2.5-0.5b --dtype bfloat16 --num-requests 256 \
        --prompt-len 100 1024 --output-len 256 256 --hf-batch-size 64 --hf-generate-batch --cuda-graphs \
        --sync-scheduling --profile-steps 8 --json "$out/throughput.json"
    ;;
tune)
    step sweep python3 benchmarks/kernels.py --sweep --budget-s 480 --json "$out/sweep.json"
    ;;
large)
    step throughput_8b python3 benchmarks/throughput.py --random llama-3-8b --dtype bfloat16 --num-requests 128 \
        --prompt-len 100 1024 --output-len 256 256 --hf-batch-size 64 --cuda-graphs --profile-steps 8 \
        --json "$out/throughput_8b.json"
    ;;
esac
exit $status
