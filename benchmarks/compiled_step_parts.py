"""What each part of the observer adds to a compiled training step, side by side.

    python benchmarks/compiled_step_parts.py                       # inductor, 15 blocks
    python benchmarks/compiled_step_parts.py --backend aot_eager --blocks 21 --steps 400

Four copies of the example's ``ResidualMLP()`` (``examples/basic_training.py``, batch 64
of 64 features, SGD), each compiled with ``torch.compile(backend=...)`` and trained in
interleaved blocks of ``--steps`` steps, one CPU thread, after 1,600 warm-up steps (the
default schedule's steady state):

- ``plain``: no observer;
- ``no-op root hooks``: a forward pre-hook and a forward hook on the root that do
  nothing (what a root hook costs around the compiled forward by itself);
- ``observer, one sample``: ``inject_observer(..., sampling=10**9)``, so only the first
  forward is sampled (the observer's fixed cost per forward: its eager root hooks);
- ``observer, default``: ``inject_observer`` at default sampling (adds the sampled
  forwards' graph variant with the reductions, and the flushes).

Printed per copy: the fastest block's time per step, its ratio to the plain copy's
fastest, and the median over blocks of the per-block ratio. Dynamo's
``skip_nnmodule_hook_guards`` is set to False so that each copy gets its own compiled
code (the copies are instances of one class). Measurement only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchinstruments import inject_observer, remove_observer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "basic_training.py"
WARMUP_STEPS = 1_600  # the default schedule reaches its steady interval by then
COPIES = ("plain", "no-op root hooks", "observer, one sample", "observer, default")


def _example_model() -> nn.Module:
    spec = importlib.util.spec_from_file_location("basic_training", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.ResidualMLP()


def _no_op_pre_hook(module: nn.Module, args: object) -> None:
    return None


def _no_op_hook(module: nn.Module, args: object, output: object) -> None:
    return None


def _make_copy(kind: str, backend: str, directory: Path) -> tuple[Callable[[], None], nn.Module]:
    torch.manual_seed(0)
    model = _example_model()
    if kind == "no-op root hooks":
        model.register_forward_pre_hook(_no_op_pre_hook)
        model.register_forward_hook(_no_op_hook)
    elif kind == "observer, one sample":
        inject_observer(model, output_dir=directory / "one-sample", sampling=10**9)
    elif kind == "observer, default":
        inject_observer(model, output_dir=directory / "default")
    compiled: Any = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 64, generator=generator)
    y = torch.randint(0, 10, (64,), generator=generator)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(compiled(x), y).backward()
        optimizer.step()

    return step, model


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--blocks", type=int, default=15, help="interleaved blocks per copy")
    parser.add_argument("--steps", type=int, default=200, help="training steps per block")
    args = parser.parse_args(argv)
    import torch._dynamo.config as dynamo_config

    torch.set_num_threads(1)
    dynamo_config.skip_nnmodule_hook_guards = False
    with tempfile.TemporaryDirectory() as tmp:
        copies = {kind: _make_copy(kind, args.backend, Path(tmp)) for kind in COPIES}
        for step, _ in copies.values():
            for _ in range(WARMUP_STEPS):
                step()
        times: dict[str, list[float]] = {kind: [] for kind in COPIES}
        for _ in range(args.blocks):
            for kind, (step, _) in copies.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                times[kind].append((time.perf_counter() - start) / args.steps)
        for kind, (_, model) in copies.items():
            if kind.startswith("observer"):
                remove_observer(model)
    plain = times["plain"]
    print(
        f"torch {torch.__version__}, backend {args.backend}, {args.blocks} blocks of "
        f"{args.steps} steps per copy, 1 thread"
    )
    print(f"{'copy':22s} {'fastest us/step':>15s} {'fastest ratio':>13s} {'median ratio':>12s}")
    for kind in COPIES:
        ratios = [a / b for a, b in zip(times[kind], plain, strict=True)]
        print(
            f"{kind:22s} {min(times[kind]) * 1e6:15.0f} {min(times[kind]) / min(plain):13.3f} "
            f"{statistics.median(ratios):12.3f}"
        )


if __name__ == "__main__":
    main()
