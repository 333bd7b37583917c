"""Run the fault benchmark and print its table: ``python -m benchmarks.faults``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from .models import FAMILIES
from .scenarios import QUICK_STEPS, SCENARIOS, STEPS, run_scenario
from .score import ScenarioScore, format_diagnosis, format_table, score, totals

COMMAND = "python -m benchmarks.faults"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=COMMAND,
        description="Inject known faults, observe each run with torchinstruments and score "
        "whether report.json names the origin module first.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"CI smoke test: the quick scenarios only, {QUICK_STEPS} steps each",
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
        help=f"training steps per scenario (default {STEPS}, {QUICK_STEPS} with --quick)",
    )
    parser.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument(
        "--keep-reports",
        metavar="DIR",
        help="keep each scenario's report.json and index.md under DIR/NAME/",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: fastest for these tiny models, and stable)",
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
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list:
        for s in SCENARIOS:
            origin = "-" if s.origin is None else ",".join(s.origin)
            fault = s.fault.describe() if s.fault is not None else "control"
            quick = " [quick]" if s.quick else ""
            print(f"{s.name:24s} {s.family:12s} {fault} | origin {origin}{quick}")
        return 0
    known = {s.name for s in SCENARIOS}
    unknown = sorted(set(args.only or []) - known)
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; known: {sorted(known)}")
    steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else STEPS)
    if steps < 60:
        parser.error(f"--steps must be at least 60 (warm-up is 24 samples), got {steps}")
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    chosen = [
        s for s in SCENARIOS if (s.name in args.only if args.only else (s.quick or not args.quick))
    ]
    print(
        f"fault benchmark: {len(chosen)} scenario(s), {steps} steps each, sampling=1, "
        f"seed {args.seed}, {args.threads} thread(s)"
    )
    for family in FAMILIES.values():
        print(f"  {family.name}: {family.description}")
    started = time.perf_counter()
    scores: list[ScenarioScore] = []
    for scenario in chosen:
        report_dir = Path(args.keep_reports) / scenario.name if args.keep_reports else None
        result = run_scenario(scenario, steps=steps, seed=args.seed, report_dir=report_dir)
        scores.append(score(scenario, result.report, result))
        mark = "control" if scenario.control else f"RR {scores[-1].reciprocal_rank:.2f}"
        print(f"  ran {scenario.name} in {result.seconds:.1f} s ({mark})", flush=True)
    elapsed = time.perf_counter() - started
    print()
    print(format_table(scores))
    print()
    diagnosis = format_diagnosis(scores)
    if diagnosis:
        print("Misses (what the report led with instead):")
        print(diagnosis)
        print()
    total = totals(scores)
    print(total.line())
    print(f"({elapsed:.0f} s; reproduce with: {_command(args)})")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "command": _command(args),
            "steps": steps,
            "seed": args.seed,
            "sampling": 1,
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
            },
            "scenarios": [s.to_json() for s in scores],
        }
        path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
