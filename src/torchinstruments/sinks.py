"""⑥ sinks: where reports go.

A sink has three methods, in the order of TensorBoard's ``SummaryWriter``: ``write``
takes a finished report dict, ``flush`` pushes anything buffered, ``close`` releases
resources and may be called twice. Sinks work as context managers.

:class:`DirectorySink` owns every file write of the library: ``report.json`` (the exact
bytes whose size the report builder bounded) and ``index.md``, each replaced atomically,
so a run killed at any moment leaves the last complete report.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self, runtime_checkable

from .report import dumps_report, render_markdown

__all__ = ["DirectorySink", "MemorySink", "Sink"]


@runtime_checkable
class Sink(Protocol):
    """Receives finished reports. ``close`` must tolerate a second call."""

    def write(self, report: dict[str, Any]) -> None:
        """Take one report (a JSON-safe dict, see DESIGN.md's report contract)."""
        ...

    def flush(self) -> None:
        """Push anything buffered."""
        ...

    def close(self) -> None:
        """Release resources; a second call does nothing."""
        ...


class _SinkBase:
    def flush(self) -> None:
        """Nothing is buffered."""

    def close(self) -> None:
        """Nothing to release."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and ``os.replace``.

    Raises:
        OSError: the directory cannot be created or written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


class DirectorySink(_SinkBase):
    """Writes ``report.json`` and ``index.md`` into a directory, atomically.

    Args:
        output_dir: directory to write into; created on first write.

    Raises:
        OSError: from :meth:`write`, when the directory cannot be written. The observer
            catches it, warns once, counts it in the report and retries at the next write.

    Example:
        >>> import tempfile, json, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> DirectorySink(folder).path
        PosixPath('...')  # doctest: +SKIP
    """

    def __init__(self, output_dir: str | os.PathLike[str]) -> None:
        self.path = Path(output_dir)

    @property
    def report_path(self) -> Path:
        """Where ``report.json`` is written."""
        return self.path / "report.json"

    @property
    def index_path(self) -> Path:
        """Where ``index.md`` is written."""
        return self.path / "index.md"

    def write(self, report: dict[str, Any]) -> None:
        atomic_write(self.report_path, dumps_report(report))
        atomic_write(self.index_path, render_markdown(report).encode())

    def __repr__(self) -> str:
        return f"DirectorySink({str(self.path)!r})"


class MemorySink(_SinkBase):
    """Keeps every report it receives in ``reports`` (a test double).

    Example:
        >>> sink = MemorySink()
        >>> sink.write({"schema": "x"})
        >>> len(sink.reports)
        1
    """

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []
        self.closed = False

    def write(self, report: dict[str, Any]) -> None:
        self.reports.append(report)

    def close(self) -> None:
        self.closed = True

    @property
    def latest(self) -> dict[str, Any] | None:
        """The last report received, or None."""
        return self.reports[-1] if self.reports else None
