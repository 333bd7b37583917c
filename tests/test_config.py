"""Configuration objects: defaults, immutability and validation messages."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import pytest

from torchinstruments import DefaultSampling, EveryNSampling
from torchinstruments.config import ReportConfig, TrackConfig
from torchinstruments.errors import ConfigError, TorchInstrumentsError


def raises_exactly(message: str):
    return pytest.raises(ConfigError, match=f"^{re.escape(message)}$")


# ---------------------------------------------------------------- ReportConfig


def test_report_config_defaults():
    config = ReportConfig()
    assert config.max_bytes == 256_000
    assert config.top_k_per_category == 20
    assert config.max_error_entries == 20
    assert config.rewrite_interval_s == 60.0
    assert config.max_echo_modules == 8
    assert config.series_summary_max_bytes == 2_000_000
    assert [f.name for f in dataclasses.fields(config)] == [
        "max_bytes",
        "top_k_per_category",
        "max_error_entries",
        "rewrite_interval_s",
        "max_echo_modules",
        "series_summary_max_bytes",
    ]


def test_report_config_is_frozen_keyword_only_and_slotted():
    config = ReportConfig(max_bytes=64_000)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        ReportConfig(64_000)  # type: ignore[misc]
    assert not hasattr(config, "__dict__")
    assert config == ReportConfig(max_bytes=64_000)
    assert config != ReportConfig()
    assert dataclasses.replace(config, top_k_per_category=3).top_k_per_category == 3


def test_report_config_accepts_boundaries():
    config = ReportConfig(
        max_bytes=4_096,
        top_k_per_category=1,
        max_error_entries=0,
        rewrite_interval_s=1e-3,
        max_echo_modules=0,
    )
    assert config.max_bytes == 4_096
    assert config.max_error_entries == 0
    assert config.max_echo_modules == 0
    assert ReportConfig(rewrite_interval_s=5).rewrite_interval_s == 5


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_bytes", 4_095, "ReportConfig.max_bytes must be an int >= 4096, got 4095"),
        ("max_bytes", 0, "ReportConfig.max_bytes must be an int >= 4096, got 0"),
        ("max_bytes", 64_000.0, "ReportConfig.max_bytes must be an int >= 4096, got 64000.0"),
        ("max_bytes", True, "ReportConfig.max_bytes must be an int >= 4096, got True"),
        (
            "top_k_per_category",
            0,
            "ReportConfig.top_k_per_category must be an int >= 1, got 0",
        ),
        (
            "top_k_per_category",
            "5",
            "ReportConfig.top_k_per_category must be an int >= 1, got '5'",
        ),
        (
            "max_error_entries",
            -1,
            "ReportConfig.max_error_entries must be an int >= 0, got -1",
        ),
        (
            "max_error_entries",
            None,
            "ReportConfig.max_error_entries must be an int >= 0, got None",
        ),
        (
            "rewrite_interval_s",
            0.0,
            "ReportConfig.rewrite_interval_s must be a finite number > 0.0 and <= 31536000.0, "
            "got 0.0",
        ),
        (
            "rewrite_interval_s",
            -1,
            "ReportConfig.rewrite_interval_s must be a finite number > 0.0 and <= 31536000.0, "
            "got -1",
        ),
        (
            "rewrite_interval_s",
            float("inf"),
            "ReportConfig.rewrite_interval_s must be a finite number > 0.0 and <= 31536000.0, "
            "got inf",
        ),
        (
            "rewrite_interval_s",
            float("nan"),
            "ReportConfig.rewrite_interval_s must be a finite number > 0.0 and <= 31536000.0, "
            "got nan",
        ),
        (
            "rewrite_interval_s",
            True,
            "ReportConfig.rewrite_interval_s must be a finite number > 0.0 and <= 31536000.0, "
            "got True",
        ),
        (
            "rewrite_interval_s",
            "60",
            "ReportConfig.rewrite_interval_s must be a finite number > 0.0 and <= 31536000.0, "
            "got '60'",
        ),
        (
            "max_echo_modules",
            -2,
            "ReportConfig.max_echo_modules must be an int >= 0, got -2",
        ),
        (
            "series_summary_max_bytes",
            100,
            "ReportConfig.series_summary_max_bytes must be an int >= 4096, got 100",
        ),
    ],
)
def test_report_config_rejects(field, value, message):
    with raises_exactly(message):
        ReportConfig(**{field: value})


# ---------------------------------------------------------------- TrackConfig


def test_track_config_defaults():
    config = TrackConfig()
    assert config.warmup_samples == 24
    assert config.fast_ema_alpha == 0.3
    assert config.slow_ema_alpha == 0.05
    assert config.cusum_allowance == 2.5
    assert config.cusum_threshold == 5.0
    assert config.history_points == 64
    assert config.max_series == 50_000


def test_track_config_is_frozen_keyword_only_and_slotted():
    config = TrackConfig(warmup_samples=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.warmup_samples = 9  # type: ignore[misc]
    with pytest.raises(TypeError):
        TrackConfig(8)  # type: ignore[misc]
    assert not hasattr(config, "__dict__")
    assert config == TrackConfig(warmup_samples=8)
    assert hash(config) == hash(TrackConfig(warmup_samples=8))


def test_track_config_accepts_boundaries():
    config = TrackConfig(
        warmup_samples=3,
        fast_ema_alpha=1.0,
        slow_ema_alpha=1e-6,
        cusum_allowance=0.0,
        cusum_threshold=1e-9,
        history_points=4,
        max_series=1,
    )
    assert config.warmup_samples == 3
    assert config.fast_ema_alpha == 1.0
    assert config.cusum_allowance == 0.0


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("warmup_samples", 2, "TrackConfig.warmup_samples must be an int >= 3, got 2"),
        ("warmup_samples", 24.0, "TrackConfig.warmup_samples must be an int >= 3, got 24.0"),
        (
            "fast_ema_alpha",
            0.0,
            "TrackConfig.fast_ema_alpha must be a finite number > 0.0 and <= 1.0, got 0.0",
        ),
        (
            "fast_ema_alpha",
            1.5,
            "TrackConfig.fast_ema_alpha must be a finite number > 0.0 and <= 1.0, got 1.5",
        ),
        (
            "fast_ema_alpha",
            float("nan"),
            "TrackConfig.fast_ema_alpha must be a finite number > 0.0 and <= 1.0, got nan",
        ),
        (
            "slow_ema_alpha",
            -0.1,
            "TrackConfig.slow_ema_alpha must be a finite number > 0.0 and <= 1.0, got -0.1",
        ),
        (
            "slow_ema_alpha",
            None,
            "TrackConfig.slow_ema_alpha must be a finite number > 0.0 and <= 1.0, got None",
        ),
        (
            "cusum_allowance",
            -0.5,
            "TrackConfig.cusum_allowance must be a finite number >= 0.0, got -0.5",
        ),
        (
            "cusum_allowance",
            float("inf"),
            "TrackConfig.cusum_allowance must be a finite number >= 0.0, got inf",
        ),
        (
            "cusum_threshold",
            0.0,
            "TrackConfig.cusum_threshold must be a finite number > 0.0, got 0.0",
        ),
        (
            "cusum_threshold",
            False,
            "TrackConfig.cusum_threshold must be a finite number > 0.0, got False",
        ),
        ("history_points", 3, "TrackConfig.history_points must be an int >= 4, got 3"),
        ("max_series", 0, "TrackConfig.max_series must be an int >= 1, got 0"),
        ("max_series", "10", "TrackConfig.max_series must be an int >= 1, got '10'"),
    ],
)
def test_track_config_rejects(field, value, message):
    with raises_exactly(message):
        TrackConfig(**{field: value})


def test_config_error_hierarchy():
    with pytest.raises(ValueError):
        TrackConfig(warmup_samples=0)
    with pytest.raises(TorchInstrumentsError):
        ReportConfig(max_bytes=0)


# ---------------------------------------------------------------------- invalid fields
@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: ReportConfig(max_bytes=100), "max_bytes"),
        (lambda: ReportConfig(top_k_per_category=0), "top_k_per_category"),
        (lambda: ReportConfig(rewrite_interval_s=float("nan")), "rewrite_interval_s"),
        (lambda: TrackConfig(warmup_samples=1), "warmup_samples"),
        (lambda: TrackConfig(fast_ema_alpha=1.5), "fast_ema_alpha"),
        (lambda: TrackConfig(max_series=0), "max_series"),
        (lambda: DefaultSampling(samples_per_stage=0), "samples_per_stage"),
        (lambda: EveryNSampling(0), "n"),
    ],
)
def test_invalid_config_fields_name_field_expected_and_given(
    build: Callable[[], object], field: str
) -> None:
    with pytest.raises(ConfigError, match=rf"\.{field} must be .*, got "):
        build()
