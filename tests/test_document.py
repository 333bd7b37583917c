"""The bounded-document helpers, the metric table and the series-file bytes: exact values."""

from __future__ import annotations

import math

import pytest

from torchinstruments._document import (
    bounded_text,
    clean,
    longest_fitting_prefix,
    number_text,
    round_number,
    round_or_reason,
    round_robin,
    shrink_to_fit,
    utf8_length,
)
from torchinstruments._jsonio import dumps_report, float_or_none, int_or_none, is_int
from torchinstruments._metrics import (
    LOG_SCALE_METRICS,
    METRICS,
    compared_value,
    is_log_scale,
    rank_spread_floors,
)
from torchinstruments._series_file import series_file_bytes


def test_round_robin_takes_one_item_per_column_per_level() -> None:
    assert round_robin([["a1", "a2", "a3"], ["b1"], ["c1", "c2"]]) == [
        "a1",
        "b1",
        "c1",
        "a2",
        "c2",
        "a3",
    ]
    assert round_robin([]) == []
    # With a key, each level is sorted by it; ties keep the columns' order.
    assert round_robin([[3, 1], [2, 5], [3]], key=lambda x: x) == [2, 3, 3, 1, 5]


def test_longest_fitting_prefix_is_the_largest_count_that_fits() -> None:
    def build(count: int) -> dict[str, object]:
        return {"items": ["x" * 10] * count}

    sizes = {k: len(dumps_report(build(k))) for k in range(11)}
    bound = sizes[6]
    assert longest_fitting_prefix(build, 10, bound) == build(6)
    assert longest_fitting_prefix(build, 10, sizes[10]) == build(10)
    assert longest_fitting_prefix(build, 10, sizes[0] - 1) == build(0)  # none fits


def test_shrink_to_fit_stops_once_it_fits_and_skips_steps_with_nothing_to_shrink() -> None:
    document = {"a": "x" * 100, "b": "y" * 100, "c": "z" * 100}
    calls: list[str] = []

    def emptying(key: str):
        def step(doc: dict[str, object]) -> bool:
            calls.append(key)
            if not doc[key]:
                return False
            doc[key] = ""
            return True

        return step

    document["a"] = ""
    bound = len(dumps_report({"a": "", "b": "", "c": "z" * 100}))
    assert shrink_to_fit(document, bound, [emptying(k) for k in "abc"]) is True
    assert calls == ["a", "b"]  # "c" was not needed
    assert document == {"a": "", "b": "", "c": "z" * 100}
    assert shrink_to_fit(document, bound, [emptying("c")]) is False  # fits already


def test_numbers_and_names() -> None:
    assert round_number(1 / 3) == 0.333333
    assert round_number(None) is None and round_number(math.inf) is None
    assert round_or_reason(2 / 3) == 0.666667
    assert round_or_reason(math.nan) == {"value": None, "reason": "not finite (nan)"}
    assert (number_text(1234.567), number_text(None), number_text(0.0)) == ("1235", "n/a", "0.0")
    assert bounded_text("a" * 300, 20) == "aaaaaaaaaaa…003ef1ba"
    assert len(bounded_text("a" * 300, 20)) == 20
    assert bounded_text("b" * 20, 20) == "b" * 20
    assert clean({"module": "m" * 300, "x": 1 / 3, "y": [math.inf], "z": True}) == {
        "module": bounded_text("m" * 300),
        "x": 0.333333,
        "y": [{"value": None, "reason": "not finite (inf)"}],
        "z": True,
    }
    assert utf8_length("abc") == 3 and utf8_length("é…") == 5


def test_lenient_field_readers() -> None:
    assert [int_or_none(v) for v in (3, True, 2.0, "3")] == [3, None, None, None]
    assert [float_or_none(v) for v in (3, 2.5, True, "1", math.nan)] == [3.0, 2.5, None, None, None]
    assert is_int(0) and not is_int(False)


def test_the_metric_table() -> None:
    assert frozenset({"rms", "mean_abs", "max_abs", "tail_ratio", "rms_to_root"}) == (
        LOG_SCALE_METRICS
    )
    assert is_log_scale("loss_scale") and "loss_scale" not in LOG_SCALE_METRICS
    assert not is_log_scale("zero_fraction") and not is_log_scale("unknown")
    assert {m: p.tracker_floor for m, p in METRICS.items()} == {
        "rms": 0.02,
        "mean_abs": 0.02,
        "max_abs": 0.02,
        "tail_ratio": 0.02,
        "rms_to_root": 0.02,
        "zero_fraction": 0.005,
        "nonfinite_fraction": 0.005,
        "excess_kurtosis": 0.1,
        "loss_scale": None,
    }
    assert METRICS["rms"].comparison_floor == 0.1
    assert METRICS["zero_fraction"].comparison_floor == 0.02
    assert rank_spread_floors() == {
        "zero_fraction": 0.02,
        "nonfinite_fraction": 0.02,
        "excess_kurtosis": 1.0,
    }
    assert compared_value("rms", math.e) == pytest.approx(1.0, abs=1e-15)
    assert compared_value("rms", 0.0) == math.log(1e-30)
    assert compared_value("zero_fraction", 0.5) == 0.5


def test_series_file_bytes_are_compact_json() -> None:
    assert (
        series_file_bytes({"schema": "s", "é": [1, 2.5]}) == '{"schema":"s","é":[1,2.5]}'.encode()
    )
