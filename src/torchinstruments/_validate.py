"""Small argument checks shared by the configuration classes and the public API."""

from __future__ import annotations

import math

from .errors import ConfigError


def shown(value: object) -> str:
    """``repr(value)``, at most 80 characters (a value can be huge)."""
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 80 else f"{text[:77]}..."


def require_int(
    owner: str, name: str, value: object, *, minimum: int, maximum: int | None = None
) -> int:
    """Return ``value`` if it is an int (not bool) in ``[minimum, maximum]``, else raise
    ``ConfigError`` naming ``owner.name``, the range and the value given."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{owner}.{name} must be an int >= {minimum}, got {shown(value)}")
    if maximum is not None and value > maximum:
        raise ConfigError(
            f"{owner}.{name} must be an int in [{minimum}, {maximum:,}], got {shown(value)}"
        )
    return value


def require_float(
    owner: str,
    name: str,
    value: object,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
) -> float:
    """Return ``value`` as float if it is a finite real number in range, else raise."""
    bounds = []
    if minimum is not None:
        bounds.append(f"{'>' if exclusive_minimum else '>='} {minimum}")
    if maximum is not None:
        bounds.append(f"<= {maximum}")
    expected = "a finite number" + (" " + " and ".join(bounds) if bounds else "")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{owner}.{name} must be {expected}, got {shown(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int past the float range
        raise ConfigError(f"{owner}.{name} must be {expected}, got {shown(value)}") from None
    if not math.isfinite(number):
        raise ConfigError(f"{owner}.{name} must be {expected}, got {shown(value)}")
    if minimum is not None and (number < minimum or (exclusive_minimum and number == minimum)):
        raise ConfigError(f"{owner}.{name} must be {expected}, got {shown(value)}")
    if maximum is not None and number > maximum:
        raise ConfigError(f"{owner}.{name} must be {expected}, got {shown(value)}")
    return number
