"""Smoke test of benchmarks/overhead.py: the quick run finishes and prints its tables.

No timing assertions: the numbers depend on the machine; only that the benchmark runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.harness import REPO

REPO_ROOT = REPO
SCRIPT = REPO_ROOT / "benchmarks" / "overhead.py"

HEADERS = (
    "== Training-step overhead",
    "ratio median [min, max]",
    "losses identical",
    "== Unsampled hook call ==",
    "== Resident memory over samples ==",
    "== Report build and write ==",
    "== torch.compile ==",
)


def test_overhead_benchmark_quick(tmp_path: Path) -> None:
    json_path = tmp_path / "overhead.json"
    completed = subprocess.run(
        # One of the four workloads: each runs the same sections; the others' tables are
        # the same code.
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--workloads",
            "mlp",
            "--json",
            str(json_path),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    for header in HEADERS:
        assert header in completed.stdout, f"missing {header!r} in:\n{completed.stdout}"
    assert "mlp" in completed.stdout
    numbers = json.loads(json_path.read_text(encoding="utf-8"))
    assert {"meta", "overhead", "hook", "memory", "report", "compile"} <= set(numbers)


def test_device_ops_counts_are_deterministic_and_see_the_observer(tmp_path: Path) -> None:
    """benchmarks/device_ops.py: the observer adds operators, and two counts agree."""
    from benchmarks import device_ops, overhead

    workload = overhead.make_workloads(quick=True)["cnn"]
    # 32 steps hold one flush, where the staged copies are reduced. The first count also
    # builds the cached batch layout; the next two are alike.
    plain = device_ops.count(workload, False, 32, tmp_path / "plain")
    device_ops.count(workload, True, 32, tmp_path / "cold")
    first = device_ops.count(workload, True, 32, tmp_path / "first")
    second = device_ops.count(workload, True, 32, tmp_path / "second")
    assert first.launches == second.launches and first.views == second.views
    assert first.launches.total() > plain.launches.total()
    # Each of the 26 observed tensors a step is one staged copy (_to_copy); one ragged
    # batch reduces all of them at the flush in about 50 operations (a batch per distinct
    # length took 281 here).
    added = first.launches.copy()
    added.subtract(plain.launches)
    copies = added.pop("aten._to_copy")
    assert copies >= 32 * 26
    assert 30 <= added.total() <= 80, added
    threads = torch.get_num_threads()
    try:  # main sets one thread, as the benchmarks measure: later tests keep their own
        assert device_ops.main(["--quick", "--workloads", "mlp", "--steps", "2"]) == 0
    finally:
        torch.set_num_threads(threads)
