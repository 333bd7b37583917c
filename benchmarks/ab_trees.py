"""Same-process A/B of two (or more) source trees of torchinstruments: measurement only.

    git worktree add /tmp/base <commit>
    python benchmarks/ab_trees.py --tree base=/tmp/base --tree new=.
    python benchmarks/ab_trees.py --tree base=/tmp/base --tree new=. --workloads mlp \\
        --configs default,sampling=1 --repeats 9 --json ab.json

Method. Each tree's ``src/torchinstruments`` is copied to a temporary directory under
its own package name (``ti_<name>``; the package imports itself only relatively) and
imported next to the others, so every tree runs in the same process, on the same core,
in the same caches. For each workload of ``benchmarks/overhead.py`` and each
configuration, one plain copy and one observed copy per tree are built from one seed
and fed the same batches; a step runs every copy once (``zero_grad``, forward,
cross-entropy, ``backward``, ``optimizer.step``), in an order that rotates from step to
step, so that no copy always runs first or after another. A block is ``--steps`` such
steps; each copy's ratio is its summed step time over the plain copy's, per block;
reported as median [min, max] over ``--repeats`` blocks, and the median over blocks of
the per-block ratio of each tree to the first.

Configurations: ``default`` (``inject_observer(model, output_dir=tmp)``, measured in the
steady state: every observed copy is first advanced with untimed forward-only training
forwards to the default schedule's largest interval, then one interval is run
untimed) and ``sampling=1`` (every training forward sampled, after 24 untimed steps).
The losses of all copies are compared bit for bit at every step. Exit status 0
whatever the numbers.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import overhead

CONFIGS = ("default", "sampling=1")
#: Steps per block when ``--steps`` is not given: a multiple of the default schedule's
#: largest interval, so that every block of the default steady state holds one sample.
DEFAULT_STEPS = {"default": 256, "sampling=1": 64}


def load_tree(name: str, path: Path, into: Path) -> Any:
    """Import ``path/src/torchinstruments`` as the package ``ti_<name>``."""
    source = path / "src" / "torchinstruments"
    if not (source / "__init__.py").is_file():
        raise SystemExit(f"--tree {name}={path}: no src/torchinstruments/__init__.py there")
    package = f"ti_{name}"
    shutil.copytree(source, into / package, ignore=shutil.ignore_patterns("__pycache__"))
    return importlib.import_module(package)


def _steady_start(package: Any) -> tuple[int, int]:
    stages = package.DefaultSampling().describe().get("stages")
    last = stages[-1]
    return int(last["from_forward"]), int(last["interval_forwards"])


def measure(
    workload: overhead.Workload,
    config: str,
    trees: dict[str, Any],
    steps: int,
    repeats: int,
    tmp: Path,
) -> dict[str, Any]:
    """Ratios observed / plain per tree for one workload and configuration."""
    torch.manual_seed(0)
    plain = workload.build()
    models = {"plain": plain, **{name: copy.deepcopy(plain) for name in trees}}
    optimizers = {
        name: torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        for name, model in models.items()
    }
    generator = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(*workload.input_shape, generator=generator),
            torch.randint(0, workload.classes, (workload.input_shape[0],), generator=generator),
        )
        for _ in range(overhead.BATCHES)
    ]
    names = list(models)
    step = 0
    identical = True

    def run(count: int, timed: dict[str, float] | None) -> None:
        nonlocal step, identical
        clock = time.perf_counter
        for _ in range(count):
            x, y = batches[step % overhead.BATCHES]
            order = names[step % len(names) :] + names[: step % len(names)]
            step += 1
            losses = {}
            for name in order:
                started = clock()
                losses[name] = overhead._train_step(models[name], optimizers[name], x, y)
                if timed is not None:
                    timed[name] += clock() - started
            reference = losses["plain"]
            if identical and not all(torch.equal(reference, v) for v in losses.values()):
                identical = False

    run(10, None)  # warm-up, no observer yet
    for name, package in trees.items():
        sampling = 1 if config == "sampling=1" else None
        package.inject_observer(
            models[name], output_dir=tmp / f"{workload.name}-{name}", sampling=sampling
        )
    if config == "default":
        start, interval = _steady_start(next(iter(trees.values())))
        x = batches[0][0][:1]
        for name in trees:
            for _ in range(start):
                models[name](x)  # untimed training forwards, as overhead.py's advance()
        run(interval, None)
    else:
        run(24, None)
    blocks: list[dict[str, float]] = []
    for _ in range(repeats):
        gc.collect()
        timed = dict.fromkeys(names, 0.0)
        run(steps, timed)
        blocks.append(timed)
    for name, package in trees.items():
        package.remove_observer(models[name])
    first = next(iter(trees))
    result: dict[str, Any] = {
        "workload": workload.name,
        "config": config,
        "steps_per_block": steps,
        "blocks": repeats,
        "plain_ms_per_step": 1e3 * statistics.median(b["plain"] for b in blocks) / steps,
        "losses_identical": identical,
        "ratio": {},
        "relative_to_first": {},
    }
    for name in trees:
        ratios = [b[name] / b["plain"] for b in blocks]
        result["ratio"][name] = {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        }
        result["relative_to_first"][name] = statistics.median(b[name] / b[first] for b in blocks)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tree",
        action="append",
        required=True,
        metavar="NAME=PATH",
        help="a source tree (a checkout or worktree); the first is the reference",
    )
    parser.add_argument("--workloads", default=",".join(overhead.WORKLOAD_NAMES))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--steps", type=int, help="steps per block (default 256; 64 at sampling=1)")
    parser.add_argument("--repeats", type=int, default=7, help="blocks per configuration (7)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1)")
    parser.add_argument("--json", type=Path, help="also save the numbers to this JSON file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    workloads = overhead.make_workloads(quick=False)
    results = []
    with tempfile.TemporaryDirectory() as tmp_text:
        tmp = Path(tmp_text)
        (tmp / "packages").mkdir()
        sys.path.insert(0, str(tmp / "packages"))
        trees = {}
        for item in args.tree:
            name, _, path = item.partition("=")
            if not name.isidentifier() or not path:
                raise SystemExit(f"--tree wants NAME=PATH with NAME an identifier, got {item!r}")
            trees[name] = load_tree(name, Path(path).resolve(), tmp / "packages")
        header = ["workload", "config", "plain ms/step", "losses identical"]
        header += [f"{name} ratio median [min, max]" for name in trees]
        header += [f"{name} / {next(iter(trees))}" for name in list(trees)[1:]]
        rows = []
        for workload_name in args.workloads.split(","):
            for config in args.configs.split(","):
                steps = args.steps or DEFAULT_STEPS[config]
                print(f"[{workload_name} {config}]", file=sys.stderr, flush=True)
                result = measure(workloads[workload_name], config, trees, steps, args.repeats, tmp)
                results.append(result)
                cells = [
                    workload_name,
                    config,
                    f"{result['plain_ms_per_step']:.3f}",
                    "yes" if result["losses_identical"] else "NO",
                ]
                for name in trees:
                    r = result["ratio"][name]
                    cells.append(f"{r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]")
                cells += [f"{result['relative_to_first'][n]:.3f}" for n in list(trees)[1:]]
                rows.append(cells)
                # Each row as soon as it is measured (a long run stopped early keeps them).
                print("  ".join(cells), file=sys.stderr, flush=True)
    print(overhead._table(header, rows))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
