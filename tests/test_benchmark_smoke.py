"""Smoke test of benchmarks/overhead.py: the quick run finishes and prints its tables.

No timing assertions: the numbers depend on the machine; only that the benchmark runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
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
        [sys.executable, str(SCRIPT), "--quick", "--json", str(json_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    for header in HEADERS:
        assert header in completed.stdout, f"missing {header!r} in:\n{completed.stdout}"
    for workload in ("mlp", "cnn", "transformer", "residual_mlp"):
        assert workload in completed.stdout
    numbers = json.loads(json_path.read_text(encoding="utf-8"))
    assert {"meta", "overhead", "hook", "memory", "report", "compile"} <= set(numbers)
