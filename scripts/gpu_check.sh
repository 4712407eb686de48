#!/usr/bin/env bash
# The GPU check (docs/decisions.md records its figures): about 12.5 minutes on one GPU with every stage (compiling and
# recording the round's graphs is most of it), no downloads; `tests captured captured-shape` alone fits in 9.
#   bash scripts/gpu_check.sh [STAGE...]   (stages below, all by default; logs under $OUT, default /tmp/gpu_check;
#                                           PYTHON picks the interpreter)
# 1. tests: the GPU tests (lossless speculative decoding eager and captured, a training step, a served request);
# 2. eager: decode speed on the shipped model and at the Qwen3.5-0.8B shape, eager (plain vs speculative);
# 3. captured, captured-shape, captured-unmarked: the same through CUDA graphs (torch.compile mode="reduce-overhead"):
#    the shipped model and the 0.8B shape with the round's state marked static (the default), then the shipped model
#    unmarked (MTP_CUDA_STATIC=0, the control). TORCH_LOGS=cudagraphs prints why a graph was not captured, if one was
#    not.
# Every stage has its own time limit, so a stage that overruns still leaves the others' figures; each configuration's
# greedy output is checked against its own plain decoding.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
CACHE=${MTP_CACHE:-/tmp/mtp-cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
stage() {  # name, seconds, command...
    local name=$1 secs=$2
    shift 2
    echo "=== $name (limit ${secs} s) $(date +%T)"
    timeout "$secs" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name rc=$rc $(date +%T)"
    return "$rc"
}
STAGES=${*:-tests captured captured-shape eager captured-unmarked}
declare -A rc
for name in $STAGES; do
    export MTP_CACHE=$CACHE/$name  # each stage compiles afresh: a graph cached by another stage could carry its choices
    case $name in
        tests) stage tests 170 $PY -m pytest tests/test_gpu.py -p no:cacheprovider -o addopts= -q --durations=10 ;;
        eager) stage eager 100 $PY scripts/gpu_bench.py --device cuda --compile none --tokens 128 --shape-tokens 64 ;;
        captured) TORCH_LOGS=cudagraphs stage captured 170 \
            $PY scripts/gpu_bench.py --device cuda --compile only --models code-small --tokens 128 ;;
        captured-shape) TORCH_LOGS=cudagraphs stage captured-shape 200 \
            $PY scripts/gpu_bench.py --device cuda --compile only --models shape --shape-tokens 48 ;;
        captured-unmarked) MTP_CUDA_STATIC=0 TORCH_LOGS=cudagraphs stage captured-unmarked 110 \
            $PY scripts/gpu_bench.py --device cuda --compile only --models code-small --tokens 128 ;;
        *) echo "unknown stage $name"; false ;;
    esac
    rc[$name]=$?
done
failed=0
for name in $STAGES; do
    echo "gpu_check: $name rc=${rc[$name]}"
    [ "${rc[$name]}" = 0 ] || failed=1
done
exit $failed
