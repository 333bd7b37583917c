"""What each part of the observer adds to a compiled training step, side by side.

    python benchmarks/compiled_step_parts.py                       # inductor, 3 copies each
    python benchmarks/compiled_step_parts.py --backend aot_eager --copies 2 --blocks 12
    python benchmarks/compiled_step_parts.py --model gpt2 --copies 2   # needs transformers
    python benchmarks/compiled_step_parts.py --model gpt2 --compile blocks --copies 2

Copies of a model, each compiled with ``torch.compile(backend=...)`` and trained in
interleaved blocks of ``--steps`` steps, one CPU thread, after 1,600 warm-up steps (the
default schedule's steady state). Models (``--model``):

- ``example`` (default): the example's ``ResidualMLP()`` (``examples/basic_training.py``),
  batch 64 of 64 features, cross-entropy, SGD;
- ``gpt2``: a ``transformers`` ``GPT2LMHeadModel`` from a small config (4 layers of
  width 128, 4 heads, vocabulary 512, dropout 0, random init), batch 8 of 64 tokens,
  the next-token cross-entropy, SGD.

What is compiled (``--compile``): ``model`` (default), ``torch.compile(model)``;
``blocks``, each block compiled on its own (``block.compile()``: the example's
``blocks``, GPT-2's ``transformer.h``), the rest eager, as large models are often
compiled; or ``wrappers``, each block replaced by its ``torch.compile(block)`` wrapper
before the observer is injected (the root eager: the wrappers' own hooks, which open a
direct-call sample where training calls a wrapper with no root forward, run around
each block call and return after one state check). Blocks of one class share one code
object, so every copy's blocks share its compiled entries; ``recompile_limit`` is
raised to 64 for them, and the number of times Dynamo still reached a limit is printed
(it should be 0). The block class is then an observed one, so the plain copies' blocks
guard on their forward hook dictionaries too (another instance of an observed class
must not run the observed one's code).

Kinds of copy:

- ``plain``: no observer, compiled as in a process without one (Dynamo's default
  ``skip_nnmodule_hook_guards=True``: no guards on empty module hook dictionaries), as
  every model that the observer never touches is compiled in a process with one (see
  ``torchinstruments.compiled``);
- ``plain, hook guards``: no observer, compiled with ``skip_nnmodule_hook_guards=False``
  for its compilation only (guards on each module's six hook dictionaries), the
  process-wide setting the observer falls back to where Dynamo lacks the guard it
  scopes to observed models; its ratio is what that fallback costs a model the observer
  never touches;
- ``no-op hooks``: a forward hook that does nothing on each module the observer
  selects (what Dynamo's handling of hooks on inlined modules costs by itself: the
  floor of any capture through module hooks);
- ``observer, one sample``: ``inject_observer(..., sampling=10**9)``, so only the first
  forward is sampled (the observer's fixed cost per forward);
- ``observer, default``: ``inject_observer`` at default sampling (adds the sampled
  forwards' graph variant with the reductions, and the flushes);
- ``observer, sentinel 1 in 16`` (not run unless named): the same with the root
  sentinel checking one unsampled training forward in 16 instead of
  ``ROOT_SENTINEL_INTERVAL`` (8), what that interval costs.

How the copies are kept comparable: compiled code is cached per code object, so each
copy gets a class of its own whose ``forward`` is a fresh code object (no copy runs or
guards against another's code; Dynamo's configuration stays the default). Every copy
uses the parameter and buffer tensors of one untimed copy, compiled and trained first
(the copy compiled first ran 3 to 5 % slower than later plain copies), so that no copy's
weights sit in better-placed memory than another's. ``--copies`` rounds make one copy of
each kind (in an order shuffled per round: copies made later ran up to 4 % slower in
some runs) and train it ``WARMUP_STEPS`` steps. Then ``--blocks`` rounds run one block
of ``--steps`` steps of every copy, in an order shuffled per round. On a
shared machine the time of a block varies by 10 % and more from one moment to the next,
and slowly over minutes, so kinds are compared within a round: a kind's ratio in a round
is the mean time of its copies' blocks over that of the plain copies' blocks, and its
ratio is the median over rounds.

Printed per kind: the mean of its copies' median blocks (us/step), the median ratio to
plain and the half-width of its approximate 95 % interval, and each copy's median block;
then the same ratio between the first two plain copies (what the comparison can resolve).
With ``--root-hooks``, more rounds (``--blocks`` again, after the timed ones, their step times
not used) time the calls of the observer's root pre- and post-hooks, which run eagerly
around the compiled frame: per observer kind, the median and mean time of a pre-hook
call (one a forward), the post-hook's calls per forward (only forwards that need it:
samples and root sentinel checks) and their mean time, and what both take per step, in
us and as a fraction of the plain step (the timing wrappers' own cost included).
With ``--then-remove`` the observers are removed and the same copies are timed again:
their compiled code stays, so a kind's ratio before over its ratio after removal is its
observer's own cost (its hooks and eager work; not the hook-dictionary guards, which
the compiled entries keep), free of the copies' own offsets.
Measurement only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import random
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchinstruments import inject_observer, remove_observer
from torchinstruments.capture import ForwardHook, RootPostHook, RootPreHook, recompile_limit_hits

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "basic_training.py"
WARMUP_STEPS = 1_600  # the default schedule reaches its steady interval by then
KINDS = (
    "plain",
    "plain, hook guards",
    "no-op hooks",
    "observer, one sample",
    "observer, default",
    "observer, sentinel 1 in 16",
)
#: ``--kinds`` names of the kinds.
KIND_NAMES = dict(
    zip(("plain", "guards", "no-op", "one-sample", "default", "sentinel16"), KINDS, strict=True)
)
#: The root sentinel's interval of the kind ``sentinel16``.
WIDER_SENTINEL_INTERVAL = 16
GPT2_VOCABULARY, GPT2_TOKENS = 512, 64
#: What ``--compile`` compiles, as the first line of the output says it.
COMPILED_PARTS = {
    "model": "whole model",
    "blocks": "each block",
    "wrappers": "each block's torch.compile wrapper",
}


def _example_class() -> type[nn.Module]:
    spec = importlib.util.spec_from_file_location("basic_training", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.ResidualMLP


def _gpt2_class() -> type[nn.Module]:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=GPT2_VOCABULARY,
        n_positions=GPT2_TOKENS,
        n_embd=128,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )

    class SmallGPT2(transformers.GPT2LMHeadModel):
        def __init__(self) -> None:
            super().__init__(config)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            # The transformer and head called here, and the next-token loss computed
            # here: ``GPT2LMHeadModel.forward`` is wrapped by a decorator whose frame
            # Dynamo would compile, shared by every copy (its cache entries would pile
            # up past Dynamo's recompile limit), and GPT-2's own loss (``labels=``) logs
            # a warning once, a graph break.
            hidden = self.transformer(input_ids=input_ids).last_hidden_state
            logits = self.lm_head(hidden)
            return nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten()
            )

    return SmallGPT2


def _own_class(base: type[nn.Module], number: int) -> type[nn.Module]:
    """A subclass of ``base`` whose ``forward`` is a code object of its own."""
    forward = base.forward
    code = forward.__code__.replace()  # equal, not identical: Dynamo caches per object
    own = types.FunctionType(
        code, forward.__globals__, forward.__name__, forward.__defaults__, forward.__closure__
    )
    return type(f"{base.__name__}Copy{number}", (base,), {"forward": own})


def _blocks_name(model_name: str) -> str:
    """The ``nn.ModuleList`` of blocks that ``--compile blocks`` and ``wrappers`` compile."""
    return "transformer.h" if model_name == "gpt2" else "blocks"


def _no_op_hook(module: nn.Module, args: object, output: object) -> None:
    return None


def _share_tensors(model: nn.Module, reference: nn.Module) -> None:
    """Make ``model`` use ``reference``'s parameter and buffer tensors (same names)."""
    for name, module in model.named_modules():
        source = reference.get_submodule(name)
        for key in list(module._parameters):
            module._parameters[key] = source._parameters[key]
        for key in list(module._buffers):
            module._buffers[key] = source._buffers[key]


def _make_copy(
    kind: str,
    number: int,
    base: type[nn.Module],
    backend: str,
    directory: Path,
    model_name: str,
    reference: nn.Module | None = None,
    compile_what: str = "model",
) -> tuple[Callable[[], None], nn.Module]:
    torch.manual_seed(0)
    model = _own_class(base, number)()
    if compile_what == "wrappers":
        # Before the observer: it finds the wrappers below the root when injected.
        blocks = cast(nn.ModuleList, model.get_submodule(_blocks_name(model_name)))
        for index, block in enumerate(blocks):
            blocks[index] = cast(nn.Module, torch.compile(block, backend=backend))
    if reference is not None:
        _share_tensors(model, reference)
    if kind == "no-op hooks":
        # The modules the observer selects: those it puts a forward hook of its own on.
        inject_observer(model, output_dir=directory / f"probe-{number}", sampling=10**9)
        selected = [
            module
            for module in model.modules()
            if module is not model
            and any(isinstance(hook, ForwardHook) for hook in module._forward_hooks.values())
        ]
        remove_observer(model)
        for module in selected:
            module.register_forward_hook(_no_op_hook)
    elif kind == "observer, one sample":
        inject_observer(model, output_dir=directory / f"one-{number}", sampling=10**9)
    elif kind == "observer, default":
        inject_observer(model, output_dir=directory / f"default-{number}")
    elif kind == "observer, sentinel 1 in 16":
        handle = inject_observer(model, output_dir=directory / f"sentinel16-{number}")
        observer = handle._observer
        if observer is None:
            raise RuntimeError("inject_observer returned a handle without its observer")
        observer.context.ROOT_SENTINEL_INTERVAL = WIDER_SENTINEL_INTERVAL
    compiled: Any
    if compile_what == "blocks":
        blocks = model.get_submodule(_blocks_name(model_name))
        for block in cast(nn.ModuleList, blocks):
            block.compile(backend=backend)
        compiled = model
    elif compile_what == "wrappers":
        compiled = model  # the root runs eagerly, each block's wrapper compiled
    else:
        compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    if model_name == "gpt2":
        ids = torch.randint(0, GPT2_VOCABULARY, (8, GPT2_TOKENS), generator=generator)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            compiled(ids).backward()
            optimizer.step()

    else:
        x = torch.randn(64, 64, generator=generator)
        y = torch.randint(0, 10, (64,), generator=generator)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(compiled(x), y).backward()
            optimizer.step()

    if kind.startswith("plain"):
        from torch._dynamo import config

        # The first step compiles the copy's code, with its guards as this sets them.
        with config.patch(skip_nnmodule_hook_guards=kind == "plain"):
            step()
    return step, model


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--copies", type=int, default=3, help="copies of each kind")
    parser.add_argument("--blocks", type=int, default=200, help="rounds of one block per copy")
    parser.add_argument("--steps", type=int, default=10, help="training steps per block")
    parser.add_argument("--model", choices=("example", "gpt2"), default="example")
    parser.add_argument(
        "--compile",
        choices=("model", "blocks", "wrappers"),
        default="model",
        help="compile the whole model, each block on its own (block.compile()), or each "
        "block replaced by its torch.compile wrapper",
    )
    parser.add_argument(
        "--kinds",
        default=",".join(name for name in KIND_NAMES if name != "sentinel16"),
        help=f"comma-separated kinds of copy, plain among them, of {','.join(KIND_NAMES)} "
        "(default: all but sentinel16)",
    )
    parser.add_argument(
        "--root-hooks",
        action="store_true",
        help="then time the calls of the observers' root hooks, in further rounds",
    )
    parser.add_argument(
        "--then-remove",
        action="store_true",
        help="then remove the observers and time the same copies again",
    )
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.kinds.split(",")]
    if "plain" not in names or not set(names) <= set(KIND_NAMES):
        parser.error(
            f"--kinds: expected plain and others of {list(KIND_NAMES)}, got {args.kinds!r}"
        )
    kinds = [KIND_NAMES[name] for name in names]
    torch.set_num_threads(1)
    if args.compile in ("blocks", "wrappers"):
        from torch._dynamo import config

        config.recompile_limit = 64
    base = _gpt2_class() if args.model == "gpt2" else _example_class()
    with tempfile.TemporaryDirectory() as tmp:
        warm, reference = _make_copy(
            "plain", 0, base, args.backend, Path(tmp), args.model, compile_what=args.compile
        )
        for _ in range(WARMUP_STEPS // 4):
            warm()
        copies: list[tuple[str, Callable[[], None], nn.Module]] = []
        for round_ in range(args.copies):
            made = random.Random(round_).sample(kinds, len(kinds))  # no kind always first
            for offset, kind in enumerate(made):
                number = 1 + round_ * len(kinds) + offset
                step, model = _make_copy(
                    kind,
                    number,
                    base,
                    args.backend,
                    Path(tmp),
                    args.model,
                    reference,
                    args.compile,
                )
                for _ in range(WARMUP_STEPS):
                    step()
                copies.append((kind, step, model))
        times = _time_rounds(copies, args.blocks, args.steps, seed=0)
        hook_times = None
        if args.root_hooks:
            hook_times = _RootHookTimes()
            with hook_times.installed():
                _time_rounds(copies, args.blocks, args.steps, seed=2)
            hook_times.find_observers(copies)
        removed_times: list[list[float]] | None = None
        for kind, _, model in copies:
            if kind.startswith("observer"):
                remove_observer(model)
        if args.then_remove:
            # The same copies again, observers removed: their compiled entries stay (they
            # guard on the hook dictionaries, empty now as when parked), and so does each
            # copy's own offset, which then cancels out of the quotient below.
            removed_times = _time_rounds(copies, args.blocks, args.steps, seed=1)
    print(
        f"{args.model} ({COMPILED_PARTS[args.compile]} compiled): torch {torch.__version__}, "
        f"backend {args.backend}, {args.copies} copies of each kind sharing one set of "
        f"parameters, {args.blocks} rounds of {args.steps} steps per copy, 1 thread"
    )
    ratios = _print_ratios(copies, times, kinds)
    print(f"recompile limit reached: {recompile_limit_hits()} times")
    plain_indices = [index for index, (kind, _, _) in enumerate(copies) if kind == "plain"]
    if len(plain_indices) >= 2:
        first, second = (times[index] for index in plain_indices[:2])
        ratio, notch = _median_and_notch([a / b for a, b in zip(second, first, strict=True)])
        print(f"plain copy 2 / plain copy 1: {ratio:.3f} +- {notch:.3f} (the resolution)")
    if hook_times is not None:
        plain_step = statistics.median(
            statistics.mean(t)
            for t in zip(
                *(
                    blocks
                    for (kind, _, _), blocks in zip(copies, times, strict=True)
                    if kind == "plain"
                ),
                strict=True,
            )
        )
        hook_times.print(args.blocks * args.steps, plain_step)
    if removed_times is not None:
        print("the same copies after remove_observer:")
        removed = _print_ratios(copies, removed_times, kinds)
        for kind in kinds:
            if kind.startswith("observer"):
                print(
                    f"{kind}: its observer's own cost on the same copies "
                    f"{ratios[kind] / removed[kind]:.3f} (ratio before / ratio after removal)"
                )


class _RootHookTimes:
    """Times of the calls of every observer's root pre- and post-hook (``--root-hooks``),
    by the observer's forward context."""

    def __init__(self) -> None:
        self.pre: dict[int, list[float]] = {}
        self.post: dict[int, list[float]] = {}
        #: Each observer kind's forward contexts (see :meth:`find_observers`).
        self.contexts: dict[str, list[int]] = {}

    def find_observers(self, copies: Sequence[tuple[str, object, nn.Module]]) -> None:
        """Note which forward context observes which copy (before the observers go)."""
        for kind, _, model in copies:
            for hook in model._forward_pre_hooks.values():
                if isinstance(hook, RootPreHook):
                    self.contexts.setdefault(kind, []).append(id(hook._observer()))

    @contextlib.contextmanager
    def installed(self) -> Generator[None]:
        """Wrap both hook classes' ``__call__`` in timing wrappers that Dynamo runs
        eagerly, as it does the originals; the originals are back on exit."""
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )

        pre, post = RootPreHook.__call__, RootPostHook.__call__
        clock, pre_times, post_times = time.perf_counter, self.pre, self.post

        def timed_pre(hook: RootPreHook, module: nn.Module, args: object) -> None:
            start = clock()
            pre(hook, module, args)
            pre_times.setdefault(id(hook._observer()), []).append(clock() - start)

        def timed_post(hook: RootPostHook, module: nn.Module, args: Any, output: object) -> None:
            start = clock()
            post(hook, module, args, output)
            post_times.setdefault(id(hook._observer()), []).append(clock() - start)

        for wrapper in (timed_pre, timed_post):
            strategy = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
            set_code_exec_strategy(wrapper.__code__, strategy)
        RootPreHook.__call__ = timed_pre  # type: ignore[method-assign]
        RootPostHook.__call__ = timed_post  # type: ignore[method-assign]
        try:
            yield
        finally:
            RootPreHook.__call__ = pre  # type: ignore[method-assign]
            RootPostHook.__call__ = post  # type: ignore[method-assign]

    def print(self, steps: int, plain_step: float) -> None:
        """One line per observer kind: its copies' hook calls over ``steps`` steps each
        (one forward a step), against ``plain_step`` (s)."""
        print("the observers' root hooks, per kind (us):")
        for kind, ids in self.contexts.items():
            pre = [value for key in ids for value in self.pre.get(key, [])]
            post = [value for key in ids for value in self.post.get(key, [])]
            if not pre:
                continue
            per_step = (sum(pre) + sum(post)) / (steps * len(ids))
            post_mean = statistics.mean(post) * 1e6 if post else 0.0
            print(
                f"{kind:22s} pre-hook {statistics.median(pre) * 1e6:.1f} median, "
                f"{statistics.mean(pre) * 1e6:.1f} mean; post-hook {len(post) / len(pre):.3f} "
                f"calls a forward, {post_mean:.1f} mean; both {per_step * 1e6:.1f} a step "
                f"({per_step / plain_step:.1%} of the plain step)"
            )


def _time_rounds(
    copies: Sequence[tuple[str, Callable[[], None], nn.Module]], blocks: int, steps: int, seed: int
) -> list[list[float]]:
    """Per copy, the time per step (s) of each of ``blocks`` rounds of ``steps`` steps."""
    times: list[list[float]] = [[] for _ in copies]
    order = list(range(len(copies)))
    shuffle = random.Random(seed).shuffle
    for _ in range(blocks):
        shuffle(order)  # no copy always runs after the same one
        for index in order:
            step = copies[index][1]
            start = time.perf_counter()
            for _ in range(steps):
                step()
            times[index].append((time.perf_counter() - start) / steps)
    return times


def _print_ratios(
    copies: Sequence[tuple[str, object, object]],
    times: Sequence[Sequence[float]],
    kinds: Sequence[str],
) -> dict[str, float]:
    """Print each kind's line (see the module docstring); returns its median ratio."""
    print(f"{'kind':22s} {'us/step':>8s} {'ratio':>6s} {'+-':>6s}  copies' median blocks (us/step)")
    plain_rounds = _mean_per_round(copies, times, "plain")
    found: dict[str, float] = {}
    for kind in kinds:
        ratios = [
            a / b for a, b in zip(_mean_per_round(copies, times, kind), plain_rounds, strict=True)
        ]
        ratio, notch = _median_and_notch(ratios)
        found[kind] = ratio
        medians = [
            statistics.median(t) for (k, _, _), t in zip(copies, times, strict=True) if k == kind
        ]
        each = ", ".join(f"{value * 1e6:.0f}" for value in medians)
        print(f"{kind:22s} {statistics.mean(medians) * 1e6:8.0f} {ratio:6.3f} {notch:6.3f}  {each}")
    return found


def _mean_per_round(
    copies: Sequence[tuple[str, object, object]], times: Sequence[Sequence[float]], kind: str
) -> list[float]:
    """Per round, the mean time per step of the copies of ``kind``."""
    rows = [blocks for (each, _, _), blocks in zip(copies, times, strict=True) if each == kind]
    return [statistics.mean(values) for values in zip(*rows, strict=True)]


def _median_and_notch(values: Sequence[float]) -> tuple[float, float]:
    """The median of ``values`` and the half-width of its approximate 95 % interval,
    1.58 * IQR / sqrt(n) (the notch of a notched box plot: McGill, Tukey and Larsen,
    "Variations of Box Plots", The American Statistician 32, 1978)."""
    quartiles = statistics.quantiles(values, n=4)
    return statistics.median(values), 1.58 * (quartiles[2] - quartiles[0]) / len(values) ** 0.5


if __name__ == "__main__":
    main()
