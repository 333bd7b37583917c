"""The linked layout of DirectorySink: every file of one report switched in at once.

A write is stopped at each of its file-system steps in turn (``_Stopped`` stands for a
SIGKILL: nothing after it runs); what a reader then sees must always be the files of
one report. Readers (json, the command line, copies of the directory) go through the
links.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import tarfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torchinstruments._report_files as files_module
import torchinstruments.sinks as sinks_module
from torchinstruments import DirectorySink, inject_observer, remove_observer
from torchinstruments.__main__ import main as cli_main
from torchinstruments._generations import generation_of
from torchinstruments.errors import ReportReadError
from torchinstruments.show import show_directory

from .harness import ResidualNet, make_batches, train

_NUMBER = re.compile(r"^Report (\d+) of the run started (\S+) ", re.MULTILINE)


class _Stopped(BaseException):
    """Stands for a SIGKILL: nothing after it runs (not an Exception, so not caught)."""


def visible(directory: Path) -> tuple[int, int, int] | None:
    """What a reader of ``directory`` sees: the report number of ``report.json``, the
    one ``index.md`` states, and the forwards ``series.json`` counts; None when there is
    no report yet. Fails when the three do not belong to one report."""
    if not (directory / "report.json").exists():  # a link with nothing behind it yet
        assert not (directory / "index.md").exists()
        return None
    report = json.loads((directory / "report.json").read_bytes())
    index = (directory / "index.md").read_text(encoding="utf-8")
    series = json.loads((directory / "series.json").read_bytes())
    match = _NUMBER.search(index)
    assert match is not None, index[:200]
    run = report["run"]
    assert match.group(2) == run["started_at"]
    assert int(match.group(1)) == run["report_number"], "index.md is another report"
    assert series["run"]["forwards_seen"] == run["forwards_seen"], "series.json is another"
    assert series["run"]["report_number"] == run["report_number"], "series.json is another"
    assert series["run"]["samples_seen"] == run["samples_seen"]
    for picture in re.findall(r"\]\((plots/[^)]+\.png)\)", index):
        assert (directory / picture).is_file(), picture
    return run["report_number"], int(match.group(1)), run["forwards_seen"]


def own_entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


class StopAt:
    """Counts the file-system steps under ``root`` (``os.replace``, ``os.symlink``,
    ``os.mkdir``, ``os.unlink``, ``os.rename``, the sink's writes of new files and
    removals of generations) and raises ``_Stopped`` at step number ``stop`` (never,
    for None)."""

    def __init__(self, patch: pytest.MonkeyPatch, stop: int | None, root: Path) -> None:
        self.steps: list[str] = []
        self.stop = stop
        self.root = str(root)
        for name in ("replace", "symlink", "mkdir", "unlink", "rename"):
            patch.setattr(os, name, self._wrap(name, getattr(os, name)))
        patch.setattr(files_module, "write_new", self._wrap("write", files_module.write_new))
        patch.setattr(
            files_module, "remove_tree", self._wrap("remove_tree", files_module.remove_tree)
        )

    def _wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            target = args[1] if name in ("replace", "symlink", "rename") else args[0]
            # rmtree unlinks by name inside the directory it holds open (dir_fd)
            if str(target).startswith(self.root) or "dir_fd" in kwargs:
                self.steps.append(f"{name} {Path(target).name}")
                if self.stop is not None and len(self.steps) == self.stop:
                    raise _Stopped
            return real(*args, **kwargs)

        return step


def _run(directory: Path, forwards: int = 6) -> tuple[ResidualNet, Any]:
    torch.manual_seed(0)
    model = ResidualNet()
    handle = inject_observer(model, output_dir=directory, sampling=1)
    train(model, make_batches(forwards))
    handle.flush()
    return model, handle


def test_a_write_stopped_at_any_step_leaves_the_files_of_one_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, handle = _run(tmp_path)
    assert visible(tmp_path) == (2, 2, 6)  # injection, flush
    with monkeypatch.context() as patch:
        counted = StopAt(patch, None, tmp_path)
        handle.flush()
    steps = counted.steps
    # A new generation, its three files, the switch (a new link renamed onto .current),
    # then the previous generation deleted.
    assert steps == [
        "mkdir .generation-000003",
        "write report.json",
        "write index.md",
        "write series.json",
        f"symlink {steps[4].split()[1]}",
        "replace .current",
        "remove_tree .generation-000002",
        "unlink series.json",
        "unlink report.json",
        "unlink index.md",
    ]
    assert re.fullmatch(r"symlink \.\.current\.[0-9a-f]{8}", steps[4])
    switch = steps.index("replace .current") + 1
    for stop in range(1, len(steps) + 1):
        before = visible(tmp_path)
        assert before is not None
        with monkeypatch.context() as patch:
            StopAt(patch, stop, tmp_path)
            with pytest.raises(_Stopped):
                handle.flush()
        written = handle.report()["run"]["report_number"]  # the stopped write's number
        shown = visible(tmp_path)
        # Stopped up to the switch: the previous report; after it: the new one.
        assert shown == ((written, written, 6) if stop > switch else before), (stop, shown)
        handle.flush()  # a write that runs through; it deletes what the stopped one left
        assert visible(tmp_path) == (written + 1, written + 1, 6)
    remove_observer(model)
    generation = os.readlink(tmp_path / ".current")
    # Only a stopped removal of the previous generation leaves one (deleted by the next
    # run's first write, see test_stale_generations_...).
    assert [p for p in own_entries(tmp_path) if p.startswith(".generation")][-1] == generation
    assert [p for p in own_entries(tmp_path) if not p.startswith(".")] == [
        "index.md",
        "report.json",
        "series.json",
    ]


def test_every_step_of_a_write_shows_one_report_to_a_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recorded, not stopped: the state a reader would see right after each step."""
    model, handle = _run(tmp_path)
    seen: list[tuple[str, tuple[int, int, int] | None]] = []
    real_replace, real_symlink = os.replace, os.symlink

    def replace(source: Any, target: Any) -> None:
        real_replace(source, target)
        seen.append((f"replace {Path(target).name}", visible(tmp_path)))

    def symlink(source: Any, target: Any, **kwargs: Any) -> None:
        real_symlink(source, target, **kwargs)
        seen.append((f"symlink {Path(target).name}", visible(tmp_path)))

    monkeypatch.setattr(sinks_module.os, "replace", replace)
    monkeypatch.setattr(sinks_module.os, "symlink", symlink)
    handle.flush()
    remove_observer(model)
    monkeypatch.undo()
    # The flush, then the final report: each a new link, then its rename onto .current.
    assert [name.split()[0] for name, _ in seen] == ["symlink", "replace"] * 2
    assert [shown for _, shown in seen] == [(2, 2, 6), (3, 3, 6), (3, 3, 6), (4, 4, 6)]
    assert visible(tmp_path) == (4, 4, 6)


def test_the_first_write_into_a_fresh_directory_is_one_report_or_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as patch:
        counted = StopAt(patch, None, tmp_path)
        inject_observer(ResidualNet(), output_dir=tmp_path / "stats", sampling=1).remove()
    first = counted.steps[: counted.steps.index("replace .current") + 1]
    assert [s.split()[0] for s in first] == [
        "mkdir",  # stats, where injection takes its lock
        "mkdir",  # stats again, by the writer (it is there already)
        "symlink",  # the probe: two links, one renamed onto the other
        "symlink",
        "replace",
        "unlink",
        "unlink",
        "mkdir",  # the generation and its files
        "write",
        "write",
        "write",
        "symlink",  # report.json, index.md, series.json: links to nothing yet
        "replace",
        "symlink",
        "replace",
        "symlink",
        "replace",
        "symlink",  # the switch
        "replace",
    ]
    assert visible(tmp_path / "stats") == (2, 2, 0)  # at injection, at removal
    for stop in range(1, len(first) + 1):  # up to the switch: nothing to read yet
        directory = tmp_path / f"stats-{stop}"
        with monkeypatch.context() as patch:
            StopAt(patch, stop, directory)
            with pytest.raises(_Stopped):
                inject_observer(ResidualNet(), output_dir=directory, sampling=1)
        assert not directory.is_dir() or visible(directory) is None, (stop, first[stop - 1])


def test_readers_go_through_the_links(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    model, _ = _run(run)
    remove_observer(model)
    assert (run / "report.json").is_symlink() and os.readlink(run / "report.json") == (
        ".current/report.json"
    )
    report = json.loads((run / "report.json").read_text(encoding="utf-8"))
    assert report["coverage"]["file_write_mode"] == "linked_generations"
    assert show_directory(run).startswith("torchinstruments report")
    assert show_directory(run / "report.json") == show_directory(run)
    # Copies: the links are relative, so a copy of the directory reads the same.
    copies = {
        "copytree": lambda target: shutil.copytree(run, target, symlinks=True),
        "copytree_followed": lambda target: shutil.copytree(run, target),
        "cp_r": lambda target: subprocess.run(["cp", "-r", str(run), str(target)], check=True),
        "tar": lambda target: _tar_round_trip(run, target),
    }
    if shutil.which("rsync"):
        copies["rsync_a"] = lambda target: subprocess.run(
            ["rsync", "-a", f"{run}/", str(target)], check=True
        )
    for name, copy in copies.items():
        target = tmp_path / name
        copy(target)
        assert visible(target) == visible(run), name
        assert show_directory(target) == show_directory(run).replace(str(run), str(target))
    capsys.readouterr()
    assert cli_main(["compare", str(run), str(tmp_path / "tar")]) == 0
    out = capsys.readouterr().out
    assert "No notable divergence" in out, out[:400]


def _tar_round_trip(source: Path, target: Path) -> None:
    archive = source.parent / "run.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(source, arcname=target.name)
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "tar_filter"):  # Python 3.11.4 and later
            tar.extractall(target.parent, filter="tar")
        else:
            tar.extractall(target.parent)


def test_merge_reads_rank_directories_through_the_links(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for rank in range(2):
        model, _ = _run(tmp_path / f"rank-{rank:03d}")
        remove_observer(model)
        assert (tmp_path / f"rank-{rank:03d}" / "report.json").is_symlink()
    assert cli_main(["merge", str(tmp_path), "--world-size", "2"]) == 0
    merged = json.loads((tmp_path / "global-report.json").read_bytes())
    assert merged["ranks"]["present"] == ["0-1"]
    assert merged["ranks"]["unreadable_count"] == 0


@pytest.mark.parametrize("where", ["current_outside", "generation_is_a_link", "other_target"])
def test_links_other_than_the_writer_s_own_are_not_followed(tmp_path: Path, where: str) -> None:
    outside = tmp_path / "outside"
    model, _ = _run(outside)
    remove_observer(model)
    shown = tmp_path / "shown"
    shown.mkdir()
    generation = os.readlink(outside / ".current")
    if where == "current_outside":  # .current leads out of the directory
        os.symlink(outside / generation, shown / ".current")
        os.symlink(".current/report.json", shown / "report.json")
    elif where == "generation_is_a_link":  # the generation itself is a link out
        os.symlink(outside / generation, shown / ".generation-000001")
        os.symlink(".generation-000001", shown / ".current")
        os.symlink(".current/report.json", shown / "report.json")
    else:  # report.json names something else than .current/report.json
        os.symlink(outside / generation, shown / ".current")
        os.symlink(".current/index.md", shown / "report.json")
    with pytest.raises(ReportReadError, match="got a symbolic link \\(not followed\\)"):
        show_directory(shown)


def test_a_previous_run_s_plain_files_become_links_showing_the_same_at_each_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = tmp_path / "old"
    monkeypatch.setattr(sinks_module, "symlinks_work", lambda directory: False)
    model, handle = _run(old)
    remove_observer(model)
    monkeypatch.undo()
    assert not (old / "report.json").is_symlink()
    previous = visible(old)
    (old / "notes.txt").write_text("mine")
    seen = []
    real_replace = os.replace

    def replace(source: Any, target: Any) -> None:
        real_replace(source, target)
        seen.append((Path(target).name, visible(old)))

    monkeypatch.setattr(sinks_module.os, "replace", replace)
    torch.manual_seed(1)
    model = ResidualNet()
    handle = inject_observer(model, output_dir=old, sampling=1)
    monkeypatch.undo()
    # The old files become a generation, switched in, then links, one by one: each
    # step shows the old run's report; the new run's first report comes in at once.
    seen = [(name, shown) for name, shown in seen if not name.startswith(".probe.")]
    assert seen == [
        (".current", previous),
        ("report.json", previous),
        ("index.md", previous),
        ("series.json", previous),
        (".current", (1, 1, 0)),
    ]
    for name in ("report.json", "index.md", "series.json"):
        assert os.readlink(old / name) == f".current/{name}"
    assert (old / "notes.txt").read_text() == "mine"
    handle.remove()


@pytest.mark.parametrize("links", [True, False], ids=["linked", "replace_each"])
def test_files_of_someone_else_under_our_names_are_kept_aside_and_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, links: bool
) -> None:
    if not links:
        monkeypatch.setattr(sinks_module, "symlinks_work", lambda directory: False)
    (tmp_path / "index.md").write_text("# My experiment log\n")
    (tmp_path / "report.json").write_text('{"accuracy": 0.91}')
    (tmp_path / f"report.json{files_module.SET_ASIDE_SUFFIX}").write_text("kept before")
    (tmp_path / "series.json").write_text("")  # empty: not ours either
    (tmp_path / "details.json").mkdir()  # a directory under a file's name
    (tmp_path / "plots").mkdir()  # pictures of one's own, under the name of ours
    (tmp_path / "plots" / "loss_curve.png").write_bytes(b"\x89PNG mine")
    (tmp_path / ".current").write_text("a file, where ours is a link")
    with pytest.warns(RuntimeWarning) as caught:
        model, _ = _run(tmp_path)
        remove_observer(model)
    ours = [str(w.message) for w in caught if "did not write" in str(w.message)]
    assert ours == [
        f"torchinstruments found files it did not write in {str(tmp_path)!r} under the "
        "names of its report; they were kept as report.json.not-torchinstruments.1, "
        "index.md.not-torchinstruments, series.json.not-torchinstruments, "
        "details.json.not-torchinstruments, plots.not-torchinstruments, "
        ".current.not-torchinstruments"
    ]
    assert (tmp_path / "details.json.not-torchinstruments").is_dir()
    picture = tmp_path / "plots.not-torchinstruments" / "loss_curve.png"
    assert picture.read_bytes() == b"\x89PNG mine"
    assert (tmp_path / ".current.not-torchinstruments").read_text() == (
        "a file, where ours is a link"
    )
    assert (tmp_path / "index.md.not-torchinstruments").read_text() == "# My experiment log\n"
    assert (tmp_path / "report.json.not-torchinstruments.1").read_text() == '{"accuracy": 0.91}'
    assert (tmp_path / "report.json.not-torchinstruments").read_text() == "kept before"
    assert (tmp_path / "series.json.not-torchinstruments").read_text() == ""
    assert visible(tmp_path) == (3, 3, 6)
    # The next run finds only its own files there: nothing more is set aside.
    with warnings.catch_warnings(record=True) as caught_again:
        warnings.simplefilter("always")
        model, _ = _run(tmp_path)
        remove_observer(model)
    assert not [w for w in caught_again if "did not write" in str(w.message)]
    assert len(list(tmp_path.glob("*.not-torchinstruments*"))) == 7


def test_stale_generations_and_temporaries_are_removed_and_nothing_else(
    tmp_path: Path,
) -> None:
    (tmp_path / ".generation-000041").mkdir()  # a generation a kill left
    (tmp_path / ".generation-000041" / "report.json").write_text("{}")
    os.symlink(".generation-000041", tmp_path / "..current.0123abcd")  # a switch's link
    (tmp_path / ".report.json.0123abcd").write_text("{")  # a replaced-each temporary
    (tmp_path / ".generation-notes").mkdir()  # not our name
    (tmp_path / "fork-123").mkdir()  # a forked child's directory
    (tmp_path / ".generation-000007").write_text("a file, not ours to delete")
    model, _ = _run(tmp_path)
    remove_observer(model)
    generation = os.readlink(tmp_path / ".current")
    assert generation == ".generation-000044"  # after the stale one; three reports
    assert own_entries(tmp_path) == [
        ".current",
        ".generation-000007",
        generation,
        ".generation-notes",
        "fork-123",
        "index.md",
        "report.json",
        "series.json",
    ]


def test_a_full_disk_keeps_the_current_generation_until_the_switch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, handle = _run(tmp_path)
    assert visible(tmp_path) == (2, 2, 6)
    stale = tmp_path / ".generation-000001"  # a killed write's leftover
    stale.mkdir()
    (stale / "report.json").write_bytes(b"x" * 1000)
    full = {"writes": 0, "on": True}
    real = files_module.write_new

    def write_new(path: Path, data: bytes) -> None:
        full["writes"] += 1
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(files_module, "write_new", write_new)
    with pytest.warns(RuntimeWarning, match="could not write its report"):
        handle.flush()
    # Each file retried once, after the stale generation was removed; the switch never
    # came, so the reader still sees report 2, and no new generation is left.
    assert not stale.exists()
    assert visible(tmp_path) == (2, 2, 6)
    assert sorted(p.name for p in tmp_path.glob(".generation-*")) == [".generation-000002"]
    full["on"] = False
    handle.flush()
    assert visible(tmp_path) == (4, 4, 6)
    errors = {e["stage"]: e["count"] for e in handle.report()["errors"]}
    assert errors == {"series_summary": 1, "write": 1}
    remove_observer(model)


def test_where_links_cannot_be_made_each_file_is_replaced_and_the_report_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "symlink", no_links)
    model, _ = _run(tmp_path)
    remove_observer(model)
    assert own_entries(tmp_path) == ["index.md", "report.json", "series.json"]
    assert not any(p.is_symlink() for p in tmp_path.iterdir())
    report = json.loads((tmp_path / "report.json").read_bytes())
    assert report["coverage"]["file_write_mode"] == "replace_each"
    assert visible(tmp_path) == (3, 3, 6)


def test_a_sink_used_on_its_own_switches_each_file_in_with_the_others_carried_over(
    tmp_path: Path,
) -> None:
    model, _ = _run(tmp_path / "run")
    remove_observer(model)
    report = json.loads((tmp_path / "run" / "report.json").read_bytes())
    summary_bytes = (tmp_path / "run" / "series.json").read_bytes()
    sink = DirectorySink(tmp_path / "own", write_full_details=True)
    sink.write(report)
    assert sink.write_mode == "linked_generations"
    assert not os.path.lexists(tmp_path / "own" / "series.json")
    sink.write_summary(json.loads(summary_bytes))
    sink.write_details({"schema": "torchinstruments.details/1", "series": []})
    assert visible(tmp_path / "own") == visible(tmp_path / "run")
    assert json.loads((tmp_path / "own" / "details.json").read_bytes())["series"] == []
    assert len(list((tmp_path / "own").glob(".generation-*"))) == 1


def test_a_chdir_mid_run_moves_no_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = ResidualNet()
    handle = inject_observer(model, output_dir="stats", sampling=1)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    train(model, make_batches(4))
    handle.flush()
    remove_observer(model)
    assert not (tmp_path / "elsewhere" / "stats").exists()
    assert visible(tmp_path / "stats") == (3, 3, 4)


def _zip_round_trip(source: Path, target: Path) -> None:
    archive = shutil.make_archive(str(source.parent / "run"), "zip", source)  # follows links
    shutil.unpack_archive(archive, target)


@pytest.mark.parametrize("copy", ["cp_rL", "copytree", "zip"])
def test_a_copy_that_resolved_the_links_is_taken_in_by_the_next_run(
    tmp_path: Path, copy: str
) -> None:
    run = tmp_path / "run"
    model, _ = _run(run)
    remove_observer(model)
    copied = tmp_path / "copied"
    if copy == "cp_rL":
        subprocess.run(["cp", "-rL", str(run), str(copied)], check=True)
    elif copy == "copytree":
        shutil.copytree(run, copied)  # symlinks=False: links become what they point to
    else:
        _zip_round_trip(run, copied)
    assert (copied / ".current").is_dir() and not (copied / ".current").is_symlink()
    assert visible(copied) == (3, 3, 6)
    # A new run into the copy: .current, a real directory, is taken in like an earlier
    # run's plain files, and the new run's reports are switched in as usual.
    _, handle = _run(copied, forwards=4)
    assert visible(copied) == (2, 2, 4)
    assert handle.report()["errors"] == []
    assert generation_of(copied) is not None
    for name in ("report.json", "index.md", "series.json"):
        assert os.readlink(copied / name) == f".current/{name}"
    assert show_directory(copied).startswith("torchinstruments report")
    handle.remove()
    assert visible(copied) == (3, 3, 4)
    assert [p for p in own_entries(copied) if not p.startswith(".generation-")] == [
        ".current",
        "index.md",
        "report.json",
        "series.json",
    ]


def test_a_new_run_carries_over_nothing_an_earlier_run_wrote(tmp_path: Path) -> None:
    model, _ = _run(tmp_path / "run")
    remove_observer(model)
    report = json.loads((tmp_path / "run" / "report.json").read_bytes())
    summary = json.loads((tmp_path / "run" / "series.json").read_bytes())
    folder = tmp_path / "folder"
    earlier = DirectorySink(folder, write_full_details=True, plots=True)
    earlier.begin()
    earlier.write(report)
    earlier.write_summary(summary)
    earlier.write_details({"schema": "torchinstruments.details/1", "series": []})
    earlier.commit()
    assert (folder / "details.json").is_file() and (folder / "plots").is_dir()
    # A plain run into the same folder: no details.json, no plots/ of the earlier run
    # beside its report, and no link left pointing at nothing.
    model, _ = _run(folder)
    assert visible(folder) == (2, 2, 6)
    assert [p for p in own_entries(folder) if not p.startswith(".")] == [
        "index.md",
        "report.json",
        "series.json",
    ]
    remove_observer(model)
    subprocess.run(["cp", "-rL", str(folder), str(tmp_path / "resolved")], check=True)
    assert visible(tmp_path / "resolved") == (3, 3, 6)


def test_a_sink_carries_over_only_what_it_wrote_itself(tmp_path: Path) -> None:
    model, _ = _run(tmp_path / "run")
    remove_observer(model)
    report = json.loads((tmp_path / "run" / "report.json").read_bytes())
    summary = json.loads((tmp_path / "run" / "series.json").read_bytes())
    earlier = DirectorySink(tmp_path / "folder")
    earlier.write(report)
    earlier.write_summary(summary)
    assert visible(tmp_path / "folder") == visible(tmp_path / "run")
    later = DirectorySink(tmp_path / "folder")
    later.write_summary(summary)  # the earlier sink's report.json and index.md: removed
    assert not os.path.lexists(tmp_path / "folder" / "report.json")
    assert not os.path.lexists(tmp_path / "folder" / "index.md")
    later.write(report)  # its own series.json: carried over
    assert visible(tmp_path / "folder") == visible(tmp_path / "run")


def test_show_follows_a_link_to_a_directory_named_on_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    model, _ = _run(run)
    remove_observer(model)
    os.symlink(run, tmp_path / "latest", target_is_directory=True)
    capsys.readouterr()
    assert cli_main(["show", str(tmp_path / "latest")]) == 0
    shown = capsys.readouterr().out
    assert shown == show_directory(run).replace(str(run), str(tmp_path / "latest"))
    # A link to a report file is not followed, nor one inside the named directory.
    os.symlink(run / "report.json", tmp_path / "report.json")
    with pytest.raises(ReportReadError, match="got a symbolic link \\(not followed\\)"):
        show_directory(tmp_path / "report.json")
    inner = tmp_path / "inner"
    inner.mkdir()
    os.symlink(run / "report.json", inner / "report.json")
    with pytest.raises(ReportReadError, match="got a symbolic link \\(not followed\\)"):
        show_directory(tmp_path / "inner")


def test_a_copy_of_the_visible_names_alone_is_refused_with_what_went_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    model, _ = _run(run)
    remove_observer(model)
    copied = tmp_path / "copied"
    copied.mkdir()
    subprocess.run(
        ["cp", "-r", *sorted(str(p) for p in run.iterdir() if p.name[0] != "."), str(copied)],
        check=True,
    )  # as a shell's `cp -r run/* copied/`: without .current and the generations
    assert os.readlink(copied / "report.json") == ".current/report.json"
    expected = (
        f"{copied / 'report.json'}: expected a report as a regular file, got a dangling "
        "symbolic link to .current/report.json (.current, which it points into, is not "
        "beside it, as after copying the visible names alone: copy the whole directory, "
        "or use `cp -rL`)"
    )
    with pytest.raises(ReportReadError) as raised:
        show_directory(copied)
    assert str(raised.value) == expected
    capsys.readouterr()
    assert cli_main(["compare", str(run), str(copied)]) == 1
    assert "got a dangling symbolic link to .current/series.json" in capsys.readouterr().err
