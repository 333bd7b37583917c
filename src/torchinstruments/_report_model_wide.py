"""The report's ``<model>`` findings: the loss scale, and a step of the loss gradient
that rescaled every output gradient at once (with its event).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ._event_views import onset_of
from .find import format_value
from .find.base import MODEL
from .series import ACTIVATION, GRAD_OUTPUT
from .track import bounded_exp

if TYPE_CHECKING:
    from ._snapshot import RunSnapshot
    from ._trend import ChangePoint
    from .track import SeriesTracker
from ._report_sections import _point

#: Least factor of a step in the loss gradient reported as a model-wide event.
MODEL_WIDE_FACTOR = 4.0


def _model_wide_findings(observer: RunSnapshot) -> list[dict[str, Any]]:
    """``<model>`` findings: what rescaled every output gradient at once.

    Two sources: the ``torch.amp.GradScaler`` loss scale, known exactly and divided out
    of every output-gradient value (not notable: scaling is expected); and an abrupt step
    of at least ``MODEL_WIDE_FACTOR`` (4x) and 6 residual spreads in the loss gradient
    (the root output's gradient RMS), such as a changed loss reduction or accumulation
    factor (notable), confirmed by the sample after it: what such a cause does lasts,
    while one batch that the model already fits can shrink the loss gradient 10x once.
    Module findings are measured net of both.
    """
    findings: list[dict[str, Any]] = []
    scale = observer.loss_scale
    if scale.count and scale.first and scale.latest and scale.min and scale.max:
        findings.append(
            {
                **_model_wide_header(),
                "notable": False,
                "metric": "loss_scale",
                "observations": scale.count,
                "first": _point(scale.first),
                "latest": _point(scale.latest),
                "min": _point(scale.min),
                "max": _point(scale.max),
                "warmup_complete": scale.warmup_complete,
                "warmup_end_sample": scale.warmup_end_sample,
                "ranking": {
                    "basis": "abs_log_loss_scale_range",
                    "value": math.log(scale.max.value / scale.min.value),
                },
                "evidence": {"level_changes": scale.change_count},
                "interpretation": (
                    f"torch.amp.GradScaler scaled the loss by {format_value(scale.first.value)} at "
                    f"sample {scale.first.sample} and by {format_value(scale.latest.value)} at "
                    f"sample {scale.latest.sample} (between {format_value(scale.min.value)} and "
                    f"{format_value(scale.max.value)}). Every output-gradient value in this "
                    f"report is divided by the scale of its own sample."
                ),
                "next_experiment": (
                    "None needed for the scaling itself; if the scale keeps falling, look for "
                    "the non_finite findings that make the scaler back off."
                ),
            }
        )
    tracker, change = _root_rms_change(observer, GRAD_OUTPUT)
    if (
        tracker is not None
        and change is not None
        and change.confirmed
        and abs(change.step) >= math.log(MODEL_WIDE_FACTOR)
        and abs(change.step_z) >= 6.0
        and tracker.first
        and tracker.latest
        and tracker.min
        and tracker.max
    ):
        factor = bounded_exp(change.step)
        output_step = _output_moved_first(observer, change.start_sample, change.step)
        moved = (
            f"The loss gradient (the root output's gradient RMS) and with it every "
            f"output gradient changed by {format_value(factor)}x from sample "
            f"{change.start_sample}"
        )
        interpretation = (
            f"{moved}. A changed loss reduction or weighting, a changed accumulation "
            f"factor or unscaled loss scaling do this. Module findings are measured net "
            f"of it."
        )
        next_experiment = (
            f"Check the loss computation around sample {change.start_sample}: its "
            f"reduction, weighting and any division by the accumulation count."
        )
        if output_step is not None:
            interpretation = (
                f"{moved}, after the model output itself (the root's activation RMS) "
                f"changed by {format_value(bounded_exp(output_step[1]))}x from sample "
                f"{output_step[0]}: the loss follows the output, so this is an echo of "
                f"the change that moved the output. Module findings are measured net of it."
            )
            next_experiment = (
                "Follow the activation events up to the module where the output's change "
                "began; the loss computation is not implicated by this step."
            )
        findings.append(
            {
                **_model_wide_header(),
                # Not notable when the output moved first: the module events lead.
                "notable": output_step is None,
                "metric": "rms",
                "observations": tracker.count,
                "first": _point(tracker.first),
                "latest": _point(tracker.latest),
                "min": _point(tracker.min),
                "max": _point(tracker.max),
                "warmup_complete": tracker.warmup_complete,
                "warmup_end_sample": tracker.warmup_end_sample,
                "change_sample": change.start_sample,
                "change_forward": observer.sample_forwards.forward(change.start_sample),
                "onset": onset_of(change.start_sample, observer),
                "change_in_residual_spreads": abs(change.step_z),
                "ranking": {"basis": "abs_log_step_factor", "value": abs(change.step)},
                "evidence": {
                    "factor": factor,
                    "step_start_sample": change.start_sample,
                    "step_alarm_sample": change.alarm_sample,
                    "step_in_residual_spreads": change.step_z,
                },
                "interpretation": interpretation,
                "next_experiment": next_experiment,
                "follows_output_change": (
                    None
                    if output_step is None
                    else {
                        "sample": output_step[0],
                        "ratio": bounded_exp(output_step[1]),
                    }
                ),
            }
        )
    return findings


def _output_moved_first(
    observer: RunSnapshot, sample: int, gradient_step: float
) -> tuple[int, float] | None:
    """``(start sample, log step)`` of a confirmed step of the root output's activation
    RMS in the direction of the loss gradient's step ``gradient_step`` (log factor), of
    at least 6 residual spreads and a factor of 2, dated at or before ``sample``; None
    when there is none. The loss is a function of the output, so such a step moves the
    loss gradient with it, while a change of the loss computation moves the gradient
    first and the output only from the next optimizer step on."""
    _, change = _root_rms_change(observer, ACTIVATION)
    if (
        change is None
        or not change.confirmed
        or change.start_sample > sample
        or change.step * gradient_step <= 0
        or abs(change.step) < math.log(2.0)
        or abs(change.step_z) < 6.0
    ):
        return None
    return change.start_sample, change.step


def _root_rms_change(
    observer: RunSnapshot, signal: str
) -> tuple[SeriesTracker | None, ChangePoint | None]:
    """The RMS tracker of the root output's ``signal`` (its first call and tensor path)
    and that tracker's strongest change; None for what is missing."""
    roots = sorted(
        (s for s in observer.series.values() if s.module == "" and s.signal == signal),
        key=lambda s: (s.call_index, s.tensor_path),
    )
    tracker = roots[0].trackers.get("rms") if roots else None
    return tracker, tracker.strongest_change if tracker is not None else None


def _model_wide_header() -> dict[str, Any]:
    return {
        "category": "gradient_scale_change",
        "rank": 0,
        "module": MODEL,
        "call_index": None,
        "signal": "grad_output",
        "tensor_path": None,
        "not_applicable": "call_index and tensor_path: a model-wide event has neither",
        "warmup_end_sample": None,
        "young_reference": False,
        "change_in_residual_spreads": None,
        "change_sample": None,
        "change_forward": None,
        "history": [],
    }


_SPECIAL_ROW_KEYS = (
    "category",
    "rank",
    "notable",
    "module",
    "call_index",
    "signal",
    "tensor_path",
    "metric",
    "ranking",
    "first",
    "latest",
)


def _special_parts(item: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A ``<model>`` finding of :func:`_model_wide_findings` as a row of ``findings`` and,
    when notable, the body of its event (without its id)."""
    row = {key: item[key] for key in _SPECIAL_ROW_KEYS}
    if not item["notable"] and item.get("follows_output_change") is not None:
        # A loss-gradient step after the output's own: when, and what it followed.
        keys = ("change_sample", "change_forward", "follows_output_change")
        return {**row, **{k: item[k] for k in keys}}, None
    if not item["notable"]:
        # The loss scale: its range is the point (first, min, max with their samples).
        return {**row, **{k: item[k] for k in ("min", "max")}}, None
    row.update(
        {
            "change_sample": item["change_sample"],
            "change_forward": item["change_forward"],
            "change_in_residual_spreads": item["change_in_residual_spreads"],
            "young_reference": False,
        }
    )
    evidence = item["evidence"]
    body = {
        "shape": "model_wide",
        "module": MODEL,
        "call_index": None,
        "signal": item["signal"],
        "tensor_path": None,
        "module_kind": None,
        "also_named": [],
        "metric": item["metric"],
        "direction": "up" if evidence["factor"] > 1 else "down",
        "onset": item["onset"],
        "warmup_complete": item["warmup_complete"],
        "young_reference": False,
        "findings": [{"category": item["category"], "rank": item["rank"], "metric": "rms"}],
        "model_wide": {"measured_on": "loss gradient (the root output's gradient RMS)"},
        "change": {
            "metric": "rms",
            "start_sample": evidence["step_start_sample"],
            "alarm_sample": evidence["step_alarm_sample"],
            "ratio": evidence["factor"],
            "in_residual_spreads": evidence["step_in_residual_spreads"],
            "confirmed": True,
            "returned_to_trend": False,
        },
        "values": {k: item[k] for k in ("metric", "first", "latest", "min", "max")},
        "history": {"metric": "rms", "columns": ["sample", "forward", "value"], "points": []},
        "interpretation": item["interpretation"],
        "next_experiment": item["next_experiment"],
    }
    return row, body
