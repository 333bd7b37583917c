"""merge_rank_reports and ``torchinstruments merge``: ranks, outliers, bounds, memory."""

from __future__ import annotations

import copy
import json
import math
import random
import statistics
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import ResidualNet, load_example, make_batches, read_report, train
from tests.harness.ranks import rank_batches, run_ranks, seeded_net
from torchinstruments import (
    ConfigError,
    ReportReadError,
    inject_observer,
    merge_rank_reports,
    remove_observer,
)
from torchinstruments.__main__ import main as cli_main
from torchinstruments.merge import (
    GLOBAL_SCHEMA,
    leave_one_out_median_mad,
    rank_ranges,
    render_global_markdown,
    spread_floor,
)
from torchinstruments.report import SCHEMA, dumps_report

CATEGORIES = (
    "non_finite",
    "activation_scale_drift",
    "gradient_scale_change",
    "heavy_tail_growth",
    "zero_fraction_growth",
    "regime_change",
    "relative_volatility",
    "oscillation",
)


# ---------------------------------------------------------------------- synthetic reports
def finding(
    module: str,
    latest: float,
    *,
    category: str = "activation_scale_drift",
    metric: str = "rms",
    signal: str = "activation",
    notable: bool = False,
    score: float = 0.05,
    sample: int = 29,
) -> dict[str, Any]:
    """A finding with the fields the merge reads (the rest of the contract is optional)."""
    return {
        "category": category,
        "rank": 1,
        "notable": notable,
        "module": module,
        "call_index": 0,
        "signal": signal,
        "tensor_path": "output",
        "metric": metric,
        "first": {"sample": 0, "value": latest},
        "latest": {"sample": sample, "value": latest},
        "ranking": {"basis": "abs_log_ratio_to_baseline", "value": score},
    }


def non_finite_finding(module: str, first_sample: int) -> dict[str, Any]:
    entry = finding(
        module,
        0.25,
        category="non_finite",
        metric="nonfinite_fraction",
        notable=True,
        score=-float(first_sample),
    )
    entry["ranking"]["basis"] = "negative_first_nonfinite_sample"
    entry["evidence"] = {"first_nonfinite_sample": first_sample}
    return entry


def rank_report(
    rank: int,
    world: int,
    findings: list[dict[str, Any]],
    *,
    limits_hit: tuple[str, ...] = (),
    omitted_non_finite: int = 0,
) -> dict[str, Any]:
    omitted = {c: {"by_top_k": 0, "by_bytes": 0} for c in CATEGORIES}
    omitted["non_finite"]["by_top_k"] = omitted_non_finite
    return {
        "schema": SCHEMA,
        "generated_at": "2026-01-01T00:00:00+00:00",
        "run": {"rank": rank, "world_size": world, "samples_seen": 30, "forwards_seen": 30},
        "summary": {
            "notable_findings": sum(1 for f in findings if f["notable"]),
            "headline": "synthetic",
            "first_non_finite": None,
        },
        "coverage": {
            "errors_total": 0,
            "limits_hit": list(limits_hit),
            "findings_omitted": omitted,
        },
        "findings": findings,
        "errors": [],
    }


def write_rank(directory: Path, rank: int, report: dict[str, Any] | bytes) -> Path:
    path = directory / f"rank-{rank:03d}" / "report.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(report if isinstance(report, bytes) else dumps_report(report))
    return path


def read_global(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "global-report.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def real_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A report written by a real single-process observer (ResidualNet, 30 samples)."""
    directory = tmp_path_factory.mktemp("real")
    model = ResidualNet()
    inject_observer(model, output_dir=directory, sampling=1)
    train(model, make_batches(30))
    remove_observer(model)
    return read_report(directory)


def as_rank(report: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    copied = copy.deepcopy(report)
    copied["run"]["rank"], copied["run"]["world_size"] = rank, world
    return copied


# ---------------------------------------------------------------------- pure functions
def brute_force(values: list[float]) -> list[tuple[float, float]]:
    out = []
    for i in range(len(values)):
        others = values[:i] + values[i + 1 :]
        median = statistics.median(others)
        out.append((median, statistics.median(abs(v - median) for v in others)))
    return out


def test_leave_one_out_median_mad_equals_brute_force() -> None:
    generator = random.Random(0)
    for count in range(2, 40):
        for _ in range(5):
            values = [round(generator.gauss(0, 1), 1) for _ in range(count)]  # with ties
            assert leave_one_out_median_mad(values) == brute_force(values)
    assert leave_one_out_median_mad([1.0, 2.0, 10.0]) == [(6.0, 4.0), (5.5, 4.5), (1.5, 0.5)]
    with pytest.raises(ConfigError, match=r"values must hold at least 2 numbers, got 1"):
        leave_one_out_median_mad([1.0])


def test_rank_ranges_and_spread_floors() -> None:
    assert rank_ranges([]) == []
    assert rank_ranges([4]) == ["4"]
    assert rank_ranges([0, 1, 2, 5, 7, 8]) == ["0-2", "5", "7-8"]
    assert spread_floor("rms") == 0.1
    assert spread_floor("rms_to_root") == 0.1
    assert spread_floor("zero_fraction") == 0.02
    assert spread_floor("excess_kurtosis") == 1.0


# ---------------------------------------------------------------------- outlier rules
def test_series_value_outlier_is_named_with_exact_departure(tmp_path: Path) -> None:
    latest = [1.0, 1.05, 0.95, 1.02, 3.0]
    for rank, value in enumerate(latest):
        write_rank(tmp_path, rank, rank_report(rank, 5, [finding("fc1", value)]))
    merge_rank_reports(tmp_path)
    report = read_global(tmp_path)
    assert report["schema"] == GLOBAL_SCHEMA
    assert report["summary"]["outlier_ranks"] == ["4"]
    assert [o["rank"] for o in report["outlier_ranks"]] == [4]
    (outlier,) = report["outliers"]
    others = [math.log(v) for v in latest[:4]]
    median = statistics.median(others)
    mad = statistics.median(abs(v - median) for v in others)
    spread = max(1.4826 * mad, 0.1)
    assert spread == 0.1  # the other ranks agree more closely than the floor
    expected = (math.log(3.0) - median) / spread
    assert outlier["kind"] == "series_value"
    assert (outlier["rank"], outlier["module"], outlier["signal"], outlier["metric"]) == (
        4,
        "fc1",
        "activation",
        "rms",
    )
    assert outlier["value"] == 3.0
    assert outlier["sample"] == 29
    assert outlier["departure"] == float(f"{expected:.6g}")
    assert outlier["others_median"] == float(f"{math.exp(median):.6g}")
    assert outlier["ranks_compared"] == 5
    assert report["disagreements"] == []


def test_natural_spread_among_ranks_is_not_an_outlier(tmp_path: Path) -> None:
    latest = [1.0, 1.3, 0.8, 1.1, 0.9, 1.25]  # batch-to-batch differences, no outlier
    for rank, value in enumerate(latest):
        write_rank(tmp_path, rank, rank_report(rank, 6, [finding("fc1", value)]))
    merge_rank_reports(tmp_path)
    report = read_global(tmp_path)
    assert report["outliers"] == []
    assert report["summary"]["headline"] == (
        "6 of 6 ranks present. No rank departs from the others by more than the outlier "
        "rule allows."
    )


def test_two_ranks_disagree_without_naming_either(tmp_path: Path) -> None:
    write_rank(tmp_path, 0, rank_report(0, 2, [finding("fc1", 1.0)]))
    write_rank(tmp_path, 1, rank_report(1, 2, [finding("fc1", 10.0)]))
    merge_rank_reports(tmp_path)
    report = read_global(tmp_path)
    assert report["outliers"] == []
    (disagreement,) = report["disagreements"]
    assert disagreement["ranks"] == [0, 1]
    assert disagreement["values"] == [1.0, 10.0]
    assert disagreement["departure"] == float(f"{math.log(10.0) / 0.1:.6g}")


def test_non_finite_on_one_rank_is_named(tmp_path: Path) -> None:
    write_rank(tmp_path, 0, rank_report(0, 2, [finding("fc1", 1.0)]))
    write_rank(tmp_path, 1, rank_report(1, 2, [non_finite_finding("fc1", 17), finding("fc1", 1.0)]))
    merge_rank_reports(tmp_path)
    report = read_global(tmp_path)
    (outlier,) = report["outliers"]
    assert outlier["kind"] == "non_finite"
    assert (outlier["rank"], outlier["module"], outlier["category"]) == (1, "fc1", "non_finite")
    assert outlier["first_nonfinite_sample"] == 17
    assert (outlier["lacking_on_ranks"], outlier["ranks_compared"]) == (1, 1)
    assert report["outlier_ranks"][0]["non_finite"] == 1
    assert report["coverage"]["outliers_found"] == {
        "non_finite": 1,
        "series_value": 0,
        "rank_specific_finding": 0,
    }


def test_non_finite_is_not_compared_with_a_rank_that_omitted_candidates(tmp_path: Path) -> None:
    # Rank 0 left non_finite candidates out (top-k): its silence says nothing about fc1.
    write_rank(tmp_path, 0, rank_report(0, 2, [finding("fc1", 1.0)], omitted_non_finite=3))
    write_rank(tmp_path, 1, rank_report(1, 2, [non_finite_finding("fc1", 17)]))
    merge_rank_reports(tmp_path)
    assert read_global(tmp_path)["outliers"] == []


def test_notable_finding_shared_by_most_ranks_is_not_rank_specific(tmp_path: Path) -> None:
    for rank in range(4):
        notable = rank != 3
        write_rank(
            tmp_path,
            rank,
            rank_report(rank, 4, [finding("fc1", 1.0, notable=notable, score=2.0)]),
        )
    merge_rank_reports(tmp_path)
    report = read_global(tmp_path)
    assert report["outliers"] == []
    (common,) = report["common_findings"]
    assert (common["listed_on_ranks"], common["notable_on_ranks"]) == (4, 3)
    assert common["strongest"] == {"rank": 0, "value": 2.0}


# ---------------------------------------------------------------------- ranks present or not
def test_one_rank_missing_still_writes_a_global_report(
    tmp_path: Path, real_report: dict[str, Any]
) -> None:
    write_rank(tmp_path, 0, as_rank(real_report, 0, 3))
    write_rank(tmp_path, 2, as_rank(real_report, 2, 3))
    path = merge_rank_reports(tmp_path)
    assert path == tmp_path / "global-report.json"
    report = read_global(tmp_path)
    ranks = report["ranks"]
    assert (ranks["world_size"], ranks["world_size_source"]) == (3, "reports")
    assert ranks["present"] == ["0", "2"] and ranks["missing"] == ["1"]
    assert (ranks["present_count"], ranks["missing_count"], ranks["unreadable_count"]) == (2, 1, 0)
    assert report["summary"]["headline"].startswith("2 of 3 ranks present, 1 missing.")
    assert [entry["rank"] for entry in report["per_rank"]] == [0, 2]
    index = (tmp_path / "global-index.md").read_text(encoding="utf-8")
    assert "- Missing, no `rank-NNN/report.json` (1): 1." in index


def test_corrupt_report_is_unreadable_and_merge_goes_on(
    tmp_path: Path, real_report: dict[str, Any]
) -> None:
    write_rank(tmp_path, 0, as_rank(real_report, 0, 3))
    corrupt = write_rank(tmp_path, 1, dumps_report(as_rank(real_report, 1, 3))[:5000])
    wrong = write_rank(tmp_path, 2, {"schema": "something-else/1"})
    merge_rank_reports(tmp_path)
    ranks = read_global(tmp_path)["ranks"]
    assert ranks["present"] == ["0"] and ranks["missing"] == []
    assert ranks["unreadable_count"] == 2
    first, second = ranks["unreadable"]
    assert (first["rank"], first["path"]) == (1, str(corrupt))
    assert first["reason"].startswith("expected JSON, got a parse error (")
    assert (second["rank"], second["path"]) == (2, str(wrong))
    assert second["reason"] == f"expected schema '{SCHEMA}', got 'something-else/1'"


def test_no_readable_report_still_writes_a_global_report(tmp_path: Path) -> None:
    write_rank(tmp_path, 0, b"")
    write_rank(tmp_path, 1, b"[1, 2]")
    merge_rank_reports(tmp_path)
    report = read_global(tmp_path)
    ranks = report["ranks"]
    assert (ranks["world_size"], ranks["world_size_source"]) == (2, "rank directories")
    assert ranks["present"] == [] and ranks["missing"] == []
    assert [u["reason"] for u in ranks["unreadable"]] == [
        "expected JSON, got a parse error (Expecting value: line 1 column 1 (char 0))",
        "expected a JSON object, got list",
    ]
    assert report["summary"]["headline"] == (
        "0 of 2 ranks present, 2 unreadable. Fewer than two readable rank reports: no rank "
        "can be compared."
    )


def test_rank_directory_without_report_and_world_size_argument(
    tmp_path: Path, real_report: dict[str, Any]
) -> None:
    write_rank(tmp_path, 0, as_rank(real_report, 0, 2))
    (tmp_path / "rank-001").mkdir()  # started, not written yet
    merge_rank_reports(tmp_path, world_size=4)
    ranks = read_global(tmp_path)["ranks"]
    assert (ranks["world_size"], ranks["world_size_source"]) == (4, "argument")
    assert ranks["missing"] == ["1-3"]
    assert ranks["notes"] == [
        "rank directories without report.json (not finished yet, or stopped before the first "
        "write): 1"
    ]


def test_truncated_sources_and_inconsistent_world_sizes_are_stated(tmp_path: Path) -> None:
    write_rank(tmp_path, 0, rank_report(0, 2, [finding("fc1", 1.0)]))
    write_rank(
        tmp_path,
        1,
        rank_report(1, 2, [finding("fc1", 1.0)], limits_hit=("max_bytes", "top_k_per_category")),
    )
    write_rank(tmp_path, 2, rank_report(2, 3, [finding("fc1", 1.0)], limits_hit=("max_series",)))
    merge_rank_reports(tmp_path)
    ranks = read_global(tmp_path)["ranks"]
    assert ranks["truncated"] == [
        {"limits_hit": ["max_bytes", "top_k_per_category"], "ranks": ["1"]},
        {"limits_hit": ["max_series"], "ranks": ["2"]},
    ]
    assert ranks["truncated_count"] == 2
    assert ranks["world_size"] == 2
    assert ranks["notes"] == [
        "rank reports state different world sizes: 2 (2 reports), 3 (1 reports)",
        "rank directories beyond world size 2: 2",
    ]


# ---------------------------------------------------------------------- bounds and memory
def test_global_report_fits_max_bytes_and_counts_what_it_left_out(tmp_path: Path) -> None:
    for rank in range(40):
        findings = [finding(f"block{i}.fc", 1.0 + 0.01 * i + 0.001 * rank) for i in range(12)]
        if rank % 7 == 3:
            findings = [non_finite_finding(f"block{i}.fc", 5) for i in range(6)] + findings
        write_rank(tmp_path, rank, rank_report(rank, 40, findings))
    path = merge_rank_reports(tmp_path, max_bytes=8_000)
    data = path.read_bytes()
    assert len(data) <= 8_000
    report = json.loads(data)
    coverage = report["coverage"]
    assert "max_bytes" in coverage["limits_hit"]
    assert coverage["omitted_by_bytes"]["per_rank"] == 40 - len(report["per_rank"]) > 0
    assert coverage["outliers_found"]["non_finite"] == 36  # ranks 3, 10, 17, 24, 31, 38 x 6
    assert report["summary"]["outlier_rank_count"] == 6
    assert dumps_report(report) == data
    assert render_global_markdown(report).startswith("# torchinstruments global report")


def inflated_report(base: dict[str, Any], target_bytes: int) -> dict[str, Any]:
    """``base`` grown to near ``target_bytes`` as a large report grows: 160 findings (8
    categories x the default top-k of 20; ``base``'s repeated as other modules), then
    events with full histories until the size is reached."""
    report = copy.deepcopy(base)
    template = report["findings"]
    findings: list[dict[str, Any]] = []
    copy_index = 0
    while len(findings) < 160:
        for entry in template[: 160 - len(findings)]:
            findings.append(dict(entry, module=f"blocks.{copy_index}.{entry['module']}"))
        copy_index += 1
    report["findings"] = findings
    events: list[dict[str, Any]] = []
    report["events"] = events
    while True:
        number = len(events) + 1
        events.append(
            {
                "id": f"E{number}",
                "shape": "step",
                "module": f"blocks.{number}.fc1",
                "history": {
                    "metric": "rms",
                    "columns": ["sample", "forward", "value"],
                    "points": [[i, 16 * i, 0.5 + i / 1000] for i in range(40)],
                },
                "interpretation": "a step " * 40,
            }
        )
        if len(dumps_report(report)) > target_bytes:
            events.pop()
            return report


def test_merging_64_default_size_reports_keeps_memory_near_one_report(
    tmp_path: Path, real_report: dict[str, Any]
) -> None:
    big = inflated_report(real_report, 250_000)
    text = dumps_report(as_rank(big, 0, 64)).decode()
    marker = '"run": {\n    "rank": 0,'
    assert text.count(marker) == 1
    for rank in range(64):
        write_rank(tmp_path, rank, text.replace(marker, f'"run": {{\n    "rank": {rank},').encode())
    one_file = tmp_path / "rank-000" / "report.json"
    size = one_file.stat().st_size
    assert 240_000 < size <= 256_000

    tracemalloc.start()
    try:
        json.loads(one_file.read_bytes())
        _, one_report_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        merge_rank_reports(tmp_path)
        _, merge_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    merge_peak -= before
    report = read_global(tmp_path)
    assert report["ranks"]["present"] == ["0-63"]
    assert len((tmp_path / "global-report.json").read_bytes()) <= 256_000
    # Near one parsed report's footprint (the per-series summaries of 64 ranks add the
    # rest), far below 64 parsed reports.
    assert merge_peak < 3 * one_report_peak, (merge_peak, one_report_peak)
    assert merge_peak < 64 * one_report_peak / 20, (merge_peak, one_report_peak)


# ---------------------------------------------------------------------- errors and CLI
def test_merge_errors_name_argument_expected_and_given(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ReportReadError, match=r"directory must be an existing directory .* \(not"):
        merge_rank_reports(missing)
    with pytest.raises(ReportReadError, match=r"must hold rank-NNN/ directories .* with none"):
        merge_rank_reports(tmp_path)
    with pytest.raises(ConfigError, match=r"merge_rank_reports.max_bytes must be an int >= 4096"):
        merge_rank_reports(tmp_path, max_bytes=100)
    with pytest.raises(ConfigError, match=r"merge_rank_reports.threshold must be a finite number"):
        merge_rank_reports(tmp_path, threshold=0.0)
    with pytest.raises(ConfigError, match=r"merge_rank_reports.world_size must be an int >= 1"):
        merge_rank_reports(tmp_path, world_size=0)


def test_cli_merge_prints_where_it_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], real_report: dict[str, Any]
) -> None:
    write_rank(tmp_path, 0, as_rank(real_report, 0, 2))
    write_rank(tmp_path, 1, as_rank(real_report, 1, 2))
    out = tmp_path / "merged"
    assert cli_main(["merge", str(tmp_path), "--output-dir", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"wrote {out / 'global-report.json'}"
    assert lines[1] == f"wrote {out / 'global-index.md'}"
    assert lines[2] == read_global(out)["summary"]["headline"]

    assert cli_main(["merge", str(tmp_path / "nope")]) == 1
    error = capsys.readouterr().err
    assert error.startswith("torchinstruments merge: error: merge_rank_reports: directory must")
    assert cli_main([]) == 2
    assert "merge" in capsys.readouterr().err
    assert cli_main(["merge"]) == 2
    assert cli_main(["--help"]) == 0


def test_python_dash_m_merge(tmp_path: Path, real_report: dict[str, Any]) -> None:
    write_rank(tmp_path, 0, as_rank(real_report, 0, 1))
    result = subprocess.run(
        [sys.executable, "-m", "torchinstruments", "merge", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"wrote {tmp_path / 'global-report.json'}"


# ---------------------------------------------------------------------- real process groups
def rescaled_worker(rank: int, world: int, out_dir: str, bad_rank: int) -> dict[str, Any]:
    """DDP training with ``rank_policy="all"``; ``bad_rank`` gets inputs scaled by 10."""
    model = torch.nn.parallel.DistributedDataParallel(seeded_net())
    inject_observer(model, output_dir=out_dir, sampling=1, rank_policy="all")
    train(model, rank_batches(rank, scale=10.0 if rank == bad_rank else 1.0))
    remove_observer(model)
    return {}


def test_rank_fed_rescaled_inputs_is_the_named_outlier(tmp_path: Path) -> None:
    out = tmp_path / "stats"
    # Three ranks: with two, a constant scale difference cannot say which rank is odd.
    run_ranks(rescaled_worker, 3, tmp_path, str(out), 2)
    merge_rank_reports(out)
    report = read_global(out)
    assert report["ranks"]["present"] == ["0-2"]
    assert report["summary"]["outlier_ranks"] == ["2"]
    assert {entry["rank"] for entry in report["outliers"]} == {2}
    fc1 = [
        o
        for o in report["outliers"]
        if (o["module"], o["signal"], o["metric"]) == ("fc1", "activation", "rms")
    ]
    assert len(fc1) == 1 and fc1[0]["kind"] == "series_value"
    assert fc1[0]["departure"] > 5.0
    assert 5.0 < fc1[0]["value"] / fc1[0]["others_median"] < 20.0


def example_worker(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    example = sys.modules["distributed_training_example"]
    return {"status": example.main(["--output-dir", out_dir, "--rescale-rank", "1"])}


def test_example_ranks_then_cli_merge_name_the_rescaled_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Loaded before forking, so the ranks inherit it.
    load_example("distributed_training.py", "distributed_training_example")
    out = tmp_path / "stats"
    results = run_ranks(example_worker, 2, tmp_path, str(out))
    assert [r["status"] for r in results] == [0, 0]
    capsys.readouterr()
    assert cli_main(["merge", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"wrote {out / 'global-report.json'}"
    report = read_global(out)
    assert report["ranks"]["present"] == ["0-1"]
    assert report["summary"]["outlier_ranks"] == ["1"]
    drift = [
        o
        for o in report["outliers"]
        if o["kind"] == "rank_specific_finding" and o["category"] == "activation_scale_drift"
    ]
    assert [(o["rank"], o["module"], o["signal"]) for o in drift] == [(1, "inp", "activation")]
