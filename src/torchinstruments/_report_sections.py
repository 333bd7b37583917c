"""The report's sections that read the snapshot directly: ``run``, ``config`` (bounded),
the histogram summary and ``errors``; and ``details.json`` (every tracker's state).
"""

from __future__ import annotations

import dataclasses
import platform
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import torch

from ._document import bounded_text, clean
from .find import display_module
from .track import SeriesPoint

if TYPE_CHECKING:
    from ._snapshot import RunSnapshot


DETAILS_SCHEMA = "torchinstruments.details/1"


def _point(point: SeriesPoint | None) -> dict[str, float | int]:
    assert point is not None
    return point.as_dict()


def _run_section(observer: RunSnapshot) -> dict[str, Any]:
    from ._version import __version__

    info = observer.rank_info
    return {
        "rank": info.rank,
        "world_size": info.world_size,
        "local_rank": info.local_rank,
        "rank_source": info.source,
        "samples_seen": observer.counters.samples_observed,
        "forwards_seen": observer.counters.forwards_seen,
        "started_at": datetime.fromtimestamp(observer.started_at, UTC).isoformat(
            timespec="seconds"
        ),
        "report_number": observer.report_number,
        "final": observer.final,
        "ended_by": observer.ended_by,
        **(
            {"uncaught_exception": observer.uncaught_exception}
            if observer.uncaught_exception is not None
            else {}
        ),
        "elapsed_s": round(time.time() - observer.started_at, 3),
        "telemetry_seconds": round(observer.telemetry_seconds, 6),
        "hook_parking": observer.hook_parking,
        **(
            {
                "forked_from_pid": observer.forked_from_pid,
                "forwards_before_fork": observer.forwards_at_fork,
            }
            if observer.forked_from_pid is not None
            else {}
        ),
        "versions": {
            "torchinstruments": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    }


#: Most items of one list (or keys of one mapping) kept in the ``config`` section, and
#: its deepest nesting: include lists and a custom policy's ``describe()`` are the
#: user's, of any size.
MAX_CONFIG_ITEMS = 32
MAX_CONFIG_DEPTH = 4
#: Longest string kept in the ``config`` section, in characters.
MAX_CONFIG_TEXT = 256


def _bounded_config(value: object, depth: int = 0) -> Any:
    """A bounded copy of a config value: at most ``MAX_CONFIG_ITEMS`` items per list or
    mapping (then one ``"... N more"`` entry), ``MAX_CONFIG_DEPTH`` levels and
    ``MAX_CONFIG_TEXT`` characters per string."""
    if isinstance(value, str):
        return bounded_text(value, MAX_CONFIG_TEXT)
    if value is None or isinstance(value, bool | int | float):
        return value
    if depth >= MAX_CONFIG_DEPTH:
        return bounded_text(f"<{type(value).__name__} nested deeper than {depth}>", 64)
    if isinstance(value, dict):
        items = list(value.items())
        kept: dict[str, Any] = {
            bounded_text(str(k), MAX_CONFIG_TEXT): _bounded_config(v, depth + 1)
            for k, v in items[:MAX_CONFIG_ITEMS]
        }
        if len(items) > MAX_CONFIG_ITEMS:
            kept["..."] = f"{len(items) - MAX_CONFIG_ITEMS} more"
        return kept
    if isinstance(value, list | tuple):
        listed = [_bounded_config(v, depth + 1) for v in value[:MAX_CONFIG_ITEMS]]
        if len(value) > MAX_CONFIG_ITEMS:
            listed.append(f"... {len(value) - MAX_CONFIG_ITEMS} more")
        return listed
    return bounded_text(str(value), MAX_CONFIG_TEXT)


def _config_section(observer: RunSnapshot) -> dict[str, Any]:
    """The settings of the run, bounded (see :func:`_bounded_config`)."""
    return _bounded_config(
        {
            "sampling": observer.sampling,
            "report": dataclasses.asdict(observer.report_config),
            "track": dataclasses.asdict(observer.track_config),
            "capture_direct_forwards": observer.capture_direct_forwards,
            **observer.options,
        }
    )


#: Histograms summarised in ``report.json`` (those with the most mass out of range).
MAX_HISTOGRAMS_IN_REPORT = 16


def _histogram_summary(observer: RunSnapshot) -> list[dict[str, Any]]:
    """A bounded summary: the histograms with the largest out-of-range fraction."""
    entries = []
    for (index, call, signal, path, number), histogram in observer.histograms.items():
        summary = histogram.summary()
        out = (
            float(summary["underflow_fraction"])  # type: ignore[arg-type]
            + float(summary["overflow_fraction"])  # type: ignore[arg-type]
            + float(summary["nonfinite_fraction"])  # type: ignore[arg-type]
        )
        entries.append(
            (
                -out,
                observer.names[index],
                call,
                signal,
                path,
                number,
                {
                    "module": display_module(observer.names[index]),
                    "call_index": call,
                    "signal": signal,
                    "tensor_path": path,
                    "spec": number,
                    "bins": histogram.spec.bins,
                    "value_range": list(histogram.spec.value_range),
                    **summary,
                },
            )
        )
    entries.sort(key=lambda e: e[:6])
    return [entry[-1] for entry in entries[:MAX_HISTOGRAMS_IN_REPORT]]


def _errors_section(observer: RunSnapshot) -> list[dict[str, Any]]:
    entries = sorted(observer.errors, key=lambda e: (-e.count, e.stage, e.module))
    return [
        {
            "stage": e.stage,
            "module": display_module(e.module) if e.stage in ("forward", "backward") else e.module,
            "error_type": e.error_type,
            "message": e.message,
            "count": e.count,
            "first_sample": e.first_sample,
        }
        for e in entries[: observer.report_config.max_error_entries]
    ]


def _tracker_state(tracker: Any) -> dict[str, Any]:
    return {
        "count": tracker.count,
        "first": _point(tracker.first),
        "latest": _point(tracker.latest),
        "min": _point(tracker.min),
        "max": _point(tracker.max),
        "warmup_complete": tracker.warmup_complete,
        "log_scale": tracker.log_scale,
        "ema_fast": tracker.level(tracker.ema_fast),
        "ema_slow": tracker.level(tracker.ema_slow),
        "baseline": tracker.level(tracker.baseline_mean),
        "baseline_std_tracked_units": tracker.baseline_std,
        "shift_tracked_units": tracker.shift,
        "shift_in_baseline_std": tracker.shift_z,
        "momentum": tracker.momentum,
        "max_drawdown": tracker.max_drawdown,
        "volatility": tracker.volatility,
        "warmup_volatility": tracker.baseline_volatility,
        "flips": tracker.flips,
        "differences": tracker.diffs,
        "flip_rate": tracker.flip_rate,
        "cusum_positive": tracker.cusum_positive,
        "cusum_negative": tracker.cusum_negative,
        "cusum_peak": tracker.cusum_peak,
        "trend_level": tracker.level(tracker.trend_level),
        "trend_slope_per_forward": tracker.trend_slope,
        "residual_spread": tracker.spread,
        "level_changes": tracker.change_count,
        "change_points": [
            {
                "start_sample": c.start_sample,
                "alarm_sample": c.alarm_sample,
                "start_forward": c.start_forward,
                "trend_forecast": tracker.level(c.level_before),
                "level_after": tracker.level(c.level_after),
                "step_in_residual_spreads": c.step_z,
                "confirmed": c.confirmed,
                "transient": c.transient,
            }
            for c in tracker.changes
        ],
        "first_nonzero": _point(tracker.first_nonzero) if tracker.first_nonzero else None,
        "history": [[sample, value] for sample, value in tracker.history()],
    }


def build_details(observer: RunSnapshot) -> dict[str, Any]:
    """Every live series with its full tracker state, for local debugging.

    Unbounded: its size grows with the number of series (about 2 kB per series and
    metric). Not meant for an LLM; ``report.json`` is the bounded summary.
    """
    series = sorted(
        observer.series.values(),
        key=lambda s: (s.module, s.call_index, s.signal, s.tensor_path),
    )
    return clean(
        {
            "schema": DETAILS_SCHEMA,
            "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "run": _run_section(observer),
            "histograms": [
                {
                    "module": display_module(observer.names[index]),
                    "call_index": call,
                    "signal": signal,
                    "tensor_path": path,
                    "edges": histogram.spec.edges,
                    "counts": histogram.counts[: histogram.spec.bins],
                    **histogram.summary(),
                }
                for (index, call, signal, path, _), histogram in sorted(
                    observer.histograms.items(), key=lambda item: item[0]
                )
            ],
            "series": [
                {
                    "module": display_module(s.module),
                    "call_index": s.call_index,
                    "signal": s.signal,
                    "tensor_path": s.tensor_path,
                    "forward_position": s.forward_position,
                    "observations": s.observations,
                    "metrics": {
                        metric: _tracker_state(tracker)
                        for metric, tracker in sorted(s.trackers.items())
                    },
                }
                for s in series
            ],
        }
    )
