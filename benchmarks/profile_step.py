"""Where an observed training step spends its time: cProfile and torch.profiler tables.

    python benchmarks/profile_step.py                               # mlp, CPU, all configs
    python benchmarks/profile_step.py --device cuda --workload transformer
    python benchmarks/profile_step.py --config hooks --steps 2000 --top 25

For each configuration (``hooks``: observer attached, no forward sampled; ``every``:
every forward sampled; ``default``: the default schedule from its steady state on), the
workload of ``benchmarks/overhead.py`` trains ``--steps`` steps under cProfile (Python
functions by total time, so the observer's own functions show), then a few steps under
``torch.profiler`` (operators by self host time, with their counts: on CUDA each
operator is a kernel launch). Measurement only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import overhead
from torchinstruments import inject_observer, remove_observer

CONFIGS = ("hooks", "every", "default")


def _step(pair: overhead.Pair, index: int) -> None:
    x, y = pair.batches[index % overhead.BATCHES]
    overhead._train_step(pair.observed, pair.opt_observed, x, y)


def profile_config(
    workload: overhead.Workload, config: str, args: argparse.Namespace, tmp: Path
) -> None:
    pair = overhead.Pair(workload)
    options: dict[str, object] = {}
    if config == "hooks":
        options["sampling"] = overhead._NeverSample()
    elif config == "every":
        options["sampling"] = 1
    inject_observer(pair.observed, output_dir=tmp / config, **options)  # type: ignore[arg-type]
    if config == "default":
        start, _ = overhead._steady_schedule()
        pair.advance(start)
    for i in range(10):
        _step(pair, i)
    overhead._synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(args.steps):
        _step(pair, i)
    overhead._synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    print(
        f"\n==== {workload.name}, {config}, {args.steps} steps on {overhead.DEVICE}: cProfile ===="
    )
    print(text.getvalue().split("\n", 4)[-1])
    activities = [ProfilerActivity.CPU]
    if overhead.DEVICE.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for i in range(args.profiler_steps):
            _step(pair, i)
        overhead._synchronize()
    print(f"==== {workload.name}, {config}, {args.profiler_steps} steps: torch.profiler ====")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    remove_observer(pair.observed)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument(
        "--workload", default="mlp", choices=overhead.ALL_WORKLOAD_NAMES, help="default mlp"
    )
    parser.add_argument(
        "--config",
        default=",".join(CONFIGS),
        help=f"comma-separated subset of {','.join(CONFIGS)} (default all)",
    )
    parser.add_argument("--steps", type=int, default=500, help="cProfile steps (default 500)")
    parser.add_argument(
        "--profiler-steps", type=int, default=20, help="torch.profiler steps (default 20)"
    )
    parser.add_argument("--top", type=int, default=20, help="rows per table (default 20)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    configs = [c.strip() for c in args.config.split(",") if c.strip()]
    for config in configs:
        if config not in CONFIGS:
            parser.error(f"--config: unknown configuration {config!r}; choose from {CONFIGS}")
    if args.steps < 1 or args.profiler_steps < 1 or args.top < 1:
        parser.error("--steps, --profiler-steps and --top must be >= 1")
    try:
        overhead.DEVICE = overhead.parse_device(args.device)
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    workload = overhead.make_workloads(quick=False)[args.workload]
    with tempfile.TemporaryDirectory(prefix="ti-profile-") as tmp:
        for config in configs:
            profile_config(workload, config, args, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
