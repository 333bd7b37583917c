#!/usr/bin/env bash
# The CUDA checks of issue 4, as one script for a GPU machine with torch installed:
# the CUDA tests (no host sync in hooks, exact statistics on the device, compile, DDP)
# and the overhead benchmark on the GPU. Logs and JSON go to $OUT (default ./gpu-check).
#
#     OUT=/tmp/gpu bash benchmarks/gpu_check.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"
timeout "${TESTS_S:-180}" "$PY" -m pytest tests/test_cuda.py -q -p no:randomly -p no:cacheprovider 2>&1 | tee "$OUT/cuda_tests.log"
timeout "${OVERHEAD_S:-270}" "$PY" benchmarks/overhead.py --device cuda --sections overhead,memory \
    --repeats 5 --json "$OUT/overhead_cuda.json" 2>&1 | tee "$OUT/overhead_cuda.log"
timeout "${COMPILE_S:-120}" "$PY" benchmarks/overhead.py --device cuda --sections compile \
    --repeats 5 --json "$OUT/compile_cuda.json" 2>&1 | tee "$OUT/compile_cuda.log"
