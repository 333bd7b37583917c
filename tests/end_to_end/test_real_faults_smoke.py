"""Smoke test of the real-model fault benchmark: ``--quick --compare`` runs in-process.

No assertion on the scores (the ranking is being reworked; the benchmark judges it):
this checks that every quick scenario ran through its loop (plain, Trainer, accelerate),
that the probe agrees with every declared origin, that every ``report.json`` stays
within its byte bound, and that the tables and the ``TOTAL`` line are well formed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("timm")
pytest.importorskip("accelerate")
pytest.importorskip("torchvision")

from benchmarks.real_faults.__main__ import REPORT_MAX_BYTES, main
from benchmarks.real_faults.scenarios import SCENARIOS

TOTAL = re.compile(
    r"^TOTAL faults=(\d+) hit@1=\S+ hit@3=\S+ MRR=\S+ headline@1=\S+ "
    r"\| controls=(\d+) notable=\d+ non_finite=\d+ \| early=\d+$",
    re.MULTILINE,
)
COMPARE = re.compile(
    r"^COMPARE faults=(\d+) hit=\d+/\d+ early=\d+ \| control_pairs=(\d+) clean=\d+/\d+$",
    re.MULTILINE,
)


def test_quick_real_fault_benchmark_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "real_faults.json"
    keep = tmp_path / "runs"
    threads = torch.get_num_threads()
    try:
        status = main(["--quick", "--compare", "--json", str(results), "--keep-reports", str(keep)])
    finally:
        torch.set_num_threads(threads)
    output = capsys.readouterr().out
    assert status == 0, output[-3000:]

    quick = [s for s in SCENARIOS if s.quick]
    loops = {s.loop for s in quick}
    faults = [s for s in quick if not s.control]
    controls = [s for s in quick if s.control]
    assert loops == {"plain", "trainer", "accelerate"}
    assert len(faults) == len(loops) and len(controls) == len(loops)

    total = TOTAL.search(output)
    assert total is not None, output[-3000:]
    assert (int(total.group(1)), int(total.group(2))) == (len(faults), len(controls))
    compare = COMPARE.search(output)
    assert compare is not None, output[-3000:]
    assert int(compare.group(1)) == len(faults)
    assert "reproduce with: python -m benchmarks.real_faults --quick" in output
    assert "WARNING" not in output, output[-3000:]
    for scenario in quick:
        assert re.search(rf"^{re.escape(scenario.name)}\s", output, re.MULTILINE), scenario.name

    payload = json.loads(results.read_text(encoding="utf-8"))
    by_name = {s["name"]: s for s in payload["scenarios"]}
    assert set(by_name) == {s.name for s in quick}
    assert payload["totals"]["probe_disagreements"] == 0
    for scenario in faults:
        entry = by_name[scenario.name]
        assert entry["probe"] is not None and entry["probe"]["agrees"], entry["probe"]
        assert entry["samples_after_fault"] >= 5
        assert entry["fault_step"] >= 150
        assert isinstance(entry["early"], int)
    assert {s["loop"] for s in payload["scenarios"]} == {"plain", "trainer", "accelerate"}
    assert len(payload["compare"]) == len(faults)

    for scenario in quick:
        report = keep / scenario.name / "report.json"
        assert report.is_file(), report
        assert report.stat().st_size <= REPORT_MAX_BYTES
        assert json.loads(report.read_text(encoding="utf-8"))["run"]["forwards_seen"] > 0
