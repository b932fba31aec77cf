#!/usr/bin/env bash
# The CUDA path's checks and figures on one GPU, in stages that each fit a short
# session: logs and JSON go to $OUT (default ./gpu-results), each stage bounded by a
# timeout so one slow stage cannot eat the rest.
#
#   bash benchmarks/gpu_session.sh tests    # the GPU tests, tensor parallelism's NCCL group of one
#   bash benchmarks/gpu_session.sh decode   # decode, verification, batching, prefill vs the ceilings
#   bash benchmarks/gpu_session.sh more     # the seed experiment, offline throughput
#   bash benchmarks/gpu_session.sh all
set -u
out=${OUT:-gpu-results}
mkdir -p "$out"

stage() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit}s): $*"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local status=$?
    tail -n 25 "$out/$name.log"
    echo "== $name: exit $status"
}

tests() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    stage tests 330 python -m pytest -q tests/test_cuda.py tests/test_attention.py tests/test_kv_dtypes.py -k "cuda or triton"
    stage tensor-parallel 90 python -m pytest -q tests/test_tensor_parallel.py -k one_rank
}

decode() {
    stage decode 540 python benchmarks/gpu.py --steps 10 --batches 1,8,32,64 \
        --models llama-3.1-8b,llama-3.2-1b --weights bf16,q4_0,q4_k_m --out "$out/gpu.json"
}

more() {
    stage seed 120 python benchmarks/kv_cache_vs_recompute.py --device cuda --repeats 1
    stage offline 240 python -m benchmarks.offline_throughput --device cuda --dtype bfloat16 \
        --num-requests 256 --max-num-batched-tokens 8192
}

case "${1:-all}" in
    tests) tests ;;
    decode) decode ;;
    more) more ;;
    all) tests; decode; more ;;
    *) echo "usage: $0 [tests|decode|more|all]" >&2; exit 2 ;;
esac
