#!/usr/bin/env bash
# The GPU check (docs/decisions.md records its figures): at most ~8 minutes on one GPU, no downloads.
#   bash scripts/gpu_check.sh
# 1. the GPU tests (lossless speculative decoding eager and captured, a training step, a served request);
# 2. decode speed on the shipped model and at the Qwen3.5-0.8B shape: eager vs captured (CUDA graphs), plain vs
#    speculative, every output checked against its own plain decoding.
set -uo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
timeout 240 python -m pytest tests/test_gpu.py -q -x -p no:cacheprovider
tests=$?
timeout 300 python scripts/gpu_bench.py --device cuda --tokens 128
bench=$?
echo "gpu_check: tests rc=$tests bench rc=$bench"
exit $(( tests != 0 || bench != 0 ))
