"""Optional pictures of the top findings' series (needs the ``plots`` extra: matplotlib).

``DirectorySink(..., plots=True)`` (or ``inject_observer(..., plots=True)``) writes
``plots/<n>-<category>-<module>.png`` for the notable findings (at most
``MAX_PLOTS``), from the bounded history each finding carries, marking the end of
warm-up and the sample where the change was detected; ``index.md`` links them. The core
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


def plot_filename(number: int, finding: dict[str, Any]) -> str:
    """``plots/01-activation_scale_drift-blocks.2.fc1-activation.png`` style names.

    Every part is made safe and bounded (see :data:`MAX_NAME_PART`): a module name of
    any length or content gives a file name of at most about 140 ASCII characters.

    Example:
        >>> plot_filename(1, {"module": "a" * 300, "category": "oscillation",
        ...                   "signal": "activation"})[:40]
        'plots/01-oscillation-aaaaaaaaaaaaaaaaaaa'
    """
    module = _name_part(str(finding["module"]), MAX_NAME_PART) or "root"
    category = _name_part(str(finding["category"]), 32)
    signal = _name_part(str(finding["signal"]), 16)
    return f"plots/{number:02d}-{category}-{module}-{signal}.png"


def render_plot(finding: dict[str, Any]) -> bytes:
    """PNG bytes of one finding's history, with warm-up end and change sample marked."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    history = finding.get("history") or []
    samples = [point[0] for point in history]
    values = [point[1] for point in history]
    figure = Figure(figsize=(6.0, 2.6), dpi=100)
    axes = figure.add_subplot()
    axes.plot(samples, values, marker=".", linewidth=1.2)
    if finding["metric"] in LOG_SCALE_METRICS and all(v > 0 for v in values):
        axes.set_yscale("log")
    warmup = finding.get("warmup_end_sample")
    if warmup is not None:
        axes.axvspan(samples[0] if samples else 0, warmup, color="0.9", label="warm-up")
    change = finding.get("change_sample")
    if change is not None:
        axes.axvline(change, color="tab:red", linestyle="--", label=f"change @ {change}")
    call = "" if finding.get("call_index") is None else f" call {finding['call_index']}"
    axes.set_title(
        f"{finding['category']} #{finding['rank']}: {finding['module']}{call}, "
        f"{finding['signal']}.{finding['metric']}",
        fontsize=9,
    )
    axes.set_xlabel("sample")
    axes.legend(fontsize=7, loc="best")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def write_plots(
    directory: Path,
    report: dict[str, Any],
    write: Any,
    failures: list[Exception] | None = None,
) -> list[str]:
    """Render the notable findings' pictures; return the relative paths written.

    ``write(path, data)`` does the (atomic) file write, so the sink keeps ownership.
    Each picture is independent: one that cannot be rendered or written is skipped
    (its finding gets no ``plot`` link) and its error appended to ``failures``.
    """
    written: list[str] = []
    for finding in report.get("findings", []):
        if len(written) >= MAX_PLOTS:
            break
        if not finding.get("notable") or len(finding.get("history") or []) < 2:
            continue
        name = plot_filename(len(written) + 1, finding)
        try:
            write(directory / name, render_plot(finding))
        except Exception as error:
            if failures is not None:
                failures.append(error)
            continue
        finding["plot"] = name
        written.append(name)
    return written
