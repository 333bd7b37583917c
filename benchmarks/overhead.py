"""Overhead of torchinstruments on training loops (issue 4, item 1): measurement only.

    python benchmarks/overhead.py                 # full run (several minutes on 2 cores)
    python benchmarks/overhead.py --quick         # tiny sizes, for a CI smoke test (< 60 s)
    python benchmarks/overhead.py --workloads mlp,cnn --repeats 5 --json overhead.json
    python benchmarks/overhead.py --device cuda   # on a GPU, plus a GPU-sized transformer

On CUDA every timed step is bracketed by ``torch.cuda.synchronize()`` (both copies alike),
so the host clock measures the GPU work; statistics still move to the host only at flushes.

Method. Each workload is built twice from the same seed (identical initial weights): a
*plain* copy and an *observed* copy, each with its own SGD optimizer, fed the same fixed
batches. Training steps (zero_grad, forward, cross-entropy, backward, optimizer step)
alternate strictly A B A B ... in one process, plain first, with ``torch.set_num_threads``
fixed; each step is timed with ``time.perf_counter``. Warm-up steps, run on both copies
before any observer is attached, are excluded. Losses of the two copies are compared
bit for bit at every timed step (the observer is passive, so they must be identical).

A *block* is a run of consecutive interleaved steps; its ratio is the summed observed
step time divided by the summed plain step time. Each configuration prints the median,
minimum and maximum of its block ratios over ``--repeats`` blocks. Configurations:

* ``default``: ``inject_observer(model, output_dir=tmp)``. The whole-run ratio covers the
  first ``--run-steps`` (1,000) steps after injection, dense start included (one run, so
  no spread). The steady-state ratio is measured once the default schedule has reached
  its largest interval (forward 1,530 with the default 6 samples per stage and interval
  at most 256); the forwards between the end of the whole run and that point are advanced
  with untimed forward-only training forwards of a one-row batch on the observed copy
  (no backward, so no parameter changes). Steady-state blocks are whole multiples of the
  steady interval, so every block holds the same number of samples.
* ``sampling=1``: every training forward sampled.
* ``histograms``: ``sampling=1`` plus histograms, once ``inject_observer`` accepts a
  ``histograms`` argument; "n/a (not implemented)" until then.

Also measured: the cost of one unsampled hook call (a chain of trivial modules whose
forwards are never sampled, minus the same chain without hooks, per module call; with
hook parking switched off, as under ``torch.compile``, and with the default, where the
hooks of unsampled forwards are parked and never called), the
resident memory over 5,000 samples, the time to build and write the report of a model
with 2,000 observed modules, and ``torch.compile`` (injection before and after
compiling; graph breaks; compiled-step ratio at default sampling and at ``sampling=1``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import inspect
import itertools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import torchinstruments
from torchinstruments import inject_observer, remove_observer

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_PATH = REPO_ROOT / "examples" / "basic_training.py"

WORKLOAD_NAMES = ("mlp", "cnn", "transformer", "residual_mlp")
#: Workloads sized for a GPU (a CPU-sized model leaves a GPU waiting on kernel launches);
#: run by default with ``--device cuda``, on request elsewhere.
GPU_WORKLOAD_NAMES = ("transformer_large",)
ALL_WORKLOAD_NAMES = WORKLOAD_NAMES + GPU_WORKLOAD_NAMES
SECTIONS = ("overhead", "hook", "memory", "report", "compile")
#: Sections run by default with ``--device cuda``: the hook-call and report sections
#: measure host-side work that does not depend on the device.
CUDA_SECTIONS = ("overhead", "memory", "compile")
#: Device of the training loops (``--device``); set by :func:`main`.
DEVICE = torch.device("cpu")


def _synchronize() -> None:
    """Wait for queued GPU work, so that a host clock measures it (no-op on the CPU)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


#: Distinct batches cycled through by every training loop (same for both copies).
BATCHES = 8
#: Target plain seconds per block when ``--steps`` is not given.
BLOCK_TARGET_S = 0.25
BLOCK_TARGET_QUICK_S = 0.02


# --------------------------------------------------------------------------- workloads
class TransformerClassifier(nn.Module):
    """Linear embedding -> nn.TransformerEncoder -> mean over the sequence -> linear head."""

    def __init__(self, features: int, d_model: int, heads: int, layers: int, classes: int):
        super().__init__()
        self.embed = nn.Linear(features, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(dim=1))


def _load_example_module() -> Any:
    spec = importlib.util.spec_from_file_location("_ti_basic_training", EXAMPLE_PATH)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {EXAMPLE_PATH}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    classes: int = 10


def _mlp(sizes: Sequence[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _cnn(channels: Sequence[int], size: int, hidden: int) -> nn.Module:
    c1, c2, c3 = channels
    return nn.Sequential(
        nn.Conv2d(3, c1, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c2, c3, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(c3 * (size // 8) ** 2, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def make_workloads(quick: bool) -> dict[str, Workload]:
    """The four CPU workloads of issue 4 and a GPU-sized one (tiny versions with ``quick``)."""
    example = _load_example_module()
    residual_mlp = example.ResidualMLP
    if quick:
        return {
            "mlp": Workload(
                "mlp", "MLP 64-32-32-10, batch 8", lambda: _mlp((64, 32, 32, 10)), (8, 64)
            ),
            "cnn": Workload(
                "cnn",
                "CNN 3 conv (4,8,8) + 2 linear, 3x8x8, batch 4",
                lambda: _cnn((4, 8, 8), 8, 16),
                (4, 3, 8, 8),
            ),
            "transformer": Workload(
                "transformer",
                "encoder 1 layer, d_model 16, 2 heads, seq 8, batch 2",
                lambda: TransformerClassifier(8, 16, 2, 1, 10),
                (2, 8, 8),
            ),
            "residual_mlp": Workload(
                "residual_mlp",
                "examples/basic_training.py ResidualMLP(width 16, depth 2), batch 8",
                lambda: residual_mlp(inputs=64, width=16, depth=2),
                (8, 64),
            ),
            "transformer_large": Workload(
                "transformer_large",
                "encoder 2 layers, d_model 32, 4 heads, seq 16, batch 4",
                lambda: TransformerClassifier(16, 32, 4, 2, 10),
                (4, 16, 16),
            ),
        }
    return {
        "mlp": Workload(
            "mlp", "MLP 64-256-256-10, batch 64", lambda: _mlp((64, 256, 256, 10)), (64, 64)
        ),
        "cnn": Workload(
            "cnn",
            "CNN 3 conv (16,32,64) + 2 linear (1024-128-10), 3x32x32, batch 32",
            lambda: _cnn((16, 32, 64), 32, 128),
            (32, 3, 32, 32),
        ),
        "transformer": Workload(
            "transformer",
            "nn.TransformerEncoder 4 layers, d_model 128, 4 heads, ff 512, seq 64, batch 16",
            lambda: TransformerClassifier(32, 128, 4, 4, 10),
            (16, 64, 32),
        ),
        "residual_mlp": Workload(
            "residual_mlp",
            "examples/basic_training.py ResidualMLP() on digits-shaped input (64), batch 64",
            lambda: residual_mlp(),
            (64, 64),
        ),
        "transformer_large": Workload(
            "transformer_large",
            "nn.TransformerEncoder 6 layers, d_model 768, 12 heads, ff 3072, seq 256, "
            "batch 32 (GPU-sized)",
            lambda: TransformerClassifier(64, 768, 12, 6, 10),
            (32, 256, 64),
        ),
    }


# --------------------------------------------------------------------------- helpers
def _train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def _summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def _rss_kib() -> int | None:
    """Current resident set size in KiB (VmRSS), or None where /proc is missing."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _steady_schedule() -> tuple[int, int]:
    """(first forward at the largest interval, that interval) of the default schedule."""
    try:
        stages = torchinstruments.DefaultSampling().describe().get("stages")
        if isinstance(stages, list) and stages:
            last = stages[-1]
            return int(last["from_forward"]), int(last["interval_forwards"])
    except Exception:
        pass
    return 1530, 256


def _histograms_supported() -> bool:
    try:
        return "histograms" in inspect.signature(inject_observer).parameters
    except (TypeError, ValueError):
        return False


def _histograms_argument() -> tuple[Any, ...]:
    """A ``histograms=`` value that turns histograms on for every observed module."""
    factory = getattr(torchinstruments, "histogram", None)
    if factory is None:
        raise RuntimeError(
            "inject_observer takes histograms= but torchinstruments.histogram is missing"
        )
    errors = []
    for args in (("*",), ()):
        try:
            return (factory(*args),)
        except Exception as error:  # unknown signature: try the next form
            errors.append(f"histogram{args!r}: {error}")
    raise RuntimeError("; ".join(errors))


class _NeverSample:
    """Sampling policy that samples no forward (public SamplingPolicy protocol)."""

    def should_sample(self, forward_index: int) -> bool:
        return False

    def next_sampled(self, forward_index: int) -> int:
        return sys.maxsize  # no forward is sampled, as the built-in policies can tell

    def describe(self) -> dict[str, object]:
        return {"policy": "never (benchmark)"}


_STARTED = time.perf_counter()


def _progress(message: str) -> None:
    elapsed = time.perf_counter() - _STARTED
    print(f"[overhead {elapsed:6.1f} s] {message}", file=sys.stderr, flush=True)


def _read_coverage(directory: Path) -> dict[str, Any]:
    try:
        report = json.loads((directory / "report.json").read_text(encoding="utf-8"))
        coverage = report.get("coverage", {})
        return coverage if isinstance(coverage, dict) else {}
    except (OSError, ValueError):
        return {}


# --------------------------------------------------------------------------- pair runner
class Pair:
    """A plain and an observed copy of one model, trained in strict alternation."""

    def __init__(self, workload: Workload, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.plain = workload.build().to(DEVICE)
        self.observed = copy.deepcopy(self.plain)
        self.opt_plain = torch.optim.SGD(self.plain.parameters(), lr=1e-3, momentum=0.9)
        self.opt_observed = torch.optim.SGD(self.observed.parameters(), lr=1e-3, momentum=0.9)
        generator = torch.Generator().manual_seed(seed + 1)
        self.batches = [
            (
                torch.randn(*workload.input_shape, generator=generator).to(DEVICE),
                torch.randint(
                    0, workload.classes, (workload.input_shape[0],), generator=generator
                ).to(DEVICE),
            )
            for _ in range(BATCHES)
        ]
        self.step = 0
        self.identical = True
        self.observed_forwards = 0  # training forwards of the observed copy since injection

    def run(self, steps: int) -> tuple[float, float]:
        """Run ``steps`` interleaved step pairs; return (plain s, observed s)."""
        plain_s = observed_s = 0.0
        clock = time.perf_counter
        synchronize = _synchronize
        for _ in range(steps):
            x, y = self.batches[self.step % BATCHES]
            self.step += 1
            synchronize()
            t0 = clock()
            loss_plain = _train_step(self.plain, self.opt_plain, x, y)
            synchronize()
            t1 = clock()
            loss_observed = _train_step(self.observed, self.opt_observed, x, y)
            synchronize()
            t2 = clock()
            plain_s += t1 - t0
            observed_s += t2 - t1
            self.observed_forwards += 1
            if self.identical and not torch.equal(loss_plain, loss_observed):
                self.identical = False
        return plain_s, observed_s

    def advance(self, forwards: int, *, full_batch: bool = False) -> None:
        """Untimed training forwards (no backward) of the observed copy only."""
        x = self.batches[0][0]
        if not full_batch:
            x = x[:1]
        for _ in range(forwards):
            self.observed(x)
            self.observed_forwards += 1


def _blocks(pair: Pair, block: int, repeats: int) -> list[tuple[float, float]]:
    return [pair.run(block) for _ in range(repeats)]


def _block_steps(plain_step_s: float, requested: int | None, multiple: int, target_s: float) -> int:
    if requested is not None:
        steps = max(requested, 1)
    else:
        steps = max(4, math.ceil(target_s / max(plain_step_s, 1e-6)))
    return multiple * math.ceil(steps / multiple)


def _row(
    workload: str,
    config: str,
    blocks: list[tuple[float, float]],
    steps: int,
    samples_per_block: float,
    identical: bool,
    note: str = "",
) -> dict[str, Any]:
    ratios = [observed / plain for plain, observed in blocks]
    plain_ms = 1e3 * sum(p for p, _ in blocks) / (steps * len(blocks))
    observed_ms = 1e3 * sum(o for _, o in blocks) / (steps * len(blocks))
    extra = statistics.median(1e3 * (observed - plain) / steps for plain, observed in blocks)
    return {
        "workload": workload,
        "config": config,
        "blocks": len(blocks),
        "steps_per_block": steps,
        "samples_per_block": samples_per_block,
        "plain_ms_per_step": plain_ms,
        "observed_ms_per_step": observed_ms,
        "ratio": _summary(ratios),
        "block_ratios": ratios,
        "extra_ms_per_step": extra,
        "losses_identical": identical,
        "note": note,
    }


def _na_row(workload: str, config: str, note: str) -> dict[str, Any]:
    return {"workload": workload, "config": config, "ratio": None, "note": note}


def bench_overhead(workload: Workload, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    pair = Pair(workload)
    target_s = BLOCK_TARGET_QUICK_S if args.quick else BLOCK_TARGET_S

    # Warm-up on both copies, before any observer: excluded from every measurement.
    warm: list[float] = []
    for _ in range(args.warmup):
        plain_s, _ = pair.run(1)
        warm.append(plain_s)
    plain_step_s = statistics.median(warm) if warm else 1e-3
    pair.observed_forwards = 0

    # Default settings: whole run, then steady state.
    steady_start, steady_interval = _steady_schedule()
    policy = torchinstruments.DefaultSampling()
    directory = tmp / f"{workload.name}-default"
    _progress(f"{workload.name}: default settings, whole {args.run_steps}-step run")
    inject_observer(pair.observed, output_dir=directory)
    gc.collect()
    plain_s, observed_s = pair.run(args.run_steps)
    whole_samples = sum(policy.should_sample(i) for i in range(args.run_steps))
    rows.append(
        _row(
            workload.name,
            f"default, whole {args.run_steps}-step run",
            [(plain_s, observed_s)],
            args.run_steps,
            whole_samples,
            pair.identical,
            note="one run (dense start included)",
        )
    )
    if pair.observed_forwards < steady_start:
        pair.advance(steady_start - pair.observed_forwards)
    block = _block_steps(plain_step_s, args.steps, steady_interval, target_s)
    _progress(f"{workload.name}: default settings, steady state, {args.repeats} x {block} steps")
    pair.run(steady_interval)  # untimed: one steady interval to settle
    gc.collect()
    blocks = _blocks(pair, block, args.repeats)
    remove_observer(pair.observed)
    note = f"from forward {steady_start} on, one sample every {steady_interval} forwards"
    seen = _read_coverage(directory).get("samples_observed")
    expected = sum(policy.should_sample(i) for i in range(pair.observed_forwards))
    if isinstance(seen, int) and seen != expected:
        note += f"; report says {seen} samples, the schedule {expected}"
    rows.append(
        _row(
            workload.name,
            "default, steady state",
            blocks,
            block,
            block // steady_interval,
            pair.identical,
            note=note,
        )
    )

    # Hooks attached, no forward sampled: the floor of the default steady state.
    block0 = _block_steps(plain_step_s, args.steps, 1, target_s)
    _progress(f"{workload.name}: no forward sampled, {args.repeats} x {block0} steps")
    inject_observer(
        pair.observed, output_dir=tmp / f"{workload.name}-never", sampling=_NeverSample()
    )
    pair.run(2)
    gc.collect()
    blocks = _blocks(pair, block0, args.repeats)
    remove_observer(pair.observed)
    rows.append(
        _row(
            workload.name,
            "hooks only (no forward sampled)",
            blocks,
            block0,
            0,
            pair.identical,
        )
    )

    # Every forward sampled.
    block1 = _block_steps(plain_step_s, args.steps, 1, target_s)
    _progress(f"{workload.name}: sampling=1, {args.repeats} x {block1} steps")
    inject_observer(pair.observed, output_dir=tmp / f"{workload.name}-every", sampling=1)
    pair.run(2)  # untimed: series creation
    gc.collect()
    blocks = _blocks(pair, block1, args.repeats)
    remove_observer(pair.observed)
    rows.append(_row(workload.name, "sampling=1", blocks, block1, block1, pair.identical))

    # Histograms (sampling=1 plus histograms), once implemented.
    if not _histograms_supported():
        rows.append(_na_row(workload.name, "sampling=1 + histograms", "n/a (not implemented)"))
    else:
        try:
            histograms = _histograms_argument()
            inject_observer(
                pair.observed,
                output_dir=tmp / f"{workload.name}-histograms",
                sampling=1,
                histograms=histograms,  # pyrefly: ignore[unexpected-keyword]
            )
        except Exception as error:
            rows.append(
                _na_row(
                    workload.name,
                    "sampling=1 + histograms",
                    f"n/a ({type(error).__name__}: {error})",
                )
            )
        else:
            _progress(f"{workload.name}: sampling=1 + histograms, {args.repeats} x {block1} steps")
            pair.run(2)
            gc.collect()
            blocks = _blocks(pair, block1, args.repeats)
            remove_observer(pair.observed)
            rows.append(
                _row(
                    workload.name, "sampling=1 + histograms", blocks, block1, block1, pair.identical
                )
            )
    return rows


# --------------------------------------------------------------------------- hook call
def bench_hook_call(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Cost of one unsampled forward-hook call, per observed module call."""
    modules = 100 if args.quick else 1000
    forwards = 5 if args.quick else 50
    repeats = 5 if args.quick else max(args.repeats, 5) * 2

    def chain() -> nn.Module:
        return nn.Sequential(*(nn.Identity() for _ in range(modules)))

    plain, noop, observed, parked = chain(), chain(), chain(), chain()

    def noop_hook(module: nn.Module, inputs: object, output: object) -> None:
        return None

    for module in noop.modules():
        module.register_forward_hook(noop_hook)
    handle = inject_observer(observed, output_dir=tmp / "hook", sampling=_NeverSample())
    # Parking (submodule hooks taken out during unsampled eager forwards) would leave no
    # hook to call; switch it off on this copy, as torch.compile does, to time the call.
    # The "parked" copy keeps the default.
    observer = handle._observer
    assert observer is not None
    observer.parking.status = "off: benchmark"
    inject_observer(parked, output_dir=tmp / "hook-parked", sampling=_NeverSample())
    x = torch.randn(4, 4)
    models = {"plain": plain, "noop": noop, "observed": observed, "parked": parked}
    times: dict[str, list[float]] = {name: [] for name in models}
    clock = time.perf_counter
    with torch.enable_grad():
        for model in models.values():
            model.train()
            for _ in range(forwards):
                model(x)
        for _ in range(repeats):
            for name, model in models.items():
                start = clock()
                for _ in range(forwards):
                    model(x)
                times[name].append(clock() - start)
    report = handle.report() or {}
    remove_observer(observed)
    remove_observer(parked)

    # Fixed cost per unsampled training forward: the root's pre- and post-hooks (sampling
    # decision, context) and whatever they check on the root output (a 64 x 10 "logits").
    root_plain, root_observed = nn.Identity(), nn.Identity()
    inject_observer(root_observed, output_dir=tmp / "hook-root", sampling=_NeverSample())
    logits = torch.randn(64, 10)
    root_forwards = forwards * 20
    root_times: dict[str, list[float]] = {"plain": [], "observed": []}
    with torch.enable_grad():
        for _ in range(repeats):
            for name, model in (("plain", root_plain), ("observed", root_observed)):
                start = clock()
                for _ in range(root_forwards):
                    model(logits)
                root_times[name].append(clock() - start)
    remove_observer(root_observed)
    root_cost = [
        1e6 * (o - p) / root_forwards
        for o, p in zip(root_times["observed"], root_times["plain"], strict=True)
    ]
    calls = forwards * modules
    ours = [1e6 * (o - p) / calls for o, p in zip(times["observed"], times["plain"], strict=True)]
    noop_cost = [1e6 * (n - p) / calls for n, p in zip(times["noop"], times["plain"], strict=True)]
    above = [1e6 * (o - n) / calls for o, n in zip(times["observed"], times["noop"], strict=True)]
    parked_cost = [
        1e6 * (o - p) / calls for o, p in zip(times["parked"], times["plain"], strict=True)
    ]
    samples = report.get("coverage", {}).get("samples_observed")
    return {
        "modules": modules,
        "forwards_per_repeat": forwards,
        "repeats": repeats,
        "plain_us_per_module_call": 1e6 * statistics.median(times["plain"]) / calls,
        "unsampled_hook_us": _summary(ours),
        "noop_hook_us": _summary(noop_cost),
        "ours_above_noop_us": _summary(above),
        "parked_us": _summary(parked_cost),
        "root_forward_us": _summary(root_cost),
        "samples_observed": samples,
    }


# --------------------------------------------------------------------------- memory
def bench_memory(
    workloads: dict[str, Workload], args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    """RSS while an observed MLP takes 5,000 samples (sampling=1).

    Run first, before the other sections, so that freed memory of larger workloads does
    not hide growth. ``sys.getallocatedblocks()`` (Python objects alive) is recorded
    alongside, since a growing Python heap can stay inside already-resident pages.
    """
    total = 500 if args.quick else 5000
    checkpoints = set(range(0, total + 1, total // 5))
    pair = Pair(workloads["mlp"])
    model, optimizer = pair.observed, pair.opt_observed
    for i in range(5):
        x, y = pair.batches[i % BATCHES]
        _train_step(model, optimizer, x, y)
    gc.collect()
    before = _rss_kib()
    handle = inject_observer(model, output_dir=tmp / "memory", sampling=1)
    rss: dict[int, int | None] = {}
    blocks: dict[int, int] = {}
    device_bytes: dict[int, int] = {}
    start = time.perf_counter()
    for i in range(total + 1):
        if i in checkpoints:
            gc.collect()
            rss[i] = _rss_kib()
            blocks[i] = sys.getallocatedblocks()
            if DEVICE.type == "cuda":
                _synchronize()
                device_bytes[i] = torch.cuda.memory_allocated(DEVICE)
        if i == total:
            break
        x, y = pair.batches[i % BATCHES]
        _train_step(model, optimizer, x, y)
    elapsed = time.perf_counter() - start
    report = handle.report() or {}
    remove_observer(model)
    coverage = report.get("coverage", {})
    return {
        "workload": workloads["mlp"].description,
        "samples": total,
        "rss_kib_before_inject": before,
        "rss_kib": {str(k): v for k, v in rss.items()},
        "python_blocks": {str(k): v for k, v in blocks.items()},
        "cuda_allocated_bytes": {str(k): v for k, v in device_bytes.items()},
        "seconds": elapsed,
        "samples_observed": coverage.get("samples_observed"),
        "series": coverage.get("series"),
        "tensor_series": coverage.get("tensor_series"),
    }


# --------------------------------------------------------------------------- report
def bench_report(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Build + write time of the report of a model with 2,000 observed modules."""
    modules = 200 if args.quick else 2000
    steps = 3
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(modules)]
    for layer in layers:  # norm-preserving: no vanishing activations over 2,000 layers
        nn.init.orthogonal_(layer.weight)
        nn.init.zeros_(layer.bias)
    model = nn.Sequential(*layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    directory = tmp / "report"
    handle = inject_observer(model, output_dir=directory, sampling=1)
    generator = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    for _ in range(steps):
        x = torch.randn(8, 4, generator=generator)
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()
    step_s = (time.perf_counter() - start) / steps
    clock = time.perf_counter
    gc.collect()  # the process's own debt (see the overhead section), not the report's
    start = clock()
    handle.flush()
    first = clock() - start
    again = []
    for _ in range(3):
        start = clock()
        handle.flush()
        again.append(clock() - start)
    size = (
        (directory / "report.json").stat().st_size if (directory / "report.json").exists() else None
    )
    coverage = _read_coverage(directory)
    remove_observer(model)
    return {
        "observed_modules": modules + 1,
        "sampled_steps": steps,
        "sampled_step_s": step_s,
        "first_flush_s": first,
        "flush_again_s": _summary(again),
        "report_json_bytes": size,
        "tensor_series": coverage.get("tensor_series"),
        "series": coverage.get("series"),
    }


# --------------------------------------------------------------------------- compile
def _compile(module: nn.Module, backend: str) -> nn.Module:
    compiled: Any = torch.compile(module, backend=backend)
    return compiled


def _count_graph_breaks() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    breaks = sum(counters["graph_break"].values())
    graphs = counters["stats"].get("unique_graphs", 0)
    return breaks, graphs


def _explain(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    try:
        explained = torch._dynamo.explain(model)(x)
        return {
            "graph_count": explained.graph_count,
            "graph_break_count": explained.graph_break_count,
            "break_reasons": sorted({str(r.reason)[:120] for r in explained.break_reasons})[:5],
        }
    except Exception as error:
        return {"error": f"{type(error).__name__}: {str(error)[:200]}"}


def _pick_backend(args: argparse.Namespace, workload: Workload) -> tuple[str, str]:
    if args.compile_backend != "auto":
        return args.compile_backend, "requested"
    if args.quick:
        return "eager", "quick run: backend 'eager' (inductor compiles too slowly for a smoke test)"
    try:
        torch._dynamo.reset()
        pair = Pair(workload)
        compiled = _compile(pair.plain, "inductor")
        x, y = pair.batches[0]
        start = time.perf_counter()
        _train_step(compiled, pair.opt_plain, x, y)
        return "inductor", f"inductor first compiled step {time.perf_counter() - start:.1f} s"
    except Exception as error:
        return "eager", f"inductor unavailable ({type(error).__name__}: {str(error)[:120]}); eager"


COMPILE_CASES = ("inject before compile", "inject after compile")
#: Compiled-step ratio cases: the two injection orders at default sampling, then every
#: forward sampled (the graph with the in-graph reductions runs at every step).
RATIO_CASES = (*COMPILE_CASES, "sampling=1")
#: ``--compile-cases`` names: the coverage check (both injection orders), then each
#: ratio case.
COMPILE_CASE_NAMES = {
    "coverage": "coverage",
    "before": "inject before compile",
    "after": "inject after compile",
    "every": "sampling=1",
}


def _compile_coverage(workload: Workload, backend: str, tmp: Path) -> dict[str, Any]:
    """Telemetry coverage and graph breaks with the default dynamo configuration.

    One observed model per case, no plain twin, ``sampling=1``: are all selected modules
    observed, how many graph breaks and graphs does the observer cause?
    """
    from torch._dynamo.utils import counters

    results: dict[str, Any] = {}
    for case in COMPILE_CASES:
        torch._dynamo.reset()
        counters.clear()
        pair = Pair(workload)
        model, optimizer = pair.observed, pair.opt_observed
        x, y = pair.batches[0]
        directory = tmp / f"coverage-{case.split()[1]}"
        entry: dict[str, Any] = {}
        try:
            if case == "inject before compile":
                handle = inject_observer(model, output_dir=directory, sampling=1)
                compiled = _compile(model, backend)
            else:
                compiled = _compile(model, backend)
                _train_step(compiled, optimizer, x, y)
                handle = inject_observer(compiled, output_dir=directory, sampling=1)
            for i in range(3):
                bx, by = pair.batches[i % BATCHES]
                _train_step(compiled, optimizer, bx, by)
            breaks, graphs = _count_graph_breaks()
            report = handle.report() or {}
            coverage = report.get("coverage", {})
            entry.update(
                {
                    "modules_selected": coverage.get("modules_selected"),
                    "modules_observed": coverage.get("modules_observed"),
                    "tensor_series": coverage.get("tensor_series"),
                    "samples_observed": coverage.get("samples_observed"),
                    "errors_total": coverage.get("errors_total"),
                    "graph_breaks_counter": breaks,
                    "unique_graphs": graphs,
                    "names_with_orig_mod_prefix": "_orig_mod." in json.dumps(report),
                }
            )
            entry["explain"] = _explain(model, x)
            remove_observer(compiled if case == "inject after compile" else model)
        except Exception as error:
            entry["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            with contextlib.suppress(Exception):
                remove_observer(model)
        results[case] = entry
    return results


def _compile_ratio(
    case: str, workload: Workload, backend: str, args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    """Compiled plain and compiled observed copies, interleaved: default sampling in the
    two injection orders, or every forward sampled (case ``"sampling=1"``, injected
    before compiling)."""
    every = case == "sampling=1"
    steady_start, steady_interval = (0, 1) if every else _steady_schedule()
    target_s = BLOCK_TARGET_QUICK_S if args.quick else BLOCK_TARGET_S
    torch._dynamo.reset()
    pair = Pair(workload)
    directory = tmp / ("compile-every" if every else f"compile-{case.split()[1]}")
    x, y = pair.batches[0]
    # The copy compiled first in a process trains 3-5% slower than the ones after it
    # (six plain copies of the example model, measured side by side); an untimed copy
    # takes that place, so that neither the plain nor the observed copy is first.
    warm = _compile(copy.deepcopy(pair.plain), backend)
    warm_optimizer = torch.optim.SGD(warm.parameters(), lr=1e-3, momentum=0.9)
    for warm_x, warm_y in pair.batches[:3]:
        _train_step(warm, warm_optimizer, warm_x, warm_y)
    del warm, warm_optimizer
    pair.plain = _compile(pair.plain, backend)
    start = time.perf_counter()
    _train_step(pair.plain, pair.opt_plain, x, y)
    entry: dict[str, Any] = {"plain_first_step_s": time.perf_counter() - start}
    observed_module = pair.observed
    target: nn.Module = observed_module
    try:
        if case != "inject after compile":
            handle = inject_observer(
                observed_module, output_dir=directory, sampling=1 if every else None
            )
            pair.observed = _compile(observed_module, backend)
        else:
            pair.observed = _compile(observed_module, backend)
            _train_step(pair.observed, pair.opt_observed, x, y)  # compiled without hooks
            handle = inject_observer(pair.observed, output_dir=directory)
            target = pair.observed
        start = time.perf_counter()
        _train_step(pair.observed, pair.opt_observed, x, y)
        entry["observed_first_step_s"] = time.perf_counter() - start
        if case == "inject after compile":
            _train_step(pair.plain, pair.opt_plain, x, y)  # level: both copies updated twice
        pair.step = 1
        pair.observed_forwards = 1  # training forwards since injection
        pair.run(max(args.warmup, 2))
        per_block = max(min(48, 60 - pair.observed_forwards), 4) // 4
        dense = _blocks(pair, per_block, 4)
        entry["dense_start_ratio"] = _summary([o / p for p, o in dense])
        if pair.observed_forwards < steady_start:
            pair.advance(steady_start - pair.observed_forwards, full_batch=True)
        plain_step_s = sum(p for p, _ in dense) / (4 * per_block)
        block = _block_steps(plain_step_s, args.steps, steady_interval, target_s)
        pair.run(steady_interval)
        blocks = _blocks(pair, block, args.repeats)
        coverage = (handle.report() or {}).get("coverage", {})
        entry.update(
            {
                "steady_ratio": _summary([o / p for p, o in blocks]),
                "steady_blocks": len(blocks),
                "steady_steps_per_block": block,
                "plain_ms_per_step": 1e3 * sum(p for p, _ in blocks) / (block * len(blocks)),
                "observed_ms_per_step": 1e3 * sum(o for _, o in blocks) / (block * len(blocks)),
                "losses_identical": pair.identical,
                "modules_selected": coverage.get("modules_selected"),
                "modules_observed": coverage.get("modules_observed"),
                "samples_observed": coverage.get("samples_observed"),
            }
        )
        remove_observer(target)
    except Exception as error:
        entry["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        with contextlib.suppress(Exception):
            remove_observer(target)
    return entry


def bench_compile(
    workloads: dict[str, Workload], args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    import torch._dynamo.config as dynamo_config

    workload = workloads[args.compile_workload]
    backend, backend_note = _pick_backend(args, workload)
    _progress(f"compile: backend {backend} ({backend_note})")
    results: dict[str, Any] = {
        "workload": workload.description,
        "backend": backend,
        "note": backend_note,
    }
    if "coverage" in args.compile_case_list:
        _progress("compile: coverage and graph breaks (default dynamo configuration)")
        results["coverage"] = _compile_coverage(workload, backend, tmp)
    # The plain and the observed copy are two instances of one class: they share
    # Dynamo's cache, and the observer keeps the guards on both copies' empty forward
    # hook dictionaries (torchinstruments.compiled), so that neither runs the other's
    # code. The plain copy pays those guards too (compiled_step_parts.py compares with
    # a model of a class of its own).
    results["ratio_dynamo_setting"] = (
        f"skip_nnmodule_hook_guards={getattr(dynamo_config, 'skip_nnmodule_hook_guards', None)}"
    )
    try:
        for case in RATIO_CASES:
            if case not in args.compile_case_list:
                results[case] = {"error": "not run (--compile-cases)"}
                continue
            if args.quick and case != "inject before compile":
                results[case] = {"error": "not run with --quick"}
                continue
            _progress(f"compile: ratio, {case}")
            results[case] = entry = _compile_ratio(case, workload, backend, args, tmp)
            if "steady_ratio" in entry:
                # Printed at once: a run cut off later keeps this case's result.
                _progress(
                    f"compile: {case}: steady ratio {_fmt_ratio(entry['steady_ratio'])}, "
                    f"{entry['plain_ms_per_step']:.2f} / {entry['observed_ms_per_step']:.2f} "
                    f"ms a step, losses identical {entry['losses_identical']}"
                )
    finally:
        torch._dynamo.reset()
    return results


# --------------------------------------------------------------------------- printing
def _fmt_ratio(summary: dict[str, float] | None) -> str:
    if summary is None:
        return "-"
    return f"{summary['median']:.3f} [{summary['min']:.3f}, {summary['max']:.3f}]"


def _table(headers: Sequence[str], rows: Iterator[Sequence[str]] | list[list[str]]) -> str:
    rows = [list(r) for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows if i < len(r))) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip())
    return "\n".join(lines)


OVERHEAD_HEADERS = (
    "workload",
    "configuration",
    "blocks x steps",
    "plain ms/step",
    "ratio median [min, max]",
    "samples/block",
    "extra ms/step",
    "losses identical",
)


def _overhead_cells(row: dict[str, Any]) -> list[str]:
    if row.get("ratio") is None:
        return [row["workload"], row["config"], "-", "-", row["note"], "-", "-", "-"]
    ratio = row["ratio"]
    return [
        row["workload"],
        row["config"],
        f"{row['blocks']} x {row['steps_per_block']}",
        f"{row['plain_ms_per_step']:.2f}",
        f"{ratio['median']:.3f}" if row["blocks"] == 1 else _fmt_ratio(ratio),
        f"{row['samples_per_block']:g}",
        f"{row['extra_ms_per_step']:.3f}",
        "yes" if row["losses_identical"] else "NO",
    ]


def print_overhead(rows: list[dict[str, Any]], *, partial: bool = False) -> None:
    if partial:
        print("\n== Training-step overhead so far (full table at the end) ==")
        print(_table(OVERHEAD_HEADERS, [_overhead_cells(row) for row in rows]))
        sys.stdout.flush()
        return
    print("\n== Training-step overhead: ratio = observed / plain step time ==")
    print(
        "blocks: consecutive interleaved steps (A B A B ...); ratio per block = sum observed / "
        "sum plain;\nmedian [min, max] over blocks. extra ms/step: median over blocks of "
        "(observed - plain) / steps."
    )
    print(_table(OVERHEAD_HEADERS, [_overhead_cells(row) for row in rows]))
    notes = [
        f"  {r['workload']} / {r['config']}: {r['note']}"
        for r in rows
        if r.get("note") and r.get("ratio")
    ]
    if notes:
        print("notes:")
        print("\n".join(notes))


def print_hook(result: dict[str, Any]) -> None:
    print("\n== Unsampled hook call ==")
    print(
        f"nn.Sequential of {result['modules']} nn.Identity, train mode, grad enabled, a sampling "
        f"policy that samples no forward, hook parking off (as under torch.compile) unless "
        f"stated; {result['repeats']} repeats of {result['forwards_per_repeat']} forwards, "
        "per module call:"
    )
    print(
        _table(
            ("measure", "microseconds median [min, max]"),
            [
                ["plain module call (no hooks)", f"{result['plain_us_per_module_call']:.3f}"],
                ["unsampled hook call (observed - plain)", _fmt_ratio(result["unsampled_hook_us"])],
                [
                    "torch hook dispatch, no-op hook (noop - plain)",
                    _fmt_ratio(result["noop_hook_us"]),
                ],
                [
                    "ours above a no-op hook (observed - noop)",
                    _fmt_ratio(result["ours_above_noop_us"]),
                ],
                [
                    "default (hooks parked in unsampled forwards; parked - plain)",
                    _fmt_ratio(result["parked_us"]) if "parked_us" in result else "n/a",
                ],
                [
                    "per unsampled root forward: root hooks + output check (64 x 10)",
                    _fmt_ratio(result["root_forward_us"]),
                ],
            ],
        )
    )


def print_memory(result: dict[str, Any]) -> None:
    print("\n== Resident memory over samples ==")
    print(
        f"{result['workload']}, sampling=1, {result['samples']} samples "
        f"in {result['seconds']:.1f} s"
    )
    rss = result["rss_kib"]
    blocks = result["python_blocks"]
    base = rss.get("0")
    table = []
    for key, value in rss.items():
        growth = "-" if value is None or base is None else f"{(value - base) / 1024:+.1f}"
        table.append(
            [
                key,
                "-" if value is None else f"{value / 1024:.1f}",
                growth,
                str(blocks[key]),
                f"{blocks[key] - blocks['0']:+d}",
            ]
        )
    print(
        _table(
            ("samples", "RSS MiB", "RSS since 0 MiB", "Python blocks", "blocks since 0"),
            table,
        )
    )
    keys = sorted(int(k) for k in rss)
    first, last = str(keys[1]) if len(keys) > 1 else "0", str(keys[-1])
    if rss.get(first) is not None and rss.get(last) is not None:
        growth = (rss[last] - rss[first]) / 1024
        print(
            f"growth from {first} to {last} samples: RSS {growth:+.1f} MiB, Python blocks "
            f"{blocks[last] - blocks[first]:+d}"
        )
    allocated = result.get("cuda_allocated_bytes") or {}
    if allocated:
        print(
            "CUDA memory allocated (torch.cuda.memory_allocated), MiB: "
            + ", ".join(f"{k}: {v / 2**20:.2f}" for k, v in allocated.items())
        )
    print(
        f"before inject: {result['rss_kib_before_inject'] / 1024:.1f} MiB; "
        f"series tracked: {result['series']} (tensor series {result['tensor_series']})"
    )


def print_report(result: dict[str, Any]) -> None:
    print("\n== Report build and write ==")
    print(
        f"nn.Sequential of {result['observed_modules'] - 1} Linear(4, 4) "
        f"({result['observed_modules']} observed modules with the root), sampling=1, "
        f"{result['sampled_steps']} sampled steps ({result['sampled_step_s']:.2f} s each); "
        f"{result['tensor_series']} tensor series"
    )
    print(
        _table(
            ("measure", "seconds"),
            [
                [
                    "handle.flush(), first (processes pending statistics)",
                    f"{result['first_flush_s']:.3f}",
                ],
                [
                    "handle.flush(), again (median [min, max] of 3)",
                    _fmt_ratio(result["flush_again_s"]),
                ],
            ],
        )
    )
    print(f"report.json: {result['report_json_bytes']} bytes")


def _print_compile_coverage(coverage: dict[str, Any]) -> None:
    print(
        "coverage: one observed model, sampling=1, default dynamo configuration, 3 steps "
        "after injection"
    )
    coverage_rows = []
    notes = []
    for case in COMPILE_CASES:
        entry = coverage.get(case, {})
        if "error" in entry:
            coverage_rows.append([case, entry["error"][:70], "-", "-", "-", "-", "-"])
            continue
        explain = entry.get("explain", {})
        complete = entry["modules_observed"] == entry["modules_selected"]
        coverage_rows.append(
            [
                case,
                f"{entry['modules_observed']} / {entry['modules_selected']}",
                str(entry["tensor_series"]),
                str(entry["graph_breaks_counter"]),
                str(entry["unique_graphs"]),
                f"{explain.get('graph_break_count', '?')} / {explain.get('graph_count', '?')}",
                "yes" if complete else "NO",
            ]
        )
        if "break_reasons" in explain:
            notes.extend(f"  {case}: break reason: {r}" for r in explain["break_reasons"])
        elif "error" in explain:
            notes.append(f"  {case}: torch._dynamo.explain failed: {explain['error']}")
        if entry.get("names_with_orig_mod_prefix"):
            notes.append(f"  {case}: module names in the report carry the '_orig_mod.' prefix")
        if entry.get("errors_total"):
            notes.append(f"  {case}: {entry['errors_total']} hook errors counted")
    print(
        _table(
            (
                "case",
                "modules observed / selected",
                "tensor series",
                "graph breaks (counter)",
                "graphs (counter)",
                "explain breaks / graphs",
                "telemetry complete",
            ),
            coverage_rows,
        )
    )
    if notes:
        print("\n".join(notes))


def print_compile(result: dict[str, Any]) -> None:
    print("\n== torch.compile ==")
    print(f"{result['workload']}; backend {result['backend']} ({result['note']})")
    if "coverage" in result:
        _print_compile_coverage(result["coverage"])
    else:
        print("coverage: not run (--compile-cases)")
    print(
        f"\ncompiled-step ratio: compiled plain vs compiled observed copy, interleaved, at "
        "default sampling (both injection orders) and with sampling=1 (every forward runs "
        f"the graph with the in-graph reductions); dynamo {result.get('ratio_dynamo_setting')}, "
        "both copies guarded on their forward hook dictionaries (instances of one class);"
        "\ndense start = 4 blocks inside the first 64 forwards; "
        f"steady = from forward {_steady_schedule()[0]} on"
    )
    rows = []
    for case in RATIO_CASES:
        entry = result.get(case, {})
        if "steady_ratio" not in entry:
            rows.append([case, "-", "-", entry.get("error", "?")[:70], "-", "-", "-", "-"])
            continue
        rows.append(
            [
                case,
                f"{entry['plain_first_step_s']:.1f} / {entry['observed_first_step_s']:.1f}",
                _fmt_ratio(entry["dense_start_ratio"]),
                _fmt_ratio(entry["steady_ratio"]),
                f"{entry['steady_blocks']} x {entry['steady_steps_per_block']}",
                f"{entry['plain_ms_per_step']:.2f} / {entry['observed_ms_per_step']:.2f}",
                f"{entry['modules_observed']} / {entry['modules_selected']}",
                "yes" if entry["losses_identical"] else "NO",
            ]
        )
    print(
        _table(
            (
                "case",
                "first step s (plain / obs)",
                "dense-start ratio",
                "steady ratio median [min, max]",
                "blocks x steps",
                "ms/step (plain / obs)",
                "modules observed",
                "losses identical",
            ),
            rows,
        )
    )


def print_targets(results: dict[str, Any]) -> None:
    """The measured numbers next to the "done when" targets of issue 4 (nothing asserted)."""
    rows: list[list[str]] = []

    def add(target: str, value: float | None, limit: float, text: str) -> None:
        within = "-" if value is None else ("yes" if value <= limit else "no")
        rows.append([target, text, within])

    for row in results.get("overhead", []):
        ratio = row.get("ratio")
        if ratio is None:
            continue
        median = ratio["median"]
        name, config = row["workload"], row["config"]
        if config == "default, steady state":
            add(f"{name}: default steady state <= 1.03", median, 1.03, f"{median:.3f}")
        elif config.startswith("default, whole"):
            add(f"{name}: default, {config[9:]} <= 1.10", median, 1.10, f"{median:.3f}")
        elif config == "sampling=1" and name in ("cnn", "transformer"):
            add(f"{name}: sampling=1 <= 1.30", median, 1.30, f"{median:.3f}")
        elif config == "sampling=1":
            rows.append([f"{name}: sampling=1 (no target; stated)", f"{median:.3f}", "-"])
    hook = results.get("hook")
    if hook:
        value = hook["unsampled_hook_us"]["median"]
        add("unsampled hook call <= 2 us", value, 2.0, f"{value:.2f} us")
    memory = results.get("memory")
    if memory:
        rss = memory["rss_kib"]
        keys = sorted(int(k) for k in rss)
        if len(keys) > 1 and rss[str(keys[1])] is not None and rss[str(keys[-1])] is not None:
            growth = (rss[str(keys[-1])] - rss[str(keys[1])]) / 1024
            add(
                f"memory flat from {keys[1]} to {keys[-1]} samples (read: growth <= 1 MiB)",
                growth,
                1.0,
                f"{growth:+.1f} MiB",
            )
    report = results.get("report")
    if report:
        value = report["first_flush_s"]
        add(
            f"{report['observed_modules'] - 1}-module report built and written < 0.5 s "
            "(first flush)",
            value,
            0.5,
            f"{value:.3f} s",
        )
    if not rows:
        return
    print("\n== Overhead targets of the project (for reading; nothing is asserted) ==")
    if results["meta"].get("device", "cpu") != "cpu":
        print(f"the targets are set for the CPU; this run trained on {results['meta']['device']}")
    if results["meta"].get("quick"):
        print("QUICK run: tiny sizes and short runs, not comparable with the targets")
    print(_table(("target", "measured", "within"), rows))


# --------------------------------------------------------------------------- main
def parse_device(text: str) -> torch.device:
    """The ``--device`` value as a torch.device: ``cpu``, or ``cuda[:N]`` with a GPU N.

    Raises:
        ValueError: naming ``--device``, what was expected and what was given.
    """
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"--device: expected cpu or cuda[:N], got {text!r} ({error})") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu or cuda[:N], got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {text}: torch.cuda.is_available() is False on this machine")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"--device: expected cuda:0 to cuda:{count - 1} on this machine, got {text!r}"
            )
    return device


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes and few steps (CI smoke test)"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="device of the training loops: cpu (default) or cuda[:N]",
    )
    parser.add_argument(
        "--workloads",
        default=None,
        help=f"comma-separated subset of {','.join(ALL_WORKLOAD_NAMES)} (default: "
        f"{','.join(WORKLOAD_NAMES)}; on cuda also {','.join(GPU_WORKLOAD_NAMES)})",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps per block (default: enough for about 0.25 s of plain steps; rounded up "
        "to a multiple of the default steady interval for the default steady state)",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="blocks per configuration (default 7; quick 3)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument(
        "--run-steps",
        type=int,
        default=None,
        help="length of the default whole run (default 1000; quick 100)",
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="warm-up steps (default 10; quick 2)"
    )
    parser.add_argument(
        "--sections",
        default=None,
        help=f"comma-separated subset of {','.join(SECTIONS)} (default all; on cuda "
        f"{','.join(CUDA_SECTIONS)})",
    )
    parser.add_argument(
        "--compile-backend",
        choices=("auto", "inductor", "eager"),
        default="auto",
        help="torch.compile backend (auto: inductor, falling back to eager; eager with --quick)",
    )
    parser.add_argument(
        "--compile-workload",
        choices=ALL_WORKLOAD_NAMES,
        default="residual_mlp",
        help="workload for torch.compile",
    )
    parser.add_argument(
        "--compile-cases",
        default=",".join(COMPILE_CASE_NAMES),
        help="comma-separated subset of the compile section's parts: coverage (graph "
        "breaks and observed modules, both injection orders), before and after (the "
        "compiled-step ratio at default sampling, injected before or after compiling), "
        "every (the ratio with sampling=1); default all",
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="also save the numbers to this JSON file"
    )
    args = parser.parse_args(argv)
    try:
        args.device = parse_device(args.device)
    except ValueError as error:
        parser.error(str(error))
    on_cuda = args.device.type == "cuda"
    if args.workloads is None:
        args.workloads = ",".join(ALL_WORKLOAD_NAMES if on_cuda else WORKLOAD_NAMES)
    if args.sections is None:
        args.sections = ",".join(CUDA_SECTIONS if on_cuda else SECTIONS)
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.section_list = [s.strip() for s in args.sections.split(",") if s.strip()]
    for name in args.workload_list:
        if name not in ALL_WORKLOAD_NAMES:
            parser.error(
                f"--workloads: unknown workload {name!r}; choose from {ALL_WORKLOAD_NAMES}"
            )
    for name in args.section_list:
        if name not in SECTIONS:
            parser.error(f"--sections: unknown section {name!r}; choose from {SECTIONS}")
    args.compile_case_list = []
    for name in (c.strip() for c in args.compile_cases.split(",") if c.strip()):
        if name not in COMPILE_CASE_NAMES:
            parser.error(
                f"--compile-cases: unknown part {name!r}; choose from {tuple(COMPILE_CASE_NAMES)}"
            )
        args.compile_case_list.append(COMPILE_CASE_NAMES[name])
    if args.repeats is None:
        args.repeats = 3 if args.quick else 7
    if args.run_steps is None:
        args.run_steps = 100 if args.quick else 1000
    if args.warmup is None:
        args.warmup = 2 if args.quick else 10
    if args.repeats < 1 or args.run_steps < 1 or args.threads < 1 or args.warmup < 0:
        parser.error("--repeats, --run-steps and --threads must be >= 1, --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    global DEVICE
    args = parse_args(argv)
    DEVICE = args.device
    if DEVICE.type == "cuda":
        # Bitwise-deterministic convolutions, so that the passivity check compares like
        # with like (cuDNN may otherwise pick different algorithms for the two copies).
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    workloads = make_workloads(args.quick)
    meta = {
        "torch": torch.__version__,
        "torchinstruments": getattr(torchinstruments, "__version__", "?"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "quick": args.quick,
        "device": str(DEVICE),
        "gpu": torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else None,
        "argv": sys.argv[1:] if argv is None else list(argv),
    }
    where = f"CUDA, {meta['gpu']}" if DEVICE.type == "cuda" else "CPU"
    print(f"torchinstruments overhead benchmark ({where})")
    print(
        f"torch {meta['torch']}, torchinstruments {meta['torchinstruments']}, python "
        f"{meta['python']}, {meta['cpu_count']} CPUs, torch.set_num_threads({args.threads})"
        f"{', QUICK (tiny sizes)' if args.quick else ''}"
    )
    for name in args.workload_list:
        print(f"  {name}: {workloads[name].description}")
    results: dict[str, Any] = {"meta": meta}

    with tempfile.TemporaryDirectory(prefix="ti-overhead-") as tmp_name:
        tmp = Path(tmp_name)
        if "memory" in args.section_list:
            _progress("memory (run first: a fresh heap shows growth best)")
            results["memory"] = bench_memory(workloads, args, tmp)
            print_memory(results["memory"])
            gc.collect()
        if "overhead" in args.section_list:
            rows: list[dict[str, Any]] = []
            for name in args.workload_list:
                rows.extend(bench_overhead(workloads[name], args, tmp))
                gc.collect()
                if name != args.workload_list[-1]:  # partial table, in case the run is cut
                    print_overhead(rows, partial=True)
            results["overhead"] = rows
            print_overhead(rows)
        if "hook" in args.section_list:
            _progress("unsampled hook call")
            results["hook"] = bench_hook_call(args, tmp)
            print_hook(results["hook"])
        if "report" in args.section_list:
            _progress("report build and write")
            results["report"] = bench_report(args, tmp)
            print_report(results["report"])
        if "compile" in args.section_list:
            results["compile"] = bench_compile(workloads, args, tmp)
            print_compile(results["compile"])
        print_targets(results)
        sys.stdout.flush()

    elapsed = time.perf_counter() - started
    results["meta"]["seconds"] = elapsed
    print(f"\ntotal {elapsed:.0f} s")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
        print(f"numbers saved to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
