"""Every example in the package's docstrings runs and prints what it shows.

The examples run in a fresh interpreter: other tests reload and patch the package's
modules in this one, which hides docstrings from the doctest finder.
"""

from __future__ import annotations

import json
import subprocess
import sys

_RUN = """
import doctest, importlib, json, pkgutil
import torchinstruments
failed, attempted = {}, 0
for info in sorted(pkgutil.walk_packages(torchinstruments.__path__, "torchinstruments."),
                   key=lambda info: info.name):
    result = doctest.testmod(importlib.import_module(info.name), verbose=False, report=False)
    attempted += result.attempted
    if result.failed:
        failed[info.name] = result.failed
print(json.dumps({"failed": failed, "attempted": attempted}))
"""


def test_docstring_examples_run() -> None:
    done = subprocess.run([sys.executable, "-c", _RUN], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["failed"] == {}, done.stdout[-4000:]
    assert result["attempted"] >= 40  # the examples are found (42 when this was written)
