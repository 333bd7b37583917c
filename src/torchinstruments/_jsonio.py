"""Our JSON artefacts on disk: exact bytes, atomic writes, and bounded, hostile-safe reads.

Only the standard library: the offline tools (``merge``, ``compare``, ``show``) read and
write through this module without importing torch.

Reading (:func:`read_json_object`) treats every file as untrusted input:

- the file is opened without following a symbolic link (``O_NOFOLLOW``) and without
  blocking (a FIFO cannot hang the reader), and must be a regular file; the one links
  followed are those of a directory writer's own layout (``report.json`` ->
  ``.current/report.json``, ``.current`` -> ``.generation-NNNNNN`` beside it), which
  cannot lead out of the directory;
- at most ``max_bytes`` are read, whatever the size the file system states;
- the nesting depth is checked on the bytes before parsing (at most
  :data:`MAX_JSON_DEPTH` levels of arrays and objects);
- ``NaN``, ``Infinity``, numbers that overflow a float and integers beyond 64 bits are
  refused (our writers never produce them).

Every failure is a :class:`~torchinstruments.errors.ReportReadError` with a one-line
message naming the path, what was expected and what was found.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn, TypeGuard

from .errors import ReportReadError

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_JSON_INT",
    "MAX_REPORT_FILE_BYTES",
    "SCHEMA",
    "atomic_write",
    "dumps_report",
    "float_or_none",
    "int_or_none",
    "is_int",
    "json_depth",
    "one_line",
    "read_json_object",
]

#: Schema of ``report.json``.
SCHEMA = "torchinstruments.report/2"
#: Deepest nesting of arrays and objects accepted when reading (our reports nest about
#: ten levels; Python's parser recurses once per level).
MAX_JSON_DEPTH = 64
#: Largest integer magnitude accepted when reading: ``2**63 - 1`` (a signed 64-bit int).
MAX_JSON_INT = 2**63 - 1
#: A ``report.json`` or ``global-report.json`` larger than this (bytes) is unreadable: no
#: writer of ours produces one (their bound is at most ``ReportConfig.max_bytes``).
MAX_REPORT_FILE_BYTES = 16 * 1024 * 1024
#: Longest message of a read error, in characters.
_MAX_MESSAGE_CHARS = 500

#: Every byte but the quote and the four brackets, deleted by ``bytes.translate``.
_NOT_STRUCTURE = bytes(set(range(256)) - set(b'"[]{}'))
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def dumps_report(report: dict[str, Any]) -> bytes:
    """The exact bytes written to ``report.json``: indented (2), UTF-8, no NaN."""
    return (json.dumps(report, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode()


def is_int(value: object) -> TypeGuard[int]:
    """Whether a parsed JSON field is an integer (``true`` and ``false`` are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def int_or_none(value: object) -> int | None:
    """A parsed JSON field as an int, or None when it is not an integer."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def float_or_none(value: object) -> float | None:
    """A parsed JSON field as a finite float (an integer converted), or None when it is
    not a number, a boolean, or does not fit a finite float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and ``os.replace``.

    A symbolic link at ``path`` is replaced by the file, never followed.

    Raises:
        OSError: the directory cannot be created or written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
        os.chmod(temporary, 0o644)  # mkstemp creates 0600; reports are for reading
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def one_line(text: str, limit: int = _MAX_MESSAGE_CHARS) -> str:
    """``text`` on one line: control characters (newlines, terminal escapes) written as
    ``\\xNN`` escapes, cut to ``limit`` characters with ``...``.

    Example:
        >>> one_line("a\\nb\\x1b[2J")
        'a\\\\x0ab\\\\x1b[2J'
    """
    escaped = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return escaped if len(escaped) <= limit else escaped[: limit - 3] + "..."


def json_depth(data: bytes) -> int:
    """Deepest nesting of arrays and objects in JSON text, without parsing it.

    Brackets inside strings do not count. Escapes are removed first (``\\\\`` pairs,
    then ``\\"``, left to right as a parser pairs them), then everything but quotes and
    brackets; one pass over what is left (a few percent of a report) counts the depth.
    Extra memory: at most two copies of ``data``. For text that is not valid JSON the
    result is at least the depth a parser reaches before failing, so it bounds the
    parser's recursion.

    Example:
        >>> json_depth(b'{"a": [1, {"b": "]]"}]}')
        3
    """
    structure = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    depth = deepest = 0
    inside = False
    for byte in structure:
        if byte == 34:  # '"'
            inside = not inside
        elif inside:
            continue
        elif byte == 91 or byte == 123:  # '[' or '{'
            depth += 1
            if depth > deepest:
                deepest = depth
        else:
            depth -= 1
    return deepest


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"the non-standard literal {name} (NaN and infinities are not JSON)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"a number that overflows a float ({text[:40]})")
    return value


def _bounded_int(text: str) -> int:
    if len(text) > 20 or abs(value := int(text)) > MAX_JSON_INT:
        raise ValueError(f"an integer beyond 64 bits ({text[:40]})")
    return value


def _open_linked(path: Path, flags: int) -> int | None:
    """A descriptor of the file that ``path`` names through the layout of
    :mod:`~torchinstruments._generations` (``path`` a link ``.current/<name>``,
    ``.current`` a link to a ``.generation-NNNNNN`` directory beside it), opened without
    following any other link; None when ``path`` is not such a link.

    A writer may switch generations and delete the old one between the two steps:
    the links are read again then (three tries).
    """
    from ._generations import generation_of, link_target

    for _ in range(3):
        try:
            if os.readlink(path) != link_target(path.name):
                return None
        except (OSError, ValueError):
            return None
        generation = generation_of(path.parent)
        if generation is None:
            return None
        folder = path.parent / generation
        try:
            if os.open in os.supports_dir_fd and hasattr(os, "O_DIRECTORY"):
                directory = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                try:
                    return os.open(path.name, flags, dir_fd=directory)
                finally:
                    os.close(directory)
            if folder.is_symlink() or (folder / path.name).is_symlink():
                return None
            return os.open(folder / path.name, flags)
        except FileNotFoundError:
            continue  # switched meanwhile (or missing: reported as missing below)
    raise FileNotFoundError(errno.ENOENT, "not found", str(path))


def _dangling_message(path: Path, what: str) -> str:
    """The message for ``path``, a symbolic link to nothing: when it is one of the
    writer's own links (``.current/<name>``), what went wrong in copying it."""
    from ._generations import CURRENT_LINK, link_target

    try:
        target = os.readlink(path)
    except (OSError, ValueError):
        target = "?"
    message = f"{path}: expected {what} as a regular file, got a dangling symbolic link to {target}"
    if target == link_target(path.name):
        message += (
            f" ({CURRENT_LINK}, which it points into, is not beside it, as after copying"
            " the visible names alone: copy the whole directory, or use `cp -rL`)"
        )
    return message


def _read_bounded(path: Path, what: str, max_bytes: int, missing_hint: str | None) -> bytes:
    """At most ``max_bytes`` of the regular file ``path``, not through a symbolic link
    (other than the links of a directory writer's own layout, see :func:`_open_linked`)."""
    no_follow = getattr(os, "O_NOFOLLOW", 0)
    flags = os.O_RDONLY | no_follow | getattr(os, "O_NONBLOCK", 0)
    try:
        linked = _open_linked(path, flags) if path.is_symlink() else None
        if linked is not None:
            descriptor = linked
        elif not no_follow and path.is_symlink():  # no O_NOFOLLOW (Windows): check first
            raise OSError(errno.ELOOP, "a symbolic link")
        else:
            descriptor = os.open(path, flags)
    except FileNotFoundError as error:
        hint = f"; {missing_hint}" if missing_hint else ""
        raise ReportReadError(f"{path}: not found{hint}") from error
    except OSError as error:
        if path.is_symlink() and not path.exists():
            raise ReportReadError(_dangling_message(path, what)) from error
        if error.errno == errno.ELOOP or path.is_symlink():
            raise ReportReadError(
                f"{path}: expected {what} as a regular file, got a symbolic link (not followed)"
            ) from error
        raise ReportReadError(f"{path}: cannot be read ({error.strerror or error})") from error
    # Checked before fdopen, which refuses a directory with an error that names only
    # the descriptor.
    status = os.fstat(descriptor)
    if not stat.S_ISREG(status.st_mode):
        os.close(descriptor)
        kind = "a directory" if stat.S_ISDIR(status.st_mode) else "not a regular file"
        raise ReportReadError(f"{path}: expected {what} as a regular file, got {kind}")
    with os.fdopen(descriptor, "rb") as stream:
        # The stated size first (one read, one buffer), then more only if the file grew.
        chunks, total, want = [], 0, min(status.st_size, max_bytes) + 1
        while total <= max_bytes:
            chunk = stream.read(min(want, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total, want = total + len(chunk), 1 << 20
        data = b"".join(chunks)
    if len(data) > max_bytes:
        raise ReportReadError(
            f"{path}: expected {what} of at most {max_bytes} bytes, got more than {max_bytes}"
        )
    return data


def read_json_object(
    path: Path,
    *,
    what: str,
    max_bytes: int,
    schema: str,
    required: Mapping[str, type],
    missing_hint: str | None = None,
    max_depth: int = MAX_JSON_DEPTH,
) -> dict[str, Any]:
    """Parse one JSON object file, checking its size, depth, schema family and keys.

    Args:
        path: the file; a symbolic link there is refused, not followed, unless it is
            one of a directory writer's own links (see :func:`_open_linked`).
        what: what the file should be, for messages ("a rank report").
        max_bytes: largest file accepted, in bytes; no more than ``max_bytes + 1`` bytes
            are read.
        schema: expected ``schema`` value; only the part before ``/`` (the family) must
            match, so later versions of one schema still read.
        required: top-level keys and the JSON type (``dict`` or ``list``) each must have.
        missing_hint: appended to the message when the file does not exist.
        max_depth: deepest nesting of arrays and objects accepted. Default
            :data:`MAX_JSON_DEPTH` (64).

    Raises:
        ReportReadError: the file is missing, a symbolic link, not a regular file, too
            large, too deeply nested, unreadable, not UTF-8 JSON, holds NaN, an infinity
            or an integer beyond 64 bits, is not an object, of another schema, or lacks
            a required key; the one-line message names the path, what was expected and
            what was found.
    """
    data = _read_bounded(path, what, max_bytes, missing_hint)
    depth = json_depth(data)
    if depth > max_depth:
        raise ReportReadError(
            f"{path}: expected JSON nested at most {max_depth} levels deep, got {depth}"
        )
    try:
        raw = json.loads(
            data.decode("utf-8"),
            parse_constant=_refuse_constant,
            parse_float=_finite_float,
            parse_int=_bounded_int,
        )
    except UnicodeDecodeError as error:
        raise ReportReadError(f"{path}: expected UTF-8 JSON, got {error.reason}") from error
    except (ValueError, RecursionError) as error:  # JSONDecodeError is a ValueError
        raise ReportReadError(
            one_line(f"{path}: expected JSON, got a parse error ({error})")
        ) from error
    if not isinstance(raw, dict):
        raise ReportReadError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    found = raw.get("schema")
    if not isinstance(found, str) or found.split("/")[0] != schema.split("/")[0]:
        raise ReportReadError(one_line(f"{path}: expected schema {schema!r}, got {found!r}"))
    for name, kind in required.items():
        if not isinstance(raw.get(name), kind):
            raise ReportReadError(
                f"{path}: expected {name!r} to be a JSON {'object' if kind is dict else 'array'},"
                f" got {type(raw.get(name)).__name__}"
            )
    return raw
