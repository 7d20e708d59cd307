#!/usr/bin/env bash
# The checks that need a GPU, in parts meant to take under ten minutes each (only serve and the tensor-parallel check
# need ray and the serving extras: an offline bundle, scripts/offline_bundle.py, installs them on a GPU node). Timed
# on an H100: throughput's 256-request run 5, the steps after it not yet; tune 3 (the whole grid); large under
# 5. On an H200, on a cold Triton cache: correctness 3 (its tests and parity runs side by side), host under 2,
# profile under 2.
#
#   bash benchmarks/gpu_check.sh correctness   # kernel + CUDA-graph tests on CUDA (sliding windows, soft caps, KV
#                                              # groups, experts, LoRA, the KV offload tier), the engine on CUDA vs
#                                              # HF, kernel benchmark, HF parity, tensor parallel 2 on the one GPU
#                                              # (where Ray is installed), the KV offload tier's TTFT
#   bash benchmarks/gpu_check.sh nano          # nano-vllm's benchmark (Qwen3-0.6B shape, its 256 requests) beside
#                                              # HF generate on the first 64
#   bash benchmarks/gpu_check.sh serve         # serve run deploy/gpu.yaml: both routes, 64 and 256 streams beside
#                                              # the engine offline (needs Ray and the serving extras:
#                                              # scripts/offline_bundle.py)
#   bash benchmarks/gpu_check.sh throughput    # 256 requests vs HF generate and generate_batch, async scheduling on
#                                              # and off, a profile of decode steps; then launches that wait for the
#                                              # GPU, host work per step (streamed and final-only outputs, the served
#                                              # step loop), the sampler
#   bash benchmarks/gpu_check.sh host          # where a decode step's host time goes, without the HF peers: the
#                                              # graphed 256-request run with its profile, launches that wait for the
#                                              # GPU (eager and graphed), host work per step
#   bash benchmarks/gpu_check.sh tune          # the kernels' tile shapes, warps, stages, prefill launch order and
#                                              # split counts, timed
#   bash benchmarks/gpu_check.sh large         # 128 requests on a Llama-3-8B-shaped model vs HF generate
#   bash benchmarks/gpu_check.sh profile       # Nsight Compute on the prefill kernel (2048 new tokens, no prefix):
#                                              # its speed of light, occupancy and stall reasons, and SDPA's beside it
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

pids=()
background() {  # background NAME CMD...: step, in its own process; wait_all collects its status
    (
        step "$@"
        exit $status
    ) &
    pids+=($!)
}
wait_all() {
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    pids=()
}

case "${1:-}" in
correctness | nano | serve | throughput | host | tune | large | profile) ;;
*)
    echo "usage: $0 correctness|nano|serve|throughput|host|tune|large|profile" >&2
    exit 2
    ;;
esac
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
# The commit, machine and versions, as every benchmark script also prints them first.
python3 benchmarks/environment.py | tee -a "$out/gpu.txt"
python3 benchmarks/environment.py --json >"$out/environment.json"

case "${1:-}" in
correctness)
    # The tests and both parity runs at once: compiling Triton kernels takes most of their time, one core
    # each. Each engine gets a KV pool of its own size, so that none takes 0.9 of the card from the others;
    # the engine tests whose engines size their pools from the card run in one process beside them.
    xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
    # shellcheck disable=SC2086
    background tests python3 -m pytest -q -p no:cacheprovider $xdist tests/test_kernels.py \
        tests/test_norm_kernel.py tests/test_rope_kernel.py tests/test_cuda_graph.py tests/test_kv_window.py \
        tests/test_moe.py tests/test_lora_kernel.py tests/test_kv_offload.py
    background engine_tests python3 -m pytest -q -p no:cacheprovider tests/test_engine_triton.py
    background parity python3 benchmarks/gpu_parity.py --kv-cache-memory 16GiB
    background parity_graphs python3 benchmarks/gpu_parity.py --cuda-graphs --kv-cache-memory 16GiB
    if python3 -c "import ray" 2>/dev/null; then  # two worker actors sharing the GPU
        background tp_shared python3 benchmarks/gpu_tp_shared.py
    fi
    wait_all
    step kernels python3 benchmarks/kernels.py  # timed alone
    step kv_offload python3 benchmarks/kv_offload.py --device cuda --json "$out/kv_offload.json"
    ;;
nano)
    step nano python3 benchmarks/throughput.py --random qwen3-0.6b --workload nano-vllm --dtype bfloat16 \
        --max-model-len 4096 --skip-pagedserve --cuda-graphs --hf-batch-size 64 --hf-requests 64 --profile-steps 8 \
        --json "$out/nano.json"
    ;;
serve)
    step serve python3 benchmarks/gpu_serve.py --log-dir "$out/serve_logs" --json "$out/serve.json"
    ;;
throughput)
    # The headline run first (about 5 minutes): a part cut short by its caller's time limit still has it.
    step throughput python3 benchmarks/throughput.py --random qwen2.5-0.5b --dtype bfloat16 --num-requests 256 \
        --prompt-len 100 1024 --output-len 256 256 --hf-batch-size 64 --hf-generate-batch --cuda-graphs \
        --sync-scheduling --profile-steps 8 --json "$out/throughput.json"
    step syncs python3 benchmarks/gpu_syncs.py
    step host_overhead python3 benchmarks/host_overhead.py
    step host_overhead_final python3 benchmarks/host_overhead.py --final-only --rounds 1
    step host_overhead_streams python3 benchmarks/host_overhead.py --streams 0 100 --rounds 1
    step sampler python3 benchmarks/sampler.py --vocab 151936 --device cuda
    ;;
host)
    step throughput_profile python3 benchmarks/throughput.py --random qwen2.5-0.5b --dtype bfloat16 --num-requests 256 \
        --prompt-len 100 1024 --output-len 256 256 --skip-hf --skip-pagedserve --cuda-graphs --profile-steps 8 \
        --json "$out/throughput_profile.json"
    step syncs python3 benchmarks/gpu_syncs.py
    step syncs_graphs python3 benchmarks/gpu_syncs.py --cuda-graphs
    step host_overhead_final python3 benchmarks/host_overhead.py --final-only --rounds 1
    ;;
tune)
    step sweep python3 benchmarks/kernels.py --sweep --budget-s 480 --json "$out/sweep.json"
    ;;
large)
    step throughput_8b python3 benchmarks/throughput.py --random llama-3-8b --dtype bfloat16 --num-requests 128 \
        --prompt-len 100 1024 --output-len 256 256 --hf-batch-size 64 --cuda-graphs --profile-steps 8 \
        --json "$out/throughput_8b.json"
    ;;
profile)
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
    ncu_args="--clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats"
    # The first shape's second launch: the first is its check against the reference, the rest are timed.
    # shellcheck disable=SC2086
    step prefill_ncu "$ncu" --kernel-name regex:_prefill_kernel --launch-skip 1 --launch-count 1 $ncu_args \
        python3 benchmarks/kernels.py --only prefill
    # SDPA's bf16 kernel on the same shape (flash, cuDNN or memory-efficient: whichever torch picks; the fp32
    # reference's kernels do not match), for what the same work costs there.
    # shellcheck disable=SC2086
    step sdpa_ncu "$ncu" --kernel-name "regex:flash|cudnn|fmha_cutlassF_bf16" --launch-skip 1 --launch-count 1 $ncu_args \
        python3 benchmarks/kernels.py --only prefill
    ;;
esac
exit $status
