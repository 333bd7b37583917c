"""Shared machinery of the finding rules: candidates, propagation-aware ranking, output.

A rule turns tracked series into :class:`Candidate` objects, each with a ranking basis
(a named score, higher is stronger) and a ``notable`` flag (above the rule's stated noise
floor). :func:`rank_candidates` then orders them deterministically and folds echoes into
their origin: notable candidates whose change began at the same sample form a group; the
origin is the earliest module in forward call order for activations and the latest for
output gradients (a fault propagates forward through activations and backward through
gradients), and the others are listed in the origin's evidence instead of being returned
as findings of their own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..series import GRAD_OUTPUT, TensorSeries
from ..track import SeriesTracker

__all__ = ["Candidate", "display_module", "format_value", "rank_candidates"]

#: Changes whose onsets differ by at most this many samples belong to one group.
ONSET_TOLERANCE_SAMPLES = 5


def display_module(name: str) -> str:
    """Module name as shown in reports: the root ``""`` is ``<root>``."""
    return name if name else "<root>"


def format_value(value: float) -> str:
    """Four significant digits for prose; exact values live in the JSON fields."""
    if value == 0 or not math.isfinite(value):
        return str(value)
    magnitude = abs(value)
    if 1e-3 <= magnitude < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"


@dataclass(slots=True)
class Candidate:
    """One series that a rule considers, with what its rank rests on.

    Attributes:
        category: the rule's category.
        series: the tensor series (module, call index, signal, tensor path).
        metric: the metric whose tracker was judged.
        tracker: that metric's tracker.
        score: value of the ranking basis; higher ranks first.
        basis: name of the ranking basis.
        notable: above the rule's noise floor.
        direction: +1 rose, -1 fell, 0 not directional.
        onset: sample at which the change was detected (a CUSUM alarm, the first
            non-finite value), if known; candidates whose onsets are within
            ``ONSET_TOLERANCE_SAMPLES`` form one echo group.
        position: forward call position (for propagation order).
        evidence: supporting indicators (JSON-safe values).
        basis_tracker: the tracker the ranking basis was computed on, when it is not
            ``tracker`` (output gradients are ranked on ``rms_to_root``).
        echoes: candidates folded into this one by :func:`rank_candidates`.
        group_score: strongest score in this candidate's echo group.
    """

    category: str
    series: TensorSeries
    metric: str
    tracker: SeriesTracker
    score: float
    basis: str
    notable: bool
    direction: int
    onset: int | None
    position: int
    evidence: dict[str, object] = field(default_factory=dict)
    basis_tracker: SeriesTracker | None = None
    echoes: list[Candidate] = field(default_factory=list)
    group_score: float = 0.0

    @property
    def judged(self) -> SeriesTracker:
        """The tracker behind the ranking basis."""
        return self.basis_tracker if self.basis_tracker is not None else self.tracker

    @property
    def sort_key(self) -> tuple[str, int, str, str, str]:
        s = self.series
        return (s.module, s.call_index, s.signal, s.tensor_path, self.metric)


def _origin_order(candidate: Candidate) -> tuple[int, int, tuple[str, int, str, str, str]]:
    # Activations: earliest in forward order first. Gradients flow backwards, so the
    # latest module in forward order is where a gradient change starts.
    is_grad = candidate.series.signal == GRAD_OUTPUT
    position = -candidate.position if is_grad else candidate.position
    return (1 if is_grad else 0, position, candidate.sort_key)


def _ordering_onset(candidate: Candidate, onset_tolerance: int) -> float:
    """Onset used to order changes in time. Within one sample the forward runs before the
    backward, and an activation change alters the gradients of every module, so an
    output-gradient change counts as ``ONSET_TOLERANCE_SAMPLES`` later: it does not
    outrank an activation change detected at about the same samples. Where onsets are
    exact (``onset_tolerance`` 0: the first non-finite sample), a gradient's counts half
    a sample later (after its own sample's forward, before the next sample's)."""
    if candidate.onset is None:
        return 0
    if candidate.series.signal == GRAD_OUTPUT:
        return candidate.onset + (ONSET_TOLERANCE_SAMPLES if onset_tolerance else 0.5)
    return candidate.onset


def rank_candidates(
    candidates: Sequence[Candidate], onset_tolerance: int = ONSET_TOLERANCE_SAMPLES
) -> list[Candidate]:
    """Fold echoes into origins and order candidates, strongest first.

    Notable candidates of one signal whose onsets lie within ``onset_tolerance`` samples
    of the group's earliest onset form a group (0: the same sample only).

    Order: notable before not notable; notable with a detected onset before notable
    without; earlier onsets first; then groups by their strongest score; within a group
    the origin (see module docstring); ties by (module, call index, signal, tensor path,
    metric), so the same run always gives the same order.
    """
    notable = [c for c in candidates if c.notable and c.onset is not None]
    others = [c for c in candidates if not (c.notable and c.onset is not None)]
    groups: list[list[Candidate]] = []
    for candidate in sorted(notable, key=lambda c: (c.onset, _origin_order(c))):
        for group in groups:
            same_signal = group[0].series.signal == candidate.series.signal
            if same_signal and abs(group[0].onset - candidate.onset) <= onset_tolerance:  # type: ignore[operator]
                group.append(candidate)
                break
        else:
            groups.append([candidate])
    origins: list[Candidate] = []
    for group in groups:
        group.sort(key=_origin_order)
        origin = group[0]
        # Another metric of the origin's own series is the same tensor, not an echo.
        echoes = [c for c in group[1:] if c.series is not origin.series]
        origin.echoes = sorted(echoes, key=lambda c: (-c.score, c.sort_key))
        origin.group_score = max(c.score for c in group)
        origins.append(origin)
    for candidate in others:
        candidate.group_score = candidate.score
    # A notable change with a detected onset outranks one without (gradual drift), and
    # among those the earliest change ranks first: a fault starts before what it causes,
    # and the onset is what places a module before its echoes.
    ordered = sorted(
        origins + others,
        key=lambda c: (
            not c.notable,
            c.onset is None,
            _ordering_onset(c, onset_tolerance),
            -c.group_score,
            _origin_order(c),
        ),
    )
    return ordered
