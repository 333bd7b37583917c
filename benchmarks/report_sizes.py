"""Size of ``report.json`` per run, against the report's size targets: measurement only.

    python -m benchmarks.report_sizes                      # example + synthetic benchmark
    python -m benchmarks.report_sizes --skip-faults        # the three example runs only
    python -m benchmarks.report_sizes --real gpt2_clean --real gpt2_c_attn_scale
    python -m benchmarks.report_sizes --real-quick         # the real-model --quick set
    python -m benchmarks.report_sizes --keep DIR           # keep every run's output_dir
    python -m benchmarks.report_sizes --faults-from DIR    # reports kept by benchmarks.faults
    python -m benchmarks.report_sizes --real-from DIR      # runs kept by benchmarks.real_faults

Runs ``examples/basic_training.py`` three times (``none``, ``drop-norm``,
``shrink-residual``, each in its own process), every scenario of ``python -m
benchmarks.faults`` (its default steps, ``sampling=1``) and, when asked, scenarios of
``python -m benchmarks.real_faults`` (the real-model benchmark: hours for all of it, so
none by default). For each run it prints the exact bytes of ``report.json``, bytes / 4
as an estimate of its tokens for an LLM (about four bytes per token for JSON text in
English), and whether it meets its target: a clean run at most ``CLEAN_TARGET_BYTES``
(16,000), a run with one fault at most ``FAULT_TARGET_BYTES`` (64,000); every run stays
within the library's bound, ``ReportConfig.max_bytes`` (256,000 by default).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

#: Target for a run without a fault, in bytes of report.json.
CLEAN_TARGET_BYTES = 16_000
#: Target for a run with one fault, in bytes of report.json.
FAULT_TARGET_BYTES = 64_000
#: The library's default bound (``ReportConfig.max_bytes``).
BOUND_BYTES = 256_000
#: The example's modifications: none is the clean run.
EXAMPLE_RUNS = ("none", "drop-norm", "shrink-residual")
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Size:
    """One run's report size."""

    source: str
    run: str
    clean: bool
    report_bytes: int
    notable: int

    @property
    def target(self) -> int:
        return CLEAN_TARGET_BYTES if self.clean else FAULT_TARGET_BYTES

    def row(self) -> str:
        ok = "yes" if self.report_bytes <= self.target else "NO"
        return (
            f"{self.source:12s} {self.run:30s} {'clean' if self.clean else 'fault':5s} "
            f"{self.report_bytes:9,d} {self.report_bytes // 4:8,d} {self.target:8,d} {ok:>6s} "
            f"{self.notable:7d}"
        )


def _measure(source: str, run: str, clean: bool, directory: Path) -> Size:
    data = (directory / "report.json").read_bytes()
    report = json.loads(data)
    notable = (report.get("summary") or {}).get("notable_findings")
    return Size(source, run, clean, len(data), notable if isinstance(notable, int) else -1)


def _example(modification: str, directory: Path) -> Size:
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "basic_training.py"),
            "--modification",
            modification,
            "--output-dir",
            str(directory),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return _measure("example", modification, modification == "none", directory)


def _faults(directory: Path, kept: Path | None) -> list[Size]:
    import torch

    from benchmarks.faults.scenarios import SCENARIOS, run_scenario

    torch.set_num_threads(1)  # as python -m benchmarks.faults runs them
    sizes = []
    for scenario in SCENARIOS:
        report_dir = (kept or directory) / scenario.name
        if kept is None:
            run_scenario(scenario, report_dir=report_dir)
        sizes.append(_measure("faults", scenario.name, scenario.control, report_dir))
        print(sizes[-1].row(), flush=True)
    return sizes


def _real(names: list[str], quick: bool, directory: Path, kept: Path | None) -> list[Size]:
    from benchmarks.real_faults.scenarios import QUICK_STEPS, SCENARIOS, STEPS, run_scenario

    if kept is not None:
        names = [*names, *(p.name for p in sorted(kept.iterdir()) if (p / "report.json").exists())]
    chosen = [s for s in SCENARIOS if s.name in names or (quick and s.quick)]
    unknown = sorted(set(names) - {s.name for s in SCENARIOS})
    if unknown:
        raise SystemExit(f"unknown real-model scenario(s) {unknown}")
    sizes = []
    for scenario in chosen:
        output_dir = (kept or directory) / scenario.name
        if kept is None:
            steps = QUICK_STEPS if quick else STEPS
            run_scenario(scenario, steps=steps, output_dir=output_dir)
        sizes.append(_measure("real_faults", scenario.name, scenario.control, output_dir))
        print(sizes[-1].row(), flush=True)
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.report_sizes", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--skip-faults", action="store_true", help="no synthetic benchmark")
    parser.add_argument("--skip-example", action="store_true", help="no example runs")
    parser.add_argument(
        "--real", action="append", default=[], metavar="NAME", help="a real-model scenario"
    )
    parser.add_argument(
        "--real-quick", action="store_true", help="the real-model --quick set, its quick steps"
    )
    parser.add_argument("--keep", metavar="DIR", help="keep every run's output_dir under DIR")
    parser.add_argument(
        "--faults-from",
        metavar="DIR",
        help="measure the reports that python -m benchmarks.faults --keep-reports DIR kept "
        "instead of running its scenarios again",
    )
    parser.add_argument(
        "--real-from",
        metavar="DIR",
        help="measure the runs that python -m benchmarks.real_faults --keep-reports DIR kept",
    )
    args = parser.parse_args(argv)
    scratch = None if args.keep else tempfile.TemporaryDirectory(prefix="report-sizes-")
    base = Path(args.keep) if args.keep else Path(scratch.name)  # type: ignore[union-attr]
    header = (
        f"{'source':12s} {'run':30s} {'kind':5s} {'bytes':>9s} {'tokens~':>8s} "
        f"{'target':>8s} {'within':>6s} {'notable':>7s}"
    )
    print(header, flush=True)
    sizes: list[Size] = []
    if not args.skip_example:
        for modification in EXAMPLE_RUNS:
            sizes.append(_example(modification, base / "example" / modification))
            print(sizes[-1].row(), flush=True)
    if not args.skip_faults:
        kept = Path(args.faults_from) if args.faults_from else None
        sizes += _faults(base / "faults", kept)
    if args.real or args.real_quick or args.real_from:
        kept_real = Path(args.real_from) if args.real_from else None
        sizes += _real(args.real, args.real_quick, base / "real_faults", kept_real)
    print()
    for clean in (True, False):
        chosen = [s for s in sizes if s.clean is clean]
        if not chosen:
            continue
        largest = max(chosen, key=lambda s: s.report_bytes)
        within = sum(1 for s in chosen if s.report_bytes <= s.target)
        print(
            f"{'clean' if clean else 'fault'} runs: {len(chosen)}, {within} within "
            f"{chosen[0].target:,d} bytes; largest {largest.report_bytes:,d} bytes "
            f"({largest.report_bytes // 4:,d} tokens~, {largest.source} {largest.run}); "
            f"mean {sum(s.report_bytes for s in chosen) // len(chosen):,d} bytes"
        )
    over = [s for s in sizes if s.report_bytes > BOUND_BYTES]
    print(f"over the {BOUND_BYTES:,d}-byte bound: {len(over)}")
    if scratch is not None:
        scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
