"""Grouping for ``events``: series that are one tensor (:class:`SameTensor`), notable
candidates of one tensor named once (:func:`dedupe`), and facets joined into events
(:func:`build_events`). The rules of joining are in ``events.py``'s docstring.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .find import Candidate, display_module
from .find.base import (
    ONSET_TOLERANCE_SAMPLES,
    ORIGIN_ONSET_SLACK_SAMPLES,
    _is_trend,
    group_window,
    moved_by,
)
from .series import ACTIVATION, GRAD_OUTPUT, TensorSeries, forward_positions


class SameTensor:
    """Series that recorded identical values at every sample: one tensor seen by
    several modules (pass-throughs, the root's output).

    Two series are the same tensor when they have the same signal and, for their
    ``rms`` and ``max_abs`` trackers, the same count, first, latest, minimum, maximum
    and bounded history, and their ``rms`` varied (constant series are left apart:
    equal constants say nothing about identity).
    """

    def __init__(self, series: Iterable[TensorSeries]) -> None:
        positions = forward_positions(series := list(series))
        groups: dict[tuple[object, ...], list[TensorSeries]] = {}
        for s in series:
            key = _fingerprint(s)
            if key is not None:
                groups.setdefault(key, []).append(s)
        self._primary: dict[int, TensorSeries] = {}
        self._names: dict[int, list[TensorSeries]] = {}
        for members in groups.values():
            if len(members) < 2:
                continue
            members.sort(
                key=lambda s: (
                    positions.get((s.module, s.call_index, s.tensor_path), s.forward_position),
                    s.module == "",
                    s.module,
                )
            )
            # The root last: its output is what the model returns, not where it began.
            members.sort(key=lambda s: s.module == "")
            for s in members:
                self._primary[id(s)] = members[0]
            self._names[id(members[0])] = members[1:]

    def primary(self, series: TensorSeries) -> TensorSeries:
        """The series that names ``series``' tensor (itself when it is alone)."""
        return self._primary.get(id(series), series)

    def others(self, series: TensorSeries) -> list[TensorSeries]:
        """The other series of ``series``' tensor (its primary's aliases), in forward order."""
        primary = self.primary(series)
        return (
            [primary, *self._names.get(id(primary), [])]
            if primary is not series
            else list(self._names.get(id(series), []))
        )

    def also_named(self, series: TensorSeries) -> list[str]:
        """Display names of the other modules of ``series``' tensor (tensor path added
        when it differs)."""
        names = []
        for other in self.others(series):
            if other is series:
                continue
            name = display_module(other.module)
            if other.call_index:
                name += f" (call {other.call_index})"
            if other.tensor_path != series.tensor_path:
                name += f" {other.tensor_path}"
            names.append(name)
        return names


def _fingerprint(s: TensorSeries) -> tuple[object, ...] | None:
    rms = s.trackers.get("rms")
    if rms is None or rms.count < 2 or rms.min is None or rms.max is None:
        return None
    if rms.min.value == rms.max.value:
        return None
    parts: list[object] = [s.signal]
    for metric in ("rms", "max_abs"):
        t = s.trackers.get(metric)
        if t is None:
            return None
        parts.append((t.count, t.first, t.latest, t.min, t.max, tuple(t.history())))
    return tuple(parts)


def dedupe(candidates: Sequence[Candidate], same: SameTensor) -> list[Candidate]:
    """``candidates`` (ranked) without those whose tensor, metric and signal an earlier
    one already stands for; echoes of the same tensor as their origin, or as an earlier
    echo, are dropped too."""
    # The root returns another module's tensor: that module names it.
    named: dict[tuple[int, str], Candidate] = {}
    for c in candidates:
        key = (id(same.primary(c.series)), c.metric)
        if key not in named or (named[key].series.module == "" and c.series.module != ""):
            named[key] = c
    kept: list[Candidate] = []
    seen: set[tuple[int, str]] = set()
    for c in candidates:
        key = (id(same.primary(c.series)), c.metric)
        if key in seen:
            continue
        seen.add(key)
        c = named[key]
        if c.echoes:
            # One echo per tensor, named by its producer when that one is an echo too.
            own = id(same.primary(c.series))
            chosen: dict[int, Candidate] = {}
            for e in c.echoes:
                tensor = id(same.primary(e.series))
                if tensor == own:
                    continue
                if tensor not in chosen or same.primary(e.series) is e.series:
                    chosen[tensor] = e
            c.echoes = [e for e in c.echoes if chosen.get(id(same.primary(e.series))) is e]
        kept.append(c)
    return kept


@dataclass(slots=True)
class Facet:
    """One category's notable candidate, and the event it belongs to."""

    category: str
    rank: int
    candidate: Candidate
    event: Event | None = None


@dataclass(slots=True)
class Event:
    """One change at one module and onset (see the module docstring).

    Attributes:
        number: 1-based, in report order (``id`` ``E<number>``).
        facets: the category facets, the first one the event's own (its module, onset,
            history and cross-section).
        members: (module, call index) of the first facet's series and of every echo of
            every facet, for joining.
    """

    number: int
    facets: list[Facet]
    members: set[tuple[str, int]] = field(default_factory=set)

    @property
    def id(self) -> str:
        return f"E{self.number}"

    @property
    def lead(self) -> Candidate:
        return self.facets[0].candidate

    @property
    def model_wide(self) -> bool:
        return self.lead.model_wide is not None

    @property
    def shape(self) -> str:
        c = self.lead
        if c.model_wide is not None:
            return "model_wide"
        if any(f.category == "non_finite" for f in self.facets):
            return "non_finite"
        if c.change is not None and c.onset is not None:
            if c.change.kind == "trend":
                return "bend"
            return "spike" if c.change.transient else "step"
        if c.category == "oscillation":
            return "oscillation"
        if c.category == "relative_volatility":
            return "volatility"
        return "drift"


def _members(c: Candidate) -> set[tuple[str, int]]:
    return {(c.series.module, c.series.call_index)} | {
        (e.series.module, e.series.call_index) for e in c.echoes
    }


def _joins(event: Event, c: Candidate) -> bool:
    lead = event.lead
    if (c.model_wide is not None) != event.model_wide:
        return False
    if event.model_wide:
        onset = lead.onset or 0
        window = group_window(lead, ONSET_TOLERANCE_SAMPLES)
        return c.onset is not None and onset - ONSET_TOLERANCE_SAMPLES <= c.onset <= onset + window
    where = (c.series.module, c.series.call_index)
    if c.onset is None:
        return where in event.members
    if gradient_behind(c, lead) or gradient_behind(lead, c):
        return True
    if lead.onset is None or abs(c.onset - lead.onset) > ONSET_TOLERANCE_SAMPLES:
        return False
    lead_where = (lead.series.module, lead.series.call_index)
    if where == lead_where or lead_where in _members(c):
        # The event's module is this facet's, or one of its echoes: of any signal (an
        # activation step moves the output gradients at the same samples).
        return True
    same_signal = c.series.signal == lead.series.signal
    return same_signal and (where in event.members or bool(_members(c) & event.members))


def gradient_behind(gradient: Candidate, activation: Candidate) -> bool:
    """Whether ``gradient`` (an output-gradient step) is what an activation step
    ``activation`` of a module after it in forward order does to the gradients before
    it: both steps (not breaks of trend, not model-wide) dated at the same sample. A
    module's weights scaled at a sample move its output and, in the same backward
    pass, the gradient it passes back to the modules before it; a change of the loss or
    of the gradients alone moves no activation in that sample."""
    return (
        gradient.series.signal == GRAD_OUTPUT
        and activation.series.signal == ACTIVATION
        and gradient.model_wide is None
        and activation.model_wide is None
        and gradient.change is not None
        and activation.change is not None
        and not _is_trend(gradient)
        and not _is_trend(activation)
        and gradient.onset is not None
        and gradient.onset == activation.onset
        and gradient.position < activation.position
    )


def build_events(facets: Sequence[Facet]) -> list[Event]:
    """Group ``facets`` (notable, in report order) into events; set each facet's
    ``event``. Events are numbered in the order of their first facet. An output-gradient
    step joins the activation step of a module after it at the same sample, and the
    activation step leads (:func:`gradient_behind`)."""
    events: list[Event] = []
    for facet in facets:
        c = facet.candidate
        event = next((e for e in events if _joins(e, c)), None)
        if event is None:
            event = Event(number=len(events) + 1, facets=[])
            events.append(event)
        event.facets.append(facet)
        event.members |= _members(c)
        facet.event = event
    for event in events:
        cause = next((f for f in event.facets if gradient_behind(event.lead, f.candidate)), None)
        if cause is not None:
            event.facets.remove(cause)
            event.facets.insert(0, cause)
        _lead_from_upstream(event)
    return events


def _lead_from_upstream(event: Event) -> None:
    """Put first the facet where the change begins among the facets of the first facet's
    signal whose onset is within ``ONSET_TOLERANCE_SAMPLES`` of its own (its peers):
    each facet is its category's origin at those samples, and the change begins at the
    most upstream of them in propagation order (forward order for activations, backward
    order for output gradients): an upstream LayerNorm's scale step beside a larger
    kurtosis step in the Linear after it.

    Only peers whose change began first may lead, as within a category
    (:func:`~torchinstruments.find.base._profile_origin`): a step (or a non-finite
    value, or a change without a change point) whose onset is the earliest such onset
    among the peers, or within ``ORIGIN_ONSET_SLACK_SAMPLES`` after it where its value
    had already departed from its trend there
    (:func:`~torchinstruments.find.base.moved_by`), and a break of trend only where its
    corner comes before that earliest onset. A step is
    dated to the sample where the level moved; a break of trend that bends from a later
    sample on follows the step (an optimizer answering a weight scaled at the step's
    sample), and never leads it however far upstream it sits. Where every peer is a
    break of trend, the most upstream leads. Model-wide events keep their order."""
    first = event.facets[0].candidate
    if first.model_wide is not None or first.onset is None:
        return
    onset = first.onset
    backward = first.series.signal == GRAD_OUTPUT
    peers = [
        (f, c.onset)
        for f in event.facets
        if (c := f.candidate).series.signal == first.series.signal
        and c.model_wide is None
        and c.onset is not None
        and abs(c.onset - onset) <= ONSET_TOLERANCE_SAMPLES
    ]
    steps = [start for f, start in peers if not _is_trend(f.candidate)]
    if steps:
        earliest = min(steps)
        peers = [
            (f, start)
            for f, start in peers
            if start < earliest
            or (
                not _is_trend(f.candidate)
                and (
                    start == earliest
                    or (
                        start <= earliest + ORIGIN_ONSET_SLACK_SAMPLES
                        and moved_by(f.candidate, earliest)
                    )
                )
            )
        ]
    lead = min(
        (f for f, _ in peers),
        key=lambda f: -f.candidate.position if backward else f.candidate.position,
    )
    if lead is not event.facets[0]:  # min keeps the first of equal positions
        event.facets.remove(lead)
        event.facets.insert(0, lead)
