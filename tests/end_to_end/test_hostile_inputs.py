"""merge, compare and show on hostile inputs: bounded, one-line errors, nothing outside.

The fuzz test mutates real reports (truncation, byte flips, type swaps, huge numbers,
NaN literals, deep nesting, huge strings; every tenth rank report is a symbolic link to
a report outside the directory) and runs the three commands on them in this process,
seeded, for a bounded number of cases (:data:`FUZZ_CASES`, 120 commands, 3 to 5 s on
a 2-core machine). Each command must end with exit status 0 or 1, at most one line on
stderr, no traceback, within :data:`CASE_SECONDS`; every :data:`TRACED_EVERY`-th case
runs under tracemalloc with at most :data:`CASE_PEAK_BYTES` of traced memory, and the
process's resident set may grow by at most :data:`FUZZ_RSS_GROWTH_BYTES` over the whole
test.
"""

from __future__ import annotations

import copy
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from tests.harness import ResidualNet, make_batches, train
from torchinstruments import inject_observer, remove_observer
from torchinstruments.__main__ import EXIT_STATUSES
from torchinstruments.__main__ import main as cli_main
from torchinstruments._jsonio import MAX_JSON_DEPTH, json_depth, read_json_object
from torchinstruments.errors import ReportReadError

#: Fuzz cases; each runs merge, compare and show on freshly mutated inputs.
FUZZ_CASES = 40
#: Every this many cases, the commands run under tracemalloc (which slows them 3 to 5x).
TRACED_EVERY = 5
#: Most the process's peak resident set may grow over the fuzz test, in bytes.
FUZZ_RSS_GROWTH_BYTES = 256 * 1024 * 1024
#: Longest a single command may take on a mutated input, in seconds.
CASE_SECONDS = 5.0
#: Most memory (tracemalloc peak, bytes) a single command may use on a mutated input:
#: the inputs are below 100 kB, their parsed form below 2 MB.
CASE_PEAK_BYTES = 48 * 1024 * 1024


@pytest.fixture(scope="session")
def real_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two real observed runs (30 samples; ``b`` gets a scaled ``fc`` from sample 20), a
    rank directory of two real rank reports, and its merged global report."""
    root = tmp_path_factory.mktemp("hostile")
    runs = {}
    for name in ("a", "b"):
        model = ResidualNet()
        inject_observer(model, output_dir=root / name, sampling=1)

        def on_step(step: int, model: ResidualNet = model, name: str = name) -> None:
            if name == "b" and step == 20:
                model.fc.weight.data.mul_(3.0)

        train(model, make_batches(30), on_step=on_step)
        remove_observer(model)
        runs[name] = root / name
    ranks = root / "ranks"
    for rank, name in enumerate(("a", "b")):
        (ranks / f"rank-{rank:03d}").mkdir(parents=True)
        report = json.loads((runs[name] / "report.json").read_bytes())
        # As ranks of one run state them (a single-process run states world size 1).
        report["run"]["rank"], report["run"]["world_size"] = rank, 2
        (ranks / f"rank-{rank:03d}" / "report.json").write_text(json.dumps(report, indent=2))
    assert cli_main(["merge", str(ranks), "--world-size", "2"]) == 0
    runs["ranks"] = ranks
    return runs


# ---------------------------------------------------------------------- mutations
def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into a parsed JSON value (the root excluded)."""
    out = []
    if isinstance(value, dict):
        items: list[tuple[Any, Any]] = list(value.items())
    elif isinstance(value, list):
        items = list(enumerate(value))
    else:
        return out
    for key, child in items:
        out.append((*prefix, key))
        out.extend(_paths(child, (*prefix, key)))
    return out


def _replace(document: Any, path: tuple[Any, ...], new: Any) -> None:
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = new


HOSTILE_VALUES: list[Any] = [
    None,
    True,
    -1,
    0,
    2**63 - 1,
    -(2**63) + 1,
    1e308,
    -1e308,
    5e-324,
    "",
    "x" * 20_000,
    "a\nb\x1b[2J\x00`",
    [],
    {},
    [[[]]],
    {"value": None, "sample": None},
    [1, "two", None, {}],
]


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One random mutation of a JSON document (``data``)."""
    kind = rng.choice(
        ["truncate", "swap", "swap", "swap", "number", "nan", "deep", "deep_ok", "bytes"]
    )
    if kind == "truncate":
        return data[: rng.randrange(len(data))]
    if kind == "bytes":
        position = rng.randrange(len(data))
        return data[:position] + bytes([rng.randrange(256)]) + data[position + 1 :]
    document = json.loads(data)
    paths = _paths(document)
    path = rng.choice(paths)
    if kind == "swap":
        for _ in range(rng.randint(1, 4)):
            _replace(
                document, rng.choice(_paths(document)), copy.deepcopy(rng.choice(HOSTILE_VALUES))
            )
        return json.dumps(document).encode()
    if kind == "deep_ok":  # nested within the bound: reaches the code that walks it
        _replace(
            document, path, json.loads("[" * (MAX_JSON_DEPTH - 8) + "]" * (MAX_JSON_DEPTH - 8))
        )
        return json.dumps(document).encode()
    marker = "__HOSTILE__"
    _replace(document, path, marker)
    text = json.dumps(document)
    replacement = {
        "number": rng.choice(["1e999", "-1e999", "9" * 5000, "123456789012345678901234567890"]),
        "nan": rng.choice(["NaN", "Infinity", "-Infinity"]),
        "deep": "[" * 100_000 + "]" * 100_000,
    }[kind]
    return text.replace(f'"{marker}"', replacement).encode()


def run_cli(
    arguments: list[str], capsys: pytest.CaptureFixture[str], *, traced: bool = True
) -> tuple[int, str, str]:
    """Run the command line in this process; check time (and memory, when ``traced``);
    return the exit status, stdout and stderr."""
    if traced:
        tracemalloc.start()
    start = time.perf_counter()
    try:
        status = cli_main(arguments)
    finally:
        elapsed = time.perf_counter() - start
        if traced:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            assert peak < CASE_PEAK_BYTES, (arguments, peak)
    out, err = capsys.readouterr()
    assert elapsed < CASE_SECONDS, (arguments, elapsed)
    return status, out, err


def check_failure_output(status: int, err: str, command: str) -> None:
    assert status in (0, 1), (status, err)
    assert "Traceback" not in err
    if status == 1:
        assert err.count("\n") == 1 and err.startswith(f"torchinstruments {command}: error: "), err
    else:
        assert err == ""


def test_fuzz_merge_compare_show_on_mutated_real_reports(
    real_runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(20261201)
    report = (real_runs["b"] / "report.json").read_bytes()
    series = (real_runs["b"] / "series.json").read_bytes()
    merged = (real_runs["ranks"] / "global-report.json").read_bytes()
    outcomes: dict[str, set[int]] = {"merge": set(), "compare": set(), "show": set()}
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for case in range(FUZZ_CASES):
        traced = case % TRACED_EVERY == 0
        work = tmp_path / f"case-{case}"
        # merge: two good ranks and a mutated one; the merge always succeeds
        ranks = work / "ranks"
        shutil.copytree(real_runs["ranks"], ranks, ignore=shutil.ignore_patterns("global-*"))
        (ranks / "rank-002").mkdir()
        linked = case % 10 == 9  # a symbolic link to a real report outside the directory
        if linked:
            (ranks / "rank-002" / "report.json").symlink_to(real_runs["a"] / "report.json")
        else:
            (ranks / "rank-002" / "report.json").write_bytes(mutate(report, rng))
        status, _, err = run_cli(["merge", str(ranks)], capsys, traced=traced)
        assert status == 0, err
        global_report = json.loads((ranks / "global-report.json").read_bytes())
        assert len((ranks / "global-report.json").read_bytes()) <= 256_000
        assert (
            global_report["ranks"]["present_count"] + global_report["ranks"]["unreadable_count"]
            == 3
        )
        outcomes["merge"].add(global_report["ranks"]["unreadable_count"])
        if linked:
            assert [u["reason"] for u in global_report["ranks"]["unreadable"]] == [
                "expected a rank report as a regular file, got a symbolic link (not followed)"
            ]
        # compare: a good baseline and a mutated candidate
        candidate = work / "candidate"
        candidate.mkdir()
        (candidate / "series.json").write_bytes(mutate(series, rng))
        arguments = ["compare", str(real_runs["a"]), str(candidate)]
        status, _, err = run_cli(arguments, capsys, traced=traced)
        check_failure_output(status, err, "compare")
        outcomes["compare"].add(status)
        # show: a mutated report and a mutated global report
        shown = work / "shown"
        shown.mkdir()
        (shown / "report.json").write_bytes(mutate(report, rng))
        (shown / "global-report.json").write_bytes(mutate(merged, rng))
        status, out, err = run_cli(["show", str(shown)], capsys, traced=traced)
        check_failure_output(status, err, "show")
        assert "\x1b" not in out and "\x00" not in out
        outcomes["show"].add(status)
        shutil.rmtree(work)
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    assert rss_after - rss_before < FUZZ_RSS_GROWTH_BYTES, (rss_before, rss_after)
    # the cases reach both outcomes: some mutations are still readable, some are refused
    assert outcomes == {"merge": {0, 1}, "compare": {0, 1}, "show": {0, 1}}


# ---------------------------------------------------------------------- bounds, one by one
def test_depth_is_bounded_before_parsing(tmp_path: Path) -> None:
    for text, depth in [
        ('{"a": [1, {"b": "]]"}]}', 3),
        ('["\\\\", [[]]]', 3),  # an escaped backslash ends before the quote
        ('["\\\\\\"[[[", [[]]]', 3),  # an escaped backslash, then an escaped quote
        ('["\\"", {"k\\\\": [[]]}]', 4),
        ("", 0),
    ]:
        assert json_depth(text.encode()) == depth, text
        if text:
            json.loads(text)  # each is valid JSON
    path = tmp_path / "deep.json"
    path.write_bytes(b'{"schema": "torchinstruments.report/1", "x": ' + b"[" * 200_000)
    with pytest.raises(ReportReadError, match=r"deep.json: expected JSON nested at most 64 "):
        read_json_object(
            path,
            what="a report",
            max_bytes=1 << 20,
            schema="torchinstruments.report/1",
            required={},
        )


@pytest.mark.parametrize(
    ("literal", "message"),
    [
        ("NaN", "the non-standard literal NaN"),
        ("-Infinity", "the non-standard literal -Infinity"),
        ("1e400", "a number that overflows a float"),
        ("9223372036854775808", "an integer beyond 64 bits"),
        ("9" * 5000, "an integer beyond 64 bits"),
    ],
)
def test_nan_infinity_and_huge_numbers_are_refused(
    tmp_path: Path, literal: str, message: str
) -> None:
    path = tmp_path / "report.json"
    path.write_text('{"schema": "torchinstruments.report/1", "x": ' + literal + "}")
    with pytest.raises(ReportReadError, match=message):
        read_json_object(
            path,
            what="a report",
            max_bytes=1 << 20,
            schema="torchinstruments.report/1",
            required={},
        )


def test_oversized_rank_report_is_listed_without_being_read(
    real_runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ranks = tmp_path / "ranks"
    shutil.copytree(real_runs["ranks"], ranks, ignore=shutil.ignore_patterns("global-*"))
    (ranks / "rank-002").mkdir()
    with (ranks / "rank-002" / "report.json").open("wb") as stream:
        stream.truncate(1 << 40)  # a sparse 1 TiB file: reading it whole would not end
    status, _, err = run_cli(["merge", str(ranks)], capsys)
    assert (status, err) == (0, "")
    unreadable = json.loads((ranks / "global-report.json").read_bytes())["ranks"]["unreadable"]
    assert unreadable == [
        {
            "rank": 2,
            "path": str(ranks / "rank-002" / "report.json"),
            "reason": "expected a rank report of at most 16777216 bytes, got more than 16777216",
        }
    ]


def test_huge_world_size_and_rank_numbers_are_counted_not_enumerated(
    real_runs: dict[str, Path], tmp_path: Path
) -> None:
    """A rank report stating world size 10**12, and a ``rank-999999999999`` directory:
    the missing ranks are counted from the gaps (run in a subprocess with a timeout:
    enumerating them does not end)."""
    report = json.loads((real_runs["a"] / "report.json").read_bytes())
    report["run"]["world_size"] = 10**12
    (tmp_path / "rank-000").mkdir()
    (tmp_path / "rank-000" / "report.json").write_text(json.dumps(report))
    (tmp_path / "rank-999999999999").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "torchinstruments", "merge", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode, result.stderr) == (0, "")
    ranks = json.loads((tmp_path / "global-report.json").read_bytes())["ranks"]
    assert (ranks["world_size"], ranks["present"]) == (10**12, ["0"])
    assert (ranks["missing_count"], ranks["missing"]) == (10**12 - 1, ["1-999999999999"])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_fifo_in_place_of_a_report_does_not_hang(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.mkfifo(tmp_path / "report.json")
    status, _, err = run_cli(["show", str(tmp_path)], capsys)
    assert status == 1
    assert err == (
        f"torchinstruments show: error: {tmp_path / 'report.json'}: expected a report as a "
        "regular file, got not a regular file\n"
    )


def test_symlinks_are_not_followed_and_outputs_stay_inside(
    real_runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outside = tmp_path / "outside"
    shutil.copytree(real_runs["a"], outside / "run")
    (outside / "secret.json").write_text("keep")
    ranks = tmp_path / "ranks"
    shutil.copytree(real_runs["ranks"], ranks, ignore=shutil.ignore_patterns("global-*"))
    (ranks / "rank-002").symlink_to(outside / "run", target_is_directory=True)
    (ranks / "rank-003").mkdir()
    (ranks / "rank-003" / "report.json").symlink_to(outside / "run" / "report.json")
    (ranks / "global-report.json").symlink_to(outside / "secret.json")
    status, _, err = run_cli(["merge", str(ranks)], capsys)
    assert (status, err) == (0, "")
    global_report = json.loads((ranks / "global-report.json").read_bytes())
    reasons = {u["rank"]: u["reason"] for u in global_report["ranks"]["unreadable"]}
    assert reasons == {
        2: "rank-002 is a symbolic link (not followed)",
        3: "expected a rank report as a regular file, got a symbolic link (not followed)",
    }
    assert global_report["ranks"]["present"] == ["0-1"]
    assert not (ranks / "global-report.json").is_symlink()
    assert (outside / "secret.json").read_text() == "keep"

    candidate = tmp_path / "candidate"
    candidate.mkdir()
    (candidate / "series.json").symlink_to(outside / "run" / "series.json")
    status, _, err = run_cli(["compare", str(real_runs["a"]), str(candidate)], capsys)
    assert status == 1
    assert err == (
        f"torchinstruments compare: error: {candidate / 'series.json'}: expected a series "
        "summary as a regular file, got a symbolic link (not followed)\n"
    )
    shown = tmp_path / "shown"
    shown.mkdir()
    (shown / "report.json").symlink_to(outside / "run" / "report.json")
    status, out, err = run_cli(["show", str(shown)], capsys)
    assert (status, out) == (1, "")
    assert err.endswith("expected a report as a regular file, got a symbolic link (not followed)\n")
    assert sorted(p.name for p in outside.iterdir()) == ["run", "secret.json"]
    assert sorted(p.name for p in (outside / "run").iterdir()) == sorted(
        p.name for p in real_runs["a"].iterdir()
    )


def test_control_characters_in_reports_are_escaped_on_the_terminal(
    real_runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = json.loads((real_runs["b"] / "report.json").read_bytes())
    report["summary"]["headline"] = "fine\x1b[2J\nrank 0: all clear"
    (tmp_path / "report.json").write_text(json.dumps(report))
    status, out, err = run_cli(["show", str(tmp_path)], capsys)
    assert (status, err) == (0, "")
    assert "fine\\x1b[2J\\x0arank 0: all clear" in out
    assert "\x1b" not in out


# ---------------------------------------------------------------------- the command line
def test_show_prints_headline_findings_coverage_and_limits(
    real_runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    report = json.loads((real_runs["b"] / "report.json").read_bytes())
    status, out, err = run_cli(["show", str(real_runs["b"])], capsys)
    assert (status, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"torchinstruments report: {real_runs['b'] / 'report.json'}"
    assert report["summary"]["headline"].split()[0] in lines[3]
    notable = [f for f in report["findings"] if f["notable"]]
    events = report["events"]
    assert f"Events: {len(events)} ({len(notable)} notable findings refer to them)" in lines
    for number, event in enumerate(events[:10], start=1):
        assert any(
            line.startswith(f"{number:>3}. {event['id']} {event['shape']}: ") for line in lines
        )
    coverage = report["coverage"]
    assert (
        f"  modules    {coverage['modules_observed']} observed of "
        f"{coverage['modules_selected']} selected"
    ) in lines
    assert lines[-1] == "Limits: none hit (no evidence was removed)"
    assert max(len(line) for line in lines) <= 110


def test_show_of_a_merged_directory_lists_ranks_and_coverage(
    real_runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    ranks = real_runs["ranks"]
    status, out, err = run_cli(["show", str(ranks)], capsys)
    assert (status, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"torchinstruments global report: {ranks / 'global-report.json'}"
    assert "Ranks: 2 of 2 present; missing: none" in lines
    assert "  rank reports read  2" in lines
    # a directory of rank reports that was not merged says what to run
    unmerged = ranks.parent / "unmerged"
    shutil.copytree(ranks, unmerged, ignore=shutil.ignore_patterns("global-*"))
    status, out, err = run_cli(["show", str(unmerged)], capsys)
    assert (status, out) == (1, "")
    assert err == (
        f"torchinstruments show: error: {unmerged}: expected report.json or "
        f"global-report.json, got neither; it holds rank-NNN/ directories: run "
        f"`torchinstruments merge {unmerged}` first\n"
    )


def test_version_help_and_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    import torchinstruments

    assert cli_main(["--version"]) == 0
    assert capsys.readouterr().out == f"torchinstruments {torchinstruments.__version__}\n"
    assert cli_main(["--help"]) == 0
    help_text = capsys.readouterr().out
    assert "show" in help_text and "exit status:" in help_text
    for code, meaning in EXIT_STATUSES.items():
        assert f"  {code}  {meaning}" in help_text
    assert cli_main(["show"]) == 2
    assert cli_main(["merge", "x", "--max-bytes", "10"]) == 2
    assert "merge_rank_reports.max_bytes must be an int >= 4096" in capsys.readouterr().err


_NO_TORCH = """
import contextlib, io, json, sys
from torchinstruments.__main__ import main
with contextlib.redirect_stdout(io.StringIO()):
    statuses = [main(["--help"]), main(["--version"]), main(["show", sys.argv[2]])]
from torchinstruments import compare_runs, merge_rank_reports
out = sys.argv[4]
statuses += [
    merge_rank_reports(sys.argv[1], output_dir=out).name,
    compare_runs(sys.argv[3], sys.argv[2], out).name,
]
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(json.dumps([statuses, loaded]))
"""


def test_command_line_and_offline_tools_do_not_import_torch(
    real_runs: dict[str, Path], tmp_path: Path
) -> None:
    """``--help``, ``--version``, ``show``, ``merge_rank_reports`` and ``compare_runs`` in
    a fresh interpreter: ``sys.modules`` holds no torch module afterwards."""
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _NO_TORCH,
            *(str(real_runs[n]) for n in ("ranks", "b", "a")),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    statuses, loaded = json.loads(result.stdout)
    assert statuses == [0, 0, 0, "global-report.json", "comparison.json"]
    assert loaded == []


def test_lazy_package_keeps_every_public_name() -> None:
    import torchinstruments
    from torchinstruments import histogram

    assert torchinstruments.histogram is histogram and callable(histogram)
    import torchinstruments.histogram as histogram_module  # the submodule name is shadowed

    assert histogram_module is histogram
    for name in torchinstruments.__all__:
        value = getattr(torchinstruments, name)
        if isinstance(value, type) or callable(value):
            assert value.__module__ == "torchinstruments", name
    assert set(torchinstruments.__all__) <= set(dir(torchinstruments))
    with pytest.raises(AttributeError, match="module 'torchinstruments' has no attribute 'nope'"):
        _ = torchinstruments.nope  # type: ignore[attr-defined]


def test_a_directory_in_place_of_a_report_is_named_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "report.json").mkdir()
    status, _, err = run_cli(["show", str(tmp_path)], capsys)
    assert status == 1
    assert err == (
        f"torchinstruments show: error: {tmp_path / 'report.json'}: expected a report as a "
        "regular file, got a directory\n"
    )
