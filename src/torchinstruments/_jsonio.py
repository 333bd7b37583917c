"""Reading our own JSON artefacts (rank reports, series summaries) with clear errors."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import ReportReadError

__all__ = ["read_json_object"]


def read_json_object(
    path: Path,
    *,
    what: str,
    max_bytes: int,
    schema: str,
    required: Mapping[str, type],
    missing_hint: str | None = None,
) -> dict[str, Any]:
    """Parse one JSON object file, checking its size, schema family and required keys.

    Args:
        path: the file.
        what: what the file should be, for messages ("a rank report").
        max_bytes: largest file accepted, in bytes.
        schema: expected ``schema`` value; only the part before ``/`` (the family) must
            match, so later versions of one schema still read.
        required: top-level keys and the JSON type (``dict`` or ``list``) each must have.
        missing_hint: appended to the message when the file does not exist.

    Raises:
        ReportReadError: the file is missing, too large, unreadable, not JSON, not an
            object, of another schema, or lacks a required key; the message names the
            path, what was expected and what was found.
    """
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise ReportReadError(
                f"{path}: expected {what} of at most {max_bytes} bytes, got {size} bytes"
            )
        with path.open("rb") as stream:
            raw = json.load(stream)
    except FileNotFoundError as error:
        hint = f"; {missing_hint}" if missing_hint else ""
        raise ReportReadError(f"{path}: not found{hint}") from error
    except OSError as error:
        raise ReportReadError(f"{path}: cannot be read ({error.strerror or error})") from error
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ReportReadError(f"{path}: expected JSON, got a parse error ({error})") from error
    if not isinstance(raw, dict):
        raise ReportReadError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    found = raw.get("schema")
    if not isinstance(found, str) or found.split("/")[0] != schema.split("/")[0]:
        raise ReportReadError(f"{path}: expected schema {schema!r}, got {found!r}")
    for name, kind in required.items():
        if not isinstance(raw.get(name), kind):
            raise ReportReadError(
                f"{path}: expected {name!r} to be a JSON {'object' if kind is dict else 'array'},"
                f" got {type(raw.get(name)).__name__}"
            )
    return raw
