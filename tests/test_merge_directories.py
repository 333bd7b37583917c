"""The command line told a directory of the wrong kind: merge given separate runs as
ranks, compare given merged ranks or rank directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from torchinstruments import inject_observer, remove_observer
from torchinstruments.__main__ import main as cli_main
from torchinstruments.merge import SEPARATE_RUNS_NOTE

from .harness import ResidualNet, make_batches, train


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two single-process runs (``run-0``, ``run-1``) and the same reports put in
    ``ranks/rank-000`` and ``ranks/rank-001``."""
    root = tmp_path_factory.mktemp("separate")
    for seed in range(2):
        torch.manual_seed(seed)
        model = ResidualNet()
        inject_observer(model, output_dir=root / f"run-{seed}", sampling=1)
        train(model, make_batches(12))
        remove_observer(model)
        (root / "ranks" / f"rank-{seed:03d}").mkdir(parents=True)
        shutil.copy(root / f"run-{seed}" / "report.json", root / "ranks" / f"rank-{seed:03d}")
    return root


def test_merge_says_that_single_process_runs_are_not_ranks_of_one(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ranks = tmp_path / "ranks"
    shutil.copytree(runs / "ranks", ranks)
    assert cli_main(["merge", str(ranks)]) == 0
    out, err = capsys.readouterr()
    note = SEPARATE_RUNS_NOTE.format(count=2)
    assert err == f"torchinstruments merge: warning: {note}\n"
    merged = json.loads((ranks / "global-report.json").read_bytes())
    assert merged["ranks"]["separate_runs"] is True
    assert merged["ranks"]["notes"] == [note]  # not "rank-001 holds a report of rank 0"
    assert (merged["ranks"]["world_size"], merged["ranks"]["world_size_source"]) == (
        2,
        "rank directories",
    )
    headline = merged["summary"]["headline"]
    assert headline.startswith(
        "2 of 2 ranks present. These look like separate runs, not ranks of one: every "
        "report states world size 1. "
    ), headline
    assert headline in out


def test_merge_given_the_world_size_merges_them_as_ranks_without_the_note(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ranks = tmp_path / "ranks"
    shutil.copytree(runs / "ranks", ranks)
    assert cli_main(["merge", str(ranks), "--world-size", "2"]) == 0
    assert capsys.readouterr().err == ""
    merged = json.loads((ranks / "global-report.json").read_bytes())
    assert merged["ranks"]["separate_runs"] is False
    assert merged["ranks"]["notes"] == ["rank-001 holds a report of rank 0; merged as rank 1"]


def test_compare_given_merged_ranks_names_what_it_found_and_what_it_expected(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ranks = tmp_path / "ranks"
    shutil.copytree(runs / "ranks", ranks)
    assert cli_main(["merge", str(ranks)]) == 0
    capsys.readouterr()
    assert cli_main(["compare", str(ranks), str(runs / "run-1")]) == 1
    assert capsys.readouterr().err == (
        f"torchinstruments compare: error: {ranks}: expected the output directory of one "
        "observed run (baseline), holding series.json; got a directory of merged ranks "
        "(global-report.json, written by `torchinstruments merge`), which compare cannot "
        f"read; compare one rank's directory instead, such as {ranks / 'rank-000'}\n"
    )
    (ranks / "global-report.json").unlink()
    assert cli_main(["compare", str(runs / "run-0"), str(ranks)]) == 1
    assert capsys.readouterr().err == (
        f"torchinstruments compare: error: {ranks}: expected the output directory of one "
        "observed run (candidate), holding series.json; got a directory of 2 rank "
        "directories (rank_policy='all'); compare one rank's directory instead, such as "
        f"{ranks / 'rank-000'}\n"
    )
