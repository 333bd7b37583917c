"""Kinds of use that must never break training, lose data or mislead.

Each test here failed on the code before the mechanism it checks was fixed.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from torchinstruments import ReportConfig, inject_observer, remove_observer
from torchinstruments.sampling import EveryNSampling

from .conftest import ResidualNet, make_batches, read_report, train


def test_unwritable_output_dir_never_raises_under_warnings_as_errors(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    model = ResidualNet()
    handle = inject_observer(
        model,
        output_dir=blocker / "stats",  # its parent is a file: every write fails
        sampling=1,
        report_config=ReportConfig(rewrite_interval_s=1e-9),  # a rewrite in every forward
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(model, make_batches(4))
        remove_observer(model)
    report = handle.report()
    assert report is not None
    assert [e["stage"] for e in report["errors"]] == ["write"]
    assert report["errors"][0]["error_type"] == "NotADirectoryError"
    assert report["errors"][0]["count"] >= 5  # one per forward, and the final write


class _RaisingExtras(EveryNSampling):
    """Samples every forward; its optional cost listener always raises."""

    def note_cost(self, seconds: float) -> None:
        raise RuntimeError("listener broke")


def test_a_raising_policy_method_is_counted_not_raised(tmp_path: Path) -> None:
    model = ResidualNet()
    inject_observer(model, output_dir=tmp_path, sampling=_RaisingExtras(1))
    train(model, make_batches(3))
    remove_observer(model)
    errors = read_report(tmp_path)["errors"]
    assert [(e["stage"], e["error_type"], e["message"]) for e in errors] == [
        ("policy.note_cost", "RuntimeError", "listener broke")
    ]
    assert errors[0]["count"] > 3
