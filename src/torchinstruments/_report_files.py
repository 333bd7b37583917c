"""The file mechanics of :class:`~torchinstruments.sinks.DirectorySink`.

:class:`ReportFiles` writes the files of one report into a fresh generation
(:mod:`torchinstruments._generations` draws the layout), carries over from the current
generation what the new one lacks, makes the stable links and switches the generation
in; where the file system has no symbolic links it replaces each file on its own
(:meth:`ReportFiles.replace_each`). It also removes what earlier runs killed in the
middle of a write left behind (:func:`remove_stale_temporaries`), and takes in what a
copy that resolved the links made of an earlier run's layout (a real directory
``.current``, regular files under the visible names), and keeps files of someone
else's found under those names (:func:`set_aside_foreign_files`). The sink renders the
texts and decides the mode; this module only moves bytes. Only the standard library.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ._error_log import warn
from ._generations import (
    CURRENT_LINK,
    LINKED_NAMES,
    generation_name,
    generation_number,
    generation_of,
    link_target,
    remove_tree,
    temporary_name,
)

__all__ = ["ReportFiles", "atomic_write_together", "remove_stale_temporaries", "write_new"]


def atomic_write_together(files: Sequence[tuple[Path, bytes]]) -> list[OSError]:
    """Write several files atomically, staging all before replacing any.

    Each file's temporary copy is written in full first; then the files are replaced
    in order, one right after the other. A file whose copy cannot be written (or
    replaced) keeps its previous content, and the others are written all the same.

    Returns:
        The errors met, one per file that was not written.
    """
    errors: list[OSError] = []
    staged: list[tuple[str, Path]] = []
    for path, data in files:
        temporary = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            with os.fdopen(handle, "wb") as stream:
                stream.write(data)
            os.chmod(temporary, 0o644)  # mkstemp creates 0600; reports are for reading
            staged.append((temporary, path))
        except OSError as error:
            errors.append(error)
            if temporary is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
    for temporary, path in staged:
        try:
            os.replace(temporary, path)
        except OSError as error:
            errors.append(error)
            with contextlib.suppress(OSError):
                os.unlink(temporary)
    return errors


#: Files whose temporary copies :func:`remove_stale_temporaries` may delete.
_OWN_FILES = ("report.json", "index.md", "series.json", "details.json")
#: Temporary links of the linked layout (``..current.<random>``, ``.plots.<random>``,
#: ``.probe.<random>``), which :func:`remove_stale_temporaries` may delete too.
_OWN_LINKS = (CURRENT_LINK, "plots", "probe")


#: The suffix under which a file of someone else's found under one of our names is kept.
SET_ASIDE_SUFFIX = ".not-torchinstruments"
_OUR_JSON = re.compile(rb'\A\s*\{\s*"schema"\s*:\s*"torchinstruments\.')
_OUR_MARKDOWN = b"# torchinstruments "
#: Names of the pictures :mod:`torchinstruments.plots` writes.
_OUR_PICTURE = re.compile(r"\A\d{2,}-E\d+-[a-z_]+-.+\.png\Z")


def _written_by_us(path: Path) -> bool:
    """Whether the regular file ``path`` starts as this library's files do (a JSON
    object whose first key is a ``torchinstruments.`` schema; ``index.md``'s title)."""
    with open(path, "rb") as stream:
        head = stream.read(256)
    if path.suffix == ".md":
        return head.startswith(_OUR_MARKDOWN)
    return _OUR_JSON.match(head) is not None


def _foreign(path: Path) -> bool:
    """Whether the entry ``path`` under one of our names is someone else's: a regular
    file this library did not write (see :func:`_written_by_us`); a directory under a
    file's name (``report.json/``); a real directory ``plots`` holding anything but
    pictures named as ours (``01-E1-step-fc1-activation.png``); a regular file named
    ``plots`` or ``.current`` (ours are links or directories)."""
    if path.is_symlink() or not os.path.lexists(path):
        return False
    if path.name == "plots":
        return not path.is_dir() or not all(
            entry.is_file(follow_symlinks=False) and _OUR_PICTURE.match(entry.name)
            for entry in os.scandir(path)
        )
    if path.name == CURRENT_LINK:
        return not path.is_dir()
    if path.is_dir():  # a directory under a file's name
        return True
    return path.is_file() and not _written_by_us(path)


def set_aside_foreign_files(directory: Path) -> list[str]:
    """Rename each entry under one of our names (``report.json``, ``index.md``,
    ``series.json``, ``details.json``, ``plots``, ``.current``) that this library did
    not write (:func:`_foreign`) to ``<name>.not-torchinstruments`` (``.1``, ``.2``, ...
    appended while that exists), so that writing the report never destroys a user's own
    files; return the new names. Entries that cannot be read or renamed are left as they
    are (the write then replaces files, and fails on a directory, counting the error).
    """
    kept: list[str] = []
    for name in (*_OWN_FILES, "plots", CURRENT_LINK):
        path = directory / name
        try:
            if not _foreign(path):
                continue
            target = directory / f"{name}{SET_ASIDE_SUFFIX}"
            number = 0
            while os.path.lexists(target):
                number += 1
                target = directory / f"{name}{SET_ASIDE_SUFFIX}.{number}"
            os.rename(path, target)
        except OSError:
            continue
        kept.append(target.name)
    if kept:
        warn(
            f"torchinstruments found files it did not write in {str(directory)!r} under "
            f"the names of its report; they were kept as {', '.join(kept)}"
        )
    return kept


def _own_temporary(name: str, bases: Sequence[str]) -> bool:
    return any(name.startswith(f".{base}.") and len(name) == len(base) + 10 for base in bases)


def remove_stale_temporaries(directory: Path, keep: Iterable[str] = ()) -> int:
    """Delete what an earlier run killed in the middle of a write left in ``directory``;
    return how many entries were removed.

    That is: the temporary copies (``.report.json.<random>`` and the like) of
    :func:`atomic_write_together`, the temporary links of the linked layout
    (``..current.<random>``, ``.plots.<random>``, ``.probe.<random>``), and generation
    directories (``.generation-NNNNNN``) other than the one ``.current`` names and those
    in ``keep``. Each killed write can leave one of each, and on a nearly full disk they
    take the space the next write needs. Only these names of this library are touched:
    temporaries only as regular files or links, generations only as real directories.
    """
    removed = 0
    kept = {generation_of(directory), *keep}
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        name = entry.name
        if generation_number(name) is not None:
            if name not in kept and entry.is_dir(follow_symlinks=False):
                remove_tree(Path(entry.path))
                removed += 1
            continue
        stale = (_own_temporary(name, _OWN_FILES) and entry.is_file(follow_symlinks=False)) or (
            _own_temporary(name, _OWN_LINKS) and entry.is_symlink()
        )
        if stale:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed += 1
    return removed


def write_new(path: Path, data: bytes) -> None:
    """Create ``path`` (which must not exist) holding ``data``; nothing is left on error."""
    try:
        with open(path, "xb") as stream:
            stream.write(data)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` as a hard link to the file ``source``, or a copy where links fail."""
    try:
        os.link(source, target)  # a regular file (checked by the callers)
    except OSError:
        shutil.copyfile(source, target, follow_symlinks=False)


#: What ``DirectorySink.write`` puts in a generation, carried over together.
_REPORT_GROUP = ("report.json", "index.md", "plots")


class ReportFiles:
    """Writes the files of the reports of one directory: each report's files into a
    generation switched in at once, or (:meth:`replace_each`) each file replaced on its
    own.

    Args:
        path: the directory; it exists before the first write (the sink's
            ``choose_write_mode`` creates it).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._cleaned = False
        self._batch = False  # between begin() and commit()
        self._staged: Path | None = None  # the generation being written
        self._parts: set[str] = set()  # the files written into it
        self._next_number = 0
        self._written: set[str] = set()  # the names this sink has switched in so far

    def begin(self) -> None:
        """Gather the next writes into one generation, switched in by :meth:`commit`;
        a generation begun and never committed is deleted here."""
        self.abandon()
        self._batch = True

    def commit(self) -> None:
        """Switch in the generation being written (``DirectorySink.commit`` says what
        is carried over); nothing if none was written.

        Raises:
            OSError: the switch failed (the current generation stays; on a full disk,
                after one retry once stale temporaries were removed).
        """
        self._batch = False
        staged, parts = self._staged, self._parts
        self._staged, self._parts = None, set()
        if staged is None:
            return
        if not parts:  # nothing of this report was written: the current one stays
            remove_tree(staged)
            return
        try:
            previous = generation_of(self.path)
            if previous is not None:
                self._carry_over(self.path / previous, staged, parts, self._written)
            unlinked = self._link_names(staged)
            self._retrying(lambda: self._switch(staged.name), staged.name)
        except Exception:
            remove_tree(staged)
            raise
        self._written = {name for name in LINKED_NAMES if os.path.lexists(staged / name)}
        self._unlink_dangling(staged)
        if previous is not None and previous != staged.name:
            remove_tree(self.path / previous)
        if unlinked:
            raise unlinked[0]

    def _unlink_dangling(self, current: Path) -> None:
        """Remove each visible link of ours (``.current/<name>``) whose name the
        generation ``current``, now switched in, does not hold: nothing is left pointing
        at nothing (``cp -rL`` of the directory then works)."""
        for name in LINKED_NAMES:
            if os.path.lexists(current / name):
                continue
            link = self.path / name
            with contextlib.suppress(OSError, ValueError):
                if os.readlink(link) == link_target(name):
                    os.unlink(link)

    def within(self, write: Callable[[], None]) -> None:
        """Run ``write``, which writes into :meth:`generation`; outside a batch, switch
        the generation in after it, or delete it when ``write`` raises."""
        alone = not self._batch
        try:
            write()
        except BaseException:
            if alone:
                self.abandon()
            raise
        if alone:
            self.commit()

    def write_part(self, name: str, data: bytes) -> None:
        """Write the file ``name`` into the generation (switched in at once outside a
        batch)."""

        def write() -> None:
            generation = self.generation()
            self._retrying(lambda: write_new(generation / name, data), generation.name)
            self._parts.add(name)

        self.within(write)

    def write_report_texts(
        self, texts: Sequence[tuple[Path, bytes]], plots: bool, failures: list[Exception]
    ) -> None:
        """Write ``texts`` (``report.json`` and ``index.md``, paths inside
        :meth:`generation`) one after the other; with ``plots``, the ``plots/`` already
        written there counts as written too. A file that cannot be written (its
        ``OSError`` appended to ``failures``) stops the others, and all three are then
        carried over from the current generation at :meth:`commit`. A text missing from
        ``texts`` (not rendered) is shown missing rather than from another report.
        """
        generation = self.generation()
        written = {"plots"} if plots else set()
        for path, data in texts:
            try:
                self._retrying(lambda p=path, d=data: write_new(p, d), generation.name)
                written.add(path.name)
            except OSError as error:
                failures.append(error)
                written = set()  # the previous report's three are carried over instead
                break
        if written:
            self._parts |= written
            if "index.md" not in written or "report.json" not in written:
                # Not rendered: shown missing rather than from another report.
                self._parts |= {"report.json", "index.md"}

    def replace_each(self, files: Sequence[tuple[Path, bytes]]) -> list[OSError]:
        """Write ``files`` without links (:func:`atomic_write_together`), after removing
        what killed writes left (once per sink, and again on a full disk, before
        one retry); return the errors, one per file not written."""
        if not self._cleaned:
            self._cleaned = True
            remove_stale_temporaries(self.path)
            set_aside_foreign_files(self.path)
        errors = atomic_write_together(files)
        full = any(error.errno == errno.ENOSPC for error in errors)
        # On a full disk, what earlier killed writes left may be what is missing.
        if full and remove_stale_temporaries(self.path):
            errors = atomic_write_together(files)
        return errors

    def abandon(self) -> None:
        """Delete the generation being written, if any, and end the batch."""
        staged, self._staged, self._parts, self._batch = self._staged, None, set(), False
        if staged is not None:
            remove_tree(staged)

    def _retrying(self, action: Callable[[], None], keep: str | None = None) -> None:
        """Run ``action``; on a full disk, remove stale temporaries and run it again."""
        try:
            action()
        except OSError as error:
            kept = () if keep is None else (keep,)
            if error.errno != errno.ENOSPC or not remove_stale_temporaries(self.path, kept):
                raise
            action()

    def _prepare(self) -> None:
        """Once per sink: remove what killed writes left, and take in the files of an
        earlier run written without links (or by an earlier version)."""
        if self._cleaned:
            return
        self._cleaned = True
        # Numbered after every generation there, stale ones included: a name is never
        # used twice in a directory.
        numbers = [generation_number(entry.name) for entry in os.scandir(self.path)]
        self._next_number = max((n for n in numbers if n is not None), default=0) + 1
        remove_stale_temporaries(self.path)
        set_aside_foreign_files(self.path)
        self._adopt_current_directory()
        self._adopt_plain_files()

    def _adopt_current_directory(self) -> None:
        """A real directory under our name ``.current`` (what ``cp -rL``,
        ``shutil.copytree`` with its defaults or a zip round trip make of the link) is
        renamed to a fresh generation name and ``.current`` becomes a link to it: it
        is then taken in like any earlier generation. Between the two renames (a new
        link ``..current.<random>`` made first, then the directory moved, then the link
        renamed onto ``.current``) a link ``.current/<name>`` points at nothing; the
        visible names of such a copy are regular files, which do not go through it."""
        current = self.path / CURRENT_LINK
        if current.is_symlink() or not current.is_dir():
            return
        adopted = self.path / generation_name(self._next_number)
        self._next_number += 1
        temporary = self.path / temporary_name(CURRENT_LINK)
        os.symlink(adopted.name, temporary, target_is_directory=True)
        try:
            os.rename(current, adopted)  # fails if `adopted` exists: nothing moved
            os.replace(temporary, current)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    def _adopt_plain_files(self) -> None:
        """Regular files (and a ``plots/`` directory) under the linked names become a
        generation of their own, then links to it: what a reader sees stays the same at
        every step, and the next switch replaces it. Anything else under those names
        (a directory named ``report.json``, a ``plots/`` directory holding more than
        pictures) is left as it is: that name is not linked, and each write raises the
        error of trying (counted in the report), after writing the others."""
        plain = [name for name in _OWN_FILES if (self.path / name).is_file()]
        plots = self.path / "plots"
        if (
            plots.is_dir()
            and not plots.is_symlink()
            and all(
                entry.is_file(follow_symlinks=False) and entry.name.endswith(".png")
                for entry in os.scandir(plots)
            )
        ):
            plain.append("plots")
        plain = [name for name in plain if not (self.path / name).is_symlink()]
        if not plain:
            return
        adopted = self._new_generation()
        try:
            previous = generation_of(self.path)
            for name in plain:
                source = self.path / name
                if name == "plots":
                    (adopted / name).mkdir()
                    for entry in os.scandir(source):
                        link_or_copy(Path(entry.path), adopted / name / entry.name)
                else:
                    link_or_copy(source, adopted / name)
            if previous is not None:
                self._carry_over(self.path / previous, adopted, set(plain), LINKED_NAMES)
            self._switch(adopted.name)
        except Exception:
            remove_tree(adopted)
            raise
        if previous is not None:
            remove_tree(self.path / previous)
        for name in plain:
            link = self.path / name
            if name == "plots":  # a directory is not replaced by a rename: moved aside
                aside = self.path / temporary_name("plots")
                os.rename(link, aside)
                os.symlink(link_target(name), link, target_is_directory=True)
                shutil.rmtree(aside, ignore_errors=True)
            else:
                self._replace_by_link(name)

    def _new_generation(self) -> Path:
        while True:
            path = self.path / generation_name(self._next_number)
            self._next_number += 1
            try:
                os.mkdir(path)
            except FileExistsError:
                continue
            return path

    def generation(self) -> Path:
        """The generation being written, made at the first file of a report."""
        if self._staged is None:
            self._prepare()
            self._staged = self._new_generation()
            self._parts = set()
        return self._staged

    def _carry_over(
        self, previous: Path, staged: Path, parts: set[str], allowed: Iterable[str]
    ) -> None:
        """Hard-link into ``staged`` the files of ``previous`` that it lacks among
        ``allowed`` (for a write: the names this sink switched in earlier, never an
        earlier run's): ``series.json`` and ``details.json`` each on its own,
        ``report.json``, ``index.md`` and ``plots/`` together, and only when ``parts``
        lacks ``report.json`` or ``index.md``."""
        allowed = set(allowed)
        wanted = [n for n in ("series.json", "details.json") if n not in parts and n in allowed]
        if not parts.issuperset(_REPORT_GROUP[:2]):
            for name in _REPORT_GROUP:  # together, or not at all
                if (staged / name).is_dir():
                    remove_tree(staged / name)
                elif os.path.lexists(staged / name):
                    os.unlink(staged / name)
            if "report.json" in allowed:
                wanted.extend(_REPORT_GROUP)
        for name in wanted:
            source = previous / name
            if name == "plots":
                if not source.is_dir() or source.is_symlink():
                    continue
                (staged / name).mkdir(exist_ok=True)
                for entry in os.scandir(source):
                    if entry.is_file(follow_symlinks=False):
                        link_or_copy(Path(entry.path), staged / name / entry.name)
            elif source.is_file() and not source.is_symlink():
                link_or_copy(source, staged / name)

    def _link_names(self, staged: Path) -> list[OSError]:
        """Make the stable link of each name the generation holds (before the switch:
        a new link points at what ``.current`` holds, nothing yet); return the errors,
        one per name that could not be linked (a directory of someone else's there)."""
        errors: list[OSError] = []
        for name in LINKED_NAMES:
            if not os.path.lexists(staged / name):
                continue
            try:
                if os.readlink(self.path / name) == link_target(name):
                    continue
            except OSError:
                pass
            try:
                self._replace_by_link(name)
            except OSError as error:
                errors.append(error)
        return errors

    def _replace_by_link(self, name: str) -> None:
        temporary = self.path / temporary_name("plots" if name == "plots" else CURRENT_LINK)
        os.symlink(link_target(name), temporary, target_is_directory=name == "plots")
        try:
            os.replace(temporary, self.path / name)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    def _switch(self, generation: str) -> None:
        """Point ``.current`` at ``generation``: one ``rename`` of a new link onto it."""
        temporary = self.path / temporary_name(CURRENT_LINK)
        os.symlink(generation, temporary, target_is_directory=True)
        try:
            os.replace(temporary, self.path / CURRENT_LINK)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
