"""Mixed precision: ``torch.amp.GradScaler`` with bf16 autocast, with gradient
accumulation, and its overflow and back-off, observed with the loss scale divided out.

Where training runs, it is compared with an uninstrumented twin (same seed, same data)
and must be bit-identical; reported values are checked against a hand-computed float64
reference on the twin (``tests.harness.Reference``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tests.harness import (
    MLP,
    MLP_NAMES,
    Batch,
    Report,
    assert_same_model,
    attach,
    finish,
    make_batches,
    series,
)
from torchinstruments import (
    TrackConfig,
)

AMP_STEPS = 36


def amp_run(model: nn.Module, data: Sequence[Batch], *, scaled: bool) -> tuple[list[float], float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=2.0**6, growth_factor=4.0, growth_interval=9, enabled=scaled
    )
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(float(loss.detach()))
    return losses, scaler.get_scale() if scaled else 1.0


def test_grad_scaler_with_bf16_autocast_reports_unscaled_gradients(tmp_path: Path) -> None:
    data = make_batches(AMP_STEPS, features=6)
    track = TrackConfig(warmup_samples=6)
    torch.manual_seed(1)
    unscaled = MLP()
    scaled, twin = copy.deepcopy(unscaled), copy.deepcopy(unscaled)
    attach(unscaled, tmp_path / "plain", track_config=track)
    amp_run(unscaled, data, scaled=False)
    plain_report = finish(unscaled, tmp_path / "plain")
    attach(scaled, tmp_path / "scaled", track_config=track)
    losses, final_scale = amp_run(scaled, data, scaled=True)
    scaled_report = finish(scaled, tmp_path / "scaled")
    assert final_scale == 2.0**6 * 4.0**4, "test premise: the loss scale grew four times"
    assert losses == amp_run(twin, data, scaled=True)[0]
    assert_same_model(scaled, twin)
    assert_same_model(scaled, unscaled)  # power-of-two scaling is exact

    assert scaled_report["coverage"]["loss_scaled_samples"] == AMP_STEPS
    assert scaled_report["coverage"]["backward_samples_observed"] == AMP_STEPS
    compared = 0
    scaled_series = series(scaled_report)
    for key, finding in series(plain_report).items():
        if key[2] != "grad_output" or key[0] == "<model>":
            continue
        for point in ("first", "latest", "min", "max"):
            expected = finding[point]["value"]
            got = scaled_series[key][point]["value"]
            assert got == pytest.approx(expected, rel=1e-3), (key, point, got, expected)
            compared += 1
    assert compared == 4 * len(MLP_NAMES)  # every output-gradient series

    def notable(report: Report) -> set[tuple[str, str, int, str, str]]:
        return {
            (f["category"], f["module"], f["call_index"], f["signal"], f["metric"])
            for f in report["findings"]
            if f["notable"] and f["module"] != "<model>"
        }

    assert notable(scaled_report) == notable(plain_report), "loss scaling shows as a finding"
    # The loss scale itself is reported once, as a model-wide <model> event (docs/report.md).
    assert [f["notable"] for f in scaled_report["findings"] if f["module"] == "<model>"] == [False]


def scaled_accumulation(style: str, scaled: bool) -> Callable[[nn.Module], list[float]]:
    """4 micro-batches per optimizer step under GradScaler.

    ``interleaved``: forward, scaled backward, forward, ...; ``forwards_first``: 4 forwards,
    then a scaled backward of each loss; ``summed``: one scaled backward of the summed loss.
    """

    def run(model: nn.Module) -> list[float]:
        data = make_batches(8, features=6)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=scaled)
        losses = []
        for start in range(0, len(data), 4):
            optimizer.zero_grad()
            chunk: list[Tensor] = []
            for x, y in data[start : start + 4]:
                chunk.append(nn.functional.mse_loss(model(x), y) / 4)
                if style == "interleaved":
                    scaler.scale(chunk[-1]).backward()
            if style == "forwards_first":
                for loss in chunk:
                    scaler.scale(loss).backward()
            elif style == "summed":
                scaler.scale(torch.stack(chunk).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
            losses += [float(loss.detach()) for loss in chunk]
        return losses

    return run


LATEST_SAMPLE_ONLY = ()  # fixed; kept so the parametrisations read the same


@pytest.mark.parametrize(
    "style",
    [
        "interleaved",
        pytest.param("forwards_first", marks=LATEST_SAMPLE_ONLY),
        pytest.param("summed", marks=LATEST_SAMPLE_ONLY),
    ],
)
def test_grad_scaler_with_gradient_accumulation(tmp_path: Path, style: str) -> None:
    torch.manual_seed(1)
    plain = MLP()
    scaled, twin = copy.deepcopy(plain), copy.deepcopy(plain)
    attach(plain, tmp_path / "plain")
    scaled_accumulation(style, scaled=False)(plain)
    plain_report = finish(plain, tmp_path / "plain")
    attach(scaled, tmp_path / "scaled")
    losses = scaled_accumulation(style, scaled=True)(scaled)
    scaled_report = finish(scaled, tmp_path / "scaled")
    assert losses == scaled_accumulation(style, scaled=True)(twin)
    assert_same_model(scaled, twin)
    assert_same_model(scaled, plain)  # power-of-two scaling is exact
    assert scaled_report["coverage"]["backward_samples_observed"] == 8
    scaled_series = series(scaled_report)
    for key, finding in series(plain_report).items():
        if key[2] == "grad_output":
            for point in ("first", "latest", "min", "max"):
                got, expected = scaled_series[key][point]["value"], finding[point]["value"]
                assert got == pytest.approx(expected, rel=1e-4), (key, point, got, expected)


def test_grad_scaler_overflow_and_backoff_is_not_a_module_finding(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = MLP()
    twin = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(16, 6, generator=generator), 100 * torch.randn(16, 1, generator=generator))
        for _ in range(20)
    ]
    finite_activations = []

    def check(module: nn.Module, args: Any, output: Tensor) -> None:
        finite_activations.append(bool(torch.isfinite(output).all()))

    for module in model.modules():
        module.register_forward_hook(check)

    def run(m: nn.Module) -> tuple[list[float], float]:
        optimizer = torch.optim.SGD(m.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
        losses = []
        for x, y in data:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(m(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(float(loss.detach()))
        return losses, scaler.get_scale()

    attach(model, tmp_path)
    losses, final_scale = run(model)
    report = finish(model, tmp_path)
    assert (losses, final_scale) == run(twin)
    assert_same_model(model, twin)
    assert final_scale < 2.0**127, "test premise: the scale overflowed and backed off"
    assert all(finite_activations), "test premise: only the scaled gradients overflow"
    assert not [
        (f["module"], f["signal"])
        for f in report["findings"]
        if f["category"] == "non_finite" and f["notable"] and f["module"] != "<model>"
    ]
