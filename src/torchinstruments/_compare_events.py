"""The first divergences of a comparison other than values: calls that one run stops
observing or observes alone, first non-finite samples, and the profile along depth at
the first difference of an identical pair (its origin, or a model-wide divergence).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ._compare_align import _Axis, _describe_when
from ._compare_values import TensorKey, _Event, _series_name
from ._metrics import LOG_SCALE_METRICS
from ._series_file import SeriesFile, SeriesKey, SeriesRow
from .find import display_module
from .series import ACTIVATION, GRAD_OUTPUT

#: Share of the compared modules whose activations depart at the runs' first difference
#: that makes the first divergence model-wide (``<model>``): every weight moved at once
#: (a learning rate, an optimizer setting), not a module.
MODEL_WIDE_DIVERGENCE_SHARE = 0.5
#: At the first difference of an identical pair, the output gradients lead when their
#: largest departure of a scale metric is at least this many times the activations': a fault of
#: the backward pass (a gradient scaled or cut) moves activations only through the few
#: optimizer steps since the last sample (23x in a GPT-2 whose gradient was scaled by
#: 0.05), while a fault of the forward pass, or of the optimizer (a learning rate x30),
#: moves both about alike (at most 2.2x over the forward and optimizer faults of the
#: real-model benchmark). This test comes before the model-wide one.
GRADIENT_LEADS_FACTOR = 5.0
#: Module name of a model-wide first divergence.
MODEL = "<model>"


def _presence(series: Iterable[tuple[SeriesKey, SeriesRow]]) -> dict[TensorKey, dict[str, Any]]:
    """Per tensor (module, call, signal, path): observed span, count, metrics, position."""
    out: dict[TensorKey, dict[str, Any]] = {}
    for key, s in series:
        if not s.samples:
            continue
        tensor = key[:4]
        entry = out.get(tensor)
        if entry is None:
            out[tensor] = {
                "first": s.samples[0],
                "last": s.samples[-1],
                "count": s.count,
                "metrics": [key[4]],
                "position": s.forward_position,
            }
        else:
            entry["first"] = min(entry["first"], s.samples[0])
            entry["last"] = max(entry["last"], s.samples[-1])
            entry["count"] = max(entry["count"], s.count)
            entry["metrics"].append(key[4])
    return out


def _dense(span: dict[str, Any]) -> bool:
    return span["count"] == span["last"] - span["first"] + 1


def _stop_event(
    tensor: TensorKey,
    stopped: dict[str, Any],
    going: dict[str, Any],
    side: str,
    axis: _Axis,
    position: int,
) -> _Event | None:
    """The candidate (``side``) stopped observing ``tensor`` while the other run went on."""
    other = "baseline" if side == "candidate" else "candidate"
    key = axis.key(side, stopped["last"] + 1)
    going_last = axis.key(other, going["last"])
    if key is None or going_last is None or key > axis.end or going_last < key:
        return None
    if not (_dense(stopped) and _dense(going)):
        return None  # a call that comes and goes (a routed expert, a branch) proves nothing
    last = axis.when(axis.key(side, stopped["last"]) or 0)
    module, call, signal, path = tensor
    when = axis.when(key)
    interpretation = (
        f"{_series_name(tensor)} is observed in the {other} through "
        f"{_describe_when(axis.when(going_last))} but in the {side} only through "
        f"{_describe_when(last)}: from {_describe_when(when)} the {side} no longer calls it "
        f"(or it no longer returns a floating tensor there)."
    )
    experiment = (
        f"Find what skips `{module}` in the {side} from {_describe_when(when)} (a flag, a "
        f"branch, a replaced forward or module); restore only that call in the {side}, with "
        f"the same seed, data order and precision, and compare again: if the runs then "
        f"agree past that point, the skipped call is the cause."
    )
    return _Event(
        key,
        "stopped",
        side,
        module,
        call,
        signal,
        path,
        None,
        position,
        {
            **when,
            "last_observed": last,
            "interpretation": interpretation,
            "next_experiment": experiment,
        },
    )


def _one_run_entries(
    only: dict[TensorKey, dict[str, Any]],
    side: str,
    other: SeriesFile,
    axis: _Axis,
) -> tuple[list[dict[str, Any]], list[_Event]]:
    entries: list[dict[str, Any]] = []
    events: list[_Event] = []
    for tensor, span in sorted(only.items(), key=lambda item: (item[1]["position"], item[0])):
        module, call, signal, path = tensor
        explained = None
        if module not in other.modules_selected:
            explained = "module not selected in the other run"
        elif other.omitted:
            explained = "the other run's series.json was truncated"
        first_key = axis.key(side, span["first"])
        first_when = axis.when(first_key) if first_key is not None else None
        entry = {
            "module": module,
            "call_index": call,
            "signal": signal,
            "tensor_path": path,
            "forward_position": span["position"],
            "metrics": sorted(span["metrics"]),
            "first_sample": span["first"],
            "last_sample": span["last"],
            "count": span["count"],
            "explained_by": explained,
        }
        entries.append(entry)
        if explained is None and first_key is not None and first_key <= axis.end:
            missing = "candidate" if side == "baseline" else "baseline"
            interpretation = (
                f"{_series_name(tensor)} is observed only in the {side}, from "
                f"{_describe_when(first_when or {})}: the {missing} never observes it (a "
                f"call {'removed from' if side == 'baseline' else 'added to'} the candidate, "
                f"or a call that stopped returning a floating tensor)."
            )
            experiment = (
                f"{'Restore' if side == 'baseline' else 'Bypass'} only that call of "
                f"`{module}` in the candidate, with the same seed, data order and precision, "
                f"and compare again: if the runs then agree, that call is the cause."
            )
            events.append(
                _Event(
                    first_key,
                    f"only_in_{side}",
                    side,
                    module,
                    call,
                    signal,
                    path,
                    None,
                    span["position"],
                    {
                        **(first_when or {}),
                        "interpretation": interpretation,
                        "next_experiment": experiment,
                    },
                )
            )
    return entries, events


def _non_finite_event(
    key: SeriesKey, base: SeriesRow, cand: SeriesRow, axis: _Axis
) -> _Event | None:
    first_b = base.first_nonzero_sample
    first_c = cand.first_nonzero_sample
    key_b = axis.key("baseline", first_b) if first_b is not None else None
    key_c = axis.key("candidate", first_c) if first_c is not None else None
    if key_b is not None and key_b > axis.end:
        key_b = None
    if key_c is not None and key_c > axis.end:
        key_c = None
    if key_c is not None and (key_b is None or key_c < key_b):
        side, at, other_key = "candidate", key_c, key_b
    elif key_b is not None and (key_c is None or key_b < key_c):
        side, at, other_key = "baseline", key_b, key_c
    else:
        return None
    other = "baseline" if side == "candidate" else "candidate"
    when = axis.when(at)
    other_text = (
        f"the {other}'s first is at {_describe_when(axis.when(other_key))}"
        if other_key is not None
        else f"the {other} has none through {_describe_when(axis.when(axis.end))}"
    )
    module, call, signal, path, metric = key
    return _Event(
        at,
        "non_finite",
        side,
        module,
        call,
        signal,
        path,
        metric,
        base.forward_position,
        {
            **when,
            "interpretation": (
                f"{_series_name(key[:4])} has its first non-finite value in the {side} at "
                f"{_describe_when(when)}; {other_text}."
            ),
            "next_experiment": (
                f"Rerun the {side} with inject_observer(..., sampling=1, full_sentinel=True) "
                f"to name the exact training forward and the first module in forward order "
                f"that produces a non-finite value, then upcast or clamp only there and "
                f"compare again."
            ),
        },
    )


def _jumps(ordered: list[_Event], before: float) -> Iterator[tuple[_Event, float]]:
    """Each departure of ``ordered`` with its ratio to the largest before it (``before``
    standing for what came before the first)."""
    for event in ordered:
        size = abs(event.fields["departure"] or 0.0)
        yield event, size / before if before > 0.0 else 0.0
        before = max(before, size)


def _where_the_profile_jumps(ordered: list[_Event], threshold: float) -> _Event:
    """The departure at which the profile along depth jumps most: the largest ratio of a
    departure to the largest one before it in ``ordered`` (forward order for activations,
    backward order for output gradients), where a series before it that did not depart
    counts as ``threshold``; the earliest wins a tie. Between two samples the optimizer
    carries a fault's gradient upstream, so modules before the faulty one move a little
    and by about as much as each other, and modules after it echo it by about as much as
    it moved: the fault is where the departure multiplies. ``ordered`` is not empty."""
    best, best_jump = ordered[0], 0.0
    for event, jump in _jumps(ordered, threshold):
        if jump > best_jump:
            best, best_jump = event, jump
    return best


def _largest_jump(ordered: list[_Event]) -> float:
    """The largest ratio of a departure to the largest before it in ``ordered`` (after
    the first), 1 for fewer than two departures."""
    if not ordered:
        return 1.0
    first = abs(ordered[0].fields["departure"] or 0.0)
    return max([1.0, *(jump for _, jump in _jumps(ordered[1:], first))])


def _profile_at_first_difference(
    events: list[_Event],
    first_difference: int,
    modules_compared: int,
    first_module: str,
    threshold: float,
    gradient_modules: tuple[int, str | None] = (0, None),
) -> tuple[list[_Event], dict[str, Any] | None]:
    """Order the activation departures at an identical pair's first difference by where
    their profile along depth jumps (:func:`_where_the_profile_jumps`, departures beyond
    ``threshold``), and say whether the
    whole model moved at once there: ``MODEL_WIDE_DIVERGENCE_SHARE`` of the
    ``modules_compared`` depart, the model's first module (``first_module``, in forward
    order) among them. A fault at one module reaches the modules before it only through
    the weights the optimizer changed since the last sample, a run-level change moves
    the first module as much as any. Returns the events in their new order and the
    model-wide record, or None. When the output gradients depart far more than the
    activations there (``GRADIENT_LEADS_FACTOR``), the output gradient of a scale metric
    where their profile in backward order jumps leads instead; unless the gradients
    depart from the loss end on and grow backwards without a jump: the first module in
    backward order (``gradient_modules``: how many modules' output gradients are
    compared, and the first of them in backward order) among
    ``MODEL_WIDE_DIVERGENCE_SHARE`` of them that depart, and no departure
    ``GRADIENT_LEADS_FACTOR`` times the largest before it (:func:`_largest_jump`). A
    fault of one module's backward leaves the gradients after it in forward order as
    they were, or moved only through the optimizer steps since the last sample, and
    multiplies the departure at that module (7.2x at ``fc``, seven steps after its
    output gradient was scaled by 20, in the test suite's ``ResidualNet``); an optimizer
    setting changes every weight, the last layer's too, and the difference it makes
    to the gradient compounds backwards from the loss end (at most 2.6x from one module
    to the next in a ResNet-18 whose SGD momentum went from 0.9 to 0.995), while
    BatchNorm or LayerNorm can keep the activations within noise. That is a model-wide
    divergence too. The factor is ``GRADIENT_LEADS_FACTOR``'s, not fitted: those two
    examples sit on either side of it."""
    at = [
        e
        for e in events
        if e.key == first_difference and e.kind == "value" and e.signal == ACTIVATION
    ]
    gradients = sorted(
        (
            e
            for e in events
            if e.key == first_difference and e.kind == "value" and e.signal == GRAD_OUTPUT
        ),
        key=_Event.order,
    )
    if not at and not gradients:
        return events, None
    at.sort(key=_Event.order)
    # Gradients against activations: scale metrics only (log units with one floor), as
    # fractions are counted in units of another size.
    largest_gradient, largest_scale = (
        max(
            (abs(e.fields["departure"] or 0.0) for e in group if e.metric in LOG_SCALE_METRICS),
            default=0.0,
        )
        for group in (gradients, at)
    )
    root = display_module("")
    departing = {e.module for e in at if e.module not in ("", root)}  # not a compared module
    share = len(departing) / max(modules_compared, 1)
    model_wide = first_module in departing and share >= MODEL_WIDE_DIVERGENCE_SHARE
    ordered = list(events)
    if largest_gradient > 0.0 and largest_gradient >= GRADIENT_LEADS_FACTOR * largest_scale:
        # A fault of the backward pass: the gradients lead, from where their profile in
        # backward order jumps (activations that all moved, through the optimizer steps
        # since the last sample, are its echoes).
        scaled = [e for e in gradients if e.metric in LOG_SCALE_METRICS]
        origin = _where_the_profile_jumps(scaled, threshold)
        anchor = at[0] if at else gradients[0]
        if origin is not anchor:
            ordered.remove(origin)
            ordered.insert(ordered.index(anchor), origin)
        compared, loss_end = gradient_modules
        moved = {e.module for e in scaled if e.module not in ("", root)}
        if (
            loss_end in moved
            and _largest_jump(scaled) < GRADIENT_LEADS_FACTOR
            and len(moved) >= MODEL_WIDE_DIVERGENCE_SHARE * max(compared, 1)
        ):
            return ordered, _model_wide_record(scaled[0], moved, compared, GRAD_OUTPUT)
        return ordered, None
    if not at:
        return events, None
    origin = _where_the_profile_jumps(at, threshold)
    # The origin moves ahead of the activation departures before it at that point only;
    # a module that stopped being called or turned non-finite there keeps its place.
    if origin is not at[0]:
        ordered.remove(origin)
        ordered.insert(ordered.index(at[0]), origin)
    if not model_wide:
        return ordered, None
    return ordered, _model_wide_record(at[0], departing, modules_compared, ACTIVATION)


def _model_wide_record(
    origin: _Event, departing: set[str], modules_compared: int, signal: str
) -> dict[str, Any]:
    """The model-wide first divergence of ``signal``, led by ``origin``: the first
    departure in propagation order (forward order for activations, under
    ``first_in_forward_order``; backward order for output gradients, under
    ``first_in_backward_order``)."""
    share = len(departing) / max(modules_compared, 1)
    when = {
        k: origin.fields[k] for k in ("sample", "forward", "candidate_sample") if k in origin.fields
    }
    described = _describe_when(when)
    if signal == GRAD_OUTPUT:
        seen = (
            f"{len(departing)} of {modules_compared} compared modules' output gradients "
            f"depart at once ({share:.0%}), from the one nearest the loss "
            f"({origin.module}) on, while no activation departs as far: the backward "
            "changed from the loss end, where every weight's update changed, the last "
            "layer's too"
        )
        first_key = "first_in_backward_order"
    else:
        seen = (
            f"{len(departing)} of {modules_compared} compared modules' activations depart "
            f"at once ({share:.0%}), the model's first module ({origin.module}) among them: "
            "every weight moved differently"
        )
        first_key = "first_in_forward_order"
    return {
        "kind": "model_wide",
        "side": "candidate",
        "module": MODEL,
        "call_index": None,
        "signal": signal,
        "tensor_path": None,
        "metric": origin.metric,
        "forward_position": origin.position,
        **when,
        "share_of_modules": share,
        "modules_departing": len(departing),
        "modules_compared": modules_compared,
        first_key: {
            "module": origin.module,
            "call_index": origin.call_index,
            "tensor_path": origin.tensor_path,
            "metric": origin.metric,
            "departure": origin.fields["departure"],
        },
        "last_agreeing": origin.fields.get("last_agreeing"),
        "interpretation": (
            f"The runs were identical before {described}; there {seen}, the mark of a "
            "run-level change (learning rate or schedule, optimizer settings or state, "
            "data, loss scale), not of one module."
        ),
        "next_experiment": (
            "Diff the two runs' optimizer settings and state, learning-rate schedule, data "
            f"pipeline and loss scaling at the step before {described}; rerun the "
            "candidate with each restored in turn."
        ),
    }


def _event_record(event: _Event) -> dict[str, Any]:
    return {
        "kind": event.kind,
        "side": event.side,
        "module": event.module,
        "call_index": event.call_index,
        "signal": event.signal,
        "tensor_path": event.tensor_path,
        "metric": event.metric,
        "forward_position": event.position,
        **event.fields,
    }
