"""Optional pictures of the events (needs the ``plots`` extra: matplotlib).

``DirectorySink(..., plots=True)`` (or ``inject_observer(..., plots=True)``) writes
``plots/<n>-<event>-<shape>-<module>-<signal>.png``, one per event (at most
``MAX_PLOTS``), from the history each event carries: x axis the training forward, y
axis the signal and metric with its scale, the onset marked, echoes faint beside it;
``index.md`` links them. The core
install does not need matplotlib: asking for plots without it raises at injection.
"""

from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .series import LOG_SCALE_METRICS

__all__ = ["MAX_PLOTS", "plot_filename", "render_plot", "require_matplotlib"]

#: Most pictures written per report.
MAX_PLOTS = 8
#: Most echoes drawn in one picture.
MAX_ECHO_LINES = 4
#: Longest module part of a picture's file name, in characters (ASCII after
#: :func:`plot_filename`): the whole name stays far below the 255 bytes that common
#: file systems (ext4, XFS, APFS, NTFS) allow for one path component.
MAX_NAME_PART = 80


def require_matplotlib() -> None:
    """Raise ``ConfigError`` with the install command when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ConfigError(
            "plots=True needs matplotlib: install the extra with "
            "`pip install 'torchinstruments[plots]'` (or `uv add matplotlib`)"
        ) from error


def _name_part(text: str, limit: int) -> str:
    """``text`` as a safe, bounded part of a file name: characters other than ASCII
    letters, digits, ``.``, ``_`` and ``-`` become ``_``; leading and trailing ``.``
    and ``_`` go; a part cut to ``limit`` characters ends in 8 hex digits of the SHA-1
    of ``text``, so that two long names that share a prefix stay apart."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._")
    if len(safe) <= limit:
        return safe
    digest = hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{safe[: limit - 9].rstrip('._')}-{digest}"


def plot_filename(number: int, event: dict[str, Any]) -> str:
    """``plots/01-E1-step-blocks.2.fc1-activation.png`` style names.

    Every part is made safe and bounded (see :data:`MAX_NAME_PART`): a module name of
    any length or content gives a file name of at most about 140 ASCII characters.

    Example:
        >>> plot_filename(1, {"id": "E1", "module": "a" * 300, "shape": "step",
        ...                   "signal": "activation"})[:40]
        'plots/01-E1-step-aaaaaaaaaaaaaaaaaaaaaaa'
    """
    module = _name_part(str(event["module"]), MAX_NAME_PART) or "root"
    ident = _name_part(str(event.get("id", "")), 16)
    shape = _name_part(str(event.get("shape", "")), 16)
    signal = _name_part(str(event["signal"]), 16)
    return f"plots/{number:02d}-{ident}-{shape}-{module}-{signal}.png"


def _echo_lines(
    event: dict[str, Any], points: list[list[Any]], log: bool
) -> list[tuple[str, tuple[list[float], list[float]]]]:
    """Each echo's points around its onset, moved onto the event's scale: multiplied
    (log scale) or shifted (linear) so that its first point meets the event's history
    at the same sample, or at the latest sample before it. Echoes whose history is of
    another metric, or without a point to meet at, are left out."""
    lead = {p[0]: p[2] for p in points}
    lines = []
    metric = (event.get("history") or {}).get("metric") or event.get("metric")
    for echo in event.get("echoes") or []:
        history = echo.get("history") or {}
        own = [p for p in history.get("points") or [] if p[1] is not None]
        if len(own) < 2 or history.get("metric") != metric:
            continue
        first_sample, first_value = own[0][0], own[0][2]
        meet = max((s for s in lead if s <= first_sample), default=None)
        if meet is None:
            continue
        if log:
            if first_value <= 0 or any(p[2] <= 0 for p in own):
                continue
            factor = lead[meet] / first_value
            values = [p[2] * factor for p in own]
        else:
            shift = lead[meet] - first_value
            values = [p[2] + shift for p in own]
        lines.append((str(echo.get("module")), ([p[1] for p in own], values)))
    return lines


def render_plot(event: dict[str, Any]) -> bytes:
    """PNG bytes of one event's history against the training forward, its onset marked,
    and its echoes (up to ``MAX_ECHO_LINES``) faint beside it, scaled to meet the event's
    history at their first point (see :func:`_echo_lines`).

    The y axis names the signal, the metric and the scale (log for scale metrics whose
    values are all positive)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    history = event.get("history") or {}
    points = [p for p in history.get("points") or [] if p[1] is not None]
    forwards = [point[1] for point in points]
    values = [point[2] for point in points]
    metric = str(history.get("metric") or event.get("metric"))
    figure = Figure(figsize=(6.0, 4.2), dpi=100)
    axes = figure.add_subplot()
    shown = (event.get("model_wide") or {}).get("first_in_propagation_order")
    label = f"{event['module']} (values of {shown})" if shown else str(event["module"])
    axes.plot(forwards, values, marker=".", linewidth=1.2, label=label)
    log = metric in LOG_SCALE_METRICS and all(v > 0 for v in values)
    if log:
        axes.set_yscale("log")
    lines = _echo_lines(event, points, log)[:MAX_ECHO_LINES]
    for echo, (echo_forwards, echo_values) in lines:
        axes.plot(
            echo_forwards,
            echo_values,
            color="tab:gray",
            alpha=0.45,
            linewidth=0.8,
            label=f"echo {echo}",
        )
    onset = event.get("onset") or {}
    if onset.get("forward") is not None:
        axes.axvline(
            onset["forward"],
            color="tab:red",
            linestyle="--",
            label=f"onset: forward {onset['forward']} (sample {onset.get('sample')})",
        )
    call = "" if event.get("call_index") is None else f" call {event['call_index']}"
    axes.set_title(f"{event.get('id')} {event.get('shape')}: {event['module']}{call}", fontsize=9)
    echoes = " (echoes faint, scaled to meet it before the onset)" if lines else ""
    axes.set_xlabel(f"training forward{echoes}", fontsize=8)
    axes.set_ylabel(f"{event['signal']}.{metric} ({'log' if log else 'linear'} scale)", fontsize=8)
    # Below the axes, so that it covers neither the event's line nor its echoes.
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.22), frameon=False)
    figure.subplots_adjust(left=0.12, right=0.97, top=0.9, bottom=0.5)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def write_plots(
    directory: Path,
    report: dict[str, Any],
    write: Any,
    failures: list[Exception] | None = None,
) -> list[str]:
    """Render one picture per event; return the relative paths written.

    ``write(path, data)`` does the (atomic) file write, so the sink keeps ownership.
    Each picture is independent: one that cannot be rendered or written is skipped
    (its event gets no ``plot`` link) and its error appended to ``failures``.
    """
    written: list[str] = []
    for event in report.get("events", []):
        if len(written) >= MAX_PLOTS:
            break
        points = (event.get("history") or {}).get("points") or []
        if len(points) < 2:
            continue
        name = plot_filename(len(written) + 1, event)
        try:
            write(directory / name, render_plot(event))
        except Exception as error:
            if failures is not None:
                failures.append(error)
            continue
        event["plot"] = name
        written.append(name)
    return written
