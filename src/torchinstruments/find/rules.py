"""One rule per finding category.

Each rule looks only at the series and metrics of its category, ranks only within it, and
states its noise floor: the threshold above which a candidate is ``notable``. Thresholds
are expressed in the series' own warm-up variability (baseline standard deviations,
floored per metric, see :mod:`torchinstruments.series`) and, for scale metrics, also as a
least relative change, so that ordinary training drift is not flagged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..series import ACTIVATION, GRAD_OUTPUT, RMS_TO_ROOT, TensorSeries
from ..track import ChangePoint, SeriesTracker, bounded_exp
from .base import (
    EARLY_REFERENCE_FACTOR,
    ONSET_TOLERANCE_SAMPLES,
    Candidate,
    display_module,
    format_value,
)

__all__ = [
    "CATEGORIES",
    "RULES",
    "NonFiniteBetweenSamples",
    "Rule",
    "RuleContext",
    "model_wide_texts",
]

CATEGORIES: tuple[str, ...] = (
    "non_finite",
    "activation_scale_drift",
    "gradient_scale_change",
    "heavy_tail_growth",
    "zero_fraction_growth",
    "regime_change",
    "relative_volatility",
    "oscillation",
)

#: Least size of a notable step, in residual spreads of the series' own trend at the
#: step's start (see :class:`~torchinstruments.track.SeriesTracker`).
SHIFT_Z_NOTABLE = 6.0
#: Least change of the zero fraction (a fraction of elements, up or down) in one step
#: that is notable.
ZERO_FRACTION_NOTABLE = 0.1
#: Least factor (up or down) of a notable abrupt scale step.
STEP_FACTOR_NOTABLE = 1.3
#: Factor on the least size, in residual spreads, of a notable step while the series'
#: reference is young (see ``EARLY_REFERENCE_FACTOR``).
EARLY_Z_FACTOR = 2.0
#: Least rise of excess kurtosis, and least factor of the tail ratio, in one notable step.
KURTOSIS_STEP_NOTABLE = 3.0
TAIL_RATIO_FACTOR_NOTABLE = 1.5
#: A break of the trend (:meth:`~torchinstruments.track.SeriesTracker.trend_break`: from
#: one sample on, the series moves along another straight line) is notable when the new
#: slope is at least ``TREND_ACCELERATION`` times the old one (a series that leaves a
#: settled course; one that settles after early training is the common, healthy case),
#: the slope change has a t-statistic of at least ``TREND_T_NOTABLE``, and its departure
#: from the old trend at the latest sample is at least ``SHIFT_Z_NOTABLE`` residual
#: spreads of the fit and, for scale metrics, ``TREND_FACTOR_NOTABLE`` (2x; other metrics
#: take their category's least step).
TREND_ACCELERATION = 3.0
TREND_T_NOTABLE = 6.0
TREND_FACTOR_NOTABLE = 2.0


@dataclass(frozen=True, slots=True)
class NonFiniteBetweenSamples:
    """The first non-finite value a sentinel saw in an unsampled training forward.

    Attributes:
        source: ``"root_sentinel"`` (only the root output is checked between samples)
            or ``"full_sentinel"`` (every observed module's output is).
        forward_index: the training forward (0-based) the sentinel saw it in.
        module: qualified module name (``""`` for the root), first in forward order.
        call_index: call of that module within the forward.
        tensor_path: path of the tensor within the module's output.
        next_sample: index of the first sample taken after that forward.
    """

    source: str
    forward_index: int
    module: str
    call_index: int
    tensor_path: str
    next_sample: int


@dataclass(slots=True)
class RuleContext:
    """What rules need beyond one series.

    Attributes:
        positions: forward call position per (module, call index, tensor path).
        root_gradient: the root output's output-gradient trackers by metric (the loss
            gradient), used as the reference that gradient rules measure net of.
        loss_scaled: a ``torch.amp.GradScaler`` scaled the loss of some samples.
        first_activation_nonfinite: earliest sample with a non-finite activation, if any.
        nonfinite_between_samples: the non-finite values the sentinels saw between
            samples, in training-forward order.
    """

    positions: dict[tuple[str, int, str], int] = field(default_factory=dict)
    root_gradient: dict[str, SeriesTracker] = field(default_factory=dict)
    loss_scaled: bool = False
    first_activation_nonfinite: int | None = None
    nonfinite_between_samples: tuple[NonFiniteBetweenSamples, ...] = ()


def _where(c: Candidate) -> str:
    s = c.series
    return (
        f"{display_module(s.module)} (call {s.call_index}, {s.tensor_path}) {s.signal}.{c.metric}"
    )


def _span(c: Candidate) -> str:
    first, latest = c.tracker.first, c.tracker.latest
    assert first is not None and latest is not None
    return (
        f"{format_value(first.value)} at sample {first.sample} to "
        f"{format_value(latest.value)} at sample {latest.sample}"
    )


def _keep_fixed(text: str) -> str:
    return f"{text} Keep seed, data order and precision fixed so the runs compare."


def model_wide_texts(c: Candidate, forward: int | None) -> tuple[str, str]:
    """Interpretation and next experiment of a model-wide event (``c.model_wide`` set by
    :func:`~torchinstruments.find.rank_candidates`; ``forward``: training forward of its
    onset, if known)."""
    change = c.change
    share = c.model_wide or 0.0
    when = f"sample {c.onset}" + (f" (training forward {forward})" if forward is not None else "")
    measure = c.metric if c.judged is c.tracker else RMS_TO_ROOT
    size = f" ({format_value(abs(change.step_z))} residual spreads)" if change is not None else ""
    interpretation = (
        f"Model-wide: {len(c.echoes) + 1} modules, {format_value(share * 100)}% of those "
        f"observed, changed their {c.series.signal}.{measure} at about {when}; the first in "
        f"propagation order is {display_module(c.series.module)}{size}. A change that moves "
        "most of the model at once has a run-level cause, not a module: the learning rate "
        "or its schedule, the optimizer state, the data, or the loss scale."
    )
    experiment = _keep_fixed(
        f"Check what changed for the whole run at {when}: the learning rate and its "
        "schedule, the optimizer state (a reset, changed betas, momentum or weight decay), "
        "the data (a new shard, preprocessing) and the loss scale; rerun to just past it "
        "with each restored in turn."
    )
    return interpretation, experiment


class Rule:
    """Base class: a category, the series it reads, and its texts.

    Subclasses implement :meth:`candidates`, :meth:`interpretation` and
    :meth:`next_experiment`.
    """

    category = ""
    metrics: tuple[str, ...] = ("rms",)
    #: Samples between onsets that still count as "the same samples" for echoes.
    onset_tolerance = ONSET_TOLERANCE_SAMPLES
    #: Model-wide events are found in this category (one whose rule has a candidate for
    #: every activation series, so that a cross-section of the whole model is at hand);
    #: other categories' findings at the same samples are folded into them.
    model_wide = False
    signals: tuple[str, ...] = (ACTIVATION, GRAD_OUTPUT)

    def candidates(self, series: Iterable[TensorSeries], context: RuleContext) -> list[Candidate]:
        """Return one candidate per eligible series and metric (unranked)."""
        found: list[Candidate] = []
        for item in series:
            if item.signal not in self.signals:
                continue
            position = context.positions.get(_tensor_key(item), 0)
            for metric in self.metrics:
                tracker = item.trackers.get(metric)
                if tracker is None or tracker.count == 0:
                    continue
                candidate = self.judge(item, metric, tracker, position, context)
                if candidate is not None:
                    found.append(candidate)
        return found

    def judge(
        self,
        series: TensorSeries,
        metric: str,
        tracker: SeriesTracker,
        position: int,
        context: RuleContext,
    ) -> Candidate | None:
        """Return the candidate for one series and metric, or None if not eligible."""
        raise NotImplementedError

    def interpretation(self, c: Candidate) -> str:
        raise NotImplementedError

    def next_experiment(self, c: Candidate) -> str:
        raise NotImplementedError


def _tensor_key(series: TensorSeries) -> tuple[str, int, str]:
    return (series.module, series.call_index, series.tensor_path)


def _basis_tracker(series: TensorSeries, tracker: SeriesTracker) -> SeriesTracker | None:
    """The tracker a rule judges: ``rms_to_root`` for output-gradient RMS (None for the
    root's own output gradient, the loss gradient that is the reference), else ``tracker``.
    """
    if series.signal != GRAD_OUTPUT or tracker is not series.trackers.get("rms"):
        return tracker
    return series.trackers.get(RMS_TO_ROOT)


def _net(series: TensorSeries) -> str:
    return ", net of the loss gradient" if series.signal == GRAD_OUTPUT else ""


def _net_measure(c: Candidate) -> str:
    """Names the judged measure where it is not the finding's own metric."""
    return f" of {RMS_TO_ROOT}" if c.judged is not c.tracker else ""


def _step_evidence(change: ChangePoint | None, tracker: SeriesTracker) -> dict[str, object]:
    if change is None:
        return {}
    trend = (
        {
            "trend_slope_after_per_forward": change.slope_after,
            "trend_slope_change_t": change.slope_change_t,
        }
        if change.kind == "trend"
        else {}
    )
    return {
        "change_kind": change.kind,
        **trend,
        "step_start_sample": change.start_sample,
        "step_start_forward": change.start_forward,
        "step_alarm_sample": change.alarm_sample,
        "step_trend_forecast": tracker.level(change.level_before),
        "step_level_after": tracker.level(change.level_after),
        "step_in_residual_spreads": change.step_z,
        "step_confirmed": change.confirmed,
        "trend_slope_before_per_forward": change.slope_before,
        "values_before_step": change.reference_count,
    }


def _least_z(change: ChangePoint, tracker: SeriesTracker, least: float) -> float:
    """The least ``|step_z|`` for a notable change: ``least``, times ``EARLY_Z_FACTOR``
    for a change while the series' reference was young (fewer than
    ``EARLY_REFERENCE_FACTOR`` warm-ups of values before it): its spread rests on few,
    fast-moving values of early training."""
    if change.reference_count < EARLY_REFERENCE_FACTOR * tracker.config.warmup_samples:
        return least * EARLY_Z_FACTOR
    return least


def _first_notable(
    tracker: SeriesTracker, *, min_abs_step: float, min_abs_step_z: float
) -> ChangePoint | None:
    """The earliest change, not transient, whose step without the trend's slope
    (:attr:`~torchinstruments.track.ChangePoint.step_without_trend`: a series that only
    stopped rising, or fell back to where it was, is not a step) is at least
    ``min_abs_step`` (tracked units) and :func:`_least_z` residual spreads, or None.

    A step whose very next sample begins an opposite change that is notable on its own
    (a rebound) is the onset when it is that large against the spread before it alone:
    the rebound inflates its spread after, and may have marked it transient."""
    changes = tracker.changes
    for index, change in enumerate(changes):
        if abs(change.step_without_trend) < min_abs_step:
            continue
        least = _least_z(change, tracker, min_abs_step_z)
        if not change.transient and abs(change.step_without_trend_z) >= least:
            return change
        rebound = changes[index + 1] if index + 1 < len(changes) else None
        if (
            rebound is not None
            and rebound.start_sample == change.alarm_sample + 1
            and rebound.step * change.step < 0.0
            and abs(change.step_without_trend) / change.std_before >= least
            and _first_notable_rebound(rebound, tracker, min_abs_step, min_abs_step_z)
        ):
            # A step that the very next sample partly undid (a weight scaled down that
            # the optimizer regrows, a normalization after it that compensates): its
            # spread after holds the rebound, and the rebound alone is notable. The
            # change began with the step, so the step is the onset, judged by the
            # spread before it.
            return change
    return None


def _first_notable_rebound(
    rebound: ChangePoint, tracker: SeriesTracker, min_abs_step: float, min_abs_step_z: float
) -> bool:
    return (
        not rebound.transient
        and abs(rebound.step_without_trend) >= min_abs_step
        and abs(rebound.step_without_trend_z) >= _least_z(rebound, tracker, min_abs_step_z)
    )


def _notable_trend(tracker: SeriesTracker, *, min_abs_step: float) -> ChangePoint | None:
    """The tracker's break of trend if it is notable (see ``TREND_ACCELERATION``), else
    None."""
    change = tracker.trend_break()
    if change is None or abs(change.step) < min_abs_step:
        return None
    if abs(change.slope_after) < TREND_ACCELERATION * abs(change.slope_before):
        return None
    if abs(change.slope_change_t) < TREND_T_NOTABLE:
        return None
    if abs(change.step_z) < _least_z(change, tracker, SHIFT_Z_NOTABLE):
        return None
    return change


def _per_100_forwards(tracker: SeriesTracker, slope: float) -> str:
    """A slope per forward, as the change over 100 forwards (a percentage for scale
    metrics)."""
    if tracker.log_scale:
        return f"{format_value((bounded_exp(slope * 100.0) - 1.0) * 100.0)}%"
    return format_value(slope * 100.0)


def _trend_text(c: Candidate, change: ChangePoint, measure: str) -> str:
    """Interpretation of a break of trend (``change.kind == "trend"``)."""
    t = c.judged
    verb = "rise" if change.slope_after > 0 else "fall"
    faster = " faster" if change.slope_before * change.slope_after > 0 else ""
    net = f" ({_net(c.series).lstrip(', ')})" if _net(c.series) else ""
    after, before = t.level(change.level_after), t.level(change.level_before)
    size = (
        f"{format_value(bounded_exp(abs(change.step)))}x, "
        if t.log_scale and after > 0.0 and before > 0.0
        else ""
    )
    return (
        f"{_where(c)} began to {verb}{faster}{net} from sample {change.start_sample} "
        f"(training forward {change.start_forward}): its {measure} moved by "
        f"{_per_100_forwards(t, change.slope_before)} per 100 forwards before and "
        f"{_per_100_forwards(t, change.slope_after)} after, and at sample "
        f"{change.alarm_sample} the broken line through its values was at "
        f"{format_value(after)} where the earlier trend leads to {format_value(before)} "
        f"({size}{format_value(abs(change.step_z))} residual spreads of the fit; slope change "
        f"t = {format_value(abs(change.slope_change_t))}). Raw values went from {_span(c)}."
    )


def _large_tail_step(metric: str, change: ChangePoint) -> bool:
    """A tail step large in absolute terms: the tail ratio up ``TAIL_RATIO_FACTOR_NOTABLE``
    (1.5x); excess kurtosis up ``KURTOSIS_STEP_NOTABLE`` (3) and the kurtosis itself
    (excess + 3, a ratio of moments whose fluctuations are relative) up 1.5x too."""
    if metric == "tail_ratio":
        return change.step >= math.log(TAIL_RATIO_FACTOR_NOTABLE)
    before = change.level_before + 3.0
    return change.step >= KURTOSIS_STEP_NOTABLE and (
        before <= 0.0 or (change.level_after + 3.0) / before >= TAIL_RATIO_FACTOR_NOTABLE
    )


def _first_largest_of(changes: list[ChangePoint]) -> ChangePoint | None:
    """The change with the largest ``|step|`` (the first of equals), or None."""
    return max(changes, key=lambda c: abs(c.step), default=None)


def _scale_evidence(tracker: SeriesTracker) -> dict[str, object]:
    return {
        "baseline": tracker.level(tracker.baseline_mean),
        "fast_ema": tracker.level(tracker.ema_fast),
        "slow_ema": tracker.level(tracker.ema_slow),
        "log_ratio_to_baseline": tracker.shift,
        "shift_in_baseline_std": tracker.shift_z,
        "ema_divergence_log": tracker.ema_fast - tracker.ema_slow,
        "momentum_log_per_sample": tracker.momentum,
        "max_drawdown_log": tracker.max_drawdown,
        "cusum_peak": tracker.cusum_peak,
        "level_changes": tracker.change_count,
        **_step_evidence(tracker.strongest_change, tracker),
    }


class _ScaleRule(Rule):
    """Shared logic of the two scale categories (activation and output-gradient RMS).

    Ranking basis ``abs_log_step``: ``|ln(level after / trend forecast)|`` of the first
    notable step, else of the largest step that was not transient (0 without one).
    Output gradients are judged on ``rms_to_root``, the module's gradient RMS divided by
    the root output's (the loss gradient) in the same sample, so that loss scaling, a
    changed loss reduction and the loss shrinking as the model fits cancel; the root's own
    output gradient is that reference and ranks last (score 0).

    Noise floor: notable when one abrupt departure from the series' own trend (a CUSUM
    change point on trend residuals, armed after warm-up, see
    :class:`~torchinstruments.track.SeriesTracker`) moved the level by at least
    ``STEP_FACTOR_NOTABLE`` (1.3x) and ``SHIFT_Z_NOTABLE`` (6) residual spreads, and the
    values after it did not return to the old trend. Smooth drift of any size is followed
    by the trend and is never notable on its own. The onset is the step's first sample.
    Without a notable step, a notable break of trend (``TREND_ACCELERATION``) is the
    finding, dated where the series left the earlier trend; its score is the departure
    at the latest sample.
    """

    def judge(
        self,
        series: TensorSeries,
        metric: str,
        tracker: SeriesTracker,
        position: int,
        context: RuleContext,
    ) -> Candidate | None:
        judged = _basis_tracker(series, tracker)
        evidence = _scale_evidence(tracker)
        if judged is None:
            evidence["reference"] = "loss gradient (root output); others are measured net of it"
            return Candidate(
                category=self.category,
                series=series,
                metric=metric,
                tracker=tracker,
                score=0.0,
                basis="abs_log_step_net_of_loss_gradient",
                notable=False,
                direction=1 if tracker.shift > 0 else -1,
                onset=None,
                position=position,
                evidence=evidence,
            )
        basis = "abs_log_step"
        if judged is not tracker:
            basis += "_net_of_loss_gradient"
            evidence["net_of_loss_gradient"] = _scale_evidence(judged)
        change = _first_notable(
            judged, min_abs_step=math.log(STEP_FACTOR_NOTABLE), min_abs_step_z=SHIFT_Z_NOTABLE
        ) or _notable_trend(judged, min_abs_step=math.log(TREND_FACTOR_NOTABLE))
        notable = change is not None
        if change is not None:
            evidence["first_notable_step"] = _step_evidence(change, judged)
        else:
            change = judged.strongest_change
        step = change.step if change is not None else 0.0
        return Candidate(
            category=self.category,
            series=series,
            metric=metric,
            tracker=tracker,
            score=abs(step),
            basis=basis,
            notable=notable,
            # Without a step, the direction of the end-to-end movement.
            direction=1 if (step > 0 if change is not None else tracker.shift > 0) else -1,
            onset=change.start_sample if notable and change is not None else None,
            position=position,
            evidence=evidence,
            basis_tracker=judged,
            change=change,
        )

    def interpretation(self, c: Candidate) -> str:
        t = c.judged
        if c.score == 0.0 and c.basis.endswith("loss_gradient") and t is c.tracker:
            return (
                f"{_where(c)} went from {_span(c)}. This is the loss gradient itself, the "
                f"reference that other output gradients are measured against."
            )
        change = c.change
        measure = (
            f"{RMS_TO_ROOT} (its RMS over the loss gradient's)" if t is not c.tracker else c.metric
        )
        if change is None:
            return (
                f"{_where(c)} followed its own trend{_net(c.series)} with no abrupt step; "
                f"raw values went from {_span(c)}."
            )
        if change.kind == "trend":
            return _trend_text(c, change, measure)
        verb = "stepped up" if change.step > 0 else "stepped down"
        net = f" ({_net(c.series).lstrip(', ')})" if _net(c.series) else ""
        text = (
            f"{_where(c)} {verb}{net} from sample {change.start_sample}: its "
            f"{measure} was {format_value(t.level(change.level_after))} where its own "
            f"trend forecast {format_value(t.level(change.level_before))}"
        )
        if t.log_scale and t.level(change.level_after) > 0.0:
            text += f" ({format_value(bounded_exp(abs(change.step)))}x"
        else:
            text += " ("
        text += (
            f"{', ' if text.endswith('x') else ''}{format_value(abs(change.step_z))} residual "
            f"spreads){'' if change.confirmed else ', not yet confirmed by later samples'}. "
            f"Raw values went from {_span(c)}."
        )
        return text


class ActivationScaleDrift(_ScaleRule):
    """``activation_scale_drift``: activation RMS moved away from its warm-up baseline."""

    category = "activation_scale_drift"
    signals = (ACTIVATION,)
    model_wide = True

    def next_experiment(self, c: Candidate) -> str:
        module = display_module(c.series.module)
        if c.direction > 0:
            return _keep_fixed(
                f"Rerun with {module}'s normalization, initialization or residual scale "
                f"restored to the baseline's, at this module only, and check whether "
                f"its activation RMS returns to the baseline."
            )
        return _keep_fixed(
            f"Check what shrinks {module}'s output: compare its input and weight scale "
            f"against the baseline run, then restore its residual scale or normalization "
            f"at this module only."
        )


class GradientScaleChange(_ScaleRule):
    """``gradient_scale_change``: output-gradient RMS moved, net of the loss gradient.

    A factor that rescaled every output gradient at once (loss scaling, a changed loss
    reduction) is reported as one ``<model>`` finding; module findings are net of it.
    """

    category = "gradient_scale_change"
    signals = (GRAD_OUTPUT,)

    def next_experiment(self, c: Candidate) -> str:
        module = display_module(c.series.module)
        if c.direction < 0:
            return _keep_fixed(
                f"Restore the previous normalization or residual scale at {module} and "
                f"the modules after it, one at a time starting at {module}, and check "
                f"whether the gradient reaching {module} recovers."
            )
        return _keep_fixed(
            f"Find what amplifies the gradient reaching {module}: revert changes to "
            f"{module} and the modules after it (in forward order) one at a time."
        )


class HeavyTailGrowth(Rule):
    """``heavy_tail_growth``: a few elements grew large relative to the rest.

    Metrics: ``excess_kurtosis`` and ``tail_ratio`` (max_abs / rms). Ranking basis
    ``tail_step_in_residual_spreads``: the rising step (a departure from the series' own
    trend, see :class:`~torchinstruments.track.SeriesTracker`) in residual spreads: the
    first notable one, else the largest. Activations only: output-gradient tails follow
    the per-example losses (as easy examples are fitted, a few hard ones carry the whole
    gradient), which the report cannot tell from a fault. Noise floor: notable when one
    rising step, not transient, is at least ``SHIFT_Z_NOTABLE`` (6) residual spreads and
    large in absolute terms (excess kurtosis up by ``KURTOSIS_STEP_NOTABLE``, 3, and the
    kurtosis up 1.5x; or tail ratio up ``TAIL_RATIO_FACTOR_NOTABLE``, 1.5x). Kurtosis
    that climbs steadily as features specialise (1 to 20 in early training is common) is
    trend, not a finding.
    """

    category = "heavy_tail_growth"
    metrics = ("excess_kurtosis", "tail_ratio")
    signals = (ACTIVATION,)

    def judge(
        self,
        series: TensorSeries,
        metric: str,
        tracker: SeriesTracker,
        position: int,
        context: RuleContext,
    ) -> Candidate | None:
        rising = [c for c in tracker.changes if c.step > 0 and not c.transient]
        first = next(
            (
                c
                for c in rising
                if _large_tail_step(metric, c) and c.step_z >= _least_z(c, tracker, SHIFT_Z_NOTABLE)
            ),
            None,
        )
        if first is None:
            trend = _notable_trend(tracker, min_abs_step=0.0)
            if trend is not None and trend.step > 0 and _large_tail_step(metric, trend):
                first = trend
        change = first if first is not None else _first_largest_of(rising)
        if change is None:
            return None
        evidence: dict[str, object] = {
            "baseline": tracker.level(tracker.baseline_mean),
            "fast_ema": tracker.level(tracker.ema_fast),
            "increase_over_baseline": tracker.shift,
            "cusum_peak": tracker.cusum_peak,
            **_step_evidence(change, tracker),
        }
        return Candidate(
            category=self.category,
            series=series,
            metric=metric,
            tracker=tracker,
            score=change.step_z,
            basis="tail_step_in_residual_spreads",
            notable=first is not None,
            direction=1,
            onset=first.start_sample if first is not None else None,
            position=position,
            evidence=evidence,
            change=change,
        )

    def interpretation(self, c: Candidate) -> str:
        change = c.change
        assert change is not None
        t = c.tracker
        if change.kind == "trend":
            return (
                _trend_text(c, change, c.metric) + " The largest elements moved away from the bulk."
            )
        return (
            f"{_where(c)} stepped up from sample {change.start_sample}: "
            f"{format_value(t.level(change.level_after))} where its own trend forecast "
            f"{format_value(t.level(change.level_before))} ({format_value(c.score)} residual "
            f"spreads): the largest elements moved away from the bulk. Raw values went from "
            f"{_span(c)}."
        )

    def next_experiment(self, c: Candidate) -> str:
        module = display_module(c.series.module)
        return _keep_fixed(
            f"Log which channels or positions hold {module}'s largest "
            f"{c.series.signal} values at the latest samples; then try a normalization "
            f"or clipping change at {module} only."
        )


class NonFinite(Rule):
    """``non_finite``: NaN or infinity appeared in a tensor.

    Metric ``nonfinite_fraction``. Every series with a non-finite value is a candidate
    and notable (there is no noise floor for NaN), except output gradients that overflow
    under ``torch.amp.GradScaler`` loss scaling while all activations are finite: the
    scaler skips those steps and lowers its scale, so they are listed, not notable.
    Ranking basis ``first_nonfinite_sample``, as its negative (earlier ranks first);
    within one sample the earliest module in forward order for activations (the latest
    for gradients) is the origin and the rest are its echoes.

    Between samples. When a sentinel saw a non-finite value in an unsampled forward
    between a series' first non-finite sample and the sample before it, that series'
    evidence carries the first such hit under ``earlier_between_samples``. An optimizer
    step in between can carry the values into the parameters of every module, so
    forward order at the next sample need not show where they started. The full
    sentinel names that module: its activation series becomes the origin of its
    sample's group. With the root sentinel alone the text says the origin is not
    located and the next experiment is a rerun with ``full_sentinel=True``.
    """

    category = "non_finite"
    metrics = ("nonfinite_fraction",)
    onset_tolerance = 0

    def judge(
        self,
        series: TensorSeries,
        metric: str,
        tracker: SeriesTracker,
        position: int,
        context: RuleContext,
    ) -> Candidate | None:
        first = tracker.first_nonzero
        if first is None:
            return None
        # Under loss scaling, output gradients that overflow while every activation is
        # finite are the scaler probing its scale (it skips the step and backs off).
        overflow = (
            series.signal == GRAD_OUTPUT
            and context.loss_scaled
            and (
                context.first_activation_nonfinite is None
                or context.first_activation_nonfinite > first.sample
            )
        )
        evidence: dict[str, object] = {
            "first_nonfinite_sample": first.sample,
            "first_nonfinite_fraction": first.value,
            "samples_with_nonfinite": tracker.nonzero_count,
            "samples_observed": tracker.count,
            "latest_nonfinite_fraction": tracker.latest.value if tracker.latest else None,
            "loss_scale_overflow": overflow,
        }
        # A hit in the gap just before this series' first non-finite sample (the first
        # one in that gap); older hits were one-offs that the samples between did not see.
        earlier = next(
            (h for h in context.nonfinite_between_samples if h.next_sample == first.sample),
            None,
        )
        if earlier is not None and not overflow:
            located = earlier.source == "full_sentinel" and (
                series.signal == ACTIVATION
                and (series.module, series.call_index, series.tensor_path)
                == (earlier.module, earlier.call_index, earlier.tensor_path)
            )
            evidence["earlier_between_samples"] = {
                "source": earlier.source,
                "forward_index": earlier.forward_index,
                "module": display_module(earlier.module),
                "call_index": earlier.call_index,
                "tensor_path": earlier.tensor_path,
                "this_series": located,
            }
            if located:
                # It was non-finite before any module at the next sample: make it the
                # origin of that sample's group (first in forward order).
                position = -1
        return Candidate(
            category=self.category,
            series=series,
            metric=metric,
            tracker=tracker,
            score=-float(first.sample),
            basis="negative_first_nonfinite_sample",
            notable=not overflow,
            direction=1,
            onset=first.sample,
            position=position,
            evidence=evidence,
        )

    def interpretation(self, c: Candidate) -> str:
        t = c.tracker
        first = t.first_nonzero
        assert first is not None and t.latest is not None
        recovered = t.latest.value == 0
        text = (
            f"{_where(c)}: non-finite values first appeared at sample {first.sample} "
            f"({format_value(first.value * 100)}% of elements) and were present in "
            f"{t.nonzero_count} of {t.count} samples"
            + ("; the latest sample is finite again." if recovered else ".")
        )
        earlier = c.evidence.get("earlier_between_samples")
        if not isinstance(earlier, dict):
            return text
        forward = earlier["forward_index"]
        if earlier["this_series"]:
            return text + (
                f" The full sentinel saw them here first, at training forward {forward} "
                "between samples, before any other module's output in that forward."
            )
        if earlier["source"] == "full_sentinel":
            return text + (
                f" The full sentinel saw them first in {earlier['module']} (call "
                f"{earlier['call_index']}, {earlier['tensor_path']}) at training forward "
                f"{forward}, between samples: this is probably an echo of it."
            )
        return text + (
            f" The root output was already non-finite at training forward {forward}, "
            "between samples; an optimizer step since then can have carried the values "
            "into every module's parameters, so forward order here need not show where "
            "they started."
        )

    def next_experiment(self, c: Candidate) -> str:
        module = display_module(c.series.module)
        first = c.tracker.first_nonzero
        sample = first.sample if first is not None else "?"
        earlier = c.evidence.get("earlier_between_samples")
        if isinstance(earlier, dict) and earlier["source"] == "root_sentinel":
            return _keep_fixed(
                f"Rerun with inject_observer(..., full_sentinel=True), which checks every "
                f"module's output on every training forward and names the module where "
                f"the values start (training forward {earlier['forward_index']} here); "
                "torch.autograd.detect_anomaly around that step names the failing op."
            )
        if isinstance(earlier, dict) and not earlier["this_series"]:
            module = str(earlier["module"])
            return _keep_fixed(
                f"Replay the batch of training forward {earlier['forward_index']} and check "
                f"{module}'s inputs, weights and any division, log, sqrt or exp in its "
                "forward; torch.autograd.detect_anomaly around that step names the failing op."
            )
        return _keep_fixed(
            f"Replay the batch of sample {sample} and check {module}'s inputs, weights "
            f"and any division, log, sqrt or exp in its forward; "
            f"torch.autograd.detect_anomaly around that step names the failing op."
        )


class ZeroFractionGrowth(Rule):
    """``zero_fraction_growth``: the share of exact zeros stepped (dying units, or units
    that stopped rectifying).

    Ranking basis ``abs_zero_fraction_step``: the size of a step of the zero fraction
    away from its own trend (a fraction of elements, up or down; see
    :class:`~torchinstruments.track.SeriesTracker`): the first notable one, else the
    largest. Noise floor: notable when one step, not transient, moved it by at least
    ``ZERO_FRACTION_NOTABLE`` (0.1) and ``SHIFT_Z_NOTABLE`` (6) residual spreads (floor
    0.005). ReLU zero fractions creep by 0.1 or so in healthy training, which the trend
    follows; a dying layer jumps up, an activation that no longer rectifies drops. The
    root's output gradient (the loss gradient) is not a candidate.
    """

    category = "zero_fraction_growth"
    metrics = ("zero_fraction",)

    def judge(
        self,
        series: TensorSeries,
        metric: str,
        tracker: SeriesTracker,
        position: int,
        context: RuleContext,
    ) -> Candidate | None:
        if series.signal == GRAD_OUTPUT and series.module == "":
            return None
        first = _first_notable(
            tracker, min_abs_step=ZERO_FRACTION_NOTABLE, min_abs_step_z=SHIFT_Z_NOTABLE
        ) or _notable_trend(tracker, min_abs_step=ZERO_FRACTION_NOTABLE)
        change = first if first is not None else tracker.strongest_change
        if change is None or abs(change.step) < 0.01:
            return None
        return Candidate(
            category=self.category,
            series=series,
            metric=metric,
            tracker=tracker,
            score=abs(change.step),
            basis="abs_zero_fraction_step",
            notable=first is not None,
            direction=1 if change.step > 0 else -1,
            onset=first.start_sample if first is not None else None,
            position=position,
            evidence={
                "baseline": tracker.baseline_mean,
                "fast_ema": tracker.ema_fast,
                **_step_evidence(change, tracker),
            },
            change=change,
        )

    def interpretation(self, c: Candidate) -> str:
        change = c.change
        assert change is not None
        if change.kind == "trend":
            return _trend_text(c, change, c.metric)
        verb = "rose" if change.step > 0 else "fell"
        return (
            f"{_where(c)} {verb} abruptly from sample {change.start_sample}: "
            f"{format_value(change.level_after)} where its own trend forecast "
            f"{format_value(change.level_before)} ({format_value(abs(change.step) * 100)} "
            f"percentage points, {format_value(abs(change.step_z))} residual spreads). Raw "
            f"values went from {_span(c)}."
        )

    def next_experiment(self, c: Candidate) -> str:
        module = display_module(c.series.module)
        if c.direction < 0:
            return _keep_fixed(
                f"Check whether {module} (or the activation just before it) still "
                f"rectifies: compare its activation function and the input it gets with "
                f"the baseline run, at this module only."
            )
        return _keep_fixed(
            f"Find what zeroes more of {module}'s output from that sample on: a dropout "
            f"rate or mask that changed (check the module's p and training flag), or "
            f"units that died (compare the preceding layer's bias and input scale with "
            f"the baseline; a lower learning rate or a leaky activation at this module)."
        )


class RegimeChange(Rule):
    """``regime_change``: an abrupt, persistent departure from the series' own trend.

    Two-sided CUSUM on the trend residuals of the RMS (``rms_to_root`` for output
    gradients), in residual spreads, with allowance k and threshold h from
    :class:`~torchinstruments.TrackConfig` (Page 1954; k = 0.5, h = 5 by default; see
    :class:`~torchinstruments.track.SeriesTracker`); the detector re-anchors after each
    alarm. Ranking basis ``largest_step_in_residual_spreads``: the largest step that was
    not transient, in residual spreads at its start. Noise floor: notable when that
    step is at least 1.5x and 8 residual spreads.
    """

    category = "regime_change"

    def judge(
        self,
        series: TensorSeries,
        metric: str,
        tracker: SeriesTracker,
        position: int,
        context: RuleContext,
    ) -> Candidate | None:
        judged = _basis_tracker(series, tracker)
        change = judged.strongest_change if judged is not None else None
        if judged is None or change is None:
            return None
        notable = abs(change.step) >= math.log(1.5) and abs(change.step_z) >= _least_z(
            change, judged, 8.0
        )
        return Candidate(
            category=self.category,
            series=series,
            metric=metric,
            tracker=tracker,
            score=abs(change.step_z),
            basis="largest_step_in_residual_spreads"
            + ("_net_of_loss_gradient" if judged is not tracker else ""),
            notable=notable,
            direction=1 if change.step > 0 else -1,
            onset=change.start_sample,
            position=position,
            evidence={"level_changes": judged.change_count, **_step_evidence(change, judged)},
            basis_tracker=judged,
            change=change,
        )

    def interpretation(self, c: Candidate) -> str:
        t = c.judged
        change = c.change
        assert change is not None
        return (
            f"{_where(c)}{_net(c.series)}{',' if _net(c.series) else ''} left its own trend "
            f"{'upwards' if c.direction > 0 else 'downwards'} from sample {change.start_sample} "
            f"(CUSUM alarm at sample {change.alarm_sample}): "
            f"{format_value(t.level(change.level_after))} where the trend forecast "
            f"{format_value(t.level(change.level_before))}, "
            f"{format_value(abs(change.step_z))} residual spreads."
        )

    def next_experiment(self, c: Candidate) -> str:
        module = display_module(c.series.module)
        change = c.change
        sample = change.start_sample if change is not None else "?"
        return _keep_fixed(
            f"Find what changed near sample {sample} (a schedule step, a data shard, a "
            f"code path, a module switched); rerun to just past it and compare {module} "
            f"before and after."
        )


class RelativeVolatility(Rule):
    """``relative_volatility``: sample-to-sample changes grew relative to warm-up.

    On the RMS (``rms_to_root`` for output gradients; the root's own output gradient is
    not a candidate). Ranking basis ``volatility_ratio``
    (:attr:`~torchinstruments.track.SeriesTracker.volatility_ratio`): the EMA root mean
    square of trend-forecast residuals (their excess over drift, clipped at
    ``RESIDUAL_CLIP`` spreads so that one step weighs little) divided by the same over
    warm-up, both per forward (squared residuals divided by their gaps: a sampling
    schedule whose samples grow apart makes each residual larger without the series
    being any more volatile), the warm-up's floored at 0.05 per sample. Noise floor:
    notable when warm-up is complete, the ratio is at least 4 and the volatility at
    least 0.25 per sample (about 28%, in log units).
    """

    category = "relative_volatility"

    def judge(
        self,
        series: TensorSeries,
        metric: str,
        tracker: SeriesTracker,
        position: int,
        context: RuleContext,
    ) -> Candidate | None:
        judged = _basis_tracker(series, tracker)
        if judged is None or not judged.warmup_complete:
            return None
        ratio = judged.volatility_ratio
        if ratio <= 1.0:
            return None
        return Candidate(
            category=self.category,
            series=series,
            metric=metric,
            tracker=tracker,
            score=ratio,
            basis="volatility_ratio",
            notable=ratio >= 4.0 and judged.volatility >= 0.25,
            direction=0,
            onset=None,
            position=position,
            evidence={
                "volatility_log": judged.volatility,
                "warmup_volatility_log": judged.baseline_volatility,
                "warmup_mean_gap_forwards": judged.warmup_mean_gap,
                "flip_rate": judged.flip_rate,
            },
            basis_tracker=judged,
        )

    def interpretation(self, c: Candidate) -> str:
        t = c.judged
        return (
            f"{_where(c)}{_net(c.series)} now changes by about "
            f"{format_value(t.volatility * 100)}% (log) from one sample to the next, "
            f"{format_value(c.score)}x its warm-up volatility per forward."
        )

    def next_experiment(self, c: Candidate) -> str:
        module = display_module(c.series.module)
        return _keep_fixed(
            f"Halve the learning rate (or add warm-up) and check whether {module}'s "
            f"{c.series.signal} steadies; if not, compare batch composition at the "
            f"volatile samples."
        )


class Oscillation(Rule):
    """``oscillation``: consecutive changes alternate in sign (up, down, up, ...).

    On the RMS (``rms_to_root`` for output gradients). Ranking basis ``flip_rate``: slow
    EMA of sign flips between consecutive differences (2/3 for independent noise).
    Candidates: flip rate above 0.77 after a warm-up's worth of differences. Noise floor:
    notable when at least twice the warm-up length of differences were seen, the flip
    rate is at least 0.9 and the volatility at least 0.05 (5% per sample).
    """

    category = "oscillation"

    def judge(
        self,
        series: TensorSeries,
        metric: str,
        tracker: SeriesTracker,
        position: int,
        context: RuleContext,
    ) -> Candidate | None:
        judged = _basis_tracker(series, tracker)
        if judged is None:
            return None
        warmup = judged.config.warmup_samples
        if judged.diffs < warmup or judged.flip_rate <= 2.0 / 3.0 + 0.1:
            return None
        notable = (
            judged.diffs >= 2 * warmup and judged.flip_rate >= 0.9 and judged.volatility >= 0.05
        )
        return Candidate(
            category=self.category,
            series=series,
            metric=metric,
            tracker=tracker,
            score=judged.flip_rate,
            basis="flip_rate",
            notable=notable,
            direction=0,
            onset=None,
            position=position,
            evidence={
                "sign_flips": judged.flips,
                "differences": judged.diffs,
                "volatility_log": judged.volatility,
            },
            basis_tracker=judged,
        )

    def interpretation(self, c: Candidate) -> str:
        t = c.judged
        return (
            f"{_where(c)}{_net(c.series)} alternates direction from sample to sample: flip "
            f"rate {format_value(t.flip_rate)} (2/3 is noise), {t.flips} flips in {t.diffs} "
            f"changes."
        )

    def next_experiment(self, c: Candidate) -> str:
        module = display_module(c.series.module)
        return _keep_fixed(
            f"Lower the learning rate or momentum 2-4x and check whether the alternation "
            f"at {module} stops; alternation often means an update overshoots."
        )


RULES: dict[str, Rule] = {
    rule.category: rule
    for rule in (
        NonFinite(),
        ActivationScaleDrift(),
        GradientScaleChange(),
        HeavyTailGrowth(),
        ZeroFractionGrowth(),
        RegimeChange(),
        RelativeVolatility(),
        Oscillation(),
    )
}
assert tuple(RULES) == CATEGORIES
