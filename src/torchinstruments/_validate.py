"""Small argument checks shared by the configuration classes and the public API."""

from __future__ import annotations

import math

from .errors import ConfigError


def require_int(owner: str, name: str, value: object, *, minimum: int) -> int:
    """Return ``value`` if it is an int (not bool) >= ``minimum``, else raise ``ConfigError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{owner}.{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{owner}.{name} must be an int >= {minimum}, got {value!r}")
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
        raise ConfigError(f"{owner}.{name} must be {expected}, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ConfigError(f"{owner}.{name} must be {expected}, got {value!r}")
    if minimum is not None and (number < minimum or (exclusive_minimum and number == minimum)):
        raise ConfigError(f"{owner}.{name} must be {expected}, got {value!r}")
    if maximum is not None and number > maximum:
        raise ConfigError(f"{owner}.{name} must be {expected}, got {value!r}")
    return number
