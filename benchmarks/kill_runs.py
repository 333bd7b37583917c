"""Kill test: training runs stopped at random moments each leave a sound report.

Each run is a process forked from this one (torch, Dynamo and matplotlib are imported
once, so a run costs tens of milliseconds rather than an interpreter start). The child
injects the observer into a small MLP with every forward sampled and a rewrite every
few milliseconds, tells the parent, and trains until it is stopped. Every third run
writes plots (``plots=True``): its inputs are scaled up ten times from the 9th forward
on, so that an event and its picture appear, and it tells the parent after the 10th
forward, so that its rewrites draw. The parent waits a random delay (uniform in
``[0, --max-delay-s]``), sends SIGKILL or SIGTERM, and then checks what the run left in
its directory:

- ``report.json`` exists, parses, and is at most ``max_bytes`` long;
- ``index.md`` renders the same report: it states the report number and run start
  that ``report.json`` holds (``run.report_number``, ``run.started_at``), and the same
  counts of training root forwards and samples; ``series.json`` counts the same
  forwards and samples;
- with ``plots``, every picture ``index.md`` links exists;
- the files were switched in through the link ``.current``
  (``coverage.file_write_mode`` is ``linked_generations``), and besides the visible
  names the directory holds only the writer's own: ``.current``, generation
  directories (at most three: the current one, the previous one when the kill came
  before its deletion, one being written) and temporary links;
- after SIGTERM, the process ended by the signal (status ``-SIGTERM``), and the report
  is the one written at the signal (it counts at least the forwards the child had run
  when the parent sent it, as the child reports them).

A run whose ``index.md`` is an earlier report of the same run than ``report.json``
(``torn``) is a failure; with ``--torn-allowed`` it is counted and shown apart, for a
file system without symbolic links, where ``DirectorySink`` replaces each file on its
own (``replace_each``) and a SIGKILL between two replacements leaves ``index.md`` one
report behind.

Usage (the full version, 30 SIGKILL and 10 SIGTERM runs)::

    .venv/bin/python benchmarks/kill_runs.py
    .venv/bin/python benchmarks/kill_runs.py --sigkill 4 --sigterm 2 --seed 1

It prints one line per run and a summary, and exits 1 if any run broke a check.

Each report's files are written into a fresh generation directory and switched in by
one ``rename`` of the link ``.current``, so no kill can leave files of two reports.
Before that layout the two files were replaced by two consecutive renames, and 1 to 4 of
30 SIGKILL runs tore on seeds 1 and 2 (see benchmarks/README.md): on ext4 a rename over
an existing file starts the writeback of the new file inside the system call (0.4 to 2
ms here, against 15 us onto a fresh name), and a SIGKILL arriving meanwhile takes effect
as the call returns, right after ``report.json`` was replaced. SIGTERM is handled after
the write in progress, so it never tore.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from torchinstruments import ReportConfig, TrackConfig, inject_observer

MAX_BYTES = 16_000
#: Whether the linked layout is checked too (False with ``--torn-allowed``).
LINKED = True
REWRITE_INTERVAL_S = 0.02
_COUNTS = re.compile(r"; (\d+) training root forwards, (\d+) sampled")
_NUMBER = re.compile(r"^Report (\d+) of the run started (\S+) ", re.MULTILINE)
_PICTURE = re.compile(r"\]\((plots/[^)]+\.png)\)")


def _train_forever(directory: Path, ready: int, progress: Path, plots: bool) -> None:
    """The child: inject, say so through the pipe, train until stopped."""
    torch.set_num_threads(1)
    torch.manual_seed(os.getpid())
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inject_observer(
        model,
        output_dir=directory,
        sampling=1,
        plots=plots,
        report_config=ReportConfig(max_bytes=MAX_BYTES, rewrite_interval_s=REWRITE_INTERVAL_S),
        track_config=TrackConfig(warmup_samples=4),  # events from the 9th forward
    )
    # With plots, ready once the event is there: each rewrite then draws its picture.
    ready_at = 10 if plots else 0
    forwards = 0
    while True:
        if forwards == ready_at:
            os.write(ready, b"1")
            os.close(ready)
        optimizer.zero_grad()
        scale = 10.0 if plots and forwards >= 8 else 1.0  # a step: an event to draw
        model(scale * torch.randn(8, 16)).pow(2).mean().backward()
        optimizer.step()
        forwards += 1
        if forwards % 16 == 0:
            progress.write_text(str(forwards))


def _shown(index: str) -> tuple[tuple[int, str] | None, tuple[int, int] | None]:
    """The report number and run start, and the counts, that ``index.md`` states."""
    number, counts = _NUMBER.search(index), _COUNTS.search(index)
    return (
        (int(number.group(1)), number.group(2)) if number else None,
        (int(counts.group(1)), int(counts.group(2))) if counts else None,
    )


def _pictures_linked(directory: Path) -> int:
    try:
        return len(_PICTURE.findall((directory / "index.md").read_text(encoding="utf-8")))
    except OSError:
        return 0


# The writer's own names; a killed run's `.writer.lock` names a process that is gone, and
# the next run takes it over.
_OURS = re.compile(r"\.current|\.generation-\d{6}|\.\.current\.[0-9a-f]{8}|\.writer\.lock")


def _strays(directory: Path) -> list[str]:
    """Names in ``directory`` other than the visible ones and the writer's own, and
    generations beyond three."""
    visible = {"report.json", "index.md", "series.json", "plots"}
    names = sorted(p.name for p in directory.iterdir())
    strays = [n for n in names if n not in visible and not _OURS.fullmatch(n)]
    generations = [n for n in names if n.startswith(".generation-")]
    return strays + (generations if len(generations) > 3 else [])


def _linked_problems(directory: Path, report: dict) -> list[str]:
    """What is wrong with the linked layout: the write mode, ``series.json`` of
    another report, names left behind."""
    problems = []
    run = report["run"]
    mode = report["coverage"].get("file_write_mode")
    if mode != "linked_generations":
        problems.append(f"files written in the mode {mode!r}, not through .current")
    try:
        series = json.loads((directory / "series.json").read_bytes())["run"]
        counted = (series["forwards_seen"], series["samples_seen"])
        if counted != (run["forwards_seen"], run["samples_seen"]):
            problems.append(f"series.json counts {counted}, report.json another report")
    except (OSError, ValueError, KeyError) as error:
        problems.append(f"series.json unreadable: {error}")
    strays = _strays(directory)
    if strays:
        problems.append(f"left behind: {strays}")
    return problems


def check_run(directory: Path, how: str, status: int, forwards_before: int) -> list[str]:
    """What is wrong with the files one stopped run left (empty if nothing); a run
    whose ``index.md`` is an earlier report than ``report.json`` after SIGKILL gives
    ``["torn"]``."""
    problems = []
    report_path, index_path = directory / "report.json", directory / "index.md"
    if not report_path.exists():
        return ["no report.json"]
    raw = report_path.read_bytes()
    if len(raw) > MAX_BYTES:
        problems.append(f"report.json has {len(raw)} bytes > {MAX_BYTES}")
    try:
        report = json.loads(raw)
    except ValueError as error:
        return [*problems, f"report.json does not parse: {error}"]
    index = index_path.read_text(encoding="utf-8") if index_path.exists() else ""
    identity, shown = _shown(index)
    run = report["run"]
    written_identity = (run["report_number"], run["started_at"])
    written = (run["forwards_seen"], run["samples_seen"])
    if identity != written_identity:
        behind = (
            identity is not None
            and identity[1] == written_identity[1]
            and identity[0] < written_identity[0]
        )
        if how == "SIGKILL" and behind and not problems:
            return ["torn"]
        problems.append(f"index.md is report {identity}, report.json {written_identity}")
    elif shown != written:
        problems.append(f"report {identity}: index.md shows {shown}, report.json {written}")
    if LINKED:
        problems.extend(_linked_problems(directory, report))
    missing = [name for name in _PICTURE.findall(index) if not (directory / name).is_file()]
    if missing:
        problems.append(f"index.md links missing pictures {missing}")
    if how == "SIGTERM":
        if status != -signal.SIGTERM:
            problems.append(f"ended with status {status}, not -SIGTERM")
        if written[0] < forwards_before:
            problems.append(f"report counts {written[0]} forwards, {forwards_before} had run")
    return problems


def run_once(directory: Path, how: str, delay_s: float, plots: bool = False) -> list[str]:
    """Fork one training run, stop it after ``delay_s`` and check its files."""
    read_end, write_end = os.pipe()
    progress = directory.with_suffix(".progress")
    pid = os.fork()
    if pid == 0:  # the child never returns
        code = 0
        try:
            os.close(read_end)
            _train_forever(directory, write_end, progress, plots)
        except BaseException:
            code = 2
        os._exit(code)
    os.close(write_end)
    os.read(read_end, 1)  # injected (its first report is written), or past the event
    os.close(read_end)
    time.sleep(delay_s)
    forwards_before = 0
    if how == "SIGTERM":
        try:
            forwards_before = int(progress.read_text() or 0)
        except (OSError, ValueError):
            forwards_before = 0
    os.kill(pid, signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM)
    _, raw_status = os.waitpid(pid, 0)
    status = -os.WTERMSIG(raw_status) if os.WIFSIGNALED(raw_status) else os.WEXITSTATUS(raw_status)
    return check_run(directory, how, status, forwards_before)


def _warm_up(plots: bool) -> None:
    """Import here what every child would otherwise import itself: Dynamo (which
    ``torch.optim`` loads at the first optimizer, seconds on a busy machine) and, for
    the runs with plots, matplotlib with its font cache."""
    torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    if plots:
        from torchinstruments.plots import render_plot, require_matplotlib

        require_matplotlib()
        points = [[0, 0, 1.0], [1, 1, 2.0]]
        render_plot({"module": "m", "signal": "activation", "history": {"points": points}})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sigkill", type=int, default=30, help="runs stopped by SIGKILL")
    parser.add_argument("--sigterm", type=int, default=10, help="runs stopped by SIGTERM")
    parser.add_argument("--max-delay-s", type=float, default=0.5, help="longest delay")
    parser.add_argument("--seed", type=int, default=0, help="seed of the delays and order")
    parser.add_argument(
        "--plots-every", type=int, default=3, help="every n-th run writes plots (0: none)"
    )
    parser.add_argument(
        "--torn-allowed",
        action="store_true",
        help="count a torn run apart instead of as a failure (no symbolic links there)",
    )
    parser.add_argument("--output-dir", type=Path, default=None, help="keep the runs here")
    args = parser.parse_args(argv)
    global LINKED
    LINKED = not args.torn_allowed
    chooser = random.Random(args.seed)
    plan = ["SIGKILL"] * args.sigkill + ["SIGTERM"] * args.sigterm
    chooser.shuffle(plan)
    with_plots = [args.plots_every > 0 and n % args.plots_every == 0 for n in range(len(plan))]
    _warm_up(any(with_plots))
    base = args.output_dir or Path(tempfile.mkdtemp(prefix="kill-runs-"))
    failures = torn = drawn = 0
    started = time.perf_counter()
    for number, how in enumerate(plan):
        delay = chooser.uniform(0.0, args.max_delay_s)
        plots = with_plots[number]
        problems = run_once(base / f"run-{number:03d}", how, delay, plots)
        if problems == ["torn"] and args.torn_allowed:
            torn += 1
            verdict = "torn (index.md is an earlier report than report.json)"
        else:
            failures += bool(problems)
            verdict = "ok" if not problems else "FAIL: " + "; ".join(problems)
        kind = how
        if plots:
            pictures = _pictures_linked(base / f"run-{number:03d}")
            kind += f" plots ({pictures} linked)"
            drawn += pictures > 0
        print(f"run {number:3d} {kind} after {delay * 1000:6.1f} ms: {verdict}", flush=True)
    elapsed = time.perf_counter() - started
    sound = len(plan) - failures - torn
    print(
        f"{sound} of {len(plan)} runs sound ({sum(with_plots)} with plots, {drawn} of them "
        f"with pictures), {torn} torn, "
        f"{failures} failed ({elapsed:.1f} s); files in {base}"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
