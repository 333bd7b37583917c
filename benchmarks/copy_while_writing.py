"""Copies of an output directory made while another process switches reports in.

A writer process rewrites one report (``report.json``, ``index.md``, ``series.json``,
taken from a short observed run) through a :class:`~torchinstruments.DirectorySink`
as fast as it can with a pause of ``--pause-ms`` between reports; this process copies
the directory ``--copies`` times with each ``--tool`` and counts the copies that
failed (a nonzero exit status, or an exception from ``shutil.copytree``), and the
distinct error messages, numbers and random names replaced by ``#``. Prints one line
per tool and then its most frequent messages. Usage::

    .venv/bin/python benchmarks/copy_while_writing.py --copies 300
    .venv/bin/python benchmarks/copy_while_writing.py --tool cp --tool tar --pause-ms 20
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_WRITER = r"""
import json, sys, time
from pathlib import Path
from torchinstruments import DirectorySink
root, pause = Path(sys.argv[1]), float(sys.argv[2])
report = json.loads((root / "run" / "report.json").read_bytes())
summary = json.loads((root / "run" / "series.json").read_bytes())
sink = DirectorySink(root / "live")
writes = 0
while not (root / "stop").exists():
    sink.begin()
    sink.write(report)
    sink.write_summary(summary)
    sink.commit()
    writes += 1
    time.sleep(pause)
print(writes)
"""

TOOLS = ("cp", "tar", "copytree", "cp_current")


def _copy(tool: str, source: Path, target: Path) -> str | None:
    """Copy ``source`` to ``target`` with ``tool``; the error message, or None."""
    commands = {
        "cp": ["cp", "-r", str(source), str(target)],
        "tar": ["tar", "-cf", f"{target}.tar", "-C", str(source.parent), source.name],
        "cp_current": ["cp", "-rL", str(source / ".current"), str(target)],
    }
    if tool == "copytree":
        try:
            shutil.copytree(source, target)
        except (shutil.Error, OSError) as error:
            return str(error)[:300]
        return None
    done = subprocess.run(commands[tool], capture_output=True, text=True, check=False)
    return done.stderr.strip()[:300] or "exit status 1" if done.returncode else None


def main() -> None:
    """Run the writer and the copies; print the counts (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copies", type=int, default=300, help="copies per tool")
    parser.add_argument("--pause-ms", type=float, default=1.0, help="between reports")
    parser.add_argument("--tool", action="append", choices=TOOLS, help="default: all")
    args = parser.parse_args()
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.harness import ResidualNet, make_batches, train
    from torchinstruments import inject_observer, remove_observer

    root = Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    model = ResidualNet()
    inject_observer(model, output_dir=root / "run", sampling=1)
    train(model, make_batches(6))
    remove_observer(model)
    json.loads((root / "run" / "report.json").read_bytes())  # written in full
    for tool in args.tool or TOOLS:
        (root / "stop").unlink(missing_ok=True)
        shutil.rmtree(root / "live", ignore_errors=True)
        writer = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(root), str(args.pause_ms / 1000)],
            stdout=subprocess.PIPE,
            text=True,
        )
        while not (root / "live" / "report.json").exists():
            time.sleep(0.01)
        errors = []
        for number in range(args.copies):
            target = root / f"copy-{number}"
            error = _copy(tool, root / "live", target)
            if error is not None:
                errors.append(
                    re.sub(r"[0-9a-f]{8}|\d{6}|copy-\d+", "#", error.replace(str(root), ""))
                )
            shutil.rmtree(target, ignore_errors=True)
            Path(f"{target}.tar").unlink(missing_ok=True)
        (root / "stop").touch()
        writes = writer.communicate()[0].strip()
        print(f"{tool}: {len(errors)} of {args.copies} copies failed ({writes} reports written)")
        for message, count in collections.Counter(errors).most_common(3):
            print(f"  {count} x {message.splitlines()[0]}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
