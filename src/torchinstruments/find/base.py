"""Shared machinery of the finding rules: candidates, propagation-aware ranking, output.

A rule turns tracked series into :class:`Candidate` objects, each with a ranking basis
(a named score, higher is stronger) and a ``notable`` flag (above the rule's stated noise
floor). :func:`rank_candidates` then orders them deterministically and folds echoes into
their origin: notable candidates of one signal whose change began at about the same
sample form a group. A fault propagates forward through activations and backward
through gradients, so the group is laid out in propagation order (forward order for
activations, reverse forward order for output gradients) and the origin is where the
profile of change begins: the first member, among those whose change began within
``ORIGIN_ONSET_SLACK_SAMPLES`` of the group's earliest (a later one only if its value
had already departed from its trend at the earliest onset, :func:`moved_by`), whose
step, in the metric's tracked units (a log ratio for scale metrics, a fraction of
elements for fractions), is at least ``ORIGIN_SHARE`` of the group's largest. A member
before it that moved far less is an echo carried upstream by the optimizer between
samples (an update driven by the faulty module's gradients), not the start. The others
are listed in the origin's evidence instead of being returned as findings of their own.

A group of activation changes at whose onset at least ``MODEL_WIDE_SHARE`` of the
observed modules moved (members, or modules that departed from their trends by 3
residual spreads, below a finding's floor), the modules before it included, is a
model-wide event
(module ``<model>``): a run-level cause (learning rate or schedule, optimizer state,
data, loss scale) moved most of the model at once, and no member module is named as its
origin. A change that begins after modules that stayed put starts at a module, however
far downstream it spreads. (Output gradients are not used for this: a
change at one module moves the gradients of every module before it.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..series import GRAD_OUTPUT, TensorSeries
from ..track import ChangePoint, SeriesTracker

__all__ = [
    "MODEL",
    "Candidate",
    "display_module",
    "format_value",
    "rank_candidates",
    "step_size",
]

#: Changes whose onsets differ by at most this many samples belong to one group.
ONSET_TOLERANCE_SAMPLES = 5
#: Least step of a group member, as a share of the group's largest (both in the metric's
#: tracked units), for the member to be where the profile of change begins. Not in
#: residual spreads: a series that was exactly constant (a dense gradient's zero
#: fraction) steps by hundreds of its floor's spreads, and would hide a large step of a
#: noisier series before it.
ORIGIN_SHARE = 0.25
#: The origin is among the members whose change began within this many samples of the
#: group's earliest: a change that began later is a consequence, however early it sits in
#: propagation order (one sample of slack: a step of a few spreads may alarm one sample
#: after a larger echo of it; such a step had already departed from its trend at the
#: earlier sample, see :func:`moved_by`).
ORIGIN_ONSET_SLACK_SAMPLES = 1
#: Least share of the observed modules (of one signal) in one group that makes it a
#: model-wide event.
MODEL_WIDE_SHARE = 0.5
#: Module name of a model-wide event.
MODEL = "<model>"
#: Departure from its own trend, in residual spreads, at a group's onset, of a module
#: that is not a member, that counts as having moved with the group.
UPSTREAM_DEPARTURE_SPREADS = 3.0
#: Breaks of trend (:meth:`~torchinstruments.track.SeriesTracker.trend_break`) are dated
#: at the corner of a broken line, which a gradual bend (a learning rate raised under
#: Adam, a growth that compounds) places anywhere in its first part: breaks whose
#: corners lie within this share of the span from the group's earliest corner to its
#: latest sample belong to one group, and any of them may be where it begins.
TREND_GROUP_SHARE = 0.5
#: A module that is not a member counts as having moved with a group of breaks of trend
#: when its own break of trend, with its corner in the group's window, has a slope-change
#: t-statistic of at least this (below a finding's floor, but moved).
TREND_MOVED_T = 3.0
#: A change is early (weak) when its series had seen fewer than this many warm-ups of
#: values before the alarm: the trend and spread of early training are still settling.
EARLY_REFERENCE_FACTOR = 1.5


def display_module(name: str) -> str:
    """Module name as shown in reports: the root ``""`` is ``<root>``."""
    return name if name else "<root>"


def is_early(candidate: Candidate) -> bool:
    """The candidate's change came while its series' reference was young: fewer than
    ``EARLY_REFERENCE_FACTOR`` times the warm-up length of values before the alarm. Such
    a change is weak evidence and never heads a category over a later one."""
    change = candidate.change
    if change is None:
        return False
    warmup = candidate.judged.config.warmup_samples
    return change.reference_count < EARLY_REFERENCE_FACTOR * warmup


def step_size(candidate: Candidate) -> float:
    """``|step|`` of the candidate's change in residual spreads (0 without a change)."""
    change = candidate.change
    return abs(change.step_z) if change is not None else 0.0


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
        change: the change point the candidate rests on, if any (on the judged tracker).
        model_wide_modules: for the origin of a model-wide group: how many observed
            modules (of its signal) moved at its onset, and how many are observed; None
            otherwise. Such a candidate is reported as module ``<model>``; the group's
            members (:attr:`group_modules`) are among those that moved.
        secondary: judged on its category's secondary metric, where only that one made
            a notable step (``activation_scale_drift``'s ``mean_abs``): weaker evidence
            than the category's own metric, so :func:`rank_candidates` lists it after
            the category's other notable changes.
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
    change: ChangePoint | None = None
    model_wide_modules: tuple[int, int] | None = None
    secondary: bool = False

    @property
    def model_wide(self) -> float | None:
        """The share of observed modules that moved at a model-wide group's onset (see
        :attr:`model_wide_modules`), or None when this is not a model-wide origin."""
        counts = self.model_wide_modules
        return None if counts is None else counts[0] / counts[1]

    @property
    def group_modules(self) -> set[str]:
        """The modules of this candidate and of its echoes."""
        return {e.series.module for e in self.echoes} | {self.series.module}

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


def _is_trend(candidate: Candidate) -> bool:
    return candidate.change is not None and candidate.change.kind == "trend"


def _earliest(group: list[Candidate]) -> Candidate:
    """The member whose change began first (the first in the group's order among ties)."""
    return min(group, key=lambda c: c.onset if c.onset is not None else -1)


def group_window(first: Candidate, onset_tolerance: int) -> int:
    """How many samples after ``first``'s onset another candidate's change may begin and
    still join its group: ``onset_tolerance``, or for a break of trend
    ``TREND_GROUP_SHARE`` of the span from its corner to its latest sample, if larger."""
    change = first.change
    if change is None or change.kind != "trend" or first.onset is None:
        return onset_tolerance
    return max(onset_tolerance, int(TREND_GROUP_SHARE * (change.alarm_sample - first.onset)))


def _profile_origin(group: list[Candidate]) -> Candidate:
    """The member where the profile of change begins (see the module docstring); the
    group is in propagation order. Candidates without a change point (non-finite values,
    whose onset is exact) keep the plain propagation order. In a group of breaks of
    trend, every member whose corner lies in the group's window may be where it begins
    (``TREND_GROUP_SHARE``)."""
    earliest = min((c.onset for c in group if c.onset is not None), default=None)
    slack = ORIGIN_ONSET_SLACK_SAMPLES
    trend_group = all(_is_trend(c) for c in group)
    if trend_group:
        slack = max(slack, group_window(_earliest(group), slack))

    def began_first(c: Candidate) -> bool:
        if earliest is None or c.onset is None or c.onset <= earliest:
            return True
        # A corner is only estimated; a step must have moved at the earliest onset.
        return c.onset <= earliest + slack and (trend_group or moved_by(c, earliest))

    first = [c for c in group if began_first(c)]
    largest = max(_raw_step(c) for c in group)
    if largest <= 0.0:
        return first[0]
    for candidate in first:
        if candidate.change is None or _raw_step(candidate) >= ORIGIN_SHARE * largest:
            return candidate
    return first[0]


def moved_by(candidate: Candidate, sample: int) -> bool:
    """True if ``candidate``'s series may already have changed at ``sample``, before its
    own onset: its value there departed from its trend by ``UPSTREAM_DEPARTURE_SPREADS``
    or more, or that value is no longer kept (unknown, so not ruled out). A step dated
    one sample after its group's earliest is where the change began only if it had
    moved by then (``ORIGIN_ONSET_SLACK_SAMPLES``): a module whose value held at the
    sample where the others stepped began later, an echo carried to it by the update in
    between (a Linear before a weight scaled between samples, whose output steps at the
    next sample through the larger gradients it received)."""
    departure = candidate.judged.departure_at(sample)
    return departure is None or abs(departure.z) >= UPSTREAM_DEPARTURE_SPREADS


def _raw_step(candidate: Candidate) -> float:
    """``|step|`` of the candidate's change in tracked units (0 without a change)."""
    change = candidate.change
    return abs(change.step) if change is not None else 0.0


def _model_wide_share(
    group: list[Candidate], candidates: Sequence[Candidate], first_position: int, window: int
) -> tuple[int, int] | None:
    """The cross-section of a group at its onset: how many observed modules (of the
    group's signal, the root excluded) moved, and how many are observed; a module has
    moved when it is a
    member or its series departed from its own trend by ``UPSTREAM_DEPARTURE_SPREADS`` or
    more at that sample (below a finding's floor, but moved); in a group of breaks of
    trend also when its own break of trend has its corner within ``window`` samples of
    the onset and a slope-change
    t-statistic of at least ``TREND_MOVED_T``. None when the modules
    before the group's first member mostly stayed put (fewer than half of them moved;
    none are before it when the group begins at the first observed module): a change
    that begins after modules that stayed put starts at a module, however far
    downstream it spreads."""
    signal = group[0].series.signal
    onset = min(c.onset for c in group if c.onset is not None)
    members = {c.series.module for c in group}
    moved: set[str] = set(members)
    observed: set[str] = set()
    first = min(c.position for c in group)
    trend_group = all(_is_trend(c) for c in group)
    before: set[str] = set()
    for c in candidates:
        module = c.series.module
        if c.series.signal != signal or module == "":
            continue
        observed.add(module)
        if c.position < first and c.position >= first_position:
            before.add(module)
        if module in moved:
            continue
        departure = c.judged.departure_at(onset)
        if departure is not None and abs(departure.z) >= UPSTREAM_DEPARTURE_SPREADS:
            moved.add(module)
        elif trend_group:
            bend = c.judged.trend_break()
            if (
                bend is not None
                and abs(bend.start_sample - onset) <= window
                and abs(bend.slope_change_t) >= TREND_MOVED_T
            ):
                moved.add(module)
    before -= members
    if before and len(before & moved) < 0.5 * len(before):
        return None
    return len(moved), max(len(observed), 1)


def rank_candidates(
    candidates: Sequence[Candidate],
    onset_tolerance: int = ONSET_TOLERANCE_SAMPLES,
    modules_observed: Mapping[str, tuple[int, int]] | None = None,
) -> list[Candidate]:
    """Fold echoes into origins and order candidates, strongest first.

    Notable candidates of one signal whose onsets lie within ``onset_tolerance`` samples
    of the group's earliest onset form a group (0: the same sample only). The origin of
    a group is where its profile of change begins (module docstring). With
    ``modules_observed`` (per signal: the number of modules observed and the least
    forward position among them), a group is model-wide (its origin's ``model_wide`` is
    set) when at least ``MODEL_WIDE_SHARE`` of them moved at its onset and the modules
    before it moved too (:func:`_model_wide_share`): a change that begins after modules
    that stayed put starts at a module, however far downstream it spreads.

    Order: notable before not notable; notable with a detected onset before notable
    without; changes that are not early (:func:`is_early`) before early ones; changes
    of the category's own metric before ``secondary`` ones; earlier
    onsets first; then groups by their strongest score; within a group
    the origin; ties by (module, call index, signal, tensor path, metric), so the same
    run always gives the same order.
    """
    notable = [c for c in candidates if c.notable and c.onset is not None]
    others = [c for c in candidates if not (c.notable and c.onset is not None)]
    groups: list[list[Candidate]] = []
    for candidate in sorted(notable, key=lambda c: (c.onset, _origin_order(c))):
        for group in groups:
            same_signal = group[0].series.signal == candidate.series.signal
            window = (
                group_window(group[0], onset_tolerance) if _is_trend(candidate) else onset_tolerance
            )
            if same_signal and abs(group[0].onset - candidate.onset) <= window:  # type: ignore[operator]
                group.append(candidate)
                break
        else:
            groups.append([candidate])
    origins: list[Candidate] = []
    for group in groups:
        group.sort(key=_origin_order)
        origin = _profile_origin(group)
        # Another metric of the origin's own series is the same tensor, not an echo.
        echoes = [c for c in group if c is not origin and c.series is not origin.series]
        origin.echoes = sorted(echoes, key=lambda c: (-c.score, c.sort_key))
        origin.group_score = max(c.score for c in group)
        extent = (modules_observed or {}).get(origin.series.signal)
        if extent is not None and extent[0] >= 4:
            window = group_window(_earliest(group), onset_tolerance)
            counts = _model_wide_share(group, candidates, extent[1], window)
            if counts is not None and counts[0] >= MODEL_WIDE_SHARE * counts[1]:
                origin.model_wide_modules = counts
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
            c.notable and is_early(c),
            c.notable and c.secondary,
            _ordering_onset(c, onset_tolerance),
            -c.group_score,
            _origin_order(c),
        ),
    )
    return ordered
