"""The report: byte bound, omitted counts, determinism, JSON safety, cadence, index.md."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import ResidualNet, make_batches, read_report, train
from torchinstruments import ReportConfig, inject_observer, remove_observer
from torchinstruments.report import dumps_report


def wide_model(blocks: int) -> nn.Module:
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(blocks)))


def observe_wide(tmp_path: Path, config: ReportConfig, steps: int = 3) -> dict:
    torch.manual_seed(0)
    model = wide_model(2_000)
    inject_observer(model, output_dir=tmp_path, sampling=1, report_config=config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(2, 4)).pow(2).mean().backward()
        optimizer.step()
    remove_observer(model)
    return read_report(tmp_path)


def test_two_thousand_modules_fit_the_byte_limit_and_count_what_was_left_out(
    tmp_path: Path,
) -> None:
    report = observe_wide(tmp_path, ReportConfig(top_k_per_category=1_000, max_bytes=4_096))
    size = (tmp_path / "report.json").stat().st_size
    assert size <= 4_096
    assert size == len(dumps_report(report))
    coverage = report["coverage"]
    assert coverage["modules_observed"] == 2_001
    assert coverage["modules_selected"] == 2_001
    omitted_by_bytes = sum(v["by_bytes"] for v in coverage["findings_omitted"].values())
    assert omitted_by_bytes > 0
    assert "max_bytes" in coverage["limits_hit"]
    returned = sum(coverage["findings_returned"].values())
    assert returned == len(report["findings"])
    for category, counts in coverage["findings_omitted"].items():
        kept = coverage["findings_returned"][category]
        left_out = counts["by_bytes"] + counts["by_top_k"] + counts["not_notable"]
        assert kept + left_out == coverage["candidates"][category]


def test_a_quiet_wide_model_lists_three_rows_per_category_and_counts_the_rest(
    tmp_path: Path,
) -> None:
    report = observe_wide(tmp_path, ReportConfig(), steps=2)
    coverage = report["coverage"]
    drift = coverage["findings_omitted"]["activation_scale_drift"]
    # Nothing is notable: three compact rows per category.
    assert coverage["findings_returned"]["activation_scale_drift"] == 3
    assert coverage["candidates"]["activation_scale_drift"] == 2_001
    # Rows below the noise floor past the three listed are counted, not a limit hit.
    assert (drift["by_top_k"], drift["not_notable"]) == (0, 2_001 - 3)
    assert "top_k_per_category" not in coverage["limits_hit"]
    assert report["events"] == []
    assert (tmp_path / "report.json").stat().st_size <= 16_000


def test_small_byte_limit_keeps_a_round_robin_prefix(tmp_path: Path) -> None:
    model = ResidualNet()
    inject_observer(
        model, output_dir=tmp_path, sampling=1, report_config=ReportConfig(max_bytes=8_192)
    )
    train(model, make_batches(30))
    remove_observer(model)
    raw = (tmp_path / "report.json").read_bytes()
    assert len(raw) <= 8_192
    report = json.loads(raw)
    ranks: dict[str, list[int]] = {}
    for finding in report["findings"]:
        ranks.setdefault(finding["category"], []).append(finding["rank"])
    for values in ranks.values():
        assert values == list(range(values[0], values[0] + len(values)))


def _strip_times(report: dict) -> dict:
    report = json.loads(json.dumps(report))
    report.pop("generated_at")
    report["run"].pop("elapsed_s")
    report["run"].pop("telemetry_seconds")
    report["run"].pop("started_at")
    return report


def test_same_run_gives_the_same_report(tmp_path: Path) -> None:
    reports = []
    for attempt in range(2):
        torch.manual_seed(0)
        model = ResidualNet()
        inject_observer(model, output_dir=tmp_path / str(attempt), sampling=1)
        train(model, make_batches(40))
        remove_observer(model)
        reports.append(_strip_times(read_report(tmp_path / str(attempt))))
    assert reports[0] == reports[1]


def test_the_report_says_whether_it_is_the_final_one(tmp_path: Path) -> None:
    """``run.final`` and ``index.md`` tell a report written while training ran (here the
    first, written at injection) from the one written at removal: a reader of a report
    numbered 6 could not tell whether the run was still going."""
    model = ResidualNet()
    inject_observer(model, output_dir=tmp_path, sampling=1)
    train(model, make_batches(4))
    during = read_report(tmp_path)
    index = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert (during["run"]["report_number"], during["run"]["final"]) == (1, False)
    assert "Written while training ran: a later report replaces it." in index
    remove_observer(model)
    after = read_report(tmp_path)
    index = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert after["run"]["final"] is True and after["run"]["report_number"] > 1
    assert (
        "It is the final report: training through the observer has ended "
        "(remove_observer was called)." in index
    )


def test_non_finite_values_never_reach_the_json(tmp_path: Path) -> None:
    model = ResidualNet()
    inject_observer(model, output_dir=tmp_path, sampling=1)
    for step, (x, y) in enumerate(make_batches(8)):
        with torch.no_grad():
            model.fc.bias[0] = float("inf") if step == 5 else 0.0
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()  # no update: the run recovers
    remove_observer(model)
    text = (tmp_path / "report.json").read_text(encoding="utf-8")

    def refuse(name: str) -> float:
        raise ValueError(f"{name} in report.json")

    report = json.loads(text, parse_constant=refuse)
    first = report["summary"]["first_non_finite"]
    assert (first["module"], first["sample"], first["recovered"]) == ("fc", 5, True)
    non_finite = [f for f in report["findings"] if f["category"] == "non_finite"]
    assert non_finite[0]["module"] == "fc"
    event = next(e for e in report["events"] if e["id"] == non_finite[0]["event"])
    assert (event["module"], event["shape"]) == ("fc", "non_finite")
    activation = {e["module"] for e in event["echoes"] if e["signal"] == "activation"}
    assert activation == {"act", "head"}  # <root> is head's tensor
    # The output gradients that went non-finite at the same sample are this event too.
    assert {f["category"] for f in event["findings"]} == {"non_finite"}
    assert len(event["findings"]) == 2


def test_quiet_run_says_no_finding_stands_out(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ResidualNet()
    inject_observer(model, output_dir=tmp_path, sampling=1)
    train(model, make_batches(60), lr=0.01)
    remove_observer(model)
    report = read_report(tmp_path)
    assert report["summary"]["notable_findings"] == 0
    index = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert "No finding stands out" in index
    assert "infer" in index and "warmup_complete" in index
    # The loss gradient ranks nothing against itself: in report.json, not in the table.
    zero = [
        f
        for f in report["findings"]
        if not f["notable"] and not (f.get("ranking") or {}).get("value")
    ]
    assert any(f["module"] == "<root>" and f["signal"] == "grad_output" for f in zero)
    table = index.split("## Other ranked series (below their noise floor)")[1]
    table = table.split("## Coverage and limits")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(report["findings"]) - len(zero)  # the header, then rows
    assert " 0.0 |" not in table and "`<root>` | 0 | grad_output" not in table
    assert f"{len(zero)} more with a ranking of 0 in report.json." in table
    listed = len(report["findings"]) - len(zero)
    assert (
        f"- Findings in report.json: {len(report['findings'])} (0 notable, {listed} below "
        f"their noise floor, listed above, {len(zero)} with a ranking of 0, in report.json "
        "only); limits that removed evidence: " in index
    )


def test_run_without_a_training_forward_says_so(tmp_path: Path) -> None:
    """Training in eval mode is not a healthy run: the headline says nothing was seen."""
    model = ResidualNet().eval()
    inject_observer(model, output_dir=tmp_path, sampling=1)
    for x, y in make_batches(5):
        nn.functional.mse_loss(model(x), y).backward()
    remove_observer(model)
    report = read_report(tmp_path)
    assert report["summary"]["headline"].startswith(
        "No training forward was observed (5 forwards skipped as evaluation"
    )
    assert report["findings"] == []


def test_modules_that_were_never_called_are_named(tmp_path: Path) -> None:
    """nn.MultiheadAttention uses its out_proj's weights through functional code: the
    module is selected but never called, and the report says which ones."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    inject_observer(model, output_dir=tmp_path, sampling=1)
    for _ in range(3):
        model(torch.randn(2, 5, 16)).sum().backward()
    remove_observer(model)
    coverage = read_report(tmp_path)["coverage"]
    missing = ["layers.0.self_attn.out_proj", "layers.1.self_attn.out_proj"]
    assert coverage["modules_not_observed"] == missing
    assert coverage["modules_selected"] - coverage["modules_observed"] == len(missing)
    index = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert (
        "Never ran in a sampled forward, observed through their parent: "
        "`layers.0.self_attn.out_proj` by `layers.0.self_attn`, "
        "`layers.1.self_attn.out_proj` by `layers.1.self_attn`."
    ) in index
    assert "Not observed (never called" not in index  # named once, with its parent


def test_report_is_rewritten_during_training_and_survives_a_kill(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import time, torch
        from torch import nn
        from torchinstruments import ReportConfig, inject_observer
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        inject_observer(model, output_dir={str(tmp_path)!r}, sampling=1,
                        report_config=ReportConfig(rewrite_interval_s=0.05))
        print("ready", flush=True)
        while True:
            model(torch.randn(8, 4)).pow(2).mean().backward()
            time.sleep(0.001)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        report_path = tmp_path / "report.json"
        while not report_path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    report = json.loads(report_path.read_text(encoding="utf-8"))
    assert report["coverage"]["samples_observed"] > 0
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    # The link to the complete generation shown; at most the previous one (killed before
    # deleting it), one being written, and the new link of a switch beside it.
    generation = os.readlink(tmp_path / ".current")
    assert sorted(p.name for p in (tmp_path / generation).iterdir()) == [
        "index.md",
        "report.json",
        "series.json",
    ]
    # The killed run's lock names a process that is gone: the next run takes it over.
    ours = re.compile(r"\.current|\.generation-\d{6}|\.\.current\.[0-9a-f]{8}|\.writer\.lock")
    assert all(ours.fullmatch(name) for name in leftovers), leftovers
    assert sum(name.startswith(".generation-") for name in leftovers) <= 3, leftovers


@pytest.mark.parametrize("crash", [False, True], ids=["ends", "raises"])
def test_report_is_written_at_interpreter_exit(tmp_path: Path, crash: bool) -> None:
    """The final report says how the run ended: at exit, or at exit after an exception
    that nothing caught (named, in report.json and index.md)."""
    script = textwrap.dedent(
        f"""
        import torch
        from torch import nn
        from torchinstruments import inject_observer
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        inject_observer(model, output_dir={str(tmp_path)!r}, sampling=1)
        for _ in range(3):
            model(torch.randn(8, 4)).pow(2).mean().backward()
        if {crash}:
            raise ValueError("the data loader ran dry")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == (1 if crash else 0), done.stderr
    run = read_report(tmp_path)["run"]
    assert (run["final"], run["ended_by"]) == (
        True,
        "uncaught_exception" if crash else "interpreter_exit",
    )
    assert read_report(tmp_path)["coverage"]["samples_observed"] == 3
    index = (tmp_path / "index.md").read_text(encoding="utf-8")
    if crash:
        assert run["uncaught_exception"] == "ValueError: the data loader ran dry"
        assert (
            "It is the final report: training through the observer has ended (at "
            "interpreter exit, after an exception that nothing caught: ValueError: the "
            "data loader ran dry)." in index
        )
    else:
        assert "uncaught_exception" not in run
        assert "has ended (at interpreter exit)." in index


def train_for_series_json(
    model: nn.Module, directory: Path, max_bytes: int
) -> tuple[bytes, dict[str, Any]]:
    """Three sampled steps of ``model`` (4 input features); series.json, raw and parsed."""
    config = ReportConfig(series_summary_max_bytes=max_bytes)
    inject_observer(model, output_dir=directory, sampling=1, report_config=config)
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
    remove_observer(model)
    raw = (directory / "series.json").read_bytes()
    return raw, json.loads(raw)


@pytest.mark.parametrize("max_bytes", [2_000_000, 6_000], ids=["all-rows", "bounded"])
def test_series_json_is_the_compact_encoding_of_the_summary(tmp_path: Path, max_bytes: int) -> None:
    """series.json is assembled from the rows encoded while bounding it: byte for byte
    what json.dumps of the summary writes, within the bound, rows past it counted."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    raw, summary = train_for_series_json(model, tmp_path, max_bytes)
    expected = json.dumps(summary, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    assert raw == expected.encode()
    assert len(raw) <= max_bytes
    if max_bytes == 6_000:
        assert summary["omitted"] > 0 and summary["series"]
    else:
        assert summary["omitted"] == 0
    # The report written with it counts the same omitted rows (not the previous write's).
    assert read_report(tmp_path)["coverage"]["series_summary_omitted"] == summary["omitted"]


def test_series_json_counts_bytes_not_characters(tmp_path: Path) -> None:
    """Module names outside ASCII take several UTF-8 bytes per character: the bound
    on series.json is in bytes."""
    torch.manual_seed(0)
    model = nn.Sequential()
    for i in range(12):
        model.add_module(f"层{i}_" + "编码器模块" * 20, nn.Linear(4, 4))
    raw, summary = train_for_series_json(model, tmp_path, 20_000)
    assert len(raw) <= 20_000
    assert summary["series"] and summary["omitted"] > 0
    assert len(raw) > 20_000 - 2_500  # filled up to about one row short of the bound


def test_index_names_the_process_in_standard_terms(tmp_path: Path) -> None:
    """The run line says "Single process" or the distributed rank and world size (it read
    "Rank 0 of 1", which looked like a finding's rank)."""
    from torchinstruments.report import render_markdown

    model = ResidualNet()
    inject_observer(model, output_dir=tmp_path, sampling=1)
    train(model, make_batches(2))
    remove_observer(model)
    report = read_report(tmp_path)
    index = (tmp_path / "index.md").read_text(encoding="utf-8")
    forwards = report["run"]["forwards_seen"]
    assert f"Single process; {forwards} training root forwards" in index
    report["run"].update(rank=3, world_size=8)
    assert f"Distributed rank 3 (world size 8); {forwards} training root forwards" in (
        render_markdown(report)
    )


def test_a_notable_step_carries_its_cross_section(tmp_path: Path) -> None:
    """At the step's sample, the finding's module and its forward-order neighbours, each
    against its own trend: the module before it did not move (ratio about 1), the
    faulty one moved about 4x, and it is marked as the finding."""
    torch.manual_seed(0)
    first = nn.Linear(8, 16)
    faulty = nn.Linear(16, 16)
    model = nn.Sequential(first, faulty, nn.Tanh(), nn.Linear(16, 1))
    inject_observer(model, output_dir=tmp_path, sampling=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    for step in range(90):
        if step == 60:
            with torch.no_grad():
                faulty.weight.mul_(4.0)
        x = torch.randn(32, 8, generator=generator)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    remove_observer(model)
    report = read_report(tmp_path)
    finding = next(
        f for f in report["findings"] if f["category"] == "activation_scale_drift" and f["notable"]
    )
    assert finding["module"] == "1"
    assert finding["change_sample"] == 60 and finding["change_forward"] == 60
    event = next(e for e in report["events"] if e["id"] == finding["event"])
    assert event["cross_section"]["sample"] == 60
    rows = event["cross_section"]["rows"]
    # Forward order; <root> returns module 3's tensor, one series named by both.
    assert [r["module"] for r in rows] == ["0", "1", "2", "3"]
    assert [r["offset"] for r in rows] == [-1, 0, 1, 2]
    assert event["also_named"] == [] and event["module_kind"] == "Linear"
    by_module = {r["module"]: r for r in rows}
    assert by_module["1"]["ratio"] == pytest.approx(4.0, rel=0.1)
    assert by_module["0"]["ratio"] == pytest.approx(1.0, abs=0.05)
    assert abs(by_module["0"]["in_spreads"]) < 3 < by_module["1"]["in_spreads"]


def test_an_event_without_an_onset_is_told_over_the_whole_run() -> None:
    from torchinstruments._report_markdown import _markdown_event

    event = {
        "id": "E2",
        "shape": "volatility",
        "module": "inp",
        "call_index": 0,
        "signal": "grad_output",
        "metric": "rms",
        "onset": {"sample": None, "forward": None, "after_forward": None},
        "interpretation": "volatile",
        "next_experiment": "lower the learning rate",
        "findings": [{"category": "relative_volatility", "rank": 1, "metric": "rms"}],
    }
    heading = _markdown_event(event)[0]
    assert heading == (
        "### E2: volatility at `inp` (call 0), grad_output.rms, "
        "over the whole run (no single onset)"
    )


def test_the_headline_keeps_code_spans_as_they_are_and_escapes_the_text() -> None:
    from torchinstruments._report_markdown import md_spans

    headline = (
        "1 notable finding(s) in 1 event(s); the first (E1) is a model-wide event at <x> "
        "(`<model>`)"
    )
    assert md_spans(headline) == (
        "1 notable finding(s) in 1 event(s); the first (E1) is a model-wide event at &lt;x> "
        "(`<model>`)"
    )
    assert md_spans("a ``b`c`` d") == "a ``b`c`` d"


def test_at_the_same_sample_non_finite_values_come_first_in_a_round() -> None:
    """The round-robin key: at one sample a non-finite finding precedes a scale change of
    any size (it is dated exactly, and the finite values after it moved with it); an
    earlier change still comes first, and a gradient counts as 5 samples later."""
    from torchinstruments.report import _round_key

    scale = _round_key(True, 39, False, "activation", 200.0)
    non_finite = _round_key(True, 39, False, "activation", 0.0, non_finite=True)
    earlier = _round_key(True, 38, False, "activation", 10.0)
    gradient = _round_key(True, 36, False, "grad_output", 500.0)
    assert sorted([scale, non_finite, earlier, gradient]) == [earlier, non_finite, scale, gradient]


def test_index_counts_the_findings_it_does_not_list() -> None:
    """A run whose findings all rank 0 lists none: the coverage line says where they are."""
    from torchinstruments._report_markdown import _returned_text

    assert _returned_text(0, 0, 6) == "6 (0 notable, 6 with a ranking of 0, in report.json only)"
    assert _returned_text(2, 3, 0) == "5 (2 notable, 3 below their noise floor, listed above)"


def test_a_report_over_its_bytes_leaves_out_compiled_counts_at_zero_before_sections(
    tmp_path: Path,
) -> None:
    """Past its findings, a report too large drops the compiled-capture fields that are
    zero (they tell nothing) before it empties any section; fields that are not zero
    stay, and each step is named under ``coverage.sections_omitted``."""
    from torchinstruments._snapshot import CompiledCaptureCounts
    from torchinstruments.report import _fit_sections

    report = observe_wide(tmp_path, ReportConfig(top_k_per_category=1_000, max_bytes=4_096))
    assert report["coverage"]["sections_omitted"] == [
        "coverage.compiled_capture: fields at zero",
        "config",
    ]
    written = report["coverage"]["compiled_capture"]  # counts of the process: some may be set
    assert written["mode"] == "unused" and all(written.values())
    report["coverage"]["compiled_capture"] = dataclasses.asdict(
        CompiledCaptureCounts(root_hooks_traced=3)
    )
    del report["coverage"]["sections_omitted"]
    size = len(dumps_report(report))
    fitted = _fit_sections(copy.deepcopy(report), size - 1)
    assert fitted["coverage"]["compiled_capture"] == {
        "mode": "unused",
        "root_hooks_traced": 3,
        "compiled_code_invalidation": "none",
    }
    assert fitted["coverage"]["sections_omitted"] == ["coverage.compiled_capture: fields at zero"]
    assert len(dumps_report(fitted)) <= size - 1
    assert fitted["config"] == report["config"]
