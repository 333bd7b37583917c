"""The scale rules: activation scale drift and output-gradient scale change (one
shared :class:`_ScaleRule`), and heavy-tail growth.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ..series import ACTIVATION, GRAD_OUTPUT, RMS_TO_ROOT, TensorSeries
from ..track import SeriesTracker, bounded_exp
from ._rule import (
    SHIFT_FACTOR_NOTABLE,
    SHIFT_Z_NOTABLE,
    STEP_FACTOR_NOTABLE,
    TREND_FACTOR_NOTABLE,
    Rule,
    RuleContext,
    _basis_tracker,
    _first_largest_of,
    _first_notable,
    _keep_fixed,
    _large_tail_step,
    _least_z,
    _net,
    _notable_shift,
    _notable_trend,
    _scale_evidence,
    _shift_text,
    _span,
    _step_evidence,
    _trend_text,
    _where,
)
from .base import (
    Candidate,
    display_module,
    format_value,
)


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
    at the latest sample. Without either, a notable sustained shift
    (``SHIFT_FACTOR_NOTABLE``: a level that moved at least 4x and held, in a series too
    noisy for one value to tell) is the finding, dated at its first value.
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
        change = (
            _first_notable(
                judged, min_abs_step=math.log(STEP_FACTOR_NOTABLE), min_abs_step_z=SHIFT_Z_NOTABLE
            )
            or _notable_trend(judged, min_abs_step=math.log(TREND_FACTOR_NOTABLE))
            or _notable_shift(judged, min_abs_step=math.log(SHIFT_FACTOR_NOTABLE))
        )
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
        if change.kind == "sustained_shift":
            return _shift_text(c, change, measure)
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
    """``activation_scale_drift``: activation scale moved away from its own trend.

    Judged on ``rms`` and on ``mean_abs`` (mean absolute value), one candidate per series:
    the RMS one, unless only the mean absolute value made a notable step. The RMS is
    carried by the largest elements, the mean absolute value by the bulk, so a change of
    the bulk's shape with the large elements kept moves the mean absolute value far more:
    a GELU swapped for the identity in a ViT block moved its output RMS 1.25x (2.7
    residual spreads) and its mean absolute value 1.6x (9.4 spreads), as the negative
    half that GELU had squashed came back. The same thresholds apply to both; a step of
    the mean absolute value alone is weaker evidence of a scale change than an RMS step
    (``Candidate.secondary``: listed after the RMS steps).
    """

    category = "activation_scale_drift"
    signals = (ACTIVATION,)
    model_wide = True
    metrics = ("rms", "mean_abs")

    def candidates(self, series: Iterable[TensorSeries], context: RuleContext) -> list[Candidate]:
        """One candidate per series: its ``rms`` candidate, or its ``mean_abs`` one
        where only that is notable (a series without an ``rms`` tracker has none)."""
        by_series: dict[int, dict[str, Candidate]] = {}
        for candidate in super().candidates(series, context):
            by_series.setdefault(id(candidate.series), {})[candidate.metric] = candidate
        chosen: list[Candidate] = []
        for per_metric in by_series.values():
            rms, mean_abs = per_metric.get("rms"), per_metric.get("mean_abs")
            if rms is None:
                continue
            if mean_abs is not None and mean_abs.notable and not rms.notable:
                mean_abs.secondary = True
                chosen.append(mean_abs)
            else:
                chosen.append(rms)
        return chosen

    def next_experiment(self, c: Candidate) -> str:
        module = display_module(c.series.module)
        if c.direction > 0:
            return _keep_fixed(
                f"Rerun with {module}'s normalization, initialization, activation "
                f"function or residual scale restored to the baseline's, at this module "
                f"only, and check whether its activation {c.metric} returns to the "
                f"baseline."
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
    trend, not a finding. Attention logits are not judged here (``Rule.attention_logits``).
    """

    category = "heavy_tail_growth"
    metrics = ("excess_kurtosis", "tail_ratio")
    signals = (ACTIVATION,)
    attention_logits = False

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
