#!/usr/bin/env bash
# Run the suite's core test files against one torch version and one Python, in a
# throwaway virtual environment (uv; torch from the package index, through uv's cache).
#
#   benchmarks/compat.sh TORCH_VERSION [PYTHON]
#   benchmarks/compat.sh 2.3.1                  # the declared floor, with python3.11
#   benchmarks/compat.sh 2.15.0 python3.13      # a Python interpreter name or path
#
# Installs torch==TORCH_VERSION, numpy (below 2 for torch before 2.4, which was built
# against NumPy 1), tensorboard and matplotlib (the two small extras the core tests
# use) and pytest, then this checkout's package without its dependencies, and runs
# CORE_TESTS (every test file that needs nothing else: no trainer, no example data).
# Prints one line "torch T, Python P: N passed, M failed, ..." (pytest's summary) and
# exits with pytest's status. The first run of a version downloads it (torch with its
# CUDA libraries is a few GB); later runs reuse uv's cache.
set -euo pipefail
cd "$(dirname "$0")/.."

torch_version=${1:?usage: benchmarks/compat.sh TORCH_VERSION [PYTHON]}
python=${2:-python3.11}
CORE_TESTS=(
    tests/test_amp.py tests/test_api.py tests/test_calls_shared_outputs.py tests/test_capture.py
    tests/test_capture_output_paths.py tests/test_config.py tests/test_distributed.py
    tests/test_find.py tests/test_histogram.py tests/test_observer.py tests/test_parking.py
    tests/test_reduce.py tests/test_reduce_tensor_kinds.py tests/test_report.py
    tests/test_report_model_wide.py tests/test_sampling.py tests/test_sampling_time_budget.py
    tests/test_sentinel.py tests/test_sinks.py tests/test_sinks_directories.py
    tests/test_staging.py tests/test_track.py
    tests/end_to_end/test_cases.py tests/end_to_end/test_import.py tests/end_to_end/test_safety.py
    # the one test of this file that was among the core tests before the files were split
    tests/test_compiled.py::test_torch_compile_before_and_after_injection
)

workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT
uv venv --quiet --python "$python" "$workdir/venv"
venv_python="$workdir/venv/bin/python"
numpy="numpy"
if [ "$(printf '%s\n' "$torch_version" 2.4 | sort -V | head -n1)" != "2.4" ]; then
    numpy="numpy<2"
fi
uv pip install --quiet --python "$venv_python" "torch==$torch_version" "$numpy" "pytest>=8" \
    "tensorboard>=2.14" "matplotlib>=3.7"
uv pip install --quiet --python "$venv_python" --no-deps .

python_version=$("$venv_python" -c 'import platform; print(platform.python_version())')
installed=$("$venv_python" -c 'import torch; print(torch.__version__)')
set +e
# From a copy of the tests, so the checkout's src/ is not imported instead of the
# installed package; the team's hard-case scripts (../shared/cases) stay beside it.
mkdir "$workdir/checkout"
cp -r tests "$workdir/checkout/tests"
if [ -d ../shared ]; then ln -s "$(cd .. && pwd)/shared" "$workdir/shared"; fi
(cd "$workdir/checkout" && OMP_NUM_THREADS=1 "$venv_python" -m pytest -q -p no:cacheprovider \
    "${CORE_TESTS[@]}") > "$workdir/pytest.log" 2>&1
status=$?
set -e
grep -E "^(FAILED|ERROR) |^E  " "$workdir/pytest.log" | head -n 40 || true
summary=$(tail -n 1 "$workdir/pytest.log")
echo "torch $installed, Python $python_version: $summary"
exit $status
