"""The files of one report, switched in all at once through one symbolic link.

:class:`~torchinstruments.sinks.DirectorySink` writes every file of a report
(``report.json``, ``index.md``, ``series.json``, ``details.json``, ``plots/``) into a
fresh *generation* directory inside ``output_dir`` and then points the link
``.current`` at it with one ``rename`` (atomic on POSIX file systems). The names a
reader opens are stable relative links through ``.current``::

    output_dir/
      .current -> .generation-000007
      .generation-000007/   report.json  index.md  series.json  plots/
      report.json -> .current/report.json
      index.md    -> .current/index.md
      series.json -> .current/series.json
      plots       -> .current/plots

Whenever the writing process stops (a SIGKILL included), ``.current`` names either the
previous generation or the new one, complete, so the visible files always belong to one
report. The previous generation is deleted after the switch. The same layout is used
for Kubernetes' ConfigMap volumes (its ``..data`` link).

Only the standard library: the offline readers (:mod:`torchinstruments._jsonio`)
resolve these links through :func:`generation_of` without importing torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
from pathlib import Path

__all__ = [
    "CURRENT_LINK",
    "LINKED_NAMES",
    "MODE_LINKED",
    "MODE_REPLACE",
    "generation_name",
    "generation_number",
    "generation_of",
    "link_target",
    "symlinks_work",
    "temporary_name",
]

#: The link that names the current generation.
CURRENT_LINK = ".current"
#: The names a reader opens, each a link ``.current/<name>`` (``plots`` a directory).
LINKED_NAMES = ("report.json", "index.md", "series.json", "details.json", "plots")
#: ``coverage.file_write_mode`` where the files are switched in through ``.current``.
MODE_LINKED = "linked_generations"
#: ``coverage.file_write_mode`` where each file is replaced on its own (no symbolic
#: links on this file system): a kill can leave ``index.md`` one report behind.
MODE_REPLACE = "replace_each"

_GENERATION = re.compile(r"\.generation-(\d{6,})\Z")


def generation_name(number: int) -> str:
    """``.generation-000007`` for 7 (six digits at least)."""
    return f".generation-{number:06d}"


def generation_number(name: str) -> int | None:
    """The number of a generation directory's name, or None for any other name."""
    match = _GENERATION.match(name)
    return int(match.group(1)) if match else None


def link_target(name: str) -> str:
    """What the stable link ``name`` points to: ``.current/<name>`` (with the
    platform's separator)."""
    return os.path.join(CURRENT_LINK, name)


def temporary_name(base: str) -> str:
    """A fresh temporary name for ``base``: ``.<base>.`` and 8 random characters, the
    pattern ``remove_stale_temporaries`` recognises."""
    return f".{base}.{secrets.token_hex(4)}"


def generation_of(directory: Path) -> str | None:
    """The name of the generation ``directory/.current`` points to, or None when there
    is no such link or it points anywhere else than a generation beside it."""
    try:
        target = os.readlink(directory / CURRENT_LINK)
    except (OSError, ValueError):
        return None
    return target if generation_number(target) is not None else None


#: Errors that say a file system has no symbolic links (or cannot rename them): not
#: permitted, not supported, not implemented, invalid; Windows' "a required privilege is
#: not held by the client" (1314).
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_NO_LINKS_WINDOWS = {1314}


def symlinks_work(directory: Path) -> bool:
    """Whether ``directory`` takes the two operations the layout needs: creating a
    relative symbolic link to a directory and renaming one link onto another. Tried with
    temporary names; False where either fails for want of links (Windows without the
    privilege to create them, some network and FUSE file systems).

    Raises:
        OSError: any other failure (a full disk, no permission to write there): the
            question stays open, to be asked again at the next write.
    """
    first, second = directory / temporary_name("probe"), directory / temporary_name("probe")
    try:
        os.symlink(generation_name(0), first, target_is_directory=True)
        os.symlink(generation_name(0), second, target_is_directory=True)
        os.replace(first, second)
        return os.readlink(second) == generation_name(0)
    except (NotImplementedError, AttributeError):
        return False
    except OSError as error:
        if error.errno in _NO_LINKS or getattr(error, "winerror", None) in _NO_LINKS_WINDOWS:
            return False
        raise
    finally:
        for path in (first, second):
            with contextlib.suppress(OSError):
                os.unlink(path)


def remove_tree(path: Path) -> None:
    """Delete a generation directory (errors ignored: what is left is removed later)."""
    shutil.rmtree(path, ignore_errors=True)
