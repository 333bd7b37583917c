"""One writing process per ``output_dir``: a lock file naming the holder.

Two runs started with the same ``output_dir`` (both on the default ``"stats"``, a
baseline and a candidate launched together) would switch their reports in over each
other, and the directory would end up with one of them, silently. Within one process
the observer registry refuses the second; across processes :func:`claim` does, through
``<output_dir>/.writer.lock``: created exclusively (``O_CREAT | O_EXCL``), holding the
holder's pid and host name as JSON. A lock whose holder is gone (a run killed with
SIGKILL leaves its lock behind) is taken over: on this host when its pid no longer
runs, and with a warning where whether the holder still runs cannot be told from here
(another host on a shared file system; Windows, where asking ``os.kill`` would end the
process). Only the standard library.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path

from ._error_log import warn
from .errors import ObserverStateError

__all__ = ["LOCK_NAME", "claim", "release"]

#: The lock file's name inside ``output_dir``.
LOCK_NAME = ".writer.lock"


def _holder_of(path: Path) -> dict[str, object] | None:
    """The lock's content, or None when it cannot be read as ours (then stale)."""
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int):
        return None
    return holder


def _runs(pid: int) -> bool | None:
    """Whether process ``pid`` exists on this host (one of another user counts); None
    where that cannot be asked safely (Windows, where ``os.kill`` ends the process)."""
    if os.name == "nt":
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by someone else
        return True
    return True


def _me() -> dict[str, object]:
    return {"pid": os.getpid(), "host": socket.gethostname()}


def claim(directory: Path) -> Path | None:
    """Create ``directory`` (with its parents) and take its lock for this process.

    Returns:
        The lock file's path, or None where the file system refused to create the
        directory or the lock (the first report write meets the same error and counts
        it; such a directory is not guarded).

    Raises:
        ObserverStateError: a process that still runs on this host holds the lock.
    """
    path = directory / LOCK_NAME
    me = _me()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    for _ in range(3):  # a stale lock removed, then a race with another claimant
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder_of(path)
            if holder is not None and holder != me:  # this process's own: taken back
                pid = int(str(holder["pid"]))
                running = _runs(pid) if holder.get("host") == me["host"] else None
                if running:
                    raise ObserverStateError(
                        f"inject_observer: output_dir {str(directory)!r} is used by "
                        f"another running process (pid {pid}); give each run its own "
                        f"output_dir (if that process is not a run of ours, delete "
                        f"{str(path)!r})"
                    ) from None
                if running is None:  # another host, or no safe way to ask
                    warn(
                        f"torchinstruments took over {str(path)!r}, held by pid {pid} on "
                        f"host {holder.get('host')!r}: if that run is still going, the "
                        "two runs overwrite each other's reports; give each its own "
                        "output_dir"
                    )
            with contextlib.suppress(OSError):
                os.unlink(path)
            continue
        except OSError:
            return None
        with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
            json.dump(me, stream)
        return path
    return None


def release(path: Path | None) -> None:
    """Remove the lock at ``path`` if this process holds it; never raises."""
    if path is None:
        return
    with contextlib.suppress(OSError):
        if _holder_of(path) == _me():
            os.unlink(path)
