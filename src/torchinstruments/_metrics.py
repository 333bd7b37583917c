"""The properties of each metric, in one table: its scale and its noise floors.

Only the standard library: the trackers (``series.py``), the report, ``compare`` and
``merge`` all read this table, and the offline tools do not import torch.

Three floors per metric, each the smallest noise assumed in its own setting, in compared
units (natural log for log-scale metrics, absolute otherwise):

- ``tracker_floor``: the smallest warm-up standard deviation of one run's tracker
  (``TensorSeries`` passes it to ``SeriesTracker``): 0.02 (2% relative) for scale
  metrics, 0.005 for fractions, 0.1 for excess kurtosis.
- ``comparison_floor``: the smallest run-to-run noise between a baseline and a candidate
  run (``compare.noise_floor``): 0.1 (about 10%) for scale metrics, 0.02 for fractions.
  One run cannot show how much a different initialisation or data order moves a level.
- ``rank_spread_floor``: the smallest spread of one series' latest value across ranks
  (``merge.spread_floor``): 0.1 for scale metrics, 0.02 for fractions, 1.0 for excess
  kurtosis; different ranks see different batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "ATTENTION_LOGITS_PATH",
    "COMPARISON_FRACTION_FLOOR",
    "COMPARISON_LOG_FLOOR",
    "IDENTICAL_FRACTION_FLOOR",
    "IDENTICAL_LOG_FLOOR",
    "LOG_SCALE_METRICS",
    "MAD_TO_STD",
    "METRICS",
    "RANK_DEFAULT_SPREAD_FLOOR",
    "RANK_LOG_SPREAD_FLOOR",
    "RMS_TO_ROOT",
    "TINY",
    "MetricProperties",
    "compared_value",
    "is_log_scale",
    "rank_spread_floors",
]

#: Derived gradient metric: a module's output-gradient RMS divided by the root output's
#: output-gradient RMS (the loss gradient) in the same sample. Loss scaling, loss
#: reduction and the natural shrinking of the loss gradient cancel in it.
#: Tensor path of the attention logits a module computes with
#: ``F.scaled_dot_product_attention`` (``_attention.py``; ``attention_logits[1]``, ...
#: for further calls in one module call).
ATTENTION_LOGITS_PATH = "attention_logits"

RMS_TO_ROOT = "rms_to_root"
#: Scales a median absolute deviation to a standard deviation for normal data
#: (1 / Phi^-1(3/4), rounded as in the robust-statistics literature).
MAD_TO_STD = 1.4826
#: Values of log-scale metrics are clamped to this before the log (a dead signal is 0).
TINY = 1e-30

#: Smallest run-to-run noise of a comparison: scale metrics (natural log, about 10%)
#: and fractions (absolute).
COMPARISON_LOG_FLOOR = 0.1
COMPARISON_FRACTION_FLOOR = 0.02
#: The same at the first point where runs that were identical before it differ (the
#: run-to-run noise of such a pair is zero until then): a tenth of the above.
IDENTICAL_LOG_FLOOR = 0.01
IDENTICAL_FRACTION_FLOOR = 0.002
#: Smallest spread across ranks of log-scale metrics (natural log, about 10%) and of
#: metrics the table does not list (absolute).
RANK_LOG_SPREAD_FLOOR = 0.1
RANK_DEFAULT_SPREAD_FLOOR = 0.1


@dataclass(frozen=True, slots=True)
class MetricProperties:
    """What one metric is and how much noise to assume for it.

    Attributes:
        log_scale: compared and tracked in natural log (relative change matters).
        tracked: computed per tensor and tracked per series (``loss_scale`` is not: it
            is the ``torch.amp.GradScaler`` scale, one per sample).
        tracker_floor: smallest warm-up standard deviation of its tracker, tracked
            units; None where it is not tracked.
        rank_spread_floor: smallest spread of its value across ranks, compared units.
    """

    log_scale: bool
    tracked: bool
    tracker_floor: float | None
    rank_spread_floor: float

    @property
    def comparison_floor(self) -> float:
        """Smallest run-to-run noise of the metric in a comparison, compared units."""
        return COMPARISON_LOG_FLOOR if self.log_scale else COMPARISON_FRACTION_FLOOR


def _scale(floor: float = 0.02) -> MetricProperties:
    return MetricProperties(True, True, floor, RANK_LOG_SPREAD_FLOOR)


#: Every metric by name (in the order ``merge`` lists the floors of the metrics that are
#: not log-scale).
METRICS: dict[str, MetricProperties] = {
    "rms": _scale(),
    "mean_abs": _scale(),
    "max_abs": _scale(),
    "tail_ratio": _scale(),
    RMS_TO_ROOT: _scale(),
    "zero_fraction": MetricProperties(False, True, 0.005, 0.02),
    "nonfinite_fraction": MetricProperties(False, True, 0.005, 0.02),
    "excess_kurtosis": MetricProperties(False, True, 0.1, 1.0),
    "loss_scale": MetricProperties(True, False, None, RANK_LOG_SPREAD_FLOOR),
}

#: Tracked metrics kept in log space (relative change matters, not absolute).
LOG_SCALE_METRICS = frozenset(m for m, p in METRICS.items() if p.log_scale and p.tracked)


def is_log_scale(metric: str) -> bool:
    """Whether ``metric`` is compared in natural log (the tracked scale metrics and the
    loss scale); False for a metric the table does not list."""
    properties = METRICS.get(metric)
    return properties is not None and properties.log_scale


def compared_value(metric: str, value: float) -> float:
    """``value`` in compared units: ``ln(max(value, TINY))`` for log-scale metrics,
    else ``value``.

    Example:
        >>> compared_value("rms", math.e), compared_value("zero_fraction", 0.5)
        (1.0, 0.5)
    """
    return math.log(max(value, TINY)) if is_log_scale(metric) else value


def rank_spread_floors() -> dict[str, float]:
    """The spread floors across ranks of the metrics that are not log-scale, by name."""
    return {m: p.rank_spread_floor for m, p in METRICS.items() if not p.log_scale}
