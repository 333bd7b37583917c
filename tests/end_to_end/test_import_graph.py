"""The package's import graph has no cycle (``benchmarks/code_shape.py`` walks it with
``ast``), and the walk sees the kinds of import that close one."""

from __future__ import annotations

from pathlib import Path

from benchmarks.code_shape import cycles, figures, import_graphs


def _package(root: Path, files: dict[str, str]) -> Path:
    package = root / "torchinstruments"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return package


def test_the_package_has_no_import_cycle_at_import_time_or_at_run_time() -> None:
    import_time, run_time = import_graphs()
    assert "torchinstruments.report" in run_time  # the walk found the package
    assert cycles(import_time) == []
    assert cycles(run_time) == []


def test_a_function_level_import_of_a_package_name_closes_a_run_time_cycle(
    tmp_path: Path,
) -> None:
    package = _package(
        tmp_path,
        {
            "__init__.py": '_SOURCES = {"run": "api"}\n__version__ = "1"\n',
            "api.py": "from .core import Core\n",
            "core.py": "def report():\n    from .report import build\n",
            "report.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from .core import Core\n"
                "def build():\n    from . import __version__\n"
            ),
            "find/__init__.py": "from .rules import rule\n",
            "find/rules.py": "from .base import Base\nfrom . import base\n",
            "find/base.py": "Base = 1\n",
        },
    )
    import_time, run_time = import_graphs(package)
    assert import_time["torchinstruments.api"] == {"torchinstruments.core"}
    assert import_time["torchinstruments.report"] == set()  # TYPE_CHECKING and functions
    assert run_time["torchinstruments.report"] == {"torchinstruments"}
    assert run_time["torchinstruments"] == {"torchinstruments.api"}
    # A subpackage importing its own modules is no cycle.
    assert run_time["torchinstruments.find.rules"] == {"torchinstruments.find.base"}
    assert cycles(import_time) == []
    assert cycles(run_time) == [
        [
            "torchinstruments",
            "torchinstruments.api",
            "torchinstruments.core",
            "torchinstruments.report",
        ]
    ]


def test_figures_count_lines_per_module_and_class(tmp_path: Path) -> None:
    package = _package(
        tmp_path,
        {
            "__init__.py": "",
            "observer.py": "class Observer:\n    a = 1\n\n    b = 2\n\n\nclass Small:\n    pass\n",
        },
    )
    shape = figures(package)
    assert shape["module_lines"] == {"torchinstruments.observer": 8, "torchinstruments": 0}
    assert shape["class_lines"] == {
        "torchinstruments.observer.Observer": 4,
        "torchinstruments.observer.Small": 2,
    }
    assert shape["observer_lines"] == 4
    assert shape["run_time_cycles"] == []
