"""The tests mirror ``src``: the table "Where the tests are" in docs/architecture.md
names every module of the package once and every test file, and only files that exist;
a test file outside ``tests/end_to_end/`` is named after a module of its row.

Nothing is trained: the table and the two folders are read as text and file names.
"""

from __future__ import annotations

import re
from fnmatch import fnmatch

from tests.harness import REPO

PACKAGE = REPO / "src" / "torchinstruments"
TESTS = REPO / "tests"
SECTION = "## Where the tests are"
WHOLE = "the package as a whole"
Rows = list[tuple[list[str], list[str]]]


def read_table(text: str) -> Rows:
    """The rows of the section :data:`SECTION` of ``text``: (source patterns, test
    patterns), without backticks. The row :data:`WHOLE` has no source patterns."""
    assert SECTION in text, f"docs/architecture.md has no section {SECTION!r}"
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in body.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 2 or cells[0] in ("source", "---"):
            continue
        sources = [] if cells[0] == WHOLE else re.findall(r"`([^`]+)`", cells[0])
        rows.append((sources, re.findall(r"`([^`]+)`", cells[1])))
    return rows


def short_name(source: str) -> str:
    """The name a test file of ``source`` starts with: ``_staging.py`` -> ``staging``,
    ``_compare_*.py`` -> ``compare``, ``find/*.py`` -> ``find``."""
    if "/" in source:
        return source.split("/", 1)[0]
    return source.removesuffix(".py").lstrip("_").split("*", 1)[0].rstrip("_")


def problems(rows: Rows, modules: list[str], tests: list[str]) -> list[str]:
    """What is wrong with the table ``rows`` for the package's ``modules`` (paths
    relative to ``src/torchinstruments``) and the ``tests`` (relative to ``tests/``)."""
    found = []
    for module in modules:
        owners = sum(1 for sources, _ in rows if any(fnmatch(module, s) for s in sources))
        if owners != 1:
            found.append(f"src/torchinstruments/{module} is in {owners} rows")
    for sources, patterns in rows:
        found += [
            f"no module matches {s!r}" for s in sources if not any(fnmatch(m, s) for m in modules)
        ]
        found += [
            f"no test file matches {p!r}" for p in patterns if not any(fnmatch(t, p) for t in tests)
        ]
    for path in tests:
        owners = [sources for sources, patterns in rows if any(fnmatch(path, p) for p in patterns)]
        if not owners:
            found.append(f"tests/{path} is not in the table")
        elif not path.startswith("end_to_end/"):
            stem = path.removeprefix("test_").removesuffix(".py")
            names = {short_name(s) for sources in owners for s in sources}
            if "/" in path or not any(stem == n or stem.startswith(n + "_") for n in names):
                found.append(f"tests/{path} is not named after a module of its row")
    return found


def test_the_table_matches_the_package_and_the_tests() -> None:
    rows = read_table((REPO / "docs" / "architecture.md").read_text(encoding="utf-8"))
    modules = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))
    tests = sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py"))
    assert len(rows) > 10 and len(modules) > 50 and len(tests) > 40  # all were read
    assert problems(rows, modules, tests) == []


def test_each_kind_of_drift_is_found() -> None:
    text = f"""{SECTION}

| source | tests |
| --- | --- |
| `api.py` | `test_api.py` |
| `_merge_*.py`, `api.py` | `test_merge*.py` |
| `find/*.py` | `test_find.py` |
| `gone.py` | `test_gone.py` |
| `show.py` | `x/test_show.py` |
| {WHOLE} | `end_to_end/test_example.py` |

## Next section

| `lost.py` | `test_lost.py` |
"""
    rows = read_table(text)
    assert rows[-1] == ([], ["end_to_end/test_example.py"]) and len(rows) == 6
    modules = ["api.py", "_merge_read.py", "find/rules.py", "show.py", "lost.py"]
    tests = ["test_api.py", "test_merge_x.py", "test_finder.py", "test_x.py", "x/test_show.py"]
    tests += ["end_to_end/test_example.py"]
    assert problems(rows, modules, tests) == [
        "src/torchinstruments/api.py is in 2 rows",
        "src/torchinstruments/lost.py is in 0 rows",
        "no test file matches 'test_find.py'",
        "no module matches 'gone.py'",
        "no test file matches 'test_gone.py'",
        "tests/test_finder.py is not in the table",
        "tests/test_x.py is not in the table",
        "tests/x/test_show.py is not named after a module of its row",
    ]
    assert short_name("_compare_*.py") == "compare"
    assert short_name("__main__.py") == "main"
    assert short_name("_report_model_wide.py") == "report_model_wide"
