"""④ find: one rule per category, each ranking only within its own category."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..series import ACTIVATION, GRAD_OUTPUT, TensorSeries, forward_positions
from .base import (
    ONSET_TOLERANCE_SAMPLES,
    Candidate,
    display_module,
    format_value,
    group_window,
    rank_candidates,
)
from .rules import (
    CATEGORIES,
    RULES,
    NonFiniteBetweenSamples,
    Rule,
    RuleContext,
    model_wide_texts,
)

__all__ = [
    "CATEGORIES",
    "RULES",
    "Candidate",
    "NonFiniteBetweenSamples",
    "Rule",
    "RuleContext",
    "display_module",
    "format_value",
    "model_wide_texts",
    "rank_candidates",
    "run_rules",
]


def run_rules(
    series: Iterable[TensorSeries],
    *,
    loss_scaled: bool = False,
    nonfinite_between_samples: tuple[NonFiniteBetweenSamples, ...] = (),
    stopped: Mapping[tuple[str, int], int] | None = None,
) -> dict[str, list[Candidate]]:
    """Run every rule over the series; return ranked candidates per category.

    Output gradients take the forward call position of the activation of the same
    module call and tensor path (:func:`~torchinstruments.series.forward_positions`).
    ``loss_scaled`` says a ``torch.amp.GradScaler`` scaled some samples' losses;
    ``nonfinite_between_samples`` are the sentinels' hits between samples; ``stopped``
    gives the last sample of each (module, call index) that stopped being called (see
    :func:`_ended_before_confirmed`).
    """
    items = list(series)
    context = RuleContext(
        loss_scaled=loss_scaled,
        positions=forward_positions(items),
        nonfinite_between_samples=nonfinite_between_samples,
    )
    for s in items:
        if s.signal == ACTIVATION:
            tracker = s.trackers.get("nonfinite_fraction")
            first = tracker.first_nonzero if tracker is not None else None
            if first is not None and (
                context.first_activation_nonfinite is None
                or first.sample < context.first_activation_nonfinite
            ):
                context.first_activation_nonfinite = first.sample
    root_gradients = sorted(
        (s for s in items if s.module == "" and s.signal == GRAD_OUTPUT),
        key=lambda s: (s.call_index, s.tensor_path),
    )
    if root_gradients:
        context.root_gradient = dict(root_gradients[0].trackers)
    # Model-wide events are judged on activations only: a change at one module alters
    # the output gradients of every module before it (and the loss landscape of all), so
    # gradients that move everywhere at once are no sign of a run-level cause.
    observed = [s for s in items if s.signal == ACTIVATION and s.module != ""]
    modules_observed = {
        ACTIVATION: (
            len({s.module for s in observed}),
            min(
                (
                    context.positions.get((s.module, s.call_index, s.tensor_path), 0)
                    for s in observed
                ),
                default=0,
            ),
        )
    }
    ranked = {
        category: rank_candidates(
            _ended_before_confirmed(rule.candidates(items, context), stopped or {}),
            rule.onset_tolerance,
            modules_observed if rule.model_wide else None,
        )
        for category, rule in RULES.items()
    }
    _fold_into_model_wide(ranked)
    return ranked


def _ended_before_confirmed(
    candidates: list[Candidate], stopped: Mapping[tuple[str, int], int]
) -> list[Candidate]:
    """Notable changes of a module call that stopped being called, with their onset
    within ``ONSET_TOLERANCE_SAMPLES`` of its last sample, are not notable: the series
    ended before later samples could tell the change from its trend's own curvature (a
    healthy bump that would have returned is confirmed by the two or three samples
    left), and the stop itself, at the same samples, is what the report names
    (``coverage.modules_stopped``, the headline). The evidence keeps the last sample
    under ``series_ended``. Returns ``candidates``, changed in place."""
    for c in candidates:
        last = stopped.get((c.series.module, c.series.call_index))
        if last is None or not c.notable or c.onset is None:
            continue
        if last - c.onset < ONSET_TOLERANCE_SAMPLES:
            c.notable = False
            c.evidence["series_ended"] = {"last_sample": last}
    return candidates


def _fold_into_model_wide(ranked: dict[str, list[Candidate]]) -> None:
    """A model-wide event moved most of the model at once: notable module candidates of
    any category whose change began within ``ONSET_TOLERANCE_SAMPLES`` of its onset, and
    notable candidates without an onset (volatility, oscillation), are members of it, not
    findings of their own. They stay listed, not notable, with the
    event's onset under ``evidence.part_of_model_wide_event``; their categories are
    re-ordered (notable first)."""
    events = sorted(
        {
            (c.onset, c.onset + group_window(c, ONSET_TOLERANCE_SAMPLES))
            for candidates in ranked.values()
            for c in candidates
            if c.model_wide is not None and c.notable and c.onset is not None
        }
    )
    if not events:
        return
    for category, candidates in ranked.items():
        if category == "non_finite":
            continue  # NaN propagates everywhere by nature; forward order shows its origin
        changed = False
        for c in candidates:
            if c.model_wide is not None or not c.notable:
                continue
            # Without an onset (volatility, oscillation) a notable candidate is taken as
            # a consequence of the earliest event: the whole model moved at once.
            event = (
                events[0][0]
                if c.onset is None
                else next(
                    (o for o, until in events if o - ONSET_TOLERANCE_SAMPLES <= c.onset <= until),
                    None,
                )
            )
            if event is not None:
                c.notable = False
                c.evidence["part_of_model_wide_event"] = {"onset_sample": event}
                changed = True
        if changed:
            candidates.sort(key=lambda c: not c.notable)
