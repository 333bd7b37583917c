"""``series.json``: the per-series summary one run writes and a comparison reads.

Both sides of the format are here: :func:`build_series_summary` writes it from a run's
snapshot (``report.build_series_summary`` adds the report's ``run`` and ``config``
sections), :func:`read_series_file` parses it back into :class:`SeriesFile` (rows as
:class:`SeriesRow`) for ``compare``. The file is compact JSON (UTF-8), bounded by
``ReportConfig.series_summary_max_bytes``::

    {"schema": "torchinstruments.series/1", "generated_at": ..., "run": {...},
     "config": {...}, "modules_selected": [names], "modules_selected_omitted": int,
     "sample_forwards": {"runs": [[first sample, first forward, step, samples], ...],
                         "complete": bool},
     "series": [row, ...], "omitted": int}

with one row per (module, call index, signal, tensor path, metric) of
:data:`SUMMARY_METRICS`, in forward call order (see :func:`summary_row`).

Only the standard library at import (the offline ``compare`` reads through it).
"""

from __future__ import annotations

import json
import math
import os
from array import array
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._document import bounded_text, clean, round_or_reason, utf8_length
from ._jsonio import float_or_none, is_int, one_line, read_json_object
from ._metrics import TINY
from .errors import ReportReadError
from .find import display_module
from .sampling import SampleForwards
from .series import SIGNALS, forward_positions

if TYPE_CHECKING:
    from ._snapshot import RunSnapshot

__all__ = [
    "MAX_SERIES_FILE_BYTES",
    "SERIES_NAME",
    "SERIES_SCHEMA",
    "SUMMARY_METRICS",
    "SeriesFile",
    "SeriesKey",
    "SeriesRow",
    "SeriesSummary",
    "build_series_summary",
    "parse_recorded",
    "read_series_file",
    "series_file_bytes",
    "summary_row",
]

#: File name of the summary in a run's ``output_dir``.
SERIES_NAME = "series.json"
#: Schema of ``series.json``.
SERIES_SCHEMA = "torchinstruments.series/1"
#: A ``series.json`` larger than this (bytes) is unreadable.
MAX_SERIES_FILE_BYTES = 64 * 1024 * 1024
#: Metrics carried by the per-series summary (``series.json``).
SUMMARY_METRICS = ("rms", "rms_to_root", "max_abs", "zero_fraction", "nonfinite_fraction")


#: (module, call index, signal, tensor path, metric) of one row.
SeriesKey = tuple[str, int, str, str, str]


# ---------------------------------------------------------------------- writing
def summary_row(series: Any, metric: str, tracker: Any, position: int) -> dict[str, Any]:
    """One JSON-safe row of ``series.json``, rounded as :func:`~._document.clean` would round it
    (built directly: a 2,000-module model has tens of thousands of rows)."""
    first_nonzero = tracker.first_nonzero
    low, high = tracker.min, tracker.max
    return {
        "module": bounded_text(display_module(series.module)),
        "call_index": series.call_index,
        "signal": series.signal,
        "tensor_path": bounded_text(series.tensor_path),
        "metric": metric,
        "forward_position": position,
        "count": tracker.count,
        "points": [[sample, round_or_reason(value)] for sample, value in tracker.history()],
        "ema_fast": round_or_reason(tracker.level(tracker.ema_fast)),
        "baseline": round_or_reason(tracker.level(tracker.baseline_mean)),
        "baseline_std": round_or_reason(tracker.baseline_std),
        "residual_spread": round_or_reason(tracker.spread),
        "volatility": round_or_reason(tracker.volatility),
        "log_scale": tracker.log_scale,
        "min": {"sample": low.sample, "value": round_or_reason(low.value)},
        "max": {"sample": high.sample, "value": round_or_reason(high.value)},
        "first_nonzero_sample": first_nonzero.sample if first_nonzero else None,
        "nonzero_samples": tracker.nonzero_count,
    }


def build_series_summary(
    observer: RunSnapshot, max_bytes: int, *, run: dict[str, Any], config: dict[str, Any]
) -> SeriesSummary:
    """A compact per-series summary that two runs can be compared on (``series.json``).

    For each series of :data:`SUMMARY_METRICS`: its values at the sample indices of its
    bounded history (the same indices in two runs with the same schedule), the fast EMA at
    the end, the warm-up baseline and its standard deviation, volatility, min and max, and
    how many samples had a non-zero value (non-finite counts for ``nonfinite_fraction``).
    Series are kept in forward call order until ``max_bytes`` of compact JSON; the rest
    are counted under ``omitted``. No raw tensors. ``sample_forwards`` maps every sample
    to its training forward, as runs ``[first sample, first forward, step, samples]``
    (:class:`~torchinstruments.sampling.SampleForwards`; ``complete`` False once more
    runs were needed than it keeps). ``run`` and ``config`` are the report's sections of
    the same names (``report.build_series_summary`` passes them).
    """
    positions = forward_positions(observer.series.values())

    def position(s: Any) -> int:
        return positions.get((s.module, s.call_index, s.tensor_path), s.forward_position)

    ordered = sorted(
        observer.series.values(),
        key=lambda s: (position(s), s.module, s.call_index, s.signal, s.tensor_path),
    )
    pairs = [
        (series, metric, tracker)
        for series in ordered
        for metric in SUMMARY_METRICS
        if (tracker := series.trackers.get(metric)) is not None and tracker.count
    ]
    # One encoder for every row: json.dumps with options builds a new one per call.
    encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode
    # The names of the selected modules take at most half of max_bytes: the first
    # ones in selection order, the rest counted under modules_selected_omitted.
    names: list[str] = []
    room = max_bytes // 2
    for name in observer.names:
        text = bounded_text(name)
        room -= utf8_length(encode(text)) + 1
        if room < 0:
            break
        names.append(text)
    header = clean(
        {
            "schema": SERIES_SCHEMA,
            "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "run": run,
            "config": config,
            "modules_selected": names,
            "modules_selected_omitted": len(observer.names) - len(names),
            "sample_forwards": {
                "runs": observer.sample_forwards.runs,
                "complete": observer.sample_forwards.complete,
            },
        }
    )
    header_text = encode(header)
    if utf8_length(header_text) > max_bytes - 64:
        # A tiny bound: the schedule's runs (up to 1,024) and the settings go first.
        header["sample_forwards"] = {"runs": [], "complete": False}
        header["config"] = {}
        header_text = encode(header)
    budget = max_bytes - utf8_length(header_text) - 64
    kept: list[dict[str, Any]] = []
    texts: list[str] = []
    for series, metric, tracker in pairs:
        row = summary_row(series, metric, tracker, position(series))
        text = encode(row)
        size = utf8_length(text) + 1
        if size > budget:
            break  # rows past the budget are counted, not built
        budget -= size
        kept.append(row)
        texts.append(text)
    omitted = len(pairs) - len(kept)
    summary = SeriesSummary({**header, "series": kept, "omitted": omitted})
    # The rows are encoded already (to keep within max_bytes): the file is assembled from
    # them, as json.dumps of the dict with the same separators would write it.
    summary.json_text = f'{header_text[:-1]},"series":[{",".join(texts)}],"omitted":{omitted}}}'
    return summary


class SeriesSummary(dict[str, Any]):
    """The ``series.json`` object, with its compact JSON text (``json_text``) when built
    by :func:`build_series_summary`: writers use it rather than encoding every row again
    (the rows are encoded once to keep the file within its byte bound)."""

    json_text: str | None = None


def series_file_bytes(summary: dict[str, Any]) -> bytes:
    """The exact bytes of ``series.json``: the summary's ``json_text`` when
    :func:`build_series_summary` built it, else its compact JSON (UTF-8, no NaN)."""
    text = getattr(summary, "json_text", None)
    if not isinstance(text, str):
        text = json.dumps(summary, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode()


# ---------------------------------------------------------------------- reading
def parse_recorded(raw: object) -> SampleForwards | None:
    """``sample_forwards`` of ``series.json`` if present, complete and well formed."""
    if not isinstance(raw, dict) or raw.get("complete") is not True:
        return None
    runs = raw.get("runs")
    if not isinstance(runs, list):
        return None
    parsed: list[list[int]] = []
    expected = 0
    for run in runs:
        if (
            not isinstance(run, list)
            or len(run) != 4
            or not all(is_int(v) and v >= 0 for v in run)
            or run[0] != expected
            or run[3] < 1
            or (run[3] > 1 and run[2] < 1)
            or (parsed and run[1] <= parsed[-1][1] + parsed[-1][2] * (parsed[-1][3] - 1))
        ):
            return None
        parsed.append(list(run))
        expected = run[0] + run[3]
    return SampleForwards(parsed)


@dataclass(slots=True)
class SeriesRow:
    """What is kept of one series of one run: its points and its noise indicators."""

    forward_position: int
    count: int
    log_scale: bool
    samples: array[int]
    values: array[float]
    ema_fast: float | None
    baseline_std: float | None
    volatility: float | None
    first_nonzero_sample: int | None
    residual_spread: float | None = None

    def compared(self, value: float) -> float:
        """``value`` in compared units: natural log for scale metrics."""
        return math.log(max(value, TINY)) if self.log_scale else value


@dataclass(slots=True)
class SeriesFile:
    """One run's ``series.json``, reduced."""

    directory: Path
    path: Path
    run: dict[str, Any]
    config: dict[str, Any]
    modules_selected: frozenset[str]
    omitted: int
    series: dict[SeriesKey, SeriesRow]
    recorded: SampleForwards | None = None

    def int_field(self, name: str) -> int | None:
        value = self.run.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def samples_seen(self) -> int:
        stated = self.int_field("samples_seen")
        if stated is not None:
            return stated
        return max((s.samples[-1] + 1 for s in self.series.values() if s.samples), default=0)

    @property
    def warmup_samples(self) -> int | None:
        track = self.config.get("track")
        value = track.get("warmup_samples") if isinstance(track, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def _row_error(path: Path, index: int, what: str, got: object) -> ReportReadError:
    return ReportReadError(f"{path}: series[{index}]: expected {what}, got {got!r}"[:500])


def _parse_row(path: Path, index: int, row: object) -> tuple[SeriesKey, SeriesRow]:
    if not isinstance(row, dict):
        raise _row_error(path, index, "a JSON object", type(row).__name__)
    module, call, signal = row.get("module"), row.get("call_index"), row.get("signal")
    tensor_path, metric = row.get("tensor_path"), row.get("metric")
    if not isinstance(module, str):
        raise _row_error(path, index, "'module' to be a string", module)
    if not is_int(call):
        raise _row_error(path, index, "'call_index' to be an int", call)
    if not isinstance(signal, str) or signal not in SIGNALS:
        raise _row_error(path, index, f"'signal' in {SIGNALS}", signal)
    if not isinstance(tensor_path, str) or not isinstance(metric, str):
        raise _row_error(path, index, "'tensor_path' and 'metric' to be strings", row.get("metric"))
    position, count = row.get("forward_position"), row.get("count")
    if not is_int(position) or not is_int(count):
        raise _row_error(path, index, "'forward_position' and 'count' to be ints", count)
    points = row.get("points")
    if not isinstance(points, list):
        raise _row_error(path, index, "'points' to be a list", type(points).__name__)
    samples: array[int] = array("q")
    values: array[float] = array("d")
    previous = -1
    for point in points:
        if (
            not isinstance(point, list)
            or len(point) != 2
            or not is_int(point[0])
            or point[0] <= previous
        ):
            raise _row_error(
                path, index, "points [sample, value] in increasing sample order", point
            )
        value = float_or_none(point[1])
        previous = point[0]
        if value is None:
            continue  # a value that did not exist is not compared
        samples.append(point[0])
        values.append(value)
    first_nonzero = row.get("first_nonzero_sample")
    key: SeriesKey = (module, call, signal, tensor_path, metric)
    return key, SeriesRow(
        forward_position=position,
        count=count,
        log_scale=row.get("log_scale") is True,
        samples=samples,
        values=values,
        ema_fast=float_or_none(row.get("ema_fast")),
        baseline_std=float_or_none(row.get("baseline_std")),
        volatility=float_or_none(row.get("volatility")),
        first_nonzero_sample=first_nonzero if is_int(first_nonzero) else None,
        residual_spread=float_or_none(row.get("residual_spread")),
    )


def _refuse_other_directories(root: Path, role: str) -> None:
    """Say what ``root`` is when it holds no ``series.json`` but is a directory of
    another kind: merged ranks (``global-report.json``) or ``rank-NNN/`` directories."""
    ranks = sorted(
        entry.name
        for entry in os.scandir(root)
        if entry.name.startswith("rank-") and entry.is_dir(follow_symlinks=False)
    )
    example = f"; compare one rank's directory instead, such as {root / ranks[0]}" if ranks else ""
    if (root / "global-report.json").exists():
        raise ReportReadError(
            one_line(
                f"{root}: expected the output directory of one observed run ({role}), holding "
                f"{SERIES_NAME}; got a directory of merged ranks (global-report.json, written "
                f"by `torchinstruments merge`), which compare cannot read{example}"
            )
        )
    if ranks:
        raise ReportReadError(
            one_line(
                f"{root}: expected the output directory of one observed run ({role}), holding "
                f"{SERIES_NAME}; got a directory of {len(ranks)} rank directories "
                f"(rank_policy='all'){example}"
            )
        )


def read_series_file(root: Path, role: str) -> SeriesFile:
    """Read and reduce the ``series.json`` in the run directory ``root``; ``role``
    (``"baseline"``, ``"candidate"``) names the run in messages. Holds one parsed file
    in memory until it returns.

    Raises:
        ReportReadError: ``root`` is not a directory, or its ``series.json`` is missing,
            unreadable, not JSON, not a series summary or holds a malformed row (the
            message names the path and, for a row, its index).
    """
    path = root / SERIES_NAME
    if not root.is_dir():
        raise ReportReadError(
            f"{root}: expected the output directory of an observed run ({role}), "
            f"got {'a file' if root.exists() else 'nothing'} at that path"
        )
    if not os.path.lexists(path):
        _refuse_other_directories(root, role)
    raw = read_json_object(
        path,
        what="a series summary",
        max_bytes=MAX_SERIES_FILE_BYTES,
        schema=SERIES_SCHEMA,
        required={"run": dict, "config": dict, "series": list},
        missing_hint=(
            f"the {role} run must be observed by a torchinstruments version that writes "
            f"series.json, with DirectorySink(write_series_summary=True) (the default), "
            f"and must have written its report"
        ),
    )
    selected = raw.get("modules_selected", [])
    if not isinstance(selected, list) or not all(isinstance(m, str) for m in selected):
        raise ReportReadError(f"{path}: expected 'modules_selected' to be a list of names")
    series: dict[SeriesKey, SeriesRow] = {}
    for index, row in enumerate(raw["series"]):
        key, value = _parse_row(path, index, row)
        if key in series:
            raise _row_error(path, index, "each series once", key)
        series[key] = value
    omitted = raw.get("omitted", 0)
    run = SeriesFile(
        directory=root,
        path=path,
        run=raw["run"],
        config=raw["config"],
        modules_selected=frozenset(display_module(m) for m in selected),
        omitted=omitted if is_int(omitted) else 0,
        series=series,
        recorded=parse_recorded(raw.get("sample_forwards")),
    )
    del raw  # before the other run is read: one parsed file in memory at a time
    return run
