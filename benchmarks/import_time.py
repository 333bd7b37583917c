"""What ``import torchinstruments`` adds to ``import torch``: measurement only.

    python benchmarks/import_time.py                # 9 rounds
    python benchmarks/import_time.py --rounds 21 --json import_time.json

Method. Each round starts two fresh interpreters (``sys.executable -c ...``), one running
``import torch`` and one running ``import torch; import torchinstruments``, in alternating
order from round to round, and times each process from start to exit with
``time.perf_counter``. Both pay the same interpreter start-up, so the difference of the
medians is what our package's import costs. The operating system's file cache is warm
after the first round (both commands read the same torch files); a first, untimed round
warms it. The script also lists which modules of ``torch._dynamo``, ``torch._inductor``
and the optional dependencies the import loaded (none is the target).

The target is an added median of at most 0.3 s; the exit status is 0 whatever the
numbers (``--fail-above S`` makes it 1 when the added median exceeds ``S`` seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

TORCH = "import torch"
BOTH = "import torch; import torchinstruments"
#: Packages our import must not load: the compiler stack and the optional dependencies.
HEAVY = (
    "torch._dynamo",
    "torch._inductor",
    "matplotlib",
    "tensorboard",
    "lightning",
    "transformers",
    "accelerate",
    "wandb",
)
LOADED = (
    "import sys, torch; before = set(sys.modules); import torchinstruments; "
    "print(sorted(set(sys.modules) - before))"
)


def time_process(code: str) -> float:
    """Seconds from start to exit of ``python -c code``."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def heavy_modules() -> list[str]:
    """Modules of :data:`HEAVY` that ``import torchinstruments`` loads after torch."""
    output = subprocess.run(
        [sys.executable, "-c", LOADED], check=True, capture_output=True, text=True
    ).stdout
    loaded: list[str] = json.loads(output.replace("'", '"'))
    return [name for name in loaded if name.split(".")[0] in HEAVY or name.startswith(HEAVY)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (default 9)")
    parser.add_argument("--json", type=Path, help="also write the numbers to this file")
    parser.add_argument("--fail-above", type=float, help="exit 1 above this added median (s)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")

    time_process(BOTH)  # untimed: warms the file cache for both commands
    torch_s: list[float] = []
    both_s: list[float] = []
    for index in range(args.rounds):
        pair = ((TORCH, torch_s), (BOTH, both_s))
        for code, times in pair if index % 2 == 0 else reversed(pair):
            times.append(time_process(code))
        print(
            f"round {index + 1}: torch {torch_s[-1]:.3f} s, both {both_s[-1]:.3f} s",
            file=sys.stderr,
        )

    torch_median = statistics.median(torch_s)
    both_median = statistics.median(both_s)
    added = both_median - torch_median
    heavy = heavy_modules()
    print(f"== Import time, median of {args.rounds} fresh processes ==")
    print(f"{TORCH:<40} {torch_median:.3f} s  [min {min(torch_s):.3f}, max {max(torch_s):.3f}]")
    print(f"{BOTH:<40} {both_median:.3f} s  [min {min(both_s):.3f}, max {max(both_s):.3f}]")
    print(f"{'added by torchinstruments':<40} {added:+.3f} s  (target <= 0.300 s)")
    print(f"ratio {both_median / torch_median:.3f}")
    counts = {root: sum(n == root or n.startswith(root + ".") for n in heavy) for root in HEAVY}
    listed = ", ".join(f"{root} ({n} modules)" for root, n in counts.items() if n)
    print(f"compiler or optional modules loaded: {listed or 'none'}")
    if args.json is not None:
        numbers = {
            "rounds": args.rounds,
            "torch_s": torch_s,
            "torch_and_torchinstruments_s": both_s,
            "torch_median_s": torch_median,
            "torch_and_torchinstruments_median_s": both_median,
            "added_median_s": added,
            "heavy_modules_loaded": heavy,
            "python": sys.version.split()[0],
        }
        args.json.write_text(json.dumps(numbers, indent=2) + "\n", encoding="utf-8")
    return 1 if args.fail_above is not None and added > args.fail_above else 0


if __name__ == "__main__":
    sys.exit(main())
