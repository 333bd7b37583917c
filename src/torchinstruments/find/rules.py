"""One rule per finding category.

Each rule looks only at the series and metrics of its category, ranks only within it, and
states its noise floor: the threshold above which a candidate is ``notable``. Thresholds
are expressed in the series' own warm-up variability (baseline standard deviations,
floored per metric, see :mod:`torchinstruments.series`) and, for scale metrics, also as a
least relative change, so that ordinary training drift is not flagged.

The thresholds, :class:`Rule` and the helpers every rule uses are in ``_rule.py``; the
scale rules (activation scale drift, gradient scale change, heavy-tail growth) in
``_scale_rules.py``; the other rules and the table ``RULES`` here.
"""

from __future__ import annotations

import math

from ..series import ACTIVATION, GRAD_OUTPUT, TensorSeries
from ..track import SeriesTracker
from ._rule import (
    CATEGORIES,
    SHIFT_Z_NOTABLE,
    ZERO_FRACTION_NOTABLE,
    NonFiniteBetweenSamples,
    Rule,
    RuleContext,
    _basis_tracker,
    _first_notable,
    _keep_fixed,
    _least_z,
    _net,
    _notable_trend,
    _span,
    _step_evidence,
    _trend_text,
    _where,
    model_wide_texts,
)
from ._scale_rules import ActivationScaleDrift, GradientScaleChange, HeavyTailGrowth
from .base import Candidate, display_module, format_value

__all__ = [
    "CATEGORIES",
    "RULES",
    "NonFiniteBetweenSamples",
    "Rule",
    "RuleContext",
    "model_wide_texts",
]


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
    root's output gradient (the loss gradient) and attention logits are not candidates.
    """

    category = "zero_fraction_growth"
    metrics = ("zero_fraction",)
    attention_logits = False

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
    step is at least 1.5x and 8 residual spreads, measured both from the trend's forecast
    and from the last value before it (``ChangePoint.step_without_trend``, as for
    :class:`ActivationScaleDrift`).
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
        # As for the scale rules, the step is also measured without the trend's slope
        # (ChangePoint.step_without_trend): a steeply rising series that falls back to
        # where it was two samples ago departs from a forecast that carried the old
        # slope across the gap, yet it did not step.
        notable = abs(change.step_without_trend) >= math.log(1.5) and abs(
            change.step_without_trend_z
        ) >= _least_z(change, judged, 8.0)
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
