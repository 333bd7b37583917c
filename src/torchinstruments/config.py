"""Frozen, validated configuration objects.

Each field carries its unit in its name (``max_bytes``, ``rewrite_interval_s``) and is
checked in ``__post_init__``; invalid values raise :class:`~torchinstruments.ConfigError`
naming the owner, the field, what was expected and what was given.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._document import DEFAULT_MAX_BYTES
from ._validate import require_float, require_int

__all__ = ["ReportConfig", "TrackConfig"]

#: Upper bound of every byte limit (1 GiB): a report is read whole by its readers.
MAX_BYTES_LIMIT = 1 << 30
#: Upper bound of the per-category and per-table counts (findings, errors, echoes).
MAX_ENTRIES_LIMIT = 10_000
#: Upper bound of ``rewrite_interval_s``: one year, in seconds.
MAX_REWRITE_INTERVAL_S = 365 * 24 * 3600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportConfig:
    """How the report is selected, bounded and rewritten.

    Args:
        max_bytes: upper bound, in bytes, on ``report.json`` as written (indented UTF-8
            JSON), from 4,096 to 2**30. Findings are dropped round-robin from the weakest
            until it fits, then the sections named under ``coverage.sections_omitted``;
            what was dropped is counted under ``coverage.findings_omitted``. Default
            256,000.
        top_k_per_category: most notable findings kept per category before the byte limit
            applies (then up to three compact rows of findings that are not notable), 1
            to 10,000. Default 20.
        max_error_entries: most hook errors listed under ``errors`` (all are counted),
            grouped by stage, module and exception type, 0 to 10,000. Default 20.
        rewrite_interval_s: seconds between report rewrites during training; the report is
            also written at injection, at the end of warm-up
            (``TrackConfig.warmup_samples`` samples), on ``SIGTERM``, at
            ``remove_observer`` and at interpreter exit. Above 0, at most one year.
            Default 60.
        max_echo_modules: most echoing modules listed in one event, 0 to 10,000.
            Default 8.
        series_summary_max_bytes: bound, in bytes, on ``series.json``, the per-series
            summary that run comparisons read; series past it are counted under
            ``coverage.series_summary_omitted``. From 4,096 to 2**30; default 2,000,000.

    Raises:
        ConfigError: a field is out of range or of the wrong type.

    Example:
        >>> ReportConfig(max_bytes=64_000).top_k_per_category
        20
    """

    max_bytes: int = DEFAULT_MAX_BYTES
    top_k_per_category: int = 20
    max_error_entries: int = 20
    rewrite_interval_s: float = 60.0
    max_echo_modules: int = 8
    series_summary_max_bytes: int = 2_000_000

    def __post_init__(self) -> None:
        owner, most = "ReportConfig", MAX_ENTRIES_LIMIT
        require_int(owner, "max_bytes", self.max_bytes, minimum=4_096, maximum=MAX_BYTES_LIMIT)
        require_int(owner, "top_k_per_category", self.top_k_per_category, minimum=1, maximum=most)
        require_int(owner, "max_error_entries", self.max_error_entries, minimum=0, maximum=most)
        interval = require_float(
            owner,
            "rewrite_interval_s",
            self.rewrite_interval_s,
            minimum=0.0,
            maximum=MAX_REWRITE_INTERVAL_S,
            exclusive_minimum=True,
        )
        object.__setattr__(self, "rewrite_interval_s", interval)
        require_int(owner, "max_echo_modules", self.max_echo_modules, minimum=0, maximum=most)
        require_int(
            owner,
            "series_summary_max_bytes",
            self.series_summary_max_bytes,
            minimum=4_096,
            maximum=MAX_BYTES_LIMIT,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackConfig:
    """How each series is tracked over samples.

    Args:
        warmup_samples: samples a series must see before its baseline (mean and standard
            deviation of the first ``warmup_samples`` values, in the series' own scale:
            log for scale metrics) is frozen and its temporal indicators mean something.
            3 to 1,000,000. Default 24: the first few dozen updates of a run move every
            signal fast.
        fast_ema_alpha: smoothing factor of the fast exponential moving average, in (0, 1].
            Default 0.3 (about 6 samples of memory).
        slow_ema_alpha: smoothing factor of the slow EMA, in (0, 1]. Default 0.05 (about
            40 samples).
        cusum_allowance: CUSUM reference value k, in residual spreads of the series' own
            trend forecast. CUSUM with allowance k is tuned to shifts of about 2k
            (Montgomery, *Introduction to Statistical Quality Control*, ch. 9). Default
            2.5: abrupt departures of about 5 spreads are what counts; smaller persistent
            residuals are a bending trend, which real training has everywhere.
        cusum_threshold: CUSUM decision interval h, in residual spreads. Default 5.0
            (Montgomery, ch. 9): with k = 2.5 one value 7.5 spreads away alarms, or two
            values 5 spreads away.
        history_points: points of bounded history kept per series (downsampled by two each
            time it fills), 4 to 4,096. Default 64: every sample of a 1,000-step run at
            the default schedule (44 samples), so that ``compare`` meets two runs at the
            first sample after a change and a break of trend is dated between close
            points; a 10,000-step run (82 samples) keeps about every other sample.
        max_series: most series tracked, 1 to 10,000,000; series beyond it are not
            created and are counted under ``coverage.series_dropped``. Default 50,000.

    Raises:
        ConfigError: a field is out of range or of the wrong type.
    """

    warmup_samples: int = 24
    fast_ema_alpha: float = 0.3
    slow_ema_alpha: float = 0.05
    cusum_allowance: float = 2.5
    cusum_threshold: float = 5.0
    history_points: int = 64
    max_series: int = 50_000

    def __post_init__(self) -> None:
        require_int(
            "TrackConfig", "warmup_samples", self.warmup_samples, minimum=3, maximum=1_000_000
        )
        for name in ("fast_ema_alpha", "slow_ema_alpha"):
            value = require_float(
                "TrackConfig",
                name,
                getattr(self, name),
                minimum=0.0,
                maximum=1.0,
                exclusive_minimum=True,
            )
            object.__setattr__(self, name, value)
        allowance = require_float(
            "TrackConfig", "cusum_allowance", self.cusum_allowance, minimum=0.0
        )
        object.__setattr__(self, "cusum_allowance", allowance)
        threshold = require_float(
            "TrackConfig",
            "cusum_threshold",
            self.cusum_threshold,
            minimum=0.0,
            exclusive_minimum=True,
        )
        object.__setattr__(self, "cusum_threshold", threshold)
        require_int("TrackConfig", "history_points", self.history_points, minimum=4, maximum=4_096)
        require_int("TrackConfig", "max_series", self.max_series, minimum=1, maximum=10_000_000)
