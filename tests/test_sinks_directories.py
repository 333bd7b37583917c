"""Report directories: an unwritable one and a full disk never stop training (retried,
warned once), and one directory is refused to a second observer however it is spelled,
and to a second process while the first runs.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import (
    MLP,
    assert_same_model,
    attach,
    fit,
    make_batches,
    pair,
    read,
)
from torchinstruments import (
    ObserverStateError,
    ReportConfig,
    inject_observer,
    observer_of,
    remove_observer,
)
from torchinstruments.sinks import WRITE_FAILED_NAME, DirectorySink


def write_failures(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if "could not write its report" in str(w.message)]


def test_unwritable_output_directory_never_stops_training(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory should be", encoding="utf-8")
    directory = blocker / "stats"  # cannot be created (root can write anywhere else)
    model, twin = pair(MLP)
    data = make_batches(6, features=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = attach(model, directory, report_config=ReportConfig(rewrite_interval_s=1e-6))
        losses = fit(model, data)  # a write is attempted at every forward
        assert handle.flush() is not None
        assert len(write_failures(caught)) == 1, [str(w.message) for w in caught]
    assert losses == fit(twin, data)
    assert_same_model(model, twin)
    current = handle.report()
    assert current["coverage"]["errors_total"] >= 7
    assert any(e.get("stage") == "write" for e in current["errors"]), current["errors"]

    blocker.unlink()  # the directory becomes writable: the next write succeeds
    handle.flush()
    report = read(directory)
    assert report["coverage"]["samples_observed"] == 6
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remove_observer(model)
    assert not [str(w.message) for w in caught if "wrote no report" in str(w.message)]
    assert read(directory)["coverage"]["errors_total"] >= 7


def test_full_disk_is_retried_and_warned_once(tmp_path: Path, monkeypatch: Any) -> None:
    real_replace = os.replace
    full = {"on": True}

    def replace(source: Any, target: Any) -> None:
        if full["on"] and str(tmp_path) in str(target):
            raise OSError(errno.ENOSPC, "No space left on device", str(target))
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)
    model, twin = pair(MLP)
    data = make_batches(4, features=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = attach(model, tmp_path, report_config=ReportConfig(rewrite_interval_s=1e-6))
        losses = fit(model, data)
        handle.flush()
        # The directory says that what is there is not the latest report.
        failed = (tmp_path / WRITE_FAILED_NAME).read_text(encoding="utf-8")
        assert failed.startswith("Report ") and "could not be written here:" in failed
        assert "No space left on device" in failed
        assert "No report of this run has been written here yet" in failed
        full["on"] = False
        handle.flush()
        assert not (tmp_path / WRITE_FAILED_NAME).exists()  # removed once one was written
        remove_observer(model)
    assert len(write_failures(caught)) == 1
    assert losses == fit(twin, data)
    assert_same_model(model, twin)
    report = read(tmp_path)
    assert report["coverage"]["errors_total"] >= 5
    # Nothing stale is left: the links, and the one generation they name.
    generation = os.readlink(tmp_path / ".current")
    assert re.fullmatch(r"\.generation-\d{6}", generation), generation
    names = ["index.md", "report.json", "series.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".current", generation, *names]
    assert sorted(p.name for p in (tmp_path / generation).iterdir()) == names


def same_directory_spellings(base: Path) -> Iterator[tuple[str, Path]]:
    yield "dotdot", base / ".." / base.name
    yield "trailing_dot", base / "."
    link = base.parent / f"{base.name}-link"
    link.symlink_to(base, target_is_directory=True)
    yield "symlink", link


def test_shared_report_directory_is_refused_however_spelled(
    tmp_path: Path, monkeypatch: Any
) -> None:
    base = tmp_path / "stats"
    base.mkdir()
    first = MLP()
    inject_observer(first, output_dir=base)
    for label, spelling in same_directory_spellings(base):
        other = MLP()
        with pytest.raises(ObserverStateError, match="already used"):
            inject_observer(other, output_dir=spelling)
        assert observer_of(other) is None, label
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ObserverStateError, match="already used"):
        inject_observer(MLP(), output_dir="stats")  # relative spelling
    # rank_policy="all" writes rank-000/ under it: separated, never interleaved.
    separate = MLP()
    inject_observer(separate, output_dir=base, rank_policy="all")
    first(torch.randn(2, 6)).sum().backward()
    separate(torch.randn(2, 6)).sum().backward()
    remove_observer(separate)
    remove_observer(first)
    assert read(base)["coverage"]["forwards_seen"] == 1
    assert read(base / "rank-000")["coverage"]["forwards_seen"] == 1


def test_a_failed_write_says_which_report_is_still_there(tmp_path: Path) -> None:
    sink = DirectorySink(tmp_path)
    sink.note_written({"run": {"report_number": 3}, "generated_at": "T3"})
    sink.note_failed_write(
        {"run": {"report_number": 4}, "generated_at": "T4"},
        OSError(errno.ENOSPC, "No space left on device"),
    )
    assert (tmp_path / WRITE_FAILED_NAME).read_text(encoding="utf-8") == (
        "Report 4 of this run (generated T4) could not be written here: [Errno 28] No space "
        "left on device\nreport.json and index.md here are still report 3 of this run, "
        "generated T3.\nThe observer retries at each rewrite and removes this file once a "
        "report is written.\n"
    )
    sink.note_written({"run": {"report_number": 5}, "generated_at": "T5"})
    assert not (tmp_path / WRITE_FAILED_NAME).exists()


def _lock(directory: Path, pid: int, host: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ".writer.lock").write_text(json.dumps({"pid": pid, "host": host}))


def test_a_directory_another_running_process_writes_is_refused(tmp_path: Path) -> None:
    _lock(tmp_path, os.getppid(), socket.gethostname())  # a process that runs
    with pytest.raises(ObserverStateError) as error:
        inject_observer(MLP(), output_dir=tmp_path)
    assert str(error.value) == (
        f"inject_observer: output_dir {str(tmp_path)!r} is used by another running "
        f"process (pid {os.getppid()}); give each run its own output_dir (if that process "
        f"is not a run of ours, delete {str(tmp_path / '.writer.lock')!r})"
    )
    assert not (tmp_path / "report.json").exists()


def test_a_lock_left_by_a_finished_or_distant_process_is_taken_over(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid runs no more
    _lock(tmp_path / "here", gone.pid, socket.gethostname())
    model = MLP()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inject_observer(model, output_dir=tmp_path / "here")
    assert not [w for w in caught if "took over" in str(w.message)]
    lock = json.loads((tmp_path / "here" / ".writer.lock").read_text())
    assert lock == {"pid": os.getpid(), "host": socket.gethostname()}
    remove_observer(model)
    assert not (tmp_path / "here" / ".writer.lock").exists()  # released at removal
    # Held on another host: whether it still runs cannot be told; taken over, warned.
    _lock(tmp_path / "shared", 1, "another-host")
    model = MLP()
    with pytest.warns(RuntimeWarning, match=r"took over .*held by pid 1 on host 'another-host'"):
        inject_observer(model, output_dir=tmp_path / "shared")
    remove_observer(model)
    assert not (tmp_path / "shared" / ".writer.lock").exists()
