"""④ find: one rule per category, each ranking only within its own category."""

from __future__ import annotations

from collections.abc import Iterable

from ..series import ACTIVATION, GRAD_OUTPUT, TensorSeries, forward_positions
from .base import Candidate, display_module, format_value, rank_candidates
from .rules import CATEGORIES, RULES, NonFiniteBetweenSamples, Rule, RuleContext

__all__ = [
    "CATEGORIES",
    "RULES",
    "Candidate",
    "NonFiniteBetweenSamples",
    "Rule",
    "RuleContext",
    "display_module",
    "format_value",
    "rank_candidates",
    "run_rules",
]


def run_rules(
    series: Iterable[TensorSeries],
    *,
    loss_scaled: bool = False,
    nonfinite_between_samples: tuple[NonFiniteBetweenSamples, ...] = (),
) -> dict[str, list[Candidate]]:
    """Run every rule over the series; return ranked candidates per category.

    Output gradients take the forward call position of the activation of the same
    module call and tensor path (:func:`~torchinstruments.series.forward_positions`).
    ``loss_scaled`` says a ``torch.amp.GradScaler`` scaled some samples' losses;
    ``nonfinite_between_samples`` are the sentinels' hits between samples.
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
    return {
        category: rank_candidates(rule.candidates(items, context), rule.onset_tolerance)
        for category, rule in RULES.items()
    }
