"""Reductions of observed tensors of every kind: exact statistics in every float dtype
near its limits, complex outputs, activations of more than 2**24 elements, and empty,
integer, bool, sparse and meta tensors skipped and counted.

Where training runs, it is compared with an uninstrumented twin (same seed, same data)
and must be bit-identical; reported values are checked against a hand-computed float64
reference on the twin (``tests.harness.Reference``).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from tests.harness import (
    act,
    assert_same_model,
    attach,
    check_against_reference,
    finish,
    fit,
    grad,
    make_batches,
    observe_against_twin,
    pair,
    series,
    value,
)
from tests.harness.scenarios import check_cast_statistics
from torchinstruments.reduce import cpu_statistics, finish_statistics


@pytest.mark.parametrize(
    ("dtype", "scale", "loss_scale"),
    [
        (torch.float16, 65000.0, 1e-4),  # near float16's maximum
        (torch.float16, 1e-4, 1e3),  # float16 subnormals
        (torch.bfloat16, 3.3e38, 1e-38),  # near bfloat16's maximum
        (torch.float64, 1e300, 1e-300),
        (torch.float64, 1e-300, 1e300),
        (torch.float32, 1e30, 1e-30),
        (torch.float32, 1e-30, 1e30),
    ],
    ids=["f16-max", "f16-tiny", "bf16-max", "f64-1e300", "f64-1e-300", "f32-1e30", "f32-1e-30"],
)
def test_statistics_are_finite_and_exact_in_every_dtype(
    tmp_path: Path, dtype: torch.dtype, scale: float, loss_scale: float
) -> None:
    check_cast_statistics(tmp_path, dtype, scale, loss_scale)


class ComplexNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.spectrum = Spectrum()
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.spectrum(self.fc(x)).abs())


class Spectrum(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.fft.fft(x, dim=-1)


def test_complex_outputs_are_reduced_by_magnitude_or_skipped_and_counted(tmp_path: Path) -> None:
    data = make_batches(4, features=6)
    report, reference = observe_against_twin(ComplexNet, ["spectrum"], data, tmp_path)
    assert report["coverage"]["errors_total"] == 0
    if act("spectrum") in series(report):
        check_against_reference(report, reference)  # by magnitude
    else:
        assert any("complex" in reason for reason in report["coverage"]["tensors_skipped"])


class Huge(nn.Module):
    """``numel`` values repeating 1, -1, 3, -3: rms sqrt(5), mean_abs 2, kurtosis -1.36."""

    def __init__(self, numel: int, nan: bool = False) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))
        base = torch.tensor([1.0, -1.0, 3.0, -3.0]).repeat(numel // 4)
        if nan:
            base[7] = float("nan")
        self.register_buffer("base", base)

    def forward(self) -> Tensor:
        return self.base * self.gain


class HugeNet(nn.Module):
    def __init__(self, numel: int, nan: bool = False) -> None:
        super().__init__()
        self.big = Huge(numel, nan)

    def forward(self, x: Tensor) -> Tensor:
        return self.big().nan_to_num().mean() * x.sum()


HUGE_RMS, HUGE_MEAN_ABS, HUGE_KURTOSIS = math.sqrt(5.0), 2.0, 41.0 / 25.0 - 3.0


def test_activation_of_more_than_2_pow_24_elements(tmp_path: Path) -> None:
    numel = 2**24 + 4
    model = HugeNet(numel)
    attach(model, tmp_path)
    model(torch.ones(1)).backward()
    report = finish(model, tmp_path)
    assert value(report, act("big")) == pytest.approx(HUGE_RMS, rel=1e-4)
    assert value(report, grad("big")) == pytest.approx(1.0 / numel, rel=1e-4)
    assert report["coverage"]["errors_total"] == 0


def test_huge_activation_with_a_non_finite_value(tmp_path: Path) -> None:
    """Past 2**25 elements, with one NaN (the masked reduction path)."""
    numel = 3 * 2**24
    model = HugeNet(numel, nan=True)
    attach(model, tmp_path)
    model(torch.ones(1))  # a training forward; the activation is what is checked here
    report = finish(model, tmp_path)
    assert value(report, act("big")) == pytest.approx(HUGE_RMS, rel=1e-4)
    assert value(report, act("big"), metric="nonfinite_fraction") == pytest.approx(
        1 / numel, rel=1e-4
    )
    assert report["coverage"]["errors_total"] == 0
    # Only rms reaches the report for every series: check the other metrics directly.
    metrics = finish_statistics(cpu_statistics(model.big.base))
    assert metrics["rms"] == pytest.approx(HUGE_RMS, rel=1e-4)
    assert metrics["mean_abs"] == pytest.approx(HUGE_MEAN_ABS, rel=1e-4)
    assert metrics["max_abs"] == 3.0
    assert metrics["excess_kurtosis"] == pytest.approx(HUGE_KURTOSIS, abs=1e-3)
    assert metrics["zero_fraction"] == 0.0


class ManyKinds(nn.Module):
    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {
            "float": x * 2,
            "empty": x[:0],
            "integer": x.long(),
            "bool": x > 0,
            "sparse": x.detach().to_sparse(),
            "meta": torch.empty(3, device="meta"),
        }


class KindsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.kinds = ManyKinds()
        self.head = nn.Linear(6, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.kinds(self.fc(x))["float"])


def test_empty_integer_bool_sparse_and_meta_tensors_are_skipped_and_counted(
    tmp_path: Path,
) -> None:
    model, twin = pair(KindsNet)
    data = make_batches(3, features=6)
    attach(model, tmp_path)
    losses = fit(model, data)
    report = finish(model, tmp_path)
    assert losses == fit(twin, data)
    assert_same_model(model, twin)
    skipped = report["coverage"]["tensors_skipped"]
    assert sum(skipped.values()) == 5 * len(data), skipped
    for kind in ("empty", "sparse", "meta"):
        assert any(kind in reason for reason in skipped), (kind, skipped)
    paths = {key[3] for key in series(report) if key[0] == "kinds"}
    assert paths == {"output['float']"}
    assert report["coverage"]["errors_total"] == 0
