"""Run the real-model fault benchmark and print its tables: ``python -m benchmarks.real_faults``."""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import torch

from benchmarks.faults.score import (
    ScenarioScore,
    describe_finding,
    format_diagnosis,
    format_table,
    score,
    totals,
)

from .comparison import CompareResult, compare_pair, compare_totals_line, format_compare_table
from .models import FAMILIES
from .scenarios import (
    MIN_FAULT_STEP,
    MIN_SAMPLES_AFTER,
    QUICK_STEPS,
    SCENARIOS,
    STEPS,
    RunResult,
    Scenario,
    early_findings,
    run_named_scenario,
    run_scenario,
    sampled_after,
)

COMMAND = "python -m benchmarks.real_faults"
#: Bound on report.json (the library's default ``ReportConfig.max_bytes``).
REPORT_MAX_BYTES = 256_000


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=COMMAND,
        description="Inject known faults into upstream models (GPT-2, ResNet, ViT) trained "
        "with plain loops, transformers.Trainer and accelerate, observe each run with "
        "torchinstruments' default settings, and score whether report.json names the "
        "origin module first.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"CI smoke test: one fault and one control per loop, {QUICK_STEPS} steps",
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="run only this scenario (repeatable); see --list",
    )
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"training steps per run (default {STEPS}, {QUICK_STEPS} with --quick)",
    )
    parser.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument(
        "--keep-reports",
        metavar="DIR",
        help="keep each run's output_dir (report.json, index.md, series.json) under DIR/NAME/",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: stable when other processes share the cores)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="runs at a time, each in its own process (default: the CPU cores this "
        "process may use, divided by --threads)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also compare each fault run with its family's same-seed control, and the two "
        "controls of each family, with torchinstruments.compare_runs",
    )
    return parser


def _command(args: argparse.Namespace) -> str:
    parts = [COMMAND]
    if args.quick:
        parts.append("--quick")
    for name in args.only or []:
        parts += ["--only", name]
    if args.steps is not None:
        parts += ["--steps", str(args.steps)]
    if args.seed:
        parts += ["--seed", str(args.seed)]
    if args.threads != 1:
        parts += ["--threads", str(args.threads)]
    if args.jobs is not None:
        parts += ["--jobs", str(args.jobs)]
    if args.compare:
        parts.append("--compare")
    return " ".join(parts)


def _list() -> None:
    for s in SCENARIOS:
        origin = "-" if s.origin is None else ",".join(s.origin)
        fault = s.fault.describe() if s.fault is not None else "control"
        if s.seed_offset:
            fault += f" (seed +{s.seed_offset})"
        step = s.fault_step(STEPS)
        at = "" if step is None else f" @ step {step}"
        quick = " [quick]" if s.quick else ""
        expected = ",".join(s.expected) or "-"
        print(
            f"{s.name:28s} {s.family:12s} {s.loop:10s} {fault}{at} | origin {origin} "
            f"| expected {expected}{quick}"
        )


def _same_seed_control(family: str) -> Scenario:
    return next(s for s in SCENARIOS if s.family == family and s.control and not s.seed_offset)


def _chosen(args: argparse.Namespace) -> list[Scenario]:
    if args.only:
        chosen = [s for s in SCENARIOS if s.name in args.only]
    else:
        chosen = [s for s in SCENARIOS if s.quick or not args.quick]
    if args.compare:
        needed = {_same_seed_control(s.family).name for s in chosen if not s.control}
        missing = needed - {s.name for s in chosen}
        if missing:
            print(f"--compare: also running the baseline control(s) {sorted(missing)}")
        names = {s.name for s in chosen} | needed
        chosen = [s for s in SCENARIOS if s.name in names]
    return chosen


def _brief(finding: dict[str, Any]) -> str:
    ranking = finding.get("ranking") or {}
    brief = {
        "category": finding.get("category"),
        "rank": finding.get("rank"),
        "module": finding.get("module"),
        "signal": finding.get("signal"),
        "metric": finding.get("metric"),
        "basis": ranking.get("basis"),
        "value": ranking.get("value"),
    }
    return f"{describe_finding(brief)} @forward {finding.get('change_forward')}"


def format_extras(results: list[RunResult]) -> str:
    """Per run: loop, first faulty forward, samples after it, notable findings dated
    before the fault (``early``), the probe's origin and agreement, report size, time."""
    header = (
        "scenario",
        "loop",
        "fault fwd",
        "samples after",
        "early",
        "probe found (agrees)",
        "report bytes",
        "seconds",
    )
    rows: list[tuple[str, ...]] = []
    for r in results:
        if r.probe is None:
            probe = "-"
        else:
            probe = f"{r.probe.found()} ({'yes' if r.probe.agrees else 'NO'})"
        rows.append(
            (
                r.scenario.name,
                r.scenario.loop,
                "-" if r.first_faulty_forward is None else str(r.first_faulty_forward),
                "-" if r.samples_after_fault is None else str(r.samples_after_fault),
                "-"
                if r.first_faulty_forward is None
                else str(len(early_findings(r.report, r.first_faulty_forward))),
                probe,
                str(r.report_bytes),
                f"{r.seconds:.1f}",
            )
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(header)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip() for row in rows]
    return "\n".join(lines)


def _probe_warnings(results: list[RunResult]) -> list[str]:
    warnings: list[str] = []
    for r in results:
        if r.probe is None or r.probe.agrees:
            continue
        found = r.probe.origin_found.describe() if r.probe.origin_found else "no change"
        warnings.append(
            f"WARNING probe disagrees with the declared origin of {r.scenario.name}: "
            f"{r.probe.note}; first change {found}"
        )
    return warnings


def _json_safe(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _scenario_json(result: RunResult, scored: ScenarioScore) -> dict[str, Any]:
    data = scored.to_json()
    early = early_findings(result.report, result.first_faulty_forward)
    data.update(
        {
            "loop": result.scenario.loop,
            "seed": result.seed,
            "first_faulty_forward": result.first_faulty_forward,
            "samples_after_fault": result.samples_after_fault,
            "early": len(early) if result.first_faulty_forward is not None else None,
            "early_findings": [_brief(f) for f in early],
            "probe": None if result.probe is None else result.probe.to_json(),
            "report_bytes": result.report_bytes,
            "loss_before": _json_safe(result.loss_before),
            "loss_end": _json_safe(result.loss_end),
        }
    )
    return data


def _run_compare(results: list[RunResult], directory: Path) -> list[CompareResult]:
    by_name = {r.scenario.name: r for r in results}
    comparisons: list[CompareResult] = []
    for family in FAMILIES:
        control = by_name.get(_same_seed_control(family).name)
        for r in results:
            if r.scenario.family != family or r.scenario.control or control is None:
                continue
            assert r.output_dir is not None and control.output_dir is not None
            comparisons.append(
                compare_pair(
                    control.output_dir,
                    r.output_dir,
                    directory / f"{r.scenario.name}__vs__{control.scenario.name}",
                    baseline=control.scenario.name,
                    candidate=r.scenario.name,
                    origin=r.scenario.origin,
                    first_faulty_forward=r.first_faulty_forward,
                )
            )
        others = [
            r
            for r in results
            if r.scenario.family == family and r.scenario.control and r.scenario.seed_offset
        ]
        for other in others:
            if control is None:
                continue
            assert other.output_dir is not None and control.output_dir is not None
            comparisons.append(
                compare_pair(
                    control.output_dir,
                    other.output_dir,
                    directory / f"{other.scenario.name}__vs__{control.scenario.name}",
                    baseline=control.scenario.name,
                    candidate=other.scenario.name,
                    origin=None,
                    first_faulty_forward=None,
                )
            )
    return comparisons


def _cores() -> int:
    """CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _run_all(
    chosen: list[Scenario],
    *,
    steps: int,
    seed: int,
    output_dir_of: dict[str, Path | None],
    threads: int,
    jobs: int,
    done: Any,
) -> list[RunResult]:
    """Run the scenarios, ``jobs`` at a time (in this process when 1), calling
    ``done(result)`` as each finishes; return the results in the order of ``chosen``."""
    if jobs == 1:
        results = []
        for scenario in chosen:
            result = run_scenario(
                scenario, steps=steps, seed=seed, output_dir=output_dir_of[scenario.name]
            )
            done(result)
            results.append(result)
        return results
    by_name: dict[str, RunResult] = {}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures: list[Future[RunResult]] = [
            pool.submit(run_named_scenario, s.name, steps, seed, output_dir_of[s.name], threads)
            for s in chosen
        ]
        for future in as_completed(futures):
            result = future.result()
            done(result)
            by_name[result.scenario.name] = result
    return [by_name[s.name] for s in chosen]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see ``--help``); returns the process exit status (0)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list:
        _list()
        return 0
    known = {s.name for s in SCENARIOS}
    unknown = sorted(set(args.only or []) - known)
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; known: {sorted(known)}")
    steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else STEPS)
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    chosen = _chosen(args)
    jobs = args.jobs if args.jobs is not None else max(1, _cores() // args.threads)
    jobs = min(jobs, len(chosen)) or 1
    for s in chosen:
        step, first = s.fault_step(steps), s.first_faulty_forward(steps)
        if step is None or first is None:
            continue
        after = sampled_after(first, steps)
        if step < MIN_FAULT_STEP or after < MIN_SAMPLES_AFTER:
            print(
                f"WARNING {s.name}: fault at step {step} with {after} sampled forward(s) "
                f"after it (want step >= {MIN_FAULT_STEP} and >= {MIN_SAMPLES_AFTER} samples)"
            )
    torch.set_num_threads(args.threads)
    print(
        f"real-model fault benchmark: {len(chosen)} run(s), {steps} steps each, default "
        f"sampling, seed {args.seed}, {args.threads} thread(s) per run, {jobs} at a time"
    )
    for family in FAMILIES.values():
        print(f"  {family.name} [{family.loop}]: {family.description}")
    started = time.perf_counter()
    keep = Path(args.keep_reports) if args.keep_reports else None
    scratch = tempfile.TemporaryDirectory(prefix="real-faults-") if keep is None else None
    runs_dir = keep if keep is not None else Path(scratch.name) if scratch else None
    results: list[RunResult] = []
    scores: list[ScenarioScore] = []
    comparisons: list[CompareResult] = []

    def done(result: RunResult) -> None:
        scenario = result.scenario
        scored = score(scenario, result.report, result)
        if scenario.control:
            mark = f"control, {scored.notable} notable"
        else:
            early = len(early_findings(result.report, result.first_faulty_forward))
            probe = result.probe
            verdict = "probe ok" if probe is not None and probe.agrees else "probe DISAGREES"
            mark = f"RR {scored.reciprocal_rank:.2f}, early {early}, {verdict}"
        print(f"  ran {scenario.name} in {result.seconds:.1f} s ({mark})", flush=True)

    try:
        output_dir_of = {
            s.name: runs_dir / s.name if (keep or args.compare) and runs_dir else None
            for s in chosen
        }
        results = _run_all(
            chosen,
            steps=steps,
            seed=args.seed,
            output_dir_of=output_dir_of,
            threads=args.threads,
            jobs=jobs,
            done=done,
        )
        scores = [score(r.scenario, r.report, r) for r in results]
        if args.compare and runs_dir is not None:
            comparisons = _run_compare(results, runs_dir / "compare")
    finally:
        if scratch is not None:
            scratch.cleanup()
    elapsed = time.perf_counter() - started
    print()
    print(format_table(scores))
    print()
    print(format_extras(results))
    print()
    diagnosis = format_diagnosis(scores)
    if diagnosis:
        print("Misses (what the report led with instead):")
        print(diagnosis)
        print()
    early_lines = [
        f"{r.scenario.name} (fault at forward {r.first_faulty_forward}): {_brief(f)}"
        for r in results
        for f in early_findings(r.report, r.first_faulty_forward)
    ]
    if early_lines:
        print("Notable findings dated before the fault:")
        print("\n".join(f"  {line}" for line in early_lines))
        print()
    for warning in _probe_warnings(results):
        print(warning)
    oversized = [r.scenario.name for r in results if r.report_bytes > REPORT_MAX_BYTES]
    if oversized:
        print(f"WARNING report.json over {REPORT_MAX_BYTES} bytes: {oversized}")
    if comparisons:
        print()
        print("Compare check (baseline: the family's same-seed control):")
        print(format_compare_table(comparisons))
        print(compare_totals_line(comparisons))
    print()
    total = totals(scores)
    early_total = sum(
        len(early_findings(r.report, r.first_faulty_forward))
        for r in results
        if not r.scenario.control
    )
    print(f"{total.line()} | early={early_total}")
    print(f"({elapsed:.0f} s; reproduce with: {_command(args)})")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "command": _command(args),
            "steps": steps,
            "seed": args.seed,
            "threads": args.threads,
            "jobs": jobs,
            "sampling": "default",
            "seconds": elapsed,
            "totals": {
                "faults": total.faults,
                "hit@1": total.hit1,
                "headline@1": total.headline1,
                "hit@3": total.hit3,
                "mrr": total.mrr,
                "controls": total.controls,
                "control_notable": total.control_notable,
                "control_non_finite": total.control_non_finite,
                "early": early_total,
                "probe_disagreements": sum(
                    1 for r in results if r.probe is not None and not r.probe.agrees
                ),
            },
            "scenarios": [_scenario_json(r, s) for r, s in zip(results, scores, strict=True)],
            "compare": [c.to_json() for c in comparisons],
        }
        path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
