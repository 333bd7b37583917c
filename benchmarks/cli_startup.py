"""How fast the command line answers, and whether it imports torch.

Each command runs in a fresh interpreter (a cold process), ``--repeats`` times,
interleaved with the others; the table gives the median and the range of the wall-clock
times, and whether the process imported torch (``sys.modules`` checked in a separate run
of the same command). ``python -c pass`` and ``python -c "import torch"`` are the
references::

    .venv/bin/python benchmarks/cli_startup.py               # 7 repeats
    .venv/bin/python benchmarks/cli_startup.py --repeats 15

``show`` reads a report written beforehand by a tiny observed training (in a temporary
directory, not timed). Measurement only: nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Runs the command line's main() in-process, then prints whether torch was imported.
_PROBE = (
    "import contextlib, io, sys\n"
    "from torchinstruments.__main__ import main\n"
    "with contextlib.redirect_stdout(io.StringIO()):\n"
    "    main(sys.argv[1:])\n"
    "print('torch' in sys.modules)\n"
)


def _write_report(directory: Path) -> None:
    """A report of a tiny observed training (8 -> 16 -> 1 MLP, 30 SGD steps)."""
    import torch
    from torch import nn

    from torchinstruments import inject_observer, remove_observer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    inject_observer(model, output_dir=directory, sampling=1)
    for _ in range(30):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(torch.randn(16, 8)), torch.randn(16, 1)).backward()
        optimizer.step()
    remove_observer(model)


def _seconds(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="cold processes per command")
    args = parser.parse_args(argv)
    python = sys.executable
    with tempfile.TemporaryDirectory() as temporary:
        run = Path(temporary) / "run"
        _write_report(run)
        commands = {
            "python -c pass": ([python, "-c", "pass"], None),
            'python -c "import torch"': ([python, "-c", "import torch"], None),
            "torchinstruments --help": ([python, "-m", "torchinstruments", "--help"], ["--help"]),
            "torchinstruments --version": (
                [python, "-m", "torchinstruments", "--version"],
                ["--version"],
            ),
            "torchinstruments show DIR": (
                [python, "-m", "torchinstruments", "show", str(run)],
                ["show", str(run)],
            ),
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.repeats):
            for name, (command, _) in commands.items():
                times[name].append(_seconds(command))
        imports = {}
        for name, (_, cli_arguments) in commands.items():
            if cli_arguments is not None:
                probe = subprocess.run(
                    [python, "-c", _PROBE, *cli_arguments],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                imports[name] = probe.stdout.strip().splitlines()[-1]
    print(
        f"cold processes: {args.repeats} per command, interleaved; python {sys.version.split()[0]}"
    )
    print(f"{'command':<30} {'median s':>9} {'min s':>7} {'max s':>7}  imports torch")
    for name, values in times.items():
        print(
            f"{name:<30} {statistics.median(values):>9.3f} {min(values):>7.3f} "
            f"{max(values):>7.3f}  {imports.get(name, '')}"
        )
    torch_median = statistics.median(times['python -c "import torch"'])
    help_median = statistics.median(times["torchinstruments --help"])
    print(f"--help / import torch (medians): {help_median / torch_median:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
