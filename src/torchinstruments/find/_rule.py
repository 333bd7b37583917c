"""What every rule shares: the categories and thresholds, :class:`Rule` and
:class:`RuleContext`, the non-finite values seen between samples, and the helpers
that read a candidate's change points and trends. The rules are in ``rules.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..series import ACTIVATION, ATTENTION_LOGITS_PATH, GRAD_OUTPUT, RMS_TO_ROOT, TensorSeries
from ..track import ChangePoint, SeriesTracker, bounded_exp
from .base import (
    EARLY_REFERENCE_FACTOR,
    ONSET_TOLERANCE_SAMPLES,
    Candidate,
    display_module,
    format_value,
)

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
#: A sustained shift (:meth:`~torchinstruments.track.SeriesTracker.sustained_shift`: the
#: median of ``SHIFT_POINTS_AFTER`` values against the window before them, in a series
#: too noisy for one value to tell a step) is notable when it is at least
#: ``SHIFT_Z_NOTABLE`` standard errors and, for scale metrics, ``SHIFT_FACTOR_NOTABLE``
#: (4x). Level shifts between such windows reach 2.2x in ordinary training (clean runs of
#: GPT-2, ResNet-18 and ViT after warm-up, ``benchmarks/real_faults``): a shift found
#: only over several values must be well past that.
SHIFT_FACTOR_NOTABLE = 4.0


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
    """Interpretation and next experiment of a model-wide event (``c.model_wide_modules`` set by
    :func:`~torchinstruments.find.rank_candidates`; ``forward``: training forward of its
    onset, if known)."""
    change = c.change
    when = f"sample {c.onset}" + (f" (training forward {forward})" if forward is not None else "")
    measure = c.metric if c.judged is c.tracker else RMS_TO_ROOT
    size = f" ({format_value(abs(change.step_z))} residual spreads)" if change is not None else ""
    assert c.model_wide_modules is not None and c.model_wide is not None
    moved, observed = c.model_wide_modules
    share = c.model_wide
    notable = len(c.group_modules)
    interpretation = (
        f"Model-wide: {moved} of the {observed} observed modules besides the root "
        f"({format_value(share * 100)}%) moved their {c.series.signal}.{measure} at about "
        f"{when}, {notable} of them notably; the first of those in propagation order is "
        f"{display_module(c.series.module)}{size}. A change that moves "
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
    #: The rule judges the attention logits of ``scaled_dot_product_attention`` calls
    #: (tensor path ``attention_logits``): their scale, not the shape of their
    #: distribution, which changes abruptly in healthy training when attention heads
    #: specialise (the induction-head phase change, Olsson et al. 2022), and not their
    #: zeros.
    attention_logits = True

    def candidates(self, series: Iterable[TensorSeries], context: RuleContext) -> list[Candidate]:
        """Return one candidate per eligible series and metric (unranked)."""
        found: list[Candidate] = []
        for item in series:
            if item.signal not in self.signals:
                continue
            if not self.attention_logits and item.tensor_path.startswith(ATTENTION_LOGITS_PATH):
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


def _notable_shift(tracker: SeriesTracker, *, min_abs_step: float) -> ChangePoint | None:
    """The tracker's sustained shift of at least ``min_abs_step`` (tracked units) if it
    is notable (``SHIFT_FACTOR_NOTABLE``), else None."""
    change = tracker.sustained_shift(min_abs_step)
    if change is None or abs(change.step_z) < _least_z(change, tracker, SHIFT_Z_NOTABLE):
        return None
    return change


def _change_levels(c: Candidate, change: ChangePoint) -> tuple[str, float, float, str]:
    """What the texts of a break of trend and of a sustained shift share: the
    parenthesised "net of the loss gradient" (or ""), the levels after and before in
    the metric's units, and the step as a factor followed by ", " (log-scale metrics
    with both levels positive; "" otherwise)."""
    t = c.judged
    net = f" ({_net(c.series).lstrip(', ')})" if _net(c.series) else ""
    after, before = t.level(change.level_after), t.level(change.level_before)
    size = (
        f"{format_value(bounded_exp(abs(change.step)))}x, "
        if t.log_scale and after > 0.0 and before > 0.0
        else ""
    )
    return net, after, before, size


def _shift_text(c: Candidate, change: ChangePoint, measure: str) -> str:
    """Interpretation of a sustained shift (``change.kind == "sustained_shift"``)."""
    verb = "moved up" if change.step > 0 else "moved down"
    net, after, before, size = _change_levels(c, change)
    return (
        f"{_where(c)} {verb}{net} from sample {change.start_sample} (training forward "
        f"{change.start_forward}) and stayed there through sample {change.alarm_sample}: "
        f"the median of its {measure} over those samples was {format_value(after)} where "
        f"the samples before led to {format_value(before)} ({size}"
        f"{format_value(abs(change.step_z))} standard errors). The series is too noisy "
        f"for one sample to tell a step; the level held. Raw values went from {_span(c)}."
    )


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
    net, after, before, size = _change_levels(c, change)
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
