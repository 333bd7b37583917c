"""Smoke test of the fault-localisation benchmark: ``--quick`` runs and prints its totals.

No assertion on the scores: the benchmark judges the rules; this only checks that the
judge runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.harness import REPO

ROOT = REPO


def test_quick_fault_benchmark_runs_and_prints_totals(tmp_path: Path) -> None:
    results = tmp_path / "faults.json"
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.faults", "--quick", "--json", str(results)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-3000:]
    pattern = (
        r"^TOTAL faults=\d+ hit@1=\S+ hit@3=\S+ MRR=\S+ headline@1=\S+ "
        r"\| controls=\d+ notable=\d+ non_finite=\d+$"
    )
    assert re.search(pattern, completed.stdout, re.MULTILINE), output[-3000:]
    assert "reproduce with: python -m benchmarks.faults --quick" in completed.stdout
    assert results.is_file()
