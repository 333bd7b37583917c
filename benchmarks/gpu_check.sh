#!/usr/bin/env bash
# The CUDA checks, as one script for a GPU machine with torch installed, in order of
# importance, each part bounded so that the whole fits in about 9 minutes:
#   tests    the CUDA tests: no host sync in hooks or in compiled sampled steps, exact
#            statistics on the device, capture inside inductor graphs, AMP,
#            checkpointing, DDP (TESTS_S, default 150 s)
#   large    the overhead benchmark on the GPU-sized transformer_large, eager: default
#            sampling and every forward sampled (LARGE_S, default 130 s)
#   compile  transformer_large compiled by inductor, the observed copy against the same
#            model compiled without the observer, default sampling and sampling=1
#            (COMPILE_S, default 140 s)
#   overhead the four small workloads, eager (OVERHEAD_S, default 120 s)
# Logs and JSON go to $OUT (default ./gpu-check); CHECKS picks the parts (default all
# four, in the order above). A part cut off by its bound keeps the tables it printed.
#
#     OUT=/tmp/gpu bash benchmarks/gpu_check.sh
#     CHECKS="tests compile" OUT=/tmp/gpu bash benchmarks/gpu_check.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-check}"
CHECKS="${CHECKS:-tests large compile overhead}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
wants() { [[ " $CHECKS " == *" $1 "* ]]; }
part() { echo "== $1 ($(date -u +%H:%M:%S))" | tee -a "$OUT/gpu.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"
if wants tests; then
    part tests
    timeout "${TESTS_S:-150}" "$PY" -m pytest tests/end_to_end/test_cuda.py -q -p no:randomly \
        -p no:cacheprovider --durations=5 2>&1 | tee "$OUT/cuda_tests.log"
fi
if wants large; then
    part large
    timeout "${LARGE_S:-130}" "$PY" benchmarks/overhead.py --device cuda \
        --workloads transformer_large --sections overhead --repeats 3 --run-steps 300 \
        --json "$OUT/large_cuda.json" 2>&1 | tee "$OUT/large_cuda.log"
fi
if wants compile; then
    part compile
    timeout "${COMPILE_S:-140}" "$PY" benchmarks/overhead.py --device cuda --sections compile \
        --compile-workload transformer_large --compile-cases before,every --repeats 3 \
        --json "$OUT/compile_cuda.json" 2>&1 | tee "$OUT/compile_cuda.log"
fi
if wants overhead; then
    part overhead
    timeout "${OVERHEAD_S:-120}" "$PY" benchmarks/overhead.py --device cuda \
        --workloads mlp,cnn,transformer,residual_mlp --sections overhead --repeats 3 \
        --run-steps 500 --json "$OUT/overhead_cuda.json" 2>&1 | tee "$OUT/overhead_cuda.log"
fi
part done
