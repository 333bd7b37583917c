"""④ find: one rule per category, each ranking only within its own category."""

from __future__ import annotations

from collections.abc import Iterable

from ..series import ACTIVATION, GRAD_OUTPUT, TensorSeries
from .base import Candidate, display_module, format_value, rank_candidates
from .rules import CATEGORIES, RULES, Rule, RuleContext

__all__ = [
    "CATEGORIES",
    "RULES",
    "Candidate",
    "Rule",
    "RuleContext",
    "display_module",
    "format_value",
    "rank_candidates",
    "run_rules",
]


def run_rules(series: Iterable[TensorSeries]) -> dict[str, list[Candidate]]:
    """Run every rule over the series; return ranked candidates per category.

    Output gradients take the forward call position of the activation of the same
    module call and tensor path, so that both signals can be put in propagation order.
    """
    items = list(series)
    context = RuleContext()
    for s in items:
        if s.signal == ACTIVATION:
            context.positions[(s.module, s.call_index, s.tensor_path)] = s.forward_position
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
