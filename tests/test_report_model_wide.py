"""Model-wide gradient rescaling is one <model> finding, never a set of module findings."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tests.harness import ResidualNet, event_of, make_batches, read_report
from torchinstruments import inject_observer, remove_observer


def test_changed_loss_reduction_is_one_model_wide_finding(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ResidualNet()
    inject_observer(model, output_dir=tmp_path, sampling=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    for step, (x, y) in enumerate(make_batches(80)):
        reduction = "mean" if step < 50 else "sum"  # x16 on every output gradient
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y, reduction=reduction).backward()
        optimizer.step()
    remove_observer(model)
    report = read_report(tmp_path)
    scale = [f for f in report["findings"] if f["category"] == "gradient_scale_change"]
    model_wide = [f for f in scale if f["module"] == "<model>"]
    assert len(model_wide) == 1
    finding = model_wide[0]
    assert finding["notable"] and finding["rank"] == 1
    event = event_of(report, finding)
    assert (event["shape"], event["module"]) == ("model_wide", "<model>")
    assert abs(event["change"]["ratio"] - 16.0) / 16.0 < 0.5
    assert 49 <= event["change"]["start_sample"] <= 51
    assert not [f for f in scale if f["notable"] and f["module"] != "<model>"]
    # The documented finding keys, as for module findings.
    module_finding = next(f for f in report["findings"] if f["module"] != "<model>")
    assert set(module_finding) <= set(finding) | {"call_index", "tensor_path", "also_named"}
    assert finding["change_sample"] == event["change"]["start_sample"]
    assert finding["change_forward"] == finding["change_sample"]  # sampling=1
    assert event["onset"] == {
        "sample": finding["change_sample"],
        "forward": finding["change_forward"],
        "after_forward": finding["change_forward"] - 1,  # the sample before it
    }


def test_a_loss_gradient_step_that_follows_the_output_is_no_model_wide_event(
    tmp_path: Path,
) -> None:
    """The loss is the output's mean square: scaling the last Linear's weight 10x moves
    the loss gradient 10x at the same sample. The Linear's activation step leads; the
    loss gradient's step is a compact row that says it follows the output, and the
    output gradient of the module before the Linear joins the Linear's event."""
    torch.manual_seed(0)
    last = nn.Linear(32, 4)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), last)
    inject_observer(model, output_dir=tmp_path, sampling=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    for step, (x, _) in enumerate(make_batches(60)):
        if step == 40:
            with torch.no_grad():
                last.weight.mul_(10.0)
        optimizer.zero_grad()
        (model(x) ** 2).mean().backward()
        optimizer.step()
    remove_observer(model)
    report = read_report(tmp_path)
    first = report["events"][0]
    assert (first["module"], first["signal"], first["shape"]) == ("4", "activation", "step")
    assert first["onset"]["forward"] == 40
    assert not [e for e in report["events"] if e["module"] == "<model>"]
    (row,) = [f for f in report["findings"] if f["module"] == "<model>"]
    assert (row["category"], row["notable"], row["change_sample"]) == (
        "gradient_scale_change",
        False,
        40,
    )
    assert row["follows_output_change"]["sample"] == 40
    assert row["follows_output_change"]["ratio"] > 2.0  # the least a leading output step
    index = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert "after the model output's own step" in index
    assert "does not point at the loss computation" in index
    # The output gradient of the ReLU before it stepped in the same backward pass: one
    # event, led by the Linear's activation, whose text says what the pair means.
    assert report["summary"]["headline"] == (
        "4 notable finding(s) in 1 event(s); the first (E1) is a step at `4` (call 0, "
        "activation.rms) at sample 40 (training forward 40) (activation_scale_drift, "
        "regime_change; gradient_scale_change at `3` (grad_output), regime_change at `3` "
        "(grad_output))."
    )
    # Each finding of the event at another module says where it is.
    assert [(f["category"], f.get("module"), f.get("signal")) for f in first["findings"]] == [
        ("activation_scale_drift", None, None),
        ("regime_change", None, None),
        ("gradient_scale_change", "3", "grad_output"),
        ("regime_change", "3", "grad_output"),
    ]
    assert {(f["module"], f["signal"]) for f in report["findings"] if f["notable"]} == {
        ("4", "activation"),
        ("3", "grad_output"),
    }
    assert (
        "In the same sample the output gradient of 3, before it in forward order, "
        in (first["interpretation"])
    )
    assert (
        "as it does when 4's weights (or a scale applied to them) change."
        in (first["interpretation"])
    )


def test_grad_scaler_scale_is_divided_out_and_reported_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ResidualNet()
    inject_observer(model, output_dir=tmp_path, sampling=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=5)
    for x, y in make_batches(40):
        optimizer.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(optimizer)
        scaler.update()
    remove_observer(model)
    report = read_report(tmp_path)
    scale = [f for f in report["findings"] if f["category"] == "gradient_scale_change"]
    loss_scale = [f for f in scale if f["metric"] == "loss_scale"]
    assert len(loss_scale) == 1 and loss_scale[0]["module"] == "<model>"
    assert loss_scale[0]["first"]["value"] == 2.0**10
    assert loss_scale[0]["max"]["value"] > 2.0**10  # the scaler grew
    assert report["coverage"]["loss_scaled_samples"] == 40
    assert not [f for f in scale if f["notable"] and f["module"] != "<model>"]


def test_a_loss_gradient_step_at_the_last_sample_waits_for_the_next(tmp_path: Path) -> None:
    # One batch whose loss gradient is 16x smaller, at the run's last sample: a model
    # that fits a batch shrinks it so once. Unconfirmed, it is no model-wide finding;
    # the same step confirmed by one more sample is.
    def run(directory: Path, steps: int) -> dict:
        torch.manual_seed(0)
        model = ResidualNet()
        inject_observer(model, output_dir=directory, sampling=1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
        for step, (x, y) in enumerate(make_batches(steps)):
            weight = 1.0 if step < 60 else 1.0 / 16
            optimizer.zero_grad()
            (weight * nn.functional.mse_loss(model(x), y)).backward()
            optimizer.step()
        remove_observer(model)
        return read_report(directory)

    def model_wide(report: dict) -> list[dict]:
        return [f for f in report["findings"] if f["module"] == "<model>" and f["notable"]]

    assert model_wide(run(tmp_path / "last", 61)) == []
    report = run(tmp_path / "confirmed", 62)
    (confirmed,) = model_wide(report)
    assert confirmed["change_sample"] == 60
    assert abs(event_of(report, confirmed)["change"]["ratio"] - 1 / 16) / (1 / 16) < 0.5
