"""Optional pictures of the top findings' series (needs the ``plots`` extra: matplotlib).

``DirectorySink(..., plots=True)`` (or ``inject_observer(..., plots=True)``) writes
``plots/<n>-<category>-<module>.png`` for the notable findings (at most
``MAX_PLOTS``), from the bounded history each finding carries, marking the end of
warm-up and the sample where the change was detected; ``index.md`` links them. The core
install does not need matplotlib: asking for plots without it raises at injection.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .series import LOG_SCALE_METRICS

__all__ = ["MAX_PLOTS", "plot_filename", "render_plot", "require_matplotlib"]

#: Most pictures written per report.
MAX_PLOTS = 8


def require_matplotlib() -> None:
    """Raise ``ConfigError`` with the install command when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ConfigError(
            "plots=True needs matplotlib: install the extra with "
            "`pip install 'torchinstruments[plots]'` (or `uv add matplotlib`)"
        ) from error


def plot_filename(number: int, finding: dict[str, Any]) -> str:
    """``plots/01-activation_scale_drift-blocks.2.fc1-activation.png`` style names."""
    module = re.sub(r"[^A-Za-z0-9._-]+", "_", str(finding["module"])).strip("_") or "root"
    return f"plots/{number:02d}-{finding['category']}-{module}-{finding['signal']}.png"


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


def write_plots(directory: Path, report: dict[str, Any], write: Any) -> list[str]:
    """Render the notable findings' pictures; return the relative paths written.

    ``write(path, data)`` does the (atomic) file write, so the sink keeps ownership.
    """
    written: list[str] = []
    for finding in report.get("findings", []):
        if len(written) >= MAX_PLOTS:
            break
        if not finding.get("notable") or len(finding.get("history") or []) < 2:
            continue
        name = plot_filename(len(written) + 1, finding)
        write(directory / name, render_plot(finding))
        finding["plot"] = name
        written.append(name)
    return written
