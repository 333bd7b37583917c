"""The shape of the package's code: measurement only.

    python benchmarks/code_shape.py               # the figures, as text
    python benchmarks/code_shape.py --json shape.json

Prints the lines of each module of ``src/torchinstruments`` (largest first), the
largest classes, the lines of ``Observer``, and the import cycles of the package.

Lines are physical lines (``wc -l``); a class's lines run from its ``class`` line to
its last line (``ast`` line numbers), docstrings and comments included.

Two import graphs are walked with ``ast`` (nothing is imported):

- **import time**: the imports at module level, outside ``if TYPE_CHECKING:`` blocks;
  a cycle here can fail at ``import`` (a name read before the module defining it ran).
- **run time**: those plus the imports inside functions and the package's lazy public
  names (``__init__._SOURCES``: reading ``torchinstruments.X`` imports the module named
  there). A cycle here means no module can be understood, tested or replaced without
  the others of the cycle.

An edge goes from a module to each package module it names (``from .a import b`` to
``a``, or to ``a.b`` where that is a module; ``from . import x`` to the package itself
where ``x`` is not a module) and to the packages above that module (importing
``find.base`` runs ``find/__init__.py`` first), except the packages the importing
module is itself inside (those run before it) and the root package, whose ``__init__``
every import runs anyway. ``tests/end_to_end/test_import_graph.py`` fails on a cycle
in either graph. Exit status 0 whatever the figures.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

PACKAGE = "torchinstruments"
SOURCE = Path(__file__).resolve().parents[1] / "src" / PACKAGE


def module_files(root: Path = SOURCE) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``root``."""
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> tuple[list[ast.stmt], list[ast.stmt]]:
    """(module-level imports outside ``if TYPE_CHECKING:``, imports inside functions)."""
    top: list[ast.stmt] = []
    nested: list[ast.stmt] = []

    def walk(nodes: list[ast.stmt], in_function: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                (nested if in_function else top).append(node)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                walk(node.orelse, in_function)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                walk(node.body, True)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    children = getattr(node, field, None)
                    if isinstance(children, list):
                        walk([c for c in children if isinstance(c, ast.stmt)], in_function)
                    for child in children or ():
                        if isinstance(child, ast.ExceptHandler):
                            walk(child.body, in_function)

    walk(tree.body, False)
    return top, nested


def _targets(node: ast.stmt, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Package modules that one import statement of ``module`` imports."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".")
            if not is_package:
                base = base[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        for alias in node.names:
            child = f"{source}.{alias.name}"
            names.append(child if child in known else source)
    found: set[str] = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name == PACKAGE and module != PACKAGE:
            found.add(PACKAGE)  # a name of the package itself (``from . import x``)
            continue
        while name and name != PACKAGE:
            if name != module and not module.startswith(f"{name}."):
                found.add(name)  # not a package that ``module`` itself is inside
            name = name.rpartition(".")[0]
    return found


def _lazy_sources(tree: ast.Module) -> set[str]:
    """Submodules named by the package's ``_SOURCES`` table (lazy public names)."""
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else None
        if target is None and isinstance(node, ast.AnnAssign):
            target = node.target
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id == "_SOURCES" and isinstance(value, ast.Dict):
            return {
                f"{PACKAGE}.{v.value}"
                for v in value.values
                if isinstance(v, ast.Constant) and isinstance(v.value, str)
            }
    return set()


def import_graphs(root: Path = SOURCE) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(import-time graph, run-time graph): module -> package modules it imports."""
    files = module_files(root)
    known = set(files)
    import_time: dict[str, set[str]] = {}
    run_time: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_package = path.name == "__init__.py"
        top, nested = _imports(tree)
        edges = set().union(*(_targets(n, module, is_package, known) for n in top))
        import_time[module] = edges
        late = set().union(*(_targets(n, module, is_package, known) for n in nested))
        if module == PACKAGE:
            late |= _lazy_sources(tree)
        run_time[module] = edges | late
    return import_time, run_time


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module that
    imports itself), each sorted; Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def class_lines(root: Path = SOURCE) -> list[tuple[str, int]]:
    """(module.Class, lines) of every class, largest first."""
    result: list[tuple[str, int]] = []
    for module, path in module_files(root).items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                result.append((f"{module}.{node.name}", node.end_lineno - node.lineno + 1))
    return sorted(result, key=lambda item: (-item[1], item[0]))


def figures(root: Path = SOURCE) -> dict[str, object]:
    """Every figure this script prints, as a JSON-safe dict."""
    modules = {
        name: len(path.read_text(encoding="utf-8").splitlines())
        for name, path in module_files(root).items()
    }
    classes = class_lines(root)
    import_time, run_time = import_graphs(root)
    observer = [lines for name, lines in classes if name.endswith(".Observer")]
    return {
        "module_lines": dict(sorted(modules.items(), key=lambda item: (-item[1], item[0]))),
        "class_lines": dict(classes),
        "observer_lines": observer[0] if observer else None,
        "modules_over_600": sum(1 for n in modules.values() if n > 600),
        "classes_over_400": sum(1 for _, n in classes if n > 400),
        "import_time_cycles": cycles(import_time),
        "run_time_cycles": cycles(run_time),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also save the figures to this JSON file")
    parser.add_argument("--classes", type=int, default=12, help="largest classes shown (12)")
    args = parser.parse_args(argv)
    shape = figures()
    modules: dict[str, int] = shape["module_lines"]  # type: ignore[assignment]
    classes: dict[str, int] = shape["class_lines"]  # type: ignore[assignment]
    print(f"== Lines per module ({len(modules)} modules, {sum(modules.values())} lines) ==")
    for name, lines in modules.items():
        print(f"{lines:6d}  {name}{'  (over 600)' if lines > 600 else ''}")
    print(f"\n== Largest classes (of {len(classes)}) ==")
    for name, lines in list(classes.items())[: args.classes]:
        print(f"{lines:6d}  {name}{'  (over 400)' if lines > 400 else ''}")
    print(f"\nObserver: {shape['observer_lines']} lines")
    print(f"modules over 600 lines: {shape['modules_over_600']}")
    print(f"classes over 400 lines: {shape['classes_over_400']}")
    for label in ("import_time_cycles", "run_time_cycles"):
        found: list[list[str]] = shape[label]  # type: ignore[assignment]
        text = "; ".join(" <-> ".join(c) for c in found) if found else "none"
        print(f"{label.replace('_', ' ')}: {text}")
    if args.json is not None:
        args.json.write_text(json.dumps(shape, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
