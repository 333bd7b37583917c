#!/usr/bin/env bash
# The CUDA checks of issue 4, as one script for a GPU machine with torch installed:
# the CUDA tests (no host sync in hooks, exact statistics on the device, compile, DDP),
# the overhead benchmark on the GPU (the four small workloads, then a shorter run of the
# GPU-sized transformer_large) and torch.compile on the GPU. Logs and JSON go to $OUT
# (default ./gpu-check). CHECKS picks the parts (default: tests overhead large compile);
# TESTS_S, OVERHEAD_S, LARGE_S and COMPILE_S bound each part's seconds.
#
#     OUT=/tmp/gpu bash benchmarks/gpu_check.sh
#     CHECKS="tests overhead" OUT=/tmp/gpu bash benchmarks/gpu_check.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-check}"
CHECKS="${CHECKS:-tests overhead large compile}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
wants() { [[ " $CHECKS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"
if wants tests; then
    timeout "${TESTS_S:-180}" "$PY" -m pytest tests/end_to_end/test_cuda.py -q -p no:randomly \
        -p no:cacheprovider 2>&1 | tee "$OUT/cuda_tests.log"
fi
if wants overhead; then
    timeout "${OVERHEAD_S:-270}" "$PY" benchmarks/overhead.py --device cuda \
        --workloads mlp,cnn,transformer,residual_mlp --sections memory,overhead --repeats 5 \
        --json "$OUT/overhead_cuda.json" 2>&1 | tee "$OUT/overhead_cuda.log"
fi
if wants large; then
    timeout "${LARGE_S:-150}" "$PY" benchmarks/overhead.py --device cuda \
        --workloads transformer_large --sections overhead --repeats 3 --run-steps 300 \
        --json "$OUT/large_cuda.json" 2>&1 | tee "$OUT/large_cuda.log"
fi
if wants compile; then
    timeout "${COMPILE_S:-120}" "$PY" benchmarks/overhead.py --device cuda --sections compile \
        --repeats 5 --json "$OUT/compile_cuda.json" 2>&1 | tee "$OUT/compile_cuda.log"
fi
