"""How long ``torch.compile`` takes with the observer: the first training steps, each
case in a fresh process.

    python benchmarks/compile_time.py                         # example model, inductor
    python benchmarks/compile_time.py --model gpt2 --steps 12
    python benchmarks/compile_time.py --cases plain,observed,observed-unshared --cache warm

Cases (``--cases``):

- ``plain``: the model compiled without the observer;
- ``observed``: ``inject_observer`` at default sampling, then compiled;
- ``observed-unshared``: the same, with each tensor's reductions traced where they are
  met rather than as a nested compile region that Dynamo traces once per element count
  (``_compiled_capture._rows_in_region`` set back to the plain function): what the
  region saves.

Models (``--model``): the example's ``ResidualMLP()`` (batch 64 of 64 features), or a
``transformers`` GPT-2 from a small config (4 layers of width 128, batch 8 of 64 tokens;
the same classes as ``compiled_step_parts.py``). Each case runs in a process of its own
with a compile cache of its own (``TORCHINDUCTOR_CACHE_DIR``), one thread: ``--cache
cold`` times the first run in a fresh cache, ``--cache warm`` the second run in it (what
a user sees on a rerun). Printed per case: the seconds to the end of the first step and
of step ``--steps`` (the first sampled forwards and the first unsampled ones each
compile a graph variant), Dynamo's own times (bytecode tracing, AOTAutograd's joint
trace, the backend compiler's share), the graphs built and the graph breaks.
Measurement only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.compiled_step_parts import (
    GPT2_TOKENS,
    GPT2_VOCABULARY,
    _example_class,
    _gpt2_class,
)

CASES = ("plain", "observed", "observed-unshared")
#: Dynamo's compile-time phases printed, by the name ``compile_times`` gives them.
PHASES = {
    "bytecode_tracing": "tracing",
    "aot_trace_joint_graph": "AOT trace",
    "OutputGraph.call_user_compiler": "backend",
}


def _child(case: str, model_name: str, steps: int, backend: str) -> dict[str, object]:
    """Run one case in this process; its timings."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = (_gpt2_class() if model_name == "gpt2" else _example_class())()
    if case != "plain":
        importlib.import_module("torch._dynamo")  # sets up the in-graph capture
        from torchinstruments import _compiled_capture, inject_observer

        inject_observer(model, output_dir=tempfile.mkdtemp(prefix="compile-time-"))
        if case == "observed-unshared":
            _compiled_capture._rows_in_region = _compiled_capture._masked_rows
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    if model_name == "gpt2":
        ids = torch.randint(0, GPT2_VOCABULARY, (8, GPT2_TOKENS), generator=generator)

        def loss() -> torch.Tensor:
            return compiled(ids)

    else:
        x = torch.randn(64, 64, generator=generator)
        y = torch.randint(0, 10, (64,), generator=generator)

        def loss() -> torch.Tensor:
            return nn.functional.cross_entropy(compiled(x), y)

    start = time.perf_counter()
    marks: list[float] = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss().backward()
        optimizer.step()
        marks.append(time.perf_counter() - start)
    from torch._dynamo.utils import compile_times, counters

    phases: dict[str, float] = {}
    for line in compile_times(repr="str", aggregate=True).splitlines():
        name, _, value = line.rpartition(", ")
        if name in PHASES:
            phases[PHASES[name]] = float(value)
    return {
        "first_step_s": marks[0],
        "last_step_s": marks[-1],
        "phases": phases,
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": int(sum(counters["graph_break"].values())),
    }


def _run_case(case: str, args: argparse.Namespace, cache: Path) -> dict[str, object]:
    command = [sys.executable, __file__, "--child", case, "--model", args.model]
    command += ["--steps", str(args.steps), "--backend", args.backend]
    environment = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
    done = subprocess.run(command, env=environment, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"case {case} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("example", "gpt2"), default="example")
    parser.add_argument("--cases", default=",".join(CASES), help=f"from {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=12, help="training steps timed")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--cache", choices=("cold", "warm"), default="cold")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps: expected an int >= 1, got {args.steps}")
    if args.child:
        print(json.dumps(_child(args.child, args.model, args.steps, args.backend)))
        return
    cases = [case.strip() for case in args.cases.split(",") if case.strip()]
    for case in cases:
        if case not in CASES:
            parser.error(f"--cases: unknown case {case!r}; choose from {', '.join(CASES)}")
    print(
        f"{args.model}: torch {torch.__version__}, backend {args.backend}, {args.cache} "
        f"compile cache, {args.steps} steps, one thread, one process per case"
    )
    header = f"{'case':20s} {'step 1 s':>9s} {f'step {args.steps} s':>10s}"
    header += "".join(f" {name:>10s}" for name in PHASES.values()) + "  graphs  breaks"
    print(header)
    for case in cases:
        with tempfile.TemporaryDirectory(prefix="compile-cache-") as cache:
            result = _run_case(case, args, Path(cache))
            if args.cache == "warm":
                result = _run_case(case, args, Path(cache))
        phases = result["phases"]
        assert isinstance(phases, dict)
        row = f"{case:20s} {result['first_step_s']:9.1f} {result['last_step_s']:10.1f}"
        row += "".join(f" {phases.get(name, 0.0):10.1f}" for name in PHASES.values())
        print(f"{row}  {result['graphs']:6d}  {result['breaks']:6d}")


if __name__ == "__main__":
    main()
