"""Process-wide lifecycle of observers: the report written at ``SIGTERM``, at interpreter
exit and after ``fork``.

``on_termination`` keeps the attached observers of the process (weakly); an observer
adds itself when it attaches and leaves when it detaches. See
``docs/architecture.md`` for where this sits in the data flow.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

from ._dir_lock import release

if TYPE_CHECKING:
    from .observer import Observer

__all__ = ["AtExit", "on_termination", "sink_for_child"]


class _TerminationWriter:
    """Writes the report of every live observer when the process gets ``SIGTERM``.

    torchrun, SLURM, Kubernetes and ``timeout`` stop a job with SIGTERM, whose default
    action ends the process without running ``atexit`` handlers. The handler is
    installed (from the main thread only, where Python allows it) when the first
    observer attaches and put back when the last one detaches, if it is still ours.
    On the signal it writes each live observer's report, then chains to the handler
    that was installed before (a callable is called; ``SIG_IGN`` ignores the signal;
    the default action is restored and the signal raised again, so the process ends
    as it would have, with the same exit status). A signal that arrives while a report
    is being written is handled once that write is over.
    """

    def __init__(self) -> None:
        self._live: weakref.WeakSet[Observer] = weakref.WeakSet()
        self._previous: Any = None
        self._installed = False
        self._deferred: int | None = None

    def live(self) -> list[Observer]:
        """The attached observers of this process."""
        return list(self._live)

    def add(self, observer: Observer) -> None:
        self._live.add(observer)
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        try:
            self._previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._handle)
        except (ValueError, OSError, AttributeError):  # no SIGTERM, or not allowed here
            return
        self._installed = True

    def discard(self, observer: Observer) -> None:
        self._live.discard(observer)
        if self._live or not self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGTERM) == self._handle:
                previous = self._previous
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        except (ValueError, OSError, TypeError):
            return
        self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        live = list(self._live)
        if any(getattr(observer, "writing", False) for observer in live):
            self._deferred = signum  # handled by deliver_deferred once the write is over
            return
        previous = self._previous
        ends = not callable(previous) and previous != signal.SIG_IGN  # the default action
        for observer in live:
            if observer.attached:
                with contextlib.suppress(Exception):
                    if ends:
                        observer.final_report = True  # the process ends after this write
                        observer.ended_by = "sigterm"
                    observer.write_on_signal()
        self._chain(signum, frame)

    def deliver_deferred(self) -> None:
        """Handle a SIGTERM that arrived during a report write (called after each)."""
        signum = self._deferred
        if signum is None:
            return
        self._deferred = None
        self._handle(signum, None)

    def _chain(self, signum: int, frame: Any) -> None:
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
            return
        if previous == signal.SIG_IGN:
            return
        # The default action (or a handler not set from Python): end as it would have.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


on_termination = _TerminationWriter()
_parent_pid = os.getpid()


def _after_fork_in_child() -> None:
    """``os.register_at_fork`` hook: re-point every live observer (see
    :meth:`Observer.forked`); never raises into the child."""
    global _parent_pid
    parent, _parent_pid = _parent_pid, os.getpid()
    for observer in list(on_termination.live()):
        with contextlib.suppress(Exception):
            observer.forked(parent)


def _before_fork() -> None:
    global _parent_pid
    _parent_pid = os.getpid()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


#: Most characters of ``run.uncaught_exception`` (its first line).
MAX_EXCEPTION_CHARS = 300


class AtExit:
    """Writes the final report at interpreter exit, holding the observer weakly."""

    __slots__ = ("_observer",)

    def __init__(self, observer: Observer) -> None:
        self._observer = weakref.ref(observer)

    def __call__(self) -> None:
        observer = self._observer()
        if observer is not None and observer.attached:
            # Set where the interpreter printed an exception that nothing caught.
            error = getattr(sys, "last_value", None)
            if isinstance(error, BaseException):
                text = f"{type(error).__name__}: {error}".splitlines()[0][:MAX_EXCEPTION_CHARS]
                observer.write_final_report("uncaught_exception", text)
            else:
                observer.write_final_report("interpreter_exit")
            release(observer.dir_lock)


def sink_for_child(sink: object) -> object:
    """What a process forked from an observed one writes to instead of ``sink``: a
    directory sink of the same settings under ``fork-<pid>/`` of its directory, or
    None (the parent's loggers are the parent's)."""
    from .sinks import DirectorySink

    if not isinstance(sink, DirectorySink):
        return None
    return DirectorySink(
        sink.path / f"fork-{os.getpid()}",
        write_full_details=sink.write_full_details,
        plots=sink.plots,
        write_series_summary=sink.write_series_summary,
    )
