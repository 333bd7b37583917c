"""The main example names the block it modified, and only then."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import event_of, load_example, read_report


def leaders(report: dict) -> dict[str, dict]:
    """Rank-1 notable finding per category."""
    first: dict[str, dict] = {}
    for finding in report["findings"]:
        if finding["notable"] and finding["category"] not in first:
            first[finding["category"]] = finding
    return first


@pytest.mark.parametrize(
    ("modification", "category", "module"),
    [
        ("drop-norm", "activation_scale_drift", "blocks.2.fc1"),
        ("shrink-residual", "activation_scale_drift", "blocks.2.scale"),
        ("shrink-residual", "gradient_scale_change", "blocks.2.fc2"),
    ],
)
def test_modified_block_leads_its_category(
    tmp_path: Path, modification: str, category: str, module: str
) -> None:
    example = load_example("basic_training.py", "basic_training_example")
    assert example.main(["--modification", modification, "--output-dir", str(tmp_path)]) == 0
    report = read_report(tmp_path)
    leader = leaders(report)[category]
    assert leader["module"] == module
    assert leader["rank"] == 1
    assert event_of(report, leader)["warmup_complete"] is True
    assert report["summary"]["headline"].startswith(f"{report['summary']['notable_findings']} ")
    index = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert f"`{module}`" in index


def test_unmodified_run_names_no_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example = load_example("basic_training.py", "basic_training_example")
    assert example.main(["--output-dir", str(tmp_path), "--steps", "300"]) == 0
    report = read_report(tmp_path)
    assert not any(f["module"].startswith("blocks.2") for f in leaders(report).values())
    assert report["summary"]["notable_findings"] == 0
    printed = capsys.readouterr().out
    assert "report: " in printed and "No finding stands out" in printed


def test_rejects_too_few_steps(capsys: pytest.CaptureFixture[str]) -> None:
    example = load_example("basic_training.py", "basic_training_example")
    with pytest.raises(SystemExit):
        example.main(["--steps", "1"])
    assert "--steps must be at least 2, got 1" in capsys.readouterr().err
