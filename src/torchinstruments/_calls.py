"""Per-call capture: what one observed module call or one output gradient hands on.

The forward context (``_context.py``) calls :meth:`CallCapture.on_forward` for module
calls outside the SKIP phase and :meth:`CallCapture.on_grad` for output gradients,
passing itself (the sample state). Each walks the output, hands every floating tensor
to the statistics buffer (or shares the row of a tensor already measured in this
sample), asks for histograms, and registers the gradient hooks. Every error is caught
and counted. See ``docs/architecture.md``.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ._context import MAX_SAMPLES_AWAITING_BACKWARD, transform_level
from ._context_cadence import remember_sample
from ._records import ROOT_INDEX, HistogramCounts, LossScale, SeriesKey
from ._state import IDLE, SAMPLED, SENTINEL
from .capture import (
    MAX_TENSORS_PER_OUTPUT,
    BackwardStartHook,
    GradHook,
    NodeGradHook,
    in_backward,
    iter_output_tensors,
    passive,
)
from .histogram import HistogramSpec, histogram_counts
from .reduce import STAT_WIDTH, skip_reason
from .series import ACTIVATION, GRAD_OUTPUT

if TYPE_CHECKING:
    from ._context import ForwardContext
    from ._error_log import ErrorLog
    from ._staging import StatisticsBuffer
    from ._store import SeriesStore

__all__ = ["CallCapture"]


class CallCapture:
    """Measures the outputs and output gradients of observed calls.

    Args:
        names: the observed modules' names, by index (the observer's own list).
        histogram_specs: the requested histograms, by spec number.
        buffer: where tensors are measured.
        store: where rows shared between keys are noted.
        errors: where errors are counted.
        cost_listener: the sampling policy's ``note_cost(seconds)``, or None.
    """

    def __init__(
        self,
        *,
        names: list[str],
        histogram_specs: Sequence[HistogramSpec],
        buffer: StatisticsBuffer,
        store: SeriesStore,
        errors: ErrorLog,
        cost_listener: Callable[[float], object] | None,
    ) -> None:
        self._names = names
        self.histogram_specs = tuple(histogram_specs)
        #: Per module index and signal: the numbers of the specs that apply.
        self.hist_plan: dict[tuple[int, str], tuple[int, ...]] = {}
        for index, name in enumerate(names):
            self.plan_histograms(index, name)
        self._buffer = buffer
        self._store = store
        self._errors = errors
        self._cost_listener = cost_listener
        #: Hooks on leaf tensors (a module that returns a parameter), removed at detach.
        self.leaf_hooks: list[Any] = []
        self._grad_keys_seen: dict[int, set[tuple[int, int, str]]] = {}
        self._backward_counted: dict[int, None] = {}
        #: Indices of the observed modules that ran in a sampled forward.
        self.modules_called: set[int] = set()
        #: Time spent in the hooks and report writes, in seconds.
        self.telemetry_seconds = 0.0
        # Counters (named as the report's coverage keys).
        self.skipped_tensors: Counter[str] = Counter()
        self.paths_dropped = 0
        self.backward_samples_observed = 0
        self.repeated_backward_gradients = 0
        self.backward_gradients_summed = 0
        self.backward_gradients_not_summed = 0
        #: Samples that a second backward pass reached (``retain_graph=True``), the
        #: latest ``MAX_SAMPLES_AWAITING_BACKWARD``: their compiled graphs' gradient
        #: rows hold both passes' rows summed (see ``CompiledCapture.take_gradients``).
        self.samples_with_repeated_backward: dict[int, None] = {}
        #: The autograd graph task that brought each recent sample's first root output
        #: gradient: a root gradient from another task is another backward pass, also
        #: where the passes start from different outputs (two heads, one pass each).
        self._root_grad_tasks: dict[int, int] = {}

    def plan_histograms(self, index: int, name: str) -> None:
        """Resolve once which histogram specs apply to module ``index`` (``name``)."""
        for signal in (ACTIVATION, GRAD_OUTPUT):
            self.hist_plan[(index, signal)] = tuple(
                n for n, spec in enumerate(self.histogram_specs) if spec.applies_to(name, signal)
            )

    def note_cost(self, seconds: float) -> None:
        """Add ``seconds`` of telemetry time and tell the policy (``note_cost``)."""
        self.telemetry_seconds += seconds
        if self._cost_listener is not None:
            try:  # a user policy's method: whatever it raises stays here
                self._cost_listener(seconds)
            except Exception as error:
                self._errors.record("policy.note_cost", "", error)

    # ------------------------------------------------------------------ forward
    def on_forward(
        self, ctx: ForwardContext, index: int, args: tuple[object, ...], output: object
    ) -> None:
        """Module ``index`` returned ``output`` in phase ``ctx.state`` (not SKIP)."""
        started = time.perf_counter()
        try:
            with passive():
                self._on_forward(ctx, index, args, output)
        finally:
            self.note_cost(time.perf_counter() - started)

    def _on_forward(
        self, ctx: ForwardContext, index: int, args: tuple[object, ...], output: object
    ) -> None:
        if not ctx.attached:
            return
        try:
            state = ctx.state
            if state is SENTINEL:
                calls = ctx.sentinel.calls
                call = calls.get(index, 0)
                calls[index] = call + 1
                ctx.sentinel_output(index, call, output)
                return
            if state is not SAMPLED:
                if in_backward():
                    self._on_recompute(ctx, index, args, output)
                    return
                if state is not IDLE or not self._open_implicit(ctx, index):
                    return
            elif in_backward() and not ctx.sample_in_backward:
                return
            self._observe_call(ctx, index, args, output)
        except Exception as error:  # never break training
            self._errors.record("forward", self._names[index], error)

    def _open_implicit(self, ctx: ForwardContext, index: int) -> bool:
        """A module ran with no root forward open: group such calls into samples."""
        module = ctx.modules[index]()
        if (
            module is None
            or not torch.is_grad_enabled()
            or torch.is_inference_mode_enabled()
            or not module.training
            or transform_level() is not None
        ):
            return False
        # Where training goes through the root, a submodule called on its own (an
        # auxiliary loss, a probe) is a side computation, kept out of the training
        # series (capture_direct_forwards=True asks for such calls to be observed).
        return ctx.direct_call(index) is not None and ctx.sample_open

    def _observe_call(
        self, ctx: ForwardContext, index: int, args: tuple[object, ...], output: object
    ) -> None:
        compiled = ctx.compiled
        if compiled is not None and compiled.rows_pending:
            compiled.take_rows_so_far(ctx)  # rows of graphs that ran before this call
        self.modules_called.add(index)
        calls = ctx.call_counts
        call = calls.get(index, 0)
        calls[index] = call + 1
        position = ctx.position
        ctx.position = position + 1
        sample = ctx.sample
        grad_enabled = torch.is_grad_enabled()
        outputs = ctx.sample_outputs
        buffer = self._buffer
        taken = 0
        for path, leaf in iter_output_tensors(output):
            reason = skip_reason(leaf)
            if reason is not None:
                self.skipped_tensors[reason] += 1
                continue
            taken += 1
            if taken > MAX_TENSORS_PER_OUTPUT:
                self.paths_dropped += 1
                continue
            assert isinstance(leaf, Tensor)
            key = (index, call, ACTIVATION, path)
            version = _version(leaf)
            first = outputs.get(id(leaf)) if version is not None else None
            if first is not None and (first[0]() is not leaf or first[1] != version):
                first = None
            if first is None:
                buffer.measure(key, sample, position, leaf)
            else:
                # What an earlier call of this sample returned, unchanged since (a
                # container or the root passing on a submodule's output): the same
                # values and the same gradient, so its rows are shared, not measured.
                # (A change through ``.data`` bumps no version and goes unseen here.)
                self._store.add_alias(first[2], sample, key, position)
            if self.histogram_specs:
                self._histogram(index, call, ACTIVATION, path, sample, leaf)
            if leaf.requires_grad and grad_enabled:
                node = leaf.grad_fn
                if node is not None:
                    grad_key = (index, call, GRAD_OUTPUT, path)
                    if (
                        first is not None
                        and first[3] is not None
                        and not self.hist_plan.get((index, GRAD_OUTPUT))
                    ):
                        self._store.add_alias(first[3], sample, grad_key, -1)
                        continue
                    node.register_prehook(
                        NodeGradHook(ctx, (index, call, path), sample, leaf.output_nr)
                    )
                    if first is None and version is not None:
                        outputs[id(leaf)] = (weakref.ref(leaf), version, key, grad_key)
                    continue
                # A module that returns a parameter: a hook on a leaf outlives the
                # graph, so it removes itself after its first gradient (and at detach).
                hook = GradHook(ctx, (index, call, path), sample)
                hook.handle = leaf.register_hook(hook)
                self.leaf_hooks.append(hook.handle)
                if len(self.leaf_hooks) > MAX_SAMPLES_AWAITING_BACKWARD:
                    self.leaf_hooks.pop(0).remove()
            if first is None and version is not None:
                outputs[id(leaf)] = (weakref.ref(leaf), version, key, None)
        if not grad_enabled:
            # Under no_grad inside a training forward (reentrant checkpointing): the
            # gradient flows through a recomputation during backward.
            ctx.no_grad_calls.setdefault(index, []).append(
                (call, sample, _first_tensor_pointer(args), position)
            )

    def _on_recompute(
        self, ctx: ForwardContext, index: int, args: tuple[object, ...], output: object
    ) -> None:
        """A forward re-run during backward: attach gradient hooks for reentrant calls.

        Recomputations that no sampled call awaits are ignored and counted."""
        waiting = ctx.no_grad_calls.get(index)
        if not waiting or not torch.is_grad_enabled():
            ctx.recompute_calls_ignored += 1
            return
        # The first module of a recomputed region receives the region's saved inputs
        # (same storage as in the first pass); later ones replay the first pass's call
        # order, so continue from the last matched position.
        pointer = _first_tensor_pointer(args)
        chosen = next((item for item in waiting if pointer and item[2] == pointer), None)
        if chosen is None:
            later = [item for item in waiting if item[3] > ctx.recompute_anchor]
            chosen = min(later, key=lambda item: item[3]) if later else waiting[-1]
        waiting.remove(chosen)
        call, sample, _, position = chosen
        ctx.recompute_anchor = position
        for path, leaf in iter_output_tensors(output):
            if (
                isinstance(leaf, Tensor)
                and skip_reason(leaf) is None
                and leaf.requires_grad
                and not leaf.is_leaf
            ):
                leaf.register_hook(GradHook(ctx, (index, call, path), sample))

    # ------------------------------------------------------------------ backward
    def on_grad(
        self, ctx: ForwardContext, key: tuple[int, int, str], sample: int, grad: Tensor
    ) -> None:
        """An output gradient arrived for a sampled tensor."""
        started = time.perf_counter()
        try:
            with passive():
                self._on_grad(ctx, key, sample, grad)
        finally:
            self.note_cost(time.perf_counter() - started)

    def _backward_began(self, ctx: ForwardContext, sample: int) -> set[tuple[int, int, str]]:
        """The first output gradient of ``sample`` arrived: count its backward once and
        tell the context; the set of its gradient keys seen."""
        seen: set[tuple[int, int, str]] = set()
        remember_sample(self._grad_keys_seen, sample, seen)
        if sample not in self._backward_counted:
            self._backward_counted[sample] = None
            if len(self._backward_counted) > 4 * MAX_SAMPLES_AWAITING_BACKWARD:
                del self._backward_counted[next(iter(self._backward_counted))]
            self.backward_samples_observed += 1
        ctx.backward_started(sample)
        return seen

    def on_backward_start(self, ctx: ForwardContext, sample: int, sink: object) -> None:
        """A gradient reached the output that :meth:`watch_backward` watches, whose
        graph reaches ``sink`` (a sink's gradient accumulator, or None)."""
        if not ctx.attached:
            return
        try:
            if sample not in self._grad_keys_seen:
                self._backward_began(ctx, sample)
            if ctx.compiled is not None:
                ctx.compiled.check_reached(sample, sink)
        except Exception as error:  # never break training
            self._errors.record("backward", "", error)

    def watch_backward(
        self, ctx: ForwardContext, sample: int, output: object, sink: object
    ) -> None:
        """Tell when the backward of ``sample`` starts from ``output`` (the output of a
        compile wrapper called directly, whose modules ran inside its graph, so that no
        eager gradient hook tells it): a pre-hook on the autograd node of its first
        tensor that requires grad. ``sink`` (see ``CompiledCapture.suspend_sample``) is
        checked when it fires."""
        if not torch.is_grad_enabled():
            return
        for _, leaf in iter_output_tensors(output):
            if isinstance(leaf, Tensor) and leaf.grad_fn is not None:
                leaf.grad_fn.register_prehook(BackwardStartHook(ctx, sample, sink))
                return

    def _on_grad(
        self, ctx: ForwardContext, key: tuple[int, int, str], sample: int, grad: Tensor
    ) -> None:
        if not ctx.attached:
            return
        try:
            seen = self._grad_keys_seen.get(sample)
            if seen is None:
                seen = self._backward_began(ctx, sample)
            elif key in seen:
                self.repeated_backward_gradients += 1  # retain_graph: another backward pass
                remember_sample(self.samples_with_repeated_backward, sample)
                self._sum_repeated((key[0], key[1], GRAD_OUTPUT, key[2]), sample, grad)
                return
            if key[0] == ROOT_INDEX:
                task = torch._C._current_graph_task_id()
                first = self._root_grad_tasks.get(sample)
                if first is None:
                    remember_sample(self._root_grad_tasks, sample, task)
                elif first != task:
                    remember_sample(self.samples_with_repeated_backward, sample)
            seen.add(key)
            reason = skip_reason(grad)
            if reason is not None:
                self.skipped_tensors[f"grad_{reason}"] += 1
                return
            index, call, path = key
            grad_key = (index, call, GRAD_OUTPUT, path)
            self._buffer.measure_gradient(grad_key, sample, grad)
            if self.histogram_specs:
                self._histogram(index, call, GRAD_OUTPUT, path, sample, grad)
        except Exception as error:  # never break training
            self._errors.record("backward", self._names[key[0]], error)

    def _sum_repeated(self, key: SeriesKey, sample: int, grad: Tensor) -> None:
        """Another backward pass over sample ``sample`` (``retain_graph=True``) brought
        ``grad`` for ``key``: add it to the staged copy of the earlier passes' gradient,
        so that what is measured is the total gradient that reached the output. Only
        while that copy is not reduced yet (small tensors, until the next flush or the
        slab fills: backward passes run one after the other within a step); otherwise
        counted under ``coverage.backward_gradients_not_summed``."""
        if self._buffer.add_repeated(key, sample, grad):
            self.backward_gradients_summed += 1
        else:
            self.backward_gradients_not_summed += 1

    def note_loss_scale(self, ctx: ForwardContext, scale: Tensor) -> None:
        """``GradScaler.scale`` ran: the coming backward's gradients carry ``scale``.

        It applies to every sampled forward whose backward has not started yet (several
        forwards may share one scaled backward).
        """
        if not ctx.attached or not ctx.awaiting_backward:
            return
        try:
            with passive():
                value = _padded_row(scale.detach().reshape(-1)[:1].to(torch.float64))
            for sample in ctx.awaiting_backward:
                self._buffer.append(LossScale(sample, value))
        except Exception as error:
            self._errors.record("loss_scale", "", error)

    def _histogram(
        self, index: int, call: int, signal: str, path: str, sample: int, tensor: Tensor
    ) -> None:
        for number in self.hist_plan.get((index, signal), ()):
            spec = self.histogram_specs[number]
            if sample % spec.every_n_samples:
                continue
            counts = histogram_counts(tensor, spec)
            self._buffer.append(
                HistogramCounts((index, call, signal, path), sample, number, counts)
            )


def _version(tensor: Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place change), or None for
    tensors without one (made in inference mode)."""
    try:
        return tensor._version
    except Exception:
        return None


def _padded_row(values: Tensor) -> Tensor:
    """A float64 row of ``STAT_WIDTH`` on the values' device: the values, then zeros."""
    return torch.nn.functional.pad(values, (0, STAT_WIDTH - values.numel()))


def _first_tensor_pointer(args: tuple[object, ...]) -> object:
    """Identify the first tensor argument: its storage address, shape and, on the CPU,
    its first and last values (a recomputed tensor can reuse a freed tensor's memory)."""
    for arg in args:
        if isinstance(arg, Tensor) and arg.layout == torch.strided and arg.device.type != "meta":
            try:
                identity: tuple[object, ...] = (arg.data_ptr(), tuple(arg.shape))
                if arg.device.type == "cpu" and arg.numel():
                    value = arg.detach()
                    first, last = (0,) * value.dim(), (-1,) * value.dim()
                    identity += (float(value[first]), float(value[last]))
                return identity
            except Exception:
                return 0
    return 0
