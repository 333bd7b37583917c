"""Every example in the package's docstrings runs and prints what it shows."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import torchinstruments


def test_docstring_examples_run() -> None:
    names = sorted(
        info.name for info in pkgutil.walk_packages(torchinstruments.__path__, "torchinstruments.")
    )
    failed: dict[str, int] = {}
    attempted = 0
    for name in names:
        result = doctest.testmod(importlib.import_module(name), verbose=False, report=False)
        attempted += result.attempted
        if result.failed:
            failed[name] = result.failed
    assert failed == {}
    assert attempted >= 40  # the examples are found (42 when this test was written)
