"""The texts of an event for ``events``: its interpretation and next experiment, by
shape and module kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .find import RULES, Candidate, display_module, format_value, model_wide_texts
from .find.base import ONSET_TOLERANCE_SAMPLES
from .series import ATTENTION_LOGITS_PATH, GRAD_OUTPUT, RMS_TO_ROOT
from .track import bounded_exp

if TYPE_CHECKING:
    from ._snapshot import RunSnapshot
from ._event_groups import Event, SameTensor, gradient_behind
from ._event_views import MOVED_SPREADS, cross_section

_NORM = ("Norm",)
_WEIGHTED = ("Linear", "Conv", "Embedding", "Bilinear")
_NONLINEAR = ("ReLU", "GELU", "SiLU", "Tanh", "Sigmoid", "Softmax", "Mish", "Softplus", "ELU")
_PASS = ("Dropout", "Identity")


def module_kind(kind: str | None) -> str:
    """The family of a module class name: ``normalization``, ``weighted`` (linear,
    convolution, embedding), ``nonlinearity``, ``pass_through`` (dropout, identity),
    ``attention`` or ``block`` (anything else: a container or custom module)."""
    if not kind:
        return "block"
    if any(word in kind for word in _NORM):
        return "normalization"
    if any(kind.startswith(word) or word in kind for word in _WEIGHTED) or kind == "Conv1D":
        return "weighted"
    if any(word in kind for word in _NONLINEAR):
        return "nonlinearity"
    if any(word in kind for word in _PASS):
        return "pass_through"
    if "Attention" in kind:
        return "attention"
    return "block"


_SIGNAL_WORDS = {"activation": "activations", "grad_output": "output gradients"}


def with_article(kind: str | None) -> str:
    """``kind`` (a module class name) after "a" or "an" by its first letter
    (``"an Identity"``, ``"a Linear"``)."""
    name = kind or "module"
    return f"{'an' if name[:1].upper() in 'AEIOU' else 'a'} {name}"


def _keep_fixed(text: str) -> str:
    return f"{text} Keep seed, data order and precision fixed so the runs compare."


def _when(sample: int | None, forward: int | None) -> str:
    if sample is None:
        return "an unknown sample"
    return f"sample {sample}" + (f" (training forward {forward})" if forward is not None else "")


def _trend_word(c: Candidate, previous: tuple[int, int, float] | None) -> str:
    """``rising``, ``falling`` or ``flat``: the trend before the change, over the gap
    from the previous observed sample (or one forward), against the residual spread."""
    change = c.change
    assert change is not None
    gap = change.start_forward - previous[1] if previous is not None else 1
    movement = change.slope_before * max(gap, 1)
    if abs(movement) < 0.5 * change.std_before:
        return "flat"
    return "rising" if movement > 0 else "falling"


def _gradient_experiment(section: list[dict[str, Any]] | None, module: str, when: str) -> str:
    """The next experiment of an output-gradient step at ``module``: where the gradients
    of the modules after it in forward order (which the gradient passes first) held,
    within ``MOVED_SPREADS`` in the cross-section ``section``, the change is at the
    module itself; where no observed module follows it, at the loss; otherwise at
    something after it."""
    if section and not any(r["offset"] > 0 for r in section):
        return (
            f"The gradient reaching {module} changed at {when}, and no observed module "
            f"runs after {module} in forward order: its gradient comes from the loss. "
            f"Check the loss around {when}: how it treats {module}'s output (its scale, "
            "a saturated softmax or a clamp, the targets, a reduction or weighting "
            f"changed), and {module}'s output itself."
        )
    after_rows = [r for r in section or () if r["offset"] > 0 and r["in_spreads"] is not None]
    if after_rows and all(abs(r["in_spreads"]) < MOVED_SPREADS for r in after_rows):
        held = ", ".join(r["module"] for r in after_rows[:2])
        following = after_rows[0]["module"]
        return (
            f"The gradient reaching {module} changed at {when} while those of the "
            f"modules after it in forward order held ({held} within "
            f"{format_value(MOVED_SPREADS)} residual spreads): the change is between "
            f"them, at {module} itself, whose output now takes another path back (its "
            "forward bypassed or replaced, its output changed in place, detached or "
            f"rerouted), or in the weights of {following}, which the gradient passes "
            f"from {following}'s output to {module}'s (scaled or replaced; an event at "
            f"{following} at the same sample says so). Check {following}'s weights and "
            f"{module}'s forward at {when}."
        )
    return (
        f"The gradient reaching {module} changed at {when} while the loss gradient did "
        f"not account for it: something after {module} in forward order changed its "
        f"backward. Restore the modules after {module} one at a time, nearest first, and "
        f"rerun to just past {when}."
    )


def _input_experiment(
    previous_row: dict[str, Any] | None, module: str, measure: str, when: str
) -> str | None:
    """The next experiment of an activation step whose input moved too: the row of the
    module just before it in forward order (a cross-section row) departed by
    ``MOVED_SPREADS`` or more at the same sample, so that module is checked first.
    None when it did not move, or is not known."""
    if previous_row is None or abs(previous_row["in_spreads"]) < MOVED_SPREADS:
        return None
    before = previous_row["module"]
    ratio = previous_row.get("ratio")
    ratio_text = f"{format_value(ratio)}x, " if ratio is not None else ""
    return (
        f"Its input moved at the same samples ({before}: {ratio_text}"
        f"{format_value(previous_row['in_spreads'])} residual spreads): check {before} "
        f"first (removed, bypassed, re-initialized, rescaled or switched between train "
        f"and eval at {when}), then {module} itself; restore one at a time and check "
        f"whether {module}'s {measure} returns to its trend."
    )


def _echoes_text(event: Event, c: Candidate, begins_here: bool = False) -> str:
    """How many modules of the lead's signal moved with it (the echoes of the event's
    findings), those after the lead in propagation order (forward order for
    activations, backward order for output gradients) and those before it apart: the
    origin is where the profile of change jumps, so a module that moved at the same
    sample can sit before it (the one with the largest step of those is named); one
    before it that moved only at a later sample is an echo that the updates after the
    change carried back. ``begins_here``: the modules just before the lead did not move
    (the text has said the change begins here), so modules further before it that moved
    at the same sample are told as moved by the updates between samples, not as a
    possible beginning."""
    s = c.series
    echoes: dict[tuple[str, int], Candidate] = {}
    for facet in event.facets:
        if facet.candidate.series.signal == s.signal:
            for echo in facet.candidate.echoes:
                echoes.setdefault((echo.series.module, echo.series.call_index), echo)
    if s.signal == GRAD_OUTPUT:
        before = [e for e in echoes.values() if e.position > c.position]
    else:
        before = [e for e in echoes.values() if e.position < c.position]
    after = [e for e in echoes.values() if e not in before]
    onset = c.onset

    def lag(e: Candidate) -> int:
        """Samples from the lead's onset to ``e``'s (0 where either is unknown)."""
        return e.onset - onset if onset is not None and e.onset is not None else 0

    def later(e: Candidate) -> bool:
        return lag(e) > 0

    def size(e: Candidate) -> float:
        return abs(e.change.step_z) if e.change is not None else 0.0

    text = ""
    if after:
        most = max(lag(e) for e in after)
        when = f"at the same sample or up to {most} later" if most > 0 else "at the same samples"
        text += f" {len(after)} module(s) after it in propagation order moved {when}."
    together = [e for e in before if not later(e)]
    if together:
        largest = max(together, key=size)
        text += (
            f" {len(together)} module(s) before it in propagation order moved at the same "
            f"samples too (the largest step: {display_module(largest.series.module)}, "
            f"{format_value(size(largest))} residual spreads)"
        )
        text += (
            ", but not the modules just before it: the updates between two samples, "
            "which answer this change, can move modules further back."
            if begins_here
            else "; the change may begin there."
        )
    behind = [e for e in before if later(e)]
    if behind:
        largest = max(behind, key=size)
        first = min(e.onset for e in behind if e.onset is not None)
        text += (
            f" {len(behind)} module(s) before it in propagation order moved only from "
            f"sample {first} on (the largest step: {display_module(largest.series.module)}, "
            f"{format_value(size(largest))} residual spreads), after this change: the "
            "updates that followed it carried it back."
        )
    return text


def _stopped_near(
    stopped: Sequence[dict[str, Any]], module: str, start: int
) -> dict[str, Any] | None:
    """The module that stopped being called just before ``start`` (its last sample
    within ``ONSET_TOLERANCE_SAMPLES`` before it), sharing the longest name prefix with
    ``module``; None if none did."""
    near = [
        m for m in stopped if start - ONSET_TOLERANCE_SAMPLES - 1 <= m["last_sample"] < start + 1
    ]
    if not near:
        return None

    def shared(m: dict[str, Any]) -> int:
        a, b = str(m["module"]).split("."), module.split(".")
        count = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            count += 1
        return count

    return max(near, key=shared)


def _step_texts(
    event: Event,
    observer: RunSnapshot,
    kinds: dict[str, str],
    same: SameTensor,
    stopped: Sequence[dict[str, Any]],
) -> tuple[str, str]:
    c = event.lead
    change = c.change
    assert change is not None
    t = c.judged
    s = c.series
    measure = c.metric if t is c.tracker else RMS_TO_ROOT
    module = display_module(s.module)
    where = f"{module} (call {s.call_index}, {s.tensor_path}) {s.signal}.{measure}"
    if measure == RMS_TO_ROOT:
        where += " (its RMS divided by the loss gradient's, the root output's gradient RMS)"
    forward = observer.sample_forwards.forward(change.start_sample)
    window = s.change_windows.get(measure, [])
    previous = next((p for p in reversed(window) if p[0] < change.start_sample), None)
    trend = _trend_word(c, previous)
    before, after = t.level(change.level_before), t.level(change.level_after)
    side = "above" if change.step > 0 else "below"
    if t.log_scale and after > 0.0:
        size = f"{format_value(bounded_exp(abs(change.step)))}x {side}"
    else:
        size = f"{format_value(abs(after - before))} {side}"
    kind = "returned to its old trend afterwards (one sample's spike)"
    if event.shape == "step":
        kind = (
            "held in the samples after it"
            if change.confirmed
            else "not yet confirmed by later samples"
        )
    if change.kind == "sustained_shift":
        # Found over two windows of a noisy series: the level after is the median of
        # the values from the change on, its size in standard errors of the step.
        text = (
            f"{where} moved {size} its {trend} trend from "
            f"{_when(change.start_sample, forward)} on: the median of its values from "
            f"there, {format_value(after)}, where the trend forecast {format_value(before)} "
            f"({format_value(abs(change.step_z))} standard errors of the step), and {kind}."
        )
    else:
        text = (
            f"{where} moved {size} its {trend} trend at {_when(change.start_sample, forward)}: "
            f"{format_value(after)} where the trend forecast {format_value(before)} "
            f"({format_value(abs(change.step_z))} residual spreads), and {kind}."
        )
    current = next((p for p in window if p[0] == change.start_sample), None)
    value = current[2] if current is not None else after
    if previous is not None:
        verb = "rose" if previous[2] < value else "fell" if previous[2] > value else "stayed"
        kept = " (the last value kept before it)" if previous[0] != change.start_sample - 1 else ""
        text += (
            f" The value itself {verb} from {format_value(previous[2])} at sample "
            f"{previous[0]}{kept} to {format_value(value)}"
            + (f" at sample {change.start_sample}." if current is not None else ".")
        )
    section = cross_section(c, observer, same)
    # The module just before this one in forward order, for activations: its input.
    previous_row = (
        None
        if s.signal == GRAD_OUTPUT
        else next(
            (r for r in section or () if r["offset"] == -1 and r["in_spreads"] is not None),
            None,
        )
    )
    begins_here = False
    if section:
        known = [r for r in section if r["offset"] < 0 and r["in_spreads"] is not None]
        moved_before = [r for r in known if abs(r["in_spreads"]) >= MOVED_SPREADS]
        quiet_before = [r for r in known if abs(r["in_spreads"]) < MOVED_SPREADS]
        if s.signal != GRAD_OUTPUT and quiet_before and not moved_before:
            begins_here = True
            text += (
                f" The modules before it in forward order did not move "
                f"({', '.join(r['module'] for r in quiet_before[-2:])} within 3 spreads): "
                "the change begins here."
            )
    text += _echoes_text(event, c, begins_here)
    behind = [f for f in event.facets if gradient_behind(f.candidate, c)]
    if behind:
        named = ", ".join(dict.fromkeys(display_module(f.candidate.series.module) for f in behind))
        steps = ", ".join(
            dict.fromkeys(
                f"{format_value(bounded_exp(abs(f.candidate.change.step)))}x"
                for f in behind
                if f.candidate.change is not None
            )
        )
        text += (
            f" In the same sample the output gradient of {named}, before it in forward "
            f"order, stepped {steps} ({', '.join(f.category for f in behind)}): the "
            f"gradient passed back through {module} changed with its output, as it does "
            f"when {module}'s weights (or a scale applied to them) change."
        )
    other = sorted(
        {f.candidate.series.signal for f in event.facets if f not in behind} - {s.signal}
    )
    if other:
        facets = [
            f.category
            for f in event.facets
            if f.candidate.series.signal != s.signal and f not in behind
        ]
        text += (
            f" The {' and '.join(_SIGNAL_WORDS.get(x, x) for x in other)} moved at the same "
            "samples too "
            f"({', '.join(facets)})."
        )
    when = _when(change.start_sample, forward)
    family = module_kind(kinds.get(s.module))
    a_kind = with_article(kinds.get(s.module))
    gone = _stopped_near(stopped, module, change.start_sample)
    if gone is not None:
        text += (
            f" {gone['module']} (call {gone['call_index']}) stopped being called after "
            f"sample {gone['last_sample']}, just before this change."
        )
        if event.shape == "step":
            # Either signal: a module that stopped running in the same block changed
            # what flows forward from it and what flows back through it.
            experiment = (
                f"Check why {gone['module']} no longer runs from {when} (removed, "
                f"replaced or bypassed by a code path); restore it and check whether "
                f"{module}'s {measure} returns to its trend."
            )
            return text, _keep_fixed(experiment)
    if event.shape == "spike":
        experiment = (
            f"Look at the batch of {when}: a value that returns to its trend the next "
            f"sample is one batch (an outlier input, a rare token or class), not a lasting "
            f"change at {module}. Rerun that batch alone and check {module}'s input."
        )
        return text, _keep_fixed(experiment)
    if s.signal == GRAD_OUTPUT:
        experiment = _gradient_experiment(section, module, when)
        return text, _keep_fixed(experiment)
    # Units that stopped firing: more exact zeros in this module's own activation (not in
    # an output gradient, whose zeros rise where the module after it saturates).
    zero = any(
        f.category == "zero_fraction_growth"
        and f.candidate.series.signal == s.signal
        and f.candidate.series.module == s.module
        and f.candidate.direction > 0
        for f in event.facets
    )
    from_input = (
        None
        if s.tensor_path.startswith(ATTENTION_LOGITS_PATH)
        else _input_experiment(previous_row, module, measure, when)
    )
    if from_input is not None:
        experiment = from_input
    elif zero or (measure == "zero_fraction" and change.step > 0):
        experiment = (
            f"Units at {module} stopped firing at {when}: check the scale and bias of "
            f"its input (the module before it) and the learning rate at that point; "
            f"restore them one at a time and check whether {module}'s zero_fraction "
            "returns to its trend."
        )
    elif s.tensor_path.startswith(ATTENTION_LOGITS_PATH):
        experiment = (
            f"{module}'s attention logits (scale * Q K^T) moved at {when}: check the "
            "scale passed to scaled_dot_product_attention (1/sqrt(head_dim) left out or "
            "applied twice), then the query and key projections' weights and any "
            "normalization of queries and keys; restore them one at a time."
        )
    elif family == "normalization":
        experiment = (
            f"Check {module}'s normalization at {when}: whether it was removed, bypassed, "
            "re-initialized or switched between train and eval; compare its weight, bias "
            "and running statistics with a run without the change."
        )
    elif family == "weighted":
        experiment = (
            f"{module} is {a_kind}: compare its weight norm just before and "
            f"just after {when} (two checkpoints, or a rerun to just past it); a step in "
            "its output with its input steady means its weights (or a scale applied to "
            "them) changed there. The cosine between the two weights tells how: near 1, "
            "rescaled; near 0, replaced or re-initialized. Restore them at this module "
            "only."
        )
    elif family == "nonlinearity" and previous_row is not None:
        experiment = (
            f"{module} is {a_kind}, which has no weights, and its input did "
            f"not move ({previous_row['module']} within {format_value(MOVED_SPREADS)} "
            f"residual spreads): check whether the nonlinearity itself changed at {when} "
            "(replaced, swapped for another function, or its arguments changed)."
        )
    elif family == "nonlinearity":
        experiment = (
            f"{module} is {a_kind}, which has no weights: its output moves "
            f"with its input. Check the module before it and any change to the "
            f"nonlinearity itself at {when}."
        )
    elif family == "pass_through" and "Identity" in (kinds.get(s.module) or ""):
        before = f" ({previous_row['module']})" if previous_row is not None else ""
        experiment = (
            f"{module} is {a_kind}, which returns its input "
            f"unchanged: the change happened between the module before it{before} and "
            "here, in code that no observed module covers (its parent's forward, a hook, a "
            f"patched function). Observe {module}'s parent too (include it) or hook the "
            f"code that produces {module}'s input, and rerun to just past {when}."
        )
    elif family == "pass_through":
        experiment = (
            f"{module} is {a_kind}: check its probability and "
            f"train or eval mode at {when}, and the module before it."
        )
    else:
        experiment = (
            f"Rerun to just past {when} with {module}'s parts restored one at a time "
            "(normalization, residual scale, weights), starting with the first whose "
            "output moved in the cross-section."
        )
    return text, _keep_fixed(experiment)


def _bend_experiment(c: Candidate, kinds: dict[str, str]) -> str:
    """Next experiment of a break of trend: a slow cause at the module, by its kind."""
    s = c.series
    module = display_module(s.module)
    change = c.change
    assert change is not None
    start = f"sample {change.start_sample} (training forward {change.start_forward})"
    family = module_kind(kinds.get(s.module))
    if s.signal == GRAD_OUTPUT:
        cause = (
            f"the modules after {module} in forward order: a gradient that bends while the "
            "loss gradient does not comes from a backward that changes a little every step"
        )
    elif family == "weighted":
        cause = (
            f"{module}'s weights: log their norm and the norm of each update from just "
            f"before {start} on; a norm that compounds points at its learning rate, its "
            "weight decay or a scale applied to it every step"
        )
    elif family == "normalization":
        cause = (
            f"{module}'s affine parameters and running statistics: log them from just "
            f"before {start} on (a momentum, an epsilon or a learning rate that changed)"
        )
    else:
        cause = (
            f"the module before {module} and {module}'s own parameters, logged from just "
            f"before {start} on"
        )
    return _keep_fixed(
        f"A course that bends instead of stepping has a slow cause, one that acts a little "
        f"every step: look at {cause}. If many modules bend from about the same sample, "
        "look at the learning rate and its schedule first."
    )


def event_texts(
    event: Event,
    observer: RunSnapshot,
    kinds: dict[str, str],
    same: SameTensor,
    stopped: Sequence[dict[str, Any]] = (),
) -> tuple[str, str]:
    """Interpretation (what was measured, in words) and next experiment of an event,
    from its shape and the kind of its module."""
    c = event.lead
    shape = event.shape
    if shape == "model_wide":
        return model_wide_texts(c, observer.sample_forwards.forward(c.onset))
    if shape == "non_finite":
        facet = next(f for f in event.facets if f.category == "non_finite")
        rule = RULES["non_finite"]
        return rule.interpretation(facet.candidate), rule.next_experiment(facet.candidate)
    if shape in ("step", "spike"):
        return _step_texts(event, observer, kinds, same, stopped)
    rule = RULES[c.category]
    if shape == "bend":
        return rule.interpretation(c), _bend_experiment(c, kinds)
    return rule.interpretation(c), rule.next_experiment(c)
