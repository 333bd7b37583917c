"""Produce every report number and excerpt that docs/*.md quote, and check or rewrite them.

    uv run python docs/excerpts.py            # check: exit 1 with a diff when a doc is stale
    uv run python docs/excerpts.py --write    # rewrite the marked regions in place

A quoted region in a doc sits between ``<!-- excerpt: NAME -->`` and ``<!-- /excerpt -->``
lines; this script computes its text, from the code's own constants or from runs of
``examples/basic_training.py`` made exactly as the docs say (seed 0 baseline, seed 0
``--modification drop-norm`` candidate, seed 1, 300 steps each, about a minute on two
cores). ``tests/test_compare.py`` runs the same check on the runs it already makes, so a
change that moves a quoted number fails the suite until the docs are regenerated.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import itertools
import json
import re
import sys
import tempfile
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLE = ROOT / "examples" / "basic_training.py"
#: The example runs the docs describe, as ``examples/basic_training.py`` arguments.
RUNS = {
    "baseline": ["--seed", "0"],
    "drop_norm": ["--seed", "0", "--modification", "drop-norm"],
    "seed1": ["--seed", "1"],
}
REGION = re.compile(
    r"(?P<open><!-- excerpt: (?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(?P<close><!-- /excerpt -->)",
    re.DOTALL,
)


def run_examples(root: Path) -> dict[str, Path]:
    """Run the example once per :data:`RUNS` entry (300 steps each) under ``root``."""
    spec = importlib.util.spec_from_file_location("basic_training_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    spec.loader.exec_module(example)
    runs = {}
    for name, arguments in RUNS.items():
        runs[name] = root / name
        if example.main([*arguments, "--steps", "300", "--output-dir", str(runs[name])]) != 0:
            raise RuntimeError(f"examples/basic_training.py {' '.join(arguments)} failed")
    return runs


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _schedule_sentence() -> str:
    from torchinstruments import DefaultSampling, TrackConfig

    policy = DefaultSampling()
    forwards = [i for i in range(4000) if policy.should_sample(i)]
    steady = next(f for f, g in itertools.pairwise(forwards) if g - f == 256)
    warmup = TrackConfig().warmup_samples
    return _wrap(
        f"With `DefaultSampling()`, the interval reaches 256 at forward {steady:,}; the "
        f"{warmup}-sample warm-up of `TrackConfig()` completes at forward "
        f"{forwards[warmup - 1]}; a 300-step run gets {sum(f < 300 for f in forwards)} "
        f"samples, the first 1,000 forwards {sum(f < 1000 for f in forwards)}."
    )


def _wrap(text: str, indent: str = "") -> str:
    """``text`` as lines of at most 88 characters (continuation lines indented)."""
    return textwrap.fill(text, 88, subsequent_indent=indent, break_on_hyphens=False) + "\n"


def excerpts(runs: Mapping[str, Path], workdir: Path) -> dict[str, str]:
    """The text of every named region, from ``runs`` (see :func:`run_examples`)."""
    from torchinstruments import compare_runs
    from torchinstruments.compare import first_divergence_lines
    from torchinstruments.report import LLM_PROMPT

    drop = _read(compare_runs(runs["baseline"], runs["drop_norm"], workdir / "drop_norm"))
    seeds = _read(compare_runs(runs["baseline"], runs["seed1"], workdir / "seed1"))
    first = drop["summary"]["first_divergence"]
    printed = [drop["summary"]["headline"], *first_divergence_lines(drop)]
    fc1 = next(
        e
        for e in drop["first_divergences"]
        if e["module"] == "blocks.2.fc1" and e["kind"] == "value"
    )
    seed_departures = [
        entry["sustained_departure"]
        for section in seeds["categories"].values()
        for entry in section["entries"][:1]
    ]
    low, high = min(seed_departures), max(seed_departures)
    candidate = _read(runs["drop_norm"] / "report.json")
    event = next(e for e in candidate["events"] if e["module"] == "blocks.2.fc1")
    change = event["change"]
    at_once = "there" if fc1["sample"] == first["sample"] else f"at sample {fc1['sample']}"
    reading = (
        f"Sample {first['sample']} (training forward {first['forward']}) is the first "
        "sampled forward after the modification: the norm is no longer called there "
        "(exact), and `blocks.2.fc1`, which now receives the un-normalised residual "
        f"stream, departs {fc1['candidate'] / fc1['baseline']:.1f}x {at_once}, followed by "
        "the rest of the block. Two healthy runs with different seeds (0 and 1) report "
        f'"{seeds["summary"]["headline"].split(":")[0]}": the largest sustained departure '
        f"per category is {low:.1f} to {high:.1f} noise units, below the threshold of "
        f"{seeds['rule']['threshold']:g}."
    )
    measurement = (
        '- **Measurement before mechanism.** "`blocks.2.fc1` activation RMS stepped up '
        f"{change['ratio']:.1f}x at sample "
        f"{event['onset']['sample']} ({change['in_residual_spreads']:.0f} residual "
        'spreads)" is a measurement. "Because the LayerNorm was removed" is a hypothesis: '
        "it is only as good as the experiment that tests it."
    )
    return {
        "llm-prompt": f"```text\n{LLM_PROMPT}```\n",
        "drop-norm-comparison": "```text\n" + "\n".join(printed) + "\n```\n",
        "drop-norm-reading": _wrap(reading),
        "drop-norm-measurement": _wrap(measurement, indent="  "),
        "default-schedule": _schedule_sentence(),
        "report-event": _event_excerpt(event),
        "show-drop-norm": _show_excerpt(candidate),
        "report-event-markdown": _event_markdown(runs["drop_norm"] / "index.md", event["id"]),
        "report-headline": _wrap(f"> {candidate['summary']['headline']}", indent="> "),
    }


def _show_excerpt(report: dict[str, Any]) -> str:
    """``show`` of the drop-norm run, as if its directory were ``stats``."""
    from torchinstruments.show import render_report_text

    shown = {**report, "generated_at": "<time of the run>"}
    text = render_report_text(shown, "stats/report.json")
    return "```text\n$ python -m torchinstruments show stats\n" + text + "```\n"


def _event_excerpt(event: dict[str, Any]) -> str:
    """The drop-norm run's event as written to report.json, with its history cut to the
    observed samples within three of the onset (the rest replaced by a count)."""
    shown = json.loads(json.dumps(event))
    points = shown["history"]["points"]
    onset = shown["onset"]["sample"]
    near = [p for p in points if abs(p[0] - onset) <= 3]
    shown["history"]["points"] = near
    shown["history"]["points_not_shown_here"] = len(points) - len(near)
    shown["interpretation"] = textwrap.shorten(shown["interpretation"], 160, placeholder=" ...")
    shown["next_experiment"] = textwrap.shorten(shown["next_experiment"], 160, placeholder=" ...")
    return "```json\n" + json.dumps(_rounded(shown), indent=1) + "\n```\n"


def _rounded(value: Any, digits: int = 4) -> Any:
    """``value`` with every float rounded to ``digits`` significant digits: the report
    writes six, whose last can differ between CPUs (vectorised float32 sums), and the
    docs need not follow it."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {key: _rounded(item, digits) for key, item in value.items()}
    if isinstance(value, list):
        return [_rounded(item, digits) for item in value]
    return value


def _event_markdown(path: Path, event_id: str) -> str:
    """The event's section of index.md, as the run wrote it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"### {event_id}:"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("#")), len(lines))
    body = "\n".join(lines[start:end]).strip()
    return "````markdown\n" + body + "\n````\n"


def apply(text: str, values: Mapping[str, str], where: str = "doc") -> str:
    """``text`` with every marked region's body replaced by ``values[name]``.

    Raises:
        KeyError: a region names no known excerpt.
    """

    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in values:
            raise KeyError(f"{where}: unknown excerpt {name!r} (known: {sorted(values)})")
        return match["open"] + values[name] + match["close"]

    return REGION.sub(replace, text)


def stale(values: Mapping[str, str], docs: Path = DOCS) -> dict[str, str]:
    """Unified diffs of the docs whose marked regions differ from ``values``, by file name."""
    diffs = {}
    for path in sorted(docs.glob("*.md")):
        text = path.read_text(encoding="utf-8")
        fresh = apply(text, values, path.name)
        if fresh != text:
            diffs[path.name] = "".join(
                difflib.unified_diff(
                    text.splitlines(keepends=True),
                    fresh.splitlines(keepends=True),
                    f"{path.name} (now)",
                    f"{path.name} (produced)",
                )
            )
    return diffs


def used(docs: Path = DOCS) -> set[str]:
    """Names of the excerpts the docs mark."""
    return {m["name"] for p in docs.glob("*.md") for m in REGION.finditer(p.read_text("utf-8"))}


def main(
    argv: list[str] | None = None, make_runs: Callable[[Path], dict[str, Path]] = run_examples
) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the stale regions")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        values = excerpts(make_runs(Path(folder) / "runs"), Path(folder) / "comparisons")
    diffs = stale(values)
    if args.write:
        for name in diffs:
            path = DOCS / name
            path.write_text(apply(path.read_text(encoding="utf-8"), values, name), "utf-8")
            print(f"rewrote docs/{name}")
        return 0
    for diff in diffs.values():
        print(diff)
    print(f"{len(diffs)} stale doc(s)" if diffs else "docs up to date")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
