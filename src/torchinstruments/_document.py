"""Bounded JSON documents: sections taken round-robin, the longest prefix that fits a
byte bound, shrink steps for what still does not fit, and how numbers and names are
written.

``report.json``, ``comparison.json`` and ``global-report.json`` are each built the same
way: their lists (findings per category, divergences per section, outliers, ...) are
interleaved round-robin (:func:`round_robin`), the longest prefix of that order whose
exact bytes (:func:`~torchinstruments._jsonio.dumps_report`) fit ``max_bytes`` is kept
(:func:`longest_fitting_prefix`), and when even the document without any entry is too
large, sizeable parts are shortened one step at a time (:func:`shrink_to_fit`).

Only the standard library (the offline tools do not import torch).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from ._jsonio import dumps_report

__all__ = [
    "DEFAULT_MAX_BYTES",
    "MAX_NAME_CHARS",
    "MAX_TEXT_CHARS",
    "bounded_text",
    "clean",
    "longest_fitting_prefix",
    "number_text",
    "round_number",
    "round_or_reason",
    "round_robin",
    "shrink_to_fit",
    "utf8_length",
]

T = TypeVar("T")

#: Default bound, in bytes, on each bounded document as written (``report.json``,
#: ``comparison.json``, ``global-report.json``; ``ReportConfig.max_bytes``).
DEFAULT_MAX_BYTES = 256_000
#: Longest name (module, tensor path) written to JSON, in characters; a longer one is
#: cut and ends in 8 hex digits of its SHA-1 (see :func:`bounded_text`), the same in
#: ``report.json`` and ``series.json``, so runs still compare by name.
MAX_NAME_CHARS = 256
#: Longest other string written to ``report.json`` (texts that quote names), in
#: characters.
MAX_TEXT_CHARS = 4_000
#: Keys whose string values are names, bounded by ``MAX_NAME_CHARS``.
_NAME_KEYS = frozenset({"module", "tensor_path", "modules_not_observed", "modules_never_ran"})


# ---------------------------------------------------------------------- numbers
def round_number(value: float | None) -> float | None:
    """JSON-safe float with six significant digits (None where it does not exist:
    ``None``, NaN or an infinity).

    Example:
        >>> round_number(1 / 3), round_number(float("nan"))
        (0.333333, None)
    """
    if value is None or not math.isfinite(value):
        return None
    return float(f"{value:.6g}")


def round_or_reason(value: float) -> float | dict[str, object]:
    """``value`` with six significant digits; a NaN or an infinity as
    ``{"value": None, "reason": "not finite (nan)"}`` (the report says why).

    Example:
        >>> round_or_reason(2 / 3), round_or_reason(float("inf"))
        (0.666667, {'value': None, 'reason': 'not finite (inf)'})
    """
    if not math.isfinite(value):
        return {"value": None, "reason": f"not finite ({value})"}
    return float(f"{value:.6g}")


def number_text(value: float | None) -> str:
    """A number for prose: four significant digits; ``"n/a"`` for None; zero and the
    non-finite values as Python writes them.

    Example:
        >>> number_text(1234.567), number_text(None), number_text(0.0)
        ('1235', 'n/a', '0.0')
    """
    if value is None:
        return "n/a"
    if value == 0 or not math.isfinite(value):
        return str(value)
    return f"{value:.4g}"


# ---------------------------------------------------------------------- names, texts
def bounded_text(text: str, limit: int = MAX_NAME_CHARS) -> str:
    """``text`` if it has at most ``limit`` characters; else its first characters, an
    ellipsis and 8 hex digits of its SHA-1, ``limit`` characters in all (two long
    names that share a prefix stay apart).

    Example:
        >>> bounded_text("a" * 300, 20)
        'aaaaaaaaaaa…003ef1ba'
    """
    if len(text) <= limit:
        return text
    digest = hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{text[: max(limit - 9, 0)]}…{digest}"


def clean(obj: object, limit: int = MAX_TEXT_CHARS) -> Any:
    """JSON-safe copy: floats rounded to 6 significant digits (:func:`round_or_reason`),
    no NaN or infinity, strings bounded (names, under the keys ``module``,
    ``tensor_path``, ``modules_not_observed`` and ``modules_never_ran``, by
    ``MAX_NAME_CHARS``; other texts by ``limit``, default ``MAX_TEXT_CHARS``); other
    objects as their bounded ``str``."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, int):
        return obj
    if isinstance(obj, str):
        return obj if len(obj) <= limit else bounded_text(obj, limit)
    if isinstance(obj, float):
        return round_or_reason(obj)
    if isinstance(obj, dict):
        return {
            bounded_text(str(k)): clean(v, MAX_NAME_CHARS if k in _NAME_KEYS else limit)
            for k, v in obj.items()
        }
    if isinstance(obj, list | tuple):
        return [clean(v, limit) for v in obj]
    return bounded_text(str(obj), limit)


def utf8_length(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (its length when ASCII, the common case)."""
    return len(text) if text.isascii() else len(text.encode())


# ---------------------------------------------------------------------- bounding
def round_robin(columns: Iterable[Sequence[T]], key: Callable[[T], Any] | None = None) -> list[T]:
    """The items of ``columns`` level by level: every column's first item, then every
    column's second, ... (a column that ran out is skipped). With ``key``, the items of
    one level are sorted by it (stable: ties keep the columns' order).

    Example:
        >>> round_robin([["a1", "a2", "a3"], ["b1"], ["c1", "c2"]])
        ['a1', 'b1', 'c1', 'a2', 'c2', 'a3']
    """
    listed = list(columns)
    order: list[T] = []
    depth = max((len(column) for column in listed), default=0)
    for level in range(depth):
        items = [column[level] for column in listed if level < len(column)]
        if key is not None:
            items.sort(key=key)
        order.extend(items)
    return order


def longest_fitting_prefix(
    build: Callable[[int], dict[str, Any]], count: int, max_bytes: int
) -> dict[str, Any]:
    """``build(k)`` for the largest ``k <= count`` whose :func:`dumps_report` bytes fit
    ``max_bytes`` (binary search; ``build(0)`` if none does). ``build`` must grow with k."""
    best = build(count)
    if len(dumps_report(best)) <= max_bytes:
        return best
    low, high = 0, count
    best = build(0)
    while low < high:
        middle = (low + high + 1) // 2
        candidate = build(middle)
        if len(dumps_report(candidate)) <= max_bytes:
            low, best = middle, candidate
        else:
            high = middle - 1
    return best


def shrink_to_fit(
    document: dict[str, Any], max_bytes: int, steps: Iterable[Callable[[dict[str, Any]], bool]]
) -> bool:
    """Apply ``steps`` to ``document`` in place, in order, until its
    :func:`dumps_report` bytes fit ``max_bytes``.

    Each step shortens one part and returns True, or returns False when it had nothing
    to shorten (the size is then not measured again). Steps run only while the document
    is too large; it may still be when they are all spent.

    Returns:
        Whether any step shortened the document.
    """
    fits = len(dumps_report(document)) <= max_bytes
    shrunk = False
    for step in steps:
        if fits:
            break
        if step(document):
            shrunk = True
            fits = len(dumps_report(document)) <= max_bytes
    return shrunk
