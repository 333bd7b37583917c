"""Operators an observed training step dispatches on the accelerator path, counted on the CPU.

    python benchmarks/device_ops.py                       # the four workloads
    python benchmarks/device_ops.py --workloads cnn --top 15

On CUDA every operator that is not a view is a kernel launch, several microseconds of
host time whatever the tensor's size, and the small models of ``benchmarks/overhead.py``
wait on the host, so a sampled step costs about what it launches. This script counts
those operators without a GPU: each workload trains on the CPU, plain and observed with
every forward sampled and the observer's device path forced on (``device_path_types``
gets ``"cpu"``, as in the tests, and it flushes as often as with CUDA rows pending), and
a ``TorchDispatchMode`` counts the operators dispatched per step, views
(``OpOverload.is_view``: no kernel) apart. Deterministic (after a first count, which also
builds cached layouts), so a change to the device path can be compared with the previous
commit on any machine.
Measurement only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import overhead
from torchinstruments import _calls, _context_cadence, inject_observer, remove_observer
from torchinstruments import observer as observer_module
from torchinstruments._context import DEVICE_FLUSH_INTERVAL_FORWARDS

WORKLOADS = ("mlp", "cnn", "transformer", "residual_mlp")
#: The observer's modules that hide its operators with ``capture.passive``.
_PASSIVE_USERS = (_calls, _context_cadence, observer_module)


class _OperatorCount(TorchDispatchMode):
    """Counts dispatched operators by name, views and others apart."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: collections.Counter[str] = collections.Counter()
        self.views: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        counter = self.views if func.is_view else self.launches
        counter[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count(workload: overhead.Workload, observe: bool, steps: int, tmp: Path) -> _OperatorCount:
    pair = overhead.Pair(workload)
    handle = None
    if observe:
        handle = inject_observer(pair.observed, output_dir=tmp, sampling=1)
        observer = handle._observer
        assert observer is not None
        observer.buffer.device_path_types = frozenset({"cpu", "cuda"})
        # Flush as often as with CUDA statistics pending (the CPU cadence is longer).
        observer.context.FLUSH_INTERVAL_FORWARDS = DEVICE_FLUSH_INTERVAL_FORWARDS
    # Past warm-up (24 samples), whose end writes a report (one flush more) once.
    for i in range(24):
        x, y = pair.batches[i % overhead.BATCHES]
        overhead._train_step(pair.observed, pair.opt_observed, x, y)
    mode = _OperatorCount()
    # The observer hides its own operators from dispatch modes (capture.passive: they
    # must not reach a user's mode); this count is of exactly those, so it lifts that.
    with contextlib.ExitStack() as lifted:
        for module in _PASSIVE_USERS:
            lifted.enter_context(mock.patch.object(module, "passive", contextlib.nullcontext))
        lifted.enter_context(mode)
        for i in range(steps):
            x, y = pair.batches[i % overhead.BATCHES]
            overhead._train_step(pair.observed, pair.opt_observed, x, y)
    if handle is not None:
        remove_observer(pair.observed)
    return mode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--steps", type=int, default=64, help="counted steps (default 64)")
    parser.add_argument("--top", type=int, default=0, help="list the N most added operators")
    parser.add_argument("--quick", action="store_true", help="tiny workloads (smoke test)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    workloads = overhead.make_workloads(args.quick)
    names = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = sorted(set(names) - set(workloads))
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; choose from {sorted(workloads)}")
    print(f"operators per training step, every forward sampled, {args.steps} steps counted")
    header = ("workload", "plain launches", "observed launches", "added launches", "added views")
    print("  ".join(f"{h:>18}" for h in header))
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            plain = count(workloads[name], False, args.steps, Path(tmp))
            observed = count(workloads[name], True, args.steps, Path(tmp))
        per_step = [
            plain.launches.total() / args.steps,
            observed.launches.total() / args.steps,
            (observed.launches.total() - plain.launches.total()) / args.steps,
            (observed.views.total() - plain.views.total()) / args.steps,
        ]
        print("  ".join([f"{name:>18}", *(f"{v:>18.1f}" for v in per_step)]))
        if args.top:
            added = observed.launches.copy()
            added.subtract(plain.launches)
            for op, n in added.most_common(args.top):
                print(f"{'':>18}  {n / args.steps:>8.1f}  {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
