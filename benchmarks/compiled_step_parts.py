"""What each part of the observer adds to a compiled training step, side by side.

    python benchmarks/compiled_step_parts.py                       # inductor, 3 copies each
    python benchmarks/compiled_step_parts.py --backend aot_eager --copies 2 --blocks 12
    python benchmarks/compiled_step_parts.py --model gpt2 --copies 2   # needs transformers

Copies of a model, each compiled with ``torch.compile(backend=...)`` and trained in
interleaved blocks of ``--steps`` steps, one CPU thread, after 1,600 warm-up steps (the
default schedule's steady state). Models (``--model``):

- ``example`` (default): the example's ``ResidualMLP()`` (``examples/basic_training.py``),
  batch 64 of 64 features, cross-entropy, SGD;
- ``gpt2``: a ``transformers`` ``GPT2LMHeadModel`` from a small config (4 layers of
  width 128, 4 heads, vocabulary 512, dropout 0, random init), batch 8 of 64 tokens,
  the next-token cross-entropy, SGD.

Kinds of copy:

- ``plain``: no observer;
- ``no-op hooks``: a forward hook that does nothing on each module the observer
  selects (what Dynamo's handling of hooks on inlined modules costs by itself: the
  floor of any capture through module hooks);
- ``observer, one sample``: ``inject_observer(..., sampling=10**9)``, so only the first
  forward is sampled (the observer's fixed cost per forward);
- ``observer, default``: ``inject_observer`` at default sampling (adds the sampled
  forwards' graph variant with the reductions, and the flushes).

How the copies are kept comparable: compiled code is cached per code object, so each
copy gets a class of its own whose ``forward`` is a fresh code object (no copy runs or
guards against another's code; Dynamo's configuration stays the default). A first,
untimed copy is compiled and trained before the others: the copy compiled first ran
3 to 5 % slower than later plain copies of the same model in one process. ``--copies``
copies of each kind are made in turn (plain, no-op hooks, ..., plain, ...), and a kind's
time is the mean over its copies of each copy's median block.

Printed: per copy its median block (us/step); per kind the mean of its copies' medians
and its ratio to the plain copies', with the spread of the plain copies as the
comparison's resolution. Measurement only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchinstruments import inject_observer, remove_observer
from torchinstruments.capture import ForwardHook

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "basic_training.py"
WARMUP_STEPS = 1_600  # the default schedule reaches its steady interval by then
KINDS = ("plain", "no-op hooks", "observer, one sample", "observer, default")
GPT2_VOCABULARY, GPT2_TOKENS = 512, 64


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


def _no_op_hook(module: nn.Module, args: object, output: object) -> None:
    return None


def _make_copy(
    kind: str, number: int, base: type[nn.Module], backend: str, directory: Path, model_name: str
) -> tuple[Callable[[], None], nn.Module]:
    torch.manual_seed(0)
    model = _own_class(base, number)()
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
    compiled: Any = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    if model_name == "gpt2":
        ids = torch.randint(0, GPT2_VOCABULARY, (8, GPT2_TOKENS), generator=generator)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            compiled(ids).backward()
            optimizer.step()

        return step, model
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
    parser.add_argument("--copies", type=int, default=3, help="copies of each kind")
    parser.add_argument("--blocks", type=int, default=8, help="interleaved blocks per copy")
    parser.add_argument("--steps", type=int, default=200, help="training steps per block")
    parser.add_argument("--model", choices=("example", "gpt2"), default="example")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    base = _gpt2_class() if args.model == "gpt2" else _example_class()
    with tempfile.TemporaryDirectory() as tmp:
        warm, _ = _make_copy("plain", 0, base, args.backend, Path(tmp), args.model)
        for _ in range(WARMUP_STEPS // 4):
            warm()
        copies: list[tuple[str, Callable[[], None], nn.Module]] = []
        for round_ in range(args.copies):
            for offset, kind in enumerate(KINDS):
                number = 1 + round_ * len(KINDS) + offset
                step, model = _make_copy(kind, number, base, args.backend, Path(tmp), args.model)
                for _ in range(WARMUP_STEPS):
                    step()
                copies.append((kind, step, model))
        times: list[list[float]] = [[] for _ in copies]
        for _ in range(args.blocks):
            for index, (_, step, _) in enumerate(copies):
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                times[index].append((time.perf_counter() - start) / args.steps)
        for kind, _, model in copies:
            if kind.startswith("observer"):
                remove_observer(model)
    medians: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for (kind, _, _), blocks in zip(copies, times, strict=True):
        medians[kind].append(statistics.median(blocks))
    plain = statistics.mean(medians["plain"])
    print(
        f"{args.model}: torch {torch.__version__}, backend {args.backend}, {args.copies} "
        f"copies of each kind, {args.blocks} blocks of {args.steps} steps per copy, 1 thread"
    )
    print(f"{'kind':22s} {'us/step':>8s} {'ratio':>6s}  copies' median blocks (us/step)")
    for kind in KINDS:
        mean = statistics.mean(medians[kind])
        each = ", ".join(f"{value * 1e6:.0f}" for value in medians[kind])
        print(f"{kind:22s} {mean * 1e6:8.0f} {mean / plain:6.3f}  {each}")
    spread = (max(medians["plain"]) - min(medians["plain"])) / plain
    print(f"spread of the plain copies: {spread:.3f} of their mean")


if __name__ == "__main__":
    main()
