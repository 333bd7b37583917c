"""Per-tensor reductions against float64 numpy references.

Tolerances. ``tensor_statistics`` and the CPU fast path accumulate in float32 (the inputs
are scaled by their largest magnitude first), so a sum over a few thousand elements
carries a relative error of order ``n_levels * 2**-24`` (about 1e-6 for a cascade sum);
``rel=1e-5`` leaves an order of magnitude of margin while still catching any formula or
masking error, which would be off by far more. ``excess_kurtosis`` is a difference
(``m4 / m2**2 - 3``) that can be close to zero, so the relative bound applies to the ratio
``m4 / m2**2`` (= excess + 3): an absolute tolerance of ``1e-5 * (|excess| + 3)``.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import torchinstruments.reduce as reduce_module
from tests.harness import reference_metrics
from torchinstruments.reduce import (
    METRICS,
    STAT_WIDTH,
    cpu_statistics,
    finish_statistics,
    is_reducible,
    skip_reason,
    tensor_statistics,
)

REL = 1e-5  # float32 accumulation, see the module docstring


def kurtosis_approx(expected: float | None) -> object:
    """``rel=1e-5`` on ``m4 / m2**2``, i.e. on ``expected + 3`` (see the module docstring)."""
    assert expected is not None
    return pytest.approx(expected, rel=REL, abs=REL * (abs(expected) + 3.0))


def assert_metrics_close(actual: dict[str, float | None], expected: dict[str, float | None]):
    assert set(actual) == set(METRICS)
    for metric in METRICS:
        want, got = expected[metric], actual[metric]
        if want is None:
            assert got is None, metric
            continue
        assert got is not None, metric
        assert math.isfinite(got), metric
        if metric == "excess_kurtosis":
            assert got == kurtosis_approx(want), metric
        else:
            assert got == pytest.approx(want, rel=REL), metric


def both_paths(x: torch.Tensor) -> tuple[dict[str, float | None], dict[str, float | None]]:
    device_row = tensor_statistics(x)
    assert device_row.dtype == torch.float64
    assert device_row.shape == (STAT_WIDTH,)
    return finish_statistics(device_row.tolist()), finish_statistics(cpu_statistics(x))


def seeded(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)


# ---------------------------------------------------------------- hand-computed example


def test_hand_computed_example_statistics_vector():
    x = torch.tensor([1.0, -2.0, 0.0, 3.0])
    row = tensor_statistics(x).tolist()
    # m = 3; scaled values 1/3, -2/3, 0, 1; scaled mean 1/6.
    expected = [
        4.0,  # numel
        4.0,  # finite
        1.0,  # zeros
        3.0,  # max_abs
        2.0 / 3.0,  # sum x/m
        6.0 / 3.0,  # sum |x|/m
        14.0 / 9.0,  # sum (x/m)^2
        13.0 / 9.0,  # sum (x/m - mean)^2 = 4 * 3.25 / 9
        78.25 / 81.0,  # sum (x/m - mean)^4
    ]
    assert row == pytest.approx(expected, rel=1e-6)
    assert cpu_statistics(x) == pytest.approx(expected, rel=1e-6)


def test_hand_computed_example_metrics():
    x = torch.tensor([1.0, -2.0, 0.0, 3.0])
    # mean 0.5; deviations 0.5, -2.5, -0.5, 2.5; m2 = 13/4; m4 = 313/16;
    # m4 / m2^2 = 313/169, so the excess kurtosis is 313/169 - 3 = -194/169.
    expected = {
        "rms": math.sqrt(14.0 / 4.0),
        "mean_abs": 1.5,
        "max_abs": 3.0,
        "tail_ratio": 3.0 / math.sqrt(3.5),
        "excess_kurtosis": -194.0 / 169.0,
        "zero_fraction": 0.25,
        "nonfinite_fraction": 0.0,
    }
    device, cpu = both_paths(x)
    for metric, value in expected.items():
        assert device[metric] == pytest.approx(value, rel=1e-6), metric
        assert cpu[metric] == pytest.approx(value, rel=1e-6), metric
    # Exactly representable results are exact.
    assert device["max_abs"] == 3.0
    assert device["mean_abs"] == 1.5
    assert device["zero_fraction"] == 0.25
    assert device["nonfinite_fraction"] == 0.0


# ---------------------------------------------------------------- dtypes against numpy


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str
)
def test_dtypes_match_numpy(dtype):
    x = seeded(64, 50, seed=1, dtype=dtype)
    expected = reference_metrics(x)
    device, cpu = both_paths(x)
    assert_metrics_close(device, expected)
    assert_metrics_close(cpu, expected)


def test_shifted_heavy_tailed_values_match_numpy():
    # A nonzero mean and a few large elements exercise the central moments.
    x = seeded(2000, seed=2) + 3.0
    x[::97] *= 25.0
    x[5::11] = 0.0
    expected = reference_metrics(x)
    assert expected["excess_kurtosis"] is not None and expected["excess_kurtosis"] > 3.0
    device, cpu = both_paths(x)
    assert_metrics_close(device, expected)
    assert_metrics_close(cpu, expected)
    assert device["zero_fraction"] == pytest.approx(182 / 2000, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_near_maximum_does_not_overflow(dtype):
    finfo = torch.finfo(dtype)
    x = (seeded(4000, seed=3, dtype=torch.float64).clamp(-3.0, 3.0) / 3.0 * 3.0e38).to(dtype)
    assert bool(torch.isfinite(x).all())
    assert float(x.abs().max()) > 0.85 * finfo.max
    expected = reference_metrics(x)
    device, cpu = both_paths(x)
    assert device["nonfinite_fraction"] == 0.0
    assert_metrics_close(device, expected)
    assert_metrics_close(cpu, expected)


def test_bfloat16_maximum_constant():
    big = torch.finfo(torch.bfloat16).max
    x = torch.full((1000,), big, dtype=torch.bfloat16)
    device, cpu = both_paths(x)
    for values in (device, cpu):
        assert values["rms"] == pytest.approx(big, rel=REL)
        assert values["max_abs"] == big
        assert values["tail_ratio"] == pytest.approx(1.0, rel=REL)
        assert values["nonfinite_fraction"] == 0.0


def test_float64_beyond_float32_range():
    x = seeded(500, seed=4, dtype=torch.float64) * 1e300
    expected = reference_metrics(x)
    assert expected["rms"] is not None and expected["rms"] > 1e299
    device, cpu = both_paths(x)
    assert_metrics_close(device, expected)
    assert_metrics_close(cpu, expected)


@pytest.mark.parametrize(
    ("dtype", "scale"),
    [(torch.float32, 1e-30), (torch.float64, 1e-30), (torch.float64, 1e-300)],
    ids=["float32-1e-30", "float64-1e-30", "float64-1e-300"],
)
def test_tiny_values_do_not_underflow(dtype, scale):
    x = seeded(500, seed=5, dtype=torch.float64).mul(scale).to(dtype)
    expected = reference_metrics(x)
    device, cpu = both_paths(x)
    assert device["rms"] is not None and device["rms"] > 0.0
    assert device["rms"] == pytest.approx(expected["rms"], rel=REL)
    assert_metrics_close(device, expected)
    assert_metrics_close(cpu, expected)


# ---------------------------------------------------------------- non-finite values


def test_non_finite_values_are_counted_and_excluded():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([1.0, nan, inf, -2.0, -inf, 0.0])
    device, cpu = both_paths(x)
    for values in (device, cpu):
        assert values["nonfinite_fraction"] == 0.5
        # Finite elements: 1, -2, 0.
        assert values["rms"] == pytest.approx(math.sqrt(5.0 / 3.0), rel=1e-6)
        assert values["mean_abs"] == pytest.approx(1.0, rel=1e-6)
        assert values["max_abs"] == 2.0
        assert values["tail_ratio"] == pytest.approx(2.0 / math.sqrt(5.0 / 3.0), rel=1e-6)
        assert values["zero_fraction"] == pytest.approx(1.0 / 3.0, rel=1e-12)
        assert values["excess_kurtosis"] is None  # fewer than 4 finite elements
    row = tensor_statistics(x).tolist()
    assert row[:4] == [6.0, 3.0, 1.0, 2.0]


def test_non_finite_mixed_into_random_values_match_numpy():
    x = seeded(1000, seed=6) * 4.0 + 1.0
    x[3::50] = float("nan")
    x[7::125] = float("inf")
    x[11::250] = float("-inf")
    expected = reference_metrics(x)
    assert expected["nonfinite_fraction"] == pytest.approx((20 + 8 + 4) / 1000, rel=1e-12)
    device, cpu = both_paths(x)
    assert_metrics_close(device, expected)
    assert_metrics_close(cpu, expected)
    assert device["nonfinite_fraction"] == expected["nonfinite_fraction"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_all_non_finite_tensor_has_no_scale_metrics(dtype):
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), float("nan")], dtype=dtype)
    device, cpu = both_paths(x)
    for values in (device, cpu):
        assert values["nonfinite_fraction"] == 1.0
        for metric in METRICS:
            if metric != "nonfinite_fraction":
                assert values[metric] is None, metric
    assert tensor_statistics(x).tolist()[:3] == [4.0, 0.0, 0.0]


# ---------------------------------------------------------------- degenerate values


def test_constant_tensor():
    x = torch.full((7,), -2.5)
    device, cpu = both_paths(x)
    assert device == {
        "rms": 2.5,
        "mean_abs": 2.5,
        "max_abs": 2.5,
        "tail_ratio": 1.0,
        "excess_kurtosis": None,
        "zero_fraction": 0.0,
        "nonfinite_fraction": 0.0,
    }
    assert cpu["excess_kurtosis"] is None
    assert cpu["tail_ratio"] == pytest.approx(1.0, rel=REL)
    assert cpu["rms"] == pytest.approx(2.5, rel=REL)


def test_all_zero_tensor():
    x = torch.zeros(5, 3)
    device, cpu = both_paths(x)
    expected = {
        "rms": 0.0,
        "mean_abs": 0.0,
        "max_abs": 0.0,
        "tail_ratio": None,  # rms is zero
        "excess_kurtosis": None,
        "zero_fraction": 1.0,
        "nonfinite_fraction": 0.0,
    }
    assert device == expected
    assert cpu == expected


def test_single_element():
    device, cpu = both_paths(torch.tensor([-4.0]))
    for values in (device, cpu):
        assert values["rms"] == pytest.approx(4.0, rel=1e-6)
        assert values["max_abs"] == 4.0
        assert values["excess_kurtosis"] is None


def test_finish_statistics_edge_rows():
    # numel 0 (never produced by tensor_statistics, but finish must not divide by it).
    assert finish_statistics([0.0] * STAT_WIDTH) == dict.fromkeys(METRICS)
    # Three finite elements: no kurtosis even with variance.
    values = finish_statistics([3.0, 3.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    assert values["excess_kurtosis"] is None
    assert values["rms"] == pytest.approx(math.sqrt(2.0 / 3.0), rel=1e-12)
    # Variance below the 1e-10 (units of max_abs^2) rounding floor: no kurtosis.
    values = finish_statistics([8.0, 8.0, 0.0, 1.0, 8.0, 8.0, 8.0, 8e-11, 1e-21])
    assert values["excess_kurtosis"] is None
    assert list(values) == list(METRICS)


# ---------------------------------------------------------------- complex and layouts


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_complex_is_reduced_by_magnitude(dtype):
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(300, dtype=dtype, generator=generator)
    expected = reference_metrics(x.abs())
    device, cpu = both_paths(x)
    assert_metrics_close(device, expected)
    assert_metrics_close(cpu, expected)


def test_complex_hand_example():
    x = torch.tensor([3 + 4j, 0j, -6 + 8j, 1j], dtype=torch.complex64)
    device, _ = both_paths(x)
    # Magnitudes 5, 0, 10, 1.
    assert device["max_abs"] == 10.0
    assert device["mean_abs"] == pytest.approx(4.0, rel=1e-6)
    assert device["rms"] == pytest.approx(math.sqrt(126.0 / 4.0), rel=1e-6)
    assert device["zero_fraction"] == 0.25


def test_expanded_tensor():
    base = seeded(4, 1, seed=8)
    x = base.expand(4, 1000)
    assert x.stride() == (1, 0)
    expected = reference_metrics(x)
    device, cpu = both_paths(x)
    # The layout must not matter: an expanded view reduces like its contiguous copy.
    assert device == finish_statistics(tensor_statistics(x.contiguous()).tolist())
    assert cpu == finish_statistics(cpu_statistics(x.contiguous()))
    for values in (device, cpu):
        assert values["max_abs"] == expected["max_abs"]
        assert values["rms"] == pytest.approx(expected["rms"], rel=REL)
        assert values["tail_ratio"] == pytest.approx(expected["tail_ratio"], rel=REL)
        assert values["excess_kurtosis"] == kurtosis_approx(expected["excess_kurtosis"])
    assert cpu["mean_abs"] == pytest.approx(expected["mean_abs"], rel=REL)
    assert device["mean_abs"] == pytest.approx(expected["mean_abs"], rel=REL)


@pytest.mark.parametrize(
    "make",
    [
        lambda: seeded(30, 40, seed=9).t(),
        lambda: seeded(30, 40, seed=9)[:, ::3],
        lambda: seeded(2, 30, 40, seed=9).permute(2, 0, 1)[1:, :, 5:],
        lambda: seeded(30, 40, seed=9, dtype=torch.float64)[::2].t(),
        lambda: seeded(30, 40, seed=9, dtype=torch.bfloat16)[:, 1::2],
    ],
    ids=["transposed", "strided", "permuted-sliced", "float64-strided", "bfloat16-strided"],
)
def test_non_contiguous_tensors(make):
    x = make()
    assert not x.is_contiguous()
    expected = reference_metrics(x)
    device, cpu = both_paths(x)
    assert_metrics_close(device, expected)
    assert_metrics_close(cpu, expected)


def test_input_is_not_modified():
    x = seeded(10, 10, seed=10)
    x[0, 0] = float("nan")
    before = x.clone()
    tensor_statistics(x)
    cpu_statistics(x)
    assert torch.equal(x.isnan(), before.isnan())
    assert torch.equal(x.nan_to_num(), before.nan_to_num())
    y = seeded(10, 10, seed=11)
    before = y.clone()
    tensor_statistics(y)
    cpu_statistics(y)
    assert torch.equal(y, before)


def test_requires_grad_input_is_reduced_without_graph():
    x = seeded(50, seed=12).requires_grad_()
    row = tensor_statistics(x)
    assert not row.requires_grad
    assert finish_statistics(cpu_statistics(x)) == pytest.approx(
        finish_statistics(row.tolist()), rel=REL
    )


# ---------------------------------------------------------------- unreducible tensors


def _sparse_csr() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Sparse CSR tensor support is in beta"
        return torch.eye(3).to_sparse_csr()


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: torch.zeros(0), "empty"),
        (lambda: torch.zeros(3, 0, dtype=torch.float64), "empty"),
        (lambda: torch.arange(5), "non_floating"),
        (lambda: torch.zeros(3, dtype=torch.int8), "non_floating"),
        (lambda: torch.ones(3, dtype=torch.bool), "non_floating"),
        (lambda: torch.eye(3).to_sparse(), "sparse"),
        (_sparse_csr, "sparse"),
        (lambda: torch.zeros(3, device="meta"), "meta"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
        (
            lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
            "nested",
        ),
        (lambda: torch.ones(3).to(torch.float8_e4m3fn), "float8"),
        (lambda: torch.ones(3).to(torch.float8_e5m2), "float8"),
        (lambda: 3.0, "not_a_tensor"),
        (lambda: None, "not_a_tensor"),
        (lambda: np.zeros(3), "not_a_tensor"),
    ],
    ids=[
        "empty",
        "empty-2d",
        "int64",
        "int8",
        "bool",
        "sparse-coo",
        "sparse-csr",
        "meta",
        "nested",
        "nested-jagged",
        "float8_e4m3fn",
        "float8_e5m2",
        "float",
        "none",
        "numpy",
    ],
)
def test_skip_reason(make, reason):
    value = make()
    assert skip_reason(value) == reason
    assert not is_reducible(value)
    expected = f"x must be a dense floating tensor, got {reason}$"
    with pytest.raises(ValueError, match=f"^tensor_statistics: {expected}"):
        tensor_statistics(value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"^cpu_statistics: {expected}"):
        cpu_statistics(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "dtype",
    [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64],
    ids=str,
)
def test_floating_and_complex_are_reducible(dtype):
    value = torch.ones(2, dtype=dtype)
    assert skip_reason(value) is None
    assert is_reducible(value)


# ---------------------------------------------------------------- CPU fast path


@pytest.fixture
def fallback_calls(monkeypatch):
    """Count calls of tensor_statistics made by cpu_statistics (the fallback)."""
    calls: list[torch.Tensor] = []
    original = reduce_module.tensor_statistics

    def spy(x):
        calls.append(x)
        return original(x)

    monkeypatch.setattr(reduce_module, "tensor_statistics", spy)
    return calls


@pytest.mark.parametrize(
    ("scale", "dtype"),
    [(1.0, torch.float32), (1e-5, torch.float32), (1e5, torch.float32), (1.0, torch.float16)],
    ids=["f32-1", "f32-1e-5", "f32-1e5", "f16-1"],
)
def test_fast_path_is_taken_for_safe_values(fallback_calls, scale, dtype):
    x = (seeded(100, seed=13) * scale).to(dtype)
    expected = reference_metrics(x)
    values = finish_statistics(reduce_module.cpu_statistics(x))
    assert fallback_calls == []
    assert_metrics_close(values, expected)
    assert_metrics_close(finish_statistics(tensor_statistics(x).tolist()), expected)


@pytest.mark.parametrize(
    "make",
    [
        lambda: seeded(100, seed=14) * 1e-9,  # below the 1e-8 floor
        lambda: seeded(100, seed=14) * 1e9,  # above (1e36 / 100) ** 0.25 = 3.2e8
        lambda: torch.where(torch.arange(100) == 5, float("nan"), seeded(100, seed=14)),
        lambda: torch.where(torch.arange(100) == 5, float("-inf"), seeded(100, seed=14)),
        lambda: torch.zeros(100),
        lambda: seeded(100, seed=14, dtype=torch.float64),
        lambda: torch.randn(100, dtype=torch.complex64, generator=torch.Generator().manual_seed(1)),
    ],
    ids=["tiny", "huge", "nan", "neg-inf", "zeros", "float64", "complex64"],
)
def test_fast_path_falls_back(fallback_calls, make):
    x = make()
    row = reduce_module.cpu_statistics(x)
    assert len(fallback_calls) == 1
    # The fallback is exactly the device path.
    assert row == tensor_statistics(x).tolist()
    assert_metrics_close(finish_statistics(row), reference_metrics(x))


def test_fast_path_limit_boundary(fallback_calls):
    n = 16
    limit = (1e36 / n) ** 0.25  # 5e8 for 16 elements
    inside = torch.full((n,), 0.5, dtype=torch.float64)
    inside[0] = limit * 0.999
    reduce_module.cpu_statistics(inside.to(torch.float32))
    assert fallback_calls == []
    outside = inside.clone()
    outside[0] = limit * 1.001
    reduce_module.cpu_statistics(outside.to(torch.float32))
    assert len(fallback_calls) == 1


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_fast_path_agrees_with_device_path(seed, dtype):
    x = (seeded(257, 3, seed=seed) * (seed + 1) + seed).to(dtype)
    fast = cpu_statistics(x)
    slow = tensor_statistics(x).tolist()
    assert fast[:4] == slow[:4]  # counts and max_abs are exact
    assert_metrics_close(finish_statistics(fast), finish_statistics(slow))


# ---------------------------------------------------------------- accumulation precision


def test_mean_abs_accumulation_precision():
    """Sums are pairwise (torch.sum), so a million elements keep float32 precision."""
    x = torch.rand(1_000_000, generator=torch.Generator().manual_seed(0))
    expected = reference_metrics(x)
    device = finish_statistics(tensor_statistics(x).tolist())
    assert device["mean_abs"] == pytest.approx(expected["mean_abs"], rel=REL)
    assert device["rms"] == pytest.approx(expected["rms"], rel=REL)


def test_large_cpu_tensor_keeps_scale_exact_and_estimates_shape_from_a_subsample():
    """Above 32,768 elements: RMS and maximum exact, the rest from a block subsample."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 16, 32, 32, generator=generator).relu()
    x[:, 3] *= 100.0  # one loud channel: a subsample must still see it
    expected = reference_metrics(x)
    actual = finish_statistics(cpu_statistics(x))
    assert x.numel() > reduce_module.SUBSAMPLE_ABOVE
    assert actual["max_abs"] == expected["max_abs"]
    assert actual["rms"] == pytest.approx(expected["rms"], rel=2e-5)
    assert actual["tail_ratio"] == pytest.approx(expected["tail_ratio"], rel=2e-5)
    assert actual["mean_abs"] == pytest.approx(expected["mean_abs"], rel=0.05)
    assert actual["zero_fraction"] == pytest.approx(expected["zero_fraction"], abs=0.01)
    assert actual["excess_kurtosis"] == pytest.approx(expected["excess_kurtosis"], rel=0.1)
    assert actual["nonfinite_fraction"] == 0.0


def test_batched_rows_match_single_tensor_rows():
    generator = torch.Generator().manual_seed(1)
    flats = [
        torch.randn(4096, generator=generator) * 3 + 1,
        torch.randn(4096, generator=generator).relu(),
        torch.full((4096,), 2.0),
        torch.zeros(4096),
        torch.randn(4096, generator=generator) * 1e-20,  # below the fast path: exact path
    ]
    flats[1][7] = float("nan")
    rows = reduce_module.cpu_statistics_batch(flats)
    for flat, row in zip(flats, rows, strict=True):
        assert row[:4] == cpu_statistics(flat)[:4]  # counts and max_abs exact
        assert_metrics_close(finish_statistics(row), reference_metrics(flat))
    with pytest.raises(ValueError, match="one length"):
        reduce_module.cpu_statistics_batch([torch.zeros(3), torch.zeros(4)])
    with pytest.raises(ValueError, match="at least one tensor"):
        reduce_module.cpu_statistics_batch([])


def test_matrix_rows_in_place_match_the_batch_rows():
    """cpu_statistics_matrix_ (the observer's staging slabs) gives the batch's rows, the
    non-finite and out-of-range rows exactly, whether |x| goes to a scratch buffer or
    not; the matrix is workspace afterwards."""
    generator = torch.Generator().manual_seed(2)
    matrix = torch.randn(5, 2048, generator=generator) * 3 + 1
    matrix[1] = matrix[1].relu()
    matrix[2, 9] = float("inf")
    matrix[3] *= 1e-20  # below the fast path
    matrix[4] = 0.0
    expected = reduce_module.cpu_statistics_batch(list(matrix.clone()))
    scratch = torch.full((5 * 2048 + 3,), 7.0)
    for buffer in (None, scratch):
        work = matrix.clone()
        rows = reduce_module.cpu_statistics_matrix_(work, scratch=buffer)
        assert rows == expected
        assert rows[2] == tensor_statistics(matrix[2]).tolist()
        assert rows[3] == tensor_statistics(matrix[3]).tolist()
    assert not torch.equal(work, matrix)  # used as workspace
    with pytest.raises(ValueError, match=r"contiguous 2-D float32 CPU tensor, got shape \(4,\)"):
        reduce_module.cpu_statistics_matrix_(torch.zeros(4))
    with pytest.raises(ValueError, match="contiguous True"):
        reduce_module.cpu_statistics_matrix_(torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"scratch must be .* at least 8 elements, got 7"):
        reduce_module.cpu_statistics_matrix_(torch.zeros(2, 4), scratch=torch.zeros(7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_device_batch_rows_match_single_tensor_rows(dtype):
    """The accelerator batch (run here on the CPU) gives each row what tensor_statistics
    gives that tensor alone, whatever its values: non-finite, constant, zero, tiny, huge."""
    generator = torch.Generator().manual_seed(2)
    n = 3000
    flats = [
        torch.randn(n, generator=generator) * 3 + 1,
        torch.randn(n, generator=generator).relu(),
        torch.full((n,), 2.0),
        torch.zeros(n),
        torch.randn(n, generator=generator) * 1e-30,
        torch.randn(n, generator=generator).clamp(-1, 1) * 3e38,
        torch.full((n,), float("nan")),
    ]
    flats[1][7], flats[1][8], flats[0][5] = float("nan"), float("inf"), float("-inf")
    flats = [f.to(dtype) for f in flats]
    rows = reduce_module.device_statistics_batch(flats)
    assert rows.shape == (len(flats), reduce_module.STAT_WIDTH) and rows.dtype == torch.float64
    for flat, row in zip(flats, rows, strict=True):
        single = tensor_statistics(flat)
        assert row[:4].tolist() == single[:4].tolist()  # counts and max_abs exact
        assert torch.allclose(row, single, rtol=1e-5, atol=0.0), (row, single)
        assert_metrics_close(finish_statistics(row.tolist()), reference_metrics(flat))
    # Alone, each tensor gets the row it gets in the batch.
    assert torch.allclose(
        reduce_module.device_statistics_batch(flats[:1])[0], rows[0], rtol=1e-6, atol=0.0
    )


def test_few_finite_values_among_many_non_finite_keep_exact_moments():
    """The masked path must not lose the central moments of 64 finite values to the
    (0 - mean) terms of a million masked positions."""
    values = torch.randn(64, generator=torch.Generator().manual_seed(0))
    for nans in (1_000, 1 << 20):
        x = torch.cat([values, torch.full((nans,), float("nan"))])
        expected = reference_metrics(values)
        expected["nonfinite_fraction"] = nans / x.numel()
        for row in (tensor_statistics(x), reduce_module.device_statistics_batch([x])[0]):
            assert_metrics_close(finish_statistics(row.tolist()), expected)


def test_device_batch_rejects_mixed_inputs():
    with pytest.raises(ValueError, match="at least one tensor"):
        reduce_module.device_statistics_batch([])
    with pytest.raises(ValueError, match="one dtype and device"):
        reduce_module.device_statistics_batch([torch.zeros(3), torch.zeros(3).half()])
    with pytest.raises(ValueError, match="real floating"):
        reduce_module.device_statistics_batch([torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        reduce_module.device_statistics_batch([torch.zeros(3), torch.zeros(0)])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        reduce_module.device_statistics_batch([torch.zeros(2, 3)])


def test_device_batch_of_mixed_lengths_matches_each_tensor_alone():
    """One ragged batch (lengths from 1 to past a whole number of blocks, NaN padding
    among them) gives each tensor its own statistics: counts and max |x| exactly."""
    generator = torch.Generator().manual_seed(3)
    lengths = [1, 5, 255, 256, 257, 3000, 40_000, 1 << 16, (1 << 16) + 3, 700_001]
    flats = [torch.randn(n, generator=generator) * (i + 1) + i for i, n in enumerate(lengths)]
    flats[2][10] = float("nan")
    flats[6][0] = float("-inf")
    flats[7][:100] = 0.0
    flats[9] = flats[9].relu()
    flats.append(torch.full((300,), float("nan")))
    flats.append(torch.zeros(4097))
    flats.append(torch.full((70,), 7.0))
    rows = reduce_module.device_statistics_batch(flats)
    assert rows.shape == (len(flats), reduce_module.STAT_WIDTH) and rows.dtype == torch.float64
    for flat, row in zip(flats, rows, strict=True):
        single = tensor_statistics(flat)
        assert row[:4].tolist() == single[:4].tolist(), (flat.numel(), row, single)
        assert torch.allclose(row, single, rtol=1e-5, atol=0.0), (flat.numel(), row, single)
        assert_metrics_close(finish_statistics(row.tolist()), reference_metrics(flat))
    # The same lengths again reuse the cached layout and give the same rows.
    assert torch.equal(reduce_module.device_statistics_batch(flats), rows)


def test_device_batch_keeps_a_near_constant_tensor_beside_a_large_one():
    """Sums are gathered per tensor, never as differences of running totals: the tiny
    central moments of a near-constant tensor survive next to a large spread one."""
    generator = torch.Generator().manual_seed(4)
    loud = torch.randn(50_000, generator=generator) * 1e3
    quiet = 5.0 + torch.randn(2_000, generator=generator, dtype=torch.float64) * 1e-2
    for flats in ([loud, quiet.float()], [quiet.float(), loud]):
        rows = reduce_module.device_statistics_batch(flats)
        for flat, row in zip(flats, rows, strict=True):
            assert_metrics_close(finish_statistics(row.tolist()), reference_metrics(flat))


def test_device_batch_honours_deterministic_algorithms():
    flats = [torch.randn(n) for n in (10, 1000, 70_000)]
    expected = reduce_module.device_statistics_batch(flats)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.equal(reduce_module.device_statistics_batch(flats), expected)
    finally:
        torch.use_deterministic_algorithms(previous)


def test_large_tensor_subsample_sees_every_feature_of_a_768_wide_row():
    """Rows of 12 blocks: a periodic block stride of 3 would see a third of the features."""
    for channel in (1, 138):
        x = torch.randn(1, 128, 768, generator=torch.Generator().manual_seed(0))
        x[..., channel] = 60.0  # one outlier feature
        expected = reference_metrics(x)
        actual = finish_statistics(cpu_statistics(x))
        assert actual["excess_kurtosis"] == pytest.approx(expected["excess_kurtosis"], rel=0.1)
        assert actual["mean_abs"] == pytest.approx(expected["mean_abs"], rel=0.05)


def test_deferred_subsamples_finished_in_a_batch_match_the_direct_rows():
    """Large tensors' subsamples, finished in one batch (one-signed and mixed parts
    together), give the rows that cpu_statistics gives directly; small, non-finite and
    integer tensors come back finished."""
    generator = torch.Generator().manual_seed(5)
    large = [
        torch.randn(200_000, generator=generator) * 3 + 1,
        torch.randn(100_000, generator=generator).relu(),
        -torch.randn(70_000, generator=generator).abs(),
        (torch.randn(300_000, generator=generator) * 1e-3).half(),
    ]
    large[1][:5000] = 0.0
    deferred = [reduce_module.cpu_statistics_deferred(x) for x in large]
    assert all(isinstance(d, reduce_module.Subsample) for d in deferred)
    parts = [d.part for d in deferred if isinstance(d, reduce_module.Subsample)]
    assert {p.numel() for p in parts} == {reduce_module.SUBSAMPLE_SIZE}
    mixed = reduce_module.cpu_statistics_subsamples(deferred)  # type: ignore[arg-type]
    one_signed = reduce_module.cpu_statistics_subsamples(deferred[1:3])  # type: ignore[arg-type]
    for x, finished in [*zip(large, mixed, strict=True), *zip(large[1:3], one_signed, strict=True)]:
        direct = cpu_statistics(x)
        assert finished[:4] == direct[:4]  # numel, finite, max_abs exact; zeros estimated alike
        assert finished == pytest.approx(direct, rel=1e-5, abs=0.0)
    assert one_signed[1][2] == pytest.approx(0.0, abs=3.0)  # -|x|: no zeros, sign sums to -n
    with pytest.raises(ValueError, match="at least one, got none"):
        reduce_module.cpu_statistics_subsamples([])
    short = reduce_module.Subsample(torch.ones(10), 100, 1.0, 100.0, True)
    with pytest.raises(ValueError, match=r"one length, got lengths \[10, 32768\]"):
        reduce_module.cpu_statistics_subsamples([short, deferred[0]])  # type: ignore[list-item]
    small = torch.randn(1000, generator=generator)
    assert reduce_module.cpu_statistics_deferred(small) == cpu_statistics(small)
    broken = torch.randn(100_000, generator=generator)
    broken[7] = float("nan")
    assert reduce_module.cpu_statistics_deferred(broken) == tensor_statistics(broken).tolist()


# ---------------------------------------------------------------- rows restricted to a mask


def test_a_row_restricted_to_kept_elements_is_the_row_of_those_elements_alone():
    """``_statistics_rows(x, kept=...)`` (compiled graphs' masked attention logits): the
    kept elements' row, non-finite ones among them counted, the others absent."""
    from torchinstruments._reduce_device import _statistics_rows

    nan = float("nan")
    x = torch.tensor([[1.0, -2.0, 0.0, 3.0, 100.0, nan], [nan, 5.0, 0.0, 0.0, 7.0, -1.0]])
    kept = torch.tensor(
        [[True, True, True, True, False, False], [True, False, True, True, False, True]]
    )
    rows = _statistics_rows(x, kept=kept)
    # Row 0: the hand example [1, -2, 0, 3] (100 and the NaN are masked out).
    assert rows[0].tolist() == pytest.approx(
        [4.0, 4.0, 1.0, 3.0, 2 / 3, 2.0, 14 / 9, 13 / 9, 78.25 / 81], rel=1e-6
    )
    # Row 1: [nan, 0, 0, -1]: 4 kept, 3 finite, 2 zeros; scaled by 1: sum -1, |sum| 1,
    # squares 1, mean -1/3, deviations 1/3, 1/3, -2/3: central sums 6/9 and 18/81.
    assert rows[1].tolist() == pytest.approx(
        [4.0, 3.0, 2.0, 1.0, -1.0, 1.0, 1.0, 6 / 9, 18 / 81], rel=1e-6
    )
    for index in range(2):
        alone = _statistics_rows(x[index][kept[index]].reshape(1, -1), masked=True)[0]
        assert rows[index].tolist() == pytest.approx(alone.tolist(), rel=1e-6)
