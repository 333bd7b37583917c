"""Capture inside compiled graphs: the observer's stage for ``torch.compile``.

    ForwardHook traced by Dynamo -> traced_activation: each output's statistics row into
        the next row of the hook's own block; each output that requires grad through
        _GradientTap into the same row of the hook's own gradient sink
    ForwardContext.open_sample (sampled)  -> CompiledCapture.begin_sample
    ForwardContext.leave_root (sampled)   -> CompiledCapture.end_sample: rows -> pending
    Observer.flush_statistics, next sample -> CompiledCapture.take_gradients

When Dynamo traces a submodule's forward hook of ours (``torch.compile`` of the model,
of a block, with or without ``fullgraph=True``), the hook does not break the graph: it
traces :func:`traced_activation`, which reduces every floating tensor of the module
output to its statistics row (:func:`~torchinstruments.reduce._statistics_rows`, the
device path's masked reductions, float32 accumulation; a nested compile region where
torch has them, traced once per element count, see :data:`_rows_in_region`) and
writes the row into the hook's block: a ``(ROWS_PER_MODULE + 2, STAT_WIDTH + 2)``
float64 view, on the tensor's device, of one buffer that holds every observed module's
block. Each output tensor that
requires grad (of an output that is a tensor, or a tuple or list of tensors) passes
through :class:`_GradientTap`, an identity whose backward makes the incoming gradient's
row the gradient of the hook's own gradient sink (a small leaf of the block's shape).

Both tensors are attributes of the hook object, so Dynamo makes them graph inputs and
guards only their shapes, strides and dtypes, never which module's they are. Which row
a tensor takes is counted in the block itself, on the device: its last row holds the
module's hook calls and tensors reduced so far in the sample, so a tensor takes the
next row, and the row holds the call index (the hook calls before it) and the index of
its tensor path (a trace-time constant, :meth:`CompiledCapture.assign` under
``torch.compiler.assume_constant_result``, the same for every module and every
observer in the process, and telling whether the tensor's gradient is tapped). So the
blocks of one class, compiled one by one (``block.compile()`` for each), share one
compiled graph, each call writing its own module's block; a graph that runs several
times in one forward (a block compiled on its own and called twice, a module called in
two frames around a graph break) writes each call to rows of its own, under the call
index the eager path gives it; and traced code never reads which observer's capture a
hook holds, so a later observer of a model of the same class (a sweep in one process,
injecting again) runs the graphs compiled for an earlier one.

The sampling decision is taken where it always is, in the root's forward pre-hook,
which runs eagerly around the compiled model (see :func:`_run_root_hooks_eagerly`).
Traced code reads :attr:`CompiledCapture.active`, so Dynamo guards on it: a sampled
forward runs a graph variant with the reductions and taps, an unsampled one a variant
without them (in the steady state the variant traced with the hooks parked, see
``_parking.py``, whose hook dictionaries are empty); each is compiled once and chosen
by its guards at every call, so the sampling decision never recompiles. A sampled
forward zeroes the rows first (:meth:`CompiledCapture.begin_sample`); when the root
returns (:meth:`CompiledCapture.end_sample`) one device copy of each device's buffer
becomes that sample's pending record in the statistics buffer (a
:class:`~torchinstruments._records.CompiledRows`, whose written rows the series store
reads at the flush); once its backward has run, the next flush or sampled forward takes
the sinks' gradients as its output-gradient rows
(:meth:`CompiledCapture.take_gradients`). Each sample whose backward is still to come
has sinks of its own (a gradient set; the hooks are handed the sinks of a free one when
a sample opens, tensors of the same shapes, so nothing recompiles): two sampled forwards
before one backward keep their output gradients apart. Nothing is read back to the host inside a
forward. A row that no graph wrote in a sample (a module that ran eagerly, or not at
all) counts 0 elements and is left out by the series store, which also tells the
observer which modules the graphs did run (:meth:`CompiledCapture.note_measured`):
parents are adopted only once those are known (:attr:`CompiledCapture.modules_known`).

Attention logits of ``scaled_dot_product_attention`` calls are written by the calling
module's hook too: :func:`~._attention_graph.claimed_rows` hands it their rows before
its output's (``_attention_graph.py``).

What is not captured inside compiled graphs: histograms, the full sentinel, attention
logits of calls whose module's hook is not traced in the same graph (counted, see
``_attention_graph.py``); the count of output tensors that cannot be
reduced (integer, empty, float8: ``coverage.tensors_skipped`` counts them eagerly only;
a module with nothing else still counts as run, see
:attr:`CompiledCapture.traced_without_rows`); tensors of one module's calls beyond its
``ROWS_PER_MODULE`` rows in a sample (counted at the flush); output gradients of
outputs that are other containers (counted); output gradients of samples whose
backward ran after more than ``MAX_GRADIENT_SETS`` sampled forwards in all (each
sample's sinks are a gradient set of their own; counted), of a sample that two
backward passes reached (``retain_graph=True``; counted), and of a sample whose
backward pass runs the graph up to some inputs only (``torch.autograd.grad(loss,
params)``, ``loss.backward(inputs=params)``, which leave the sinks out; counted, where
the sinks' accumulators are found within ``MAX_NODES_SEARCHED`` nodes of the root
output, see :meth:`CompiledCapture.end_sample`); output gradients of an output that is
one of the module's inputs (``nn.Identity``, ``nn.ReLU(inplace=True)``: the tap's
copy would break the alias; counted). Not told apart, and not counted: an output the
loss does not use (autograd gives the tap a zero gradient, where eagerly none comes).
Output gradients of a compiled frame that a reentrant checkpoint recomputes
(``checkpoint(compiled_block, x, use_reentrant=True)``: the recomputation runs in the
backward, after the sample, and takes the unsampled graph) are not captured either. A
frame traced under saved-tensor hooks (``use_reentrant=False``) keeps its hooks as graph
breaks, observed
eagerly (see :func:`_recomputable`). Where Dynamo cannot take the capture (a torch
without ``torch.compiler.assume_constant_result``), forward hooks stay
``torch.compiler.disable``d: each observed module call is a graph break, and
``fullgraph=True`` fails; :meth:`CompiledCapture.mode` says so in the report.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import itertools
import types
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ._attention_graph import claimed_rows, drop_pending
from ._context_cadence import remember_sample
from ._copies import InertHook
from ._records import CompiledRows, TracedPath
from ._state import SKIP
from .capture import (
    MAX_OUTPUT_DEPTH,
    MAX_TENSORS_PER_OUTPUT,
    DirectCallPostHook,
    DirectCallPreHook,
    ForwardHook,
    RootPostHook,
    RootPreHook,
    _is_compiling,
    _never_compiling,
    iter_output_tensors,
    on_compiler_loaded,
    passive,
)
from .reduce import STAT_WIDTH, _statistics_rows, reducible_when_traced
from .series import ACTIVATION, GRAD_OUTPUT

if TYPE_CHECKING:
    from ._context import ForwardContext
    from ._staging import StatisticsBuffer

__all__ = [
    "ROWS_PER_MODULE",
    "CompiledCapture",
    "enable",
    "traced_activation",
]

#: Rows of one observed module inside compiled graphs: the tensors (over its calls and
#: their tensor paths) that graphs may reduce per module and sample; further ones are
#: counted under ``slots_dropped``.
ROWS_PER_MODULE = 16
#: A module's block of rows: ``ROWS_PER_MODULE`` rows, the row that takes the tensors
#: beyond them, and its counters (hook calls, tensors reduced) in the sample.
_OVERFLOW_ROW = ROWS_PER_MODULE
_COUNTER_ROW = ROWS_PER_MODULE + 1
_BLOCK_ROWS = ROWS_PER_MODULE + 2
#: A row: the statistics row, then the call index and the tensor path's index.
_ROW_WIDTH = STAT_WIDTH + 2
#: Gradient sets (each module's gradient sinks) at most: so many sampled forwards may
#: run before their backward passes and keep their output-gradient rows apart (two
#: views of a batch, each a forward, and one backward of the summed loss).
MAX_GRADIENT_SETS = 4
#: Autograd nodes searched at most, from a sampled forward's root output, for the
#: gradient accumulator of one of the sample's gradient sinks (see
#: :meth:`CompiledCapture.end_sample`).
MAX_NODES_SEARCHED = 1024
#: What :func:`traced_activation` does with a tensor's output gradient: tap it
#: (``GRAD_OUTPUT``), count it not tapped, or nothing (no gradient).
_UNTAPPED = "untapped"
_NO_GRADIENT = ""

_assume_constant: Callable[[Callable[..., Any]], Callable[..., Any]] | None = getattr(
    getattr(torch, "compiler", None), "assume_constant_result", None
)
#: ``torch._C._will_engine_execute_node``: inside a backward pass, whether it will run a
#: node (False for a node of the graph that the pass leaves out, as
#: ``torch.autograd.grad(loss, params)`` leaves out every leaf not among ``params``).
_will_engine_execute: Callable[[Any], bool] | None = getattr(
    torch._C, "_will_engine_execute_node", None
)
#: Live captures. Traced code never reads which capture a hook holds (Dynamo would guard
#: on it, and a graph compiled for one observer would not serve the next one of the same
#: class: a sweep in one process, or injecting again, would compile once more each
#: time until ``recompile_limit``); the trace-time calls find it by a block it owns.
_CAPTURES: weakref.WeakSet[CompiledCapture] = weakref.WeakSet()
#: Tensor paths by the index their rows hold, for every capture in the process (append
#: only): the index is a constant of compiled graphs, which any later capture may run.
_PATHS: list[TracedPath] = []
_PATH_INDEX: dict[TracedPath, int] = {}
#: True once a traced graph in the process tapped an output gradient.
_gradients_tapped = False
#: ``"waiting for Dynamo"``, ``"ready"`` once :func:`enable` ran, or ``"off: <reason>"``.
_status = "waiting for Dynamo"

_Key = tuple[int, int, str, str]  # module index, call index, signal, tensor path
#: What a hook holds for each device: its block of activation rows and its gradient sink.
HookRows = dict[str, tuple[Tensor, Tensor]]


class CompiledCapture:
    """Rows and gradient sinks of one observer's capture inside compiled graphs.

    Built by the :class:`~torchinstruments.observer.Observer` (None with
    ``capture_direct_forwards``) and handed to its forward hooks and its forward
    context; it holds no reference to either. Each observed module registers once
    (:meth:`register`) and gets a dict that its hook holds: for each device, its
    block, a ``(ROWS_PER_MODULE + 2, STAT_WIDTH + 2)`` float64 view of that device's
    activation buffer (written by the forward graph), and a leaf of the same shape, the
    gradient sink of the sample's gradient set (the gradient the backward graph
    computes for it holds the output-gradient rows). Each tensor a graph reduces takes
    the block's next row (counted in the block, on the device), which holds its
    statistics row, its call index (the module's hook calls before it in the sample,
    also counted in the block) and the index of its tensor path in ``_PATHS``; its
    output gradient's row has the same place in the sink's gradient. The layout of a
    block is :class:`~torchinstruments._records.CompiledRows`'s.
    """

    def __init__(self, model: Callable[[], nn.Module | None] | None = None) -> None:
        """``model``: the observed model, by weak reference (or None): before the first
        sampled forward once Dynamo is loaded, the rows of every registered module are
        allocated on each device of its parameters and buffers (see :meth:`_allocate`)."""
        self._model = model
        _CAPTURES.add(self)
        #: Activation buffers by device string (``"cpu"``, ``"cuda:0"``): float64,
        #: ``(capacity, ROWS_PER_MODULE + 2, STAT_WIDTH + 2)``; ``[index]`` is module
        #: ``index``'s block.
        self.buffers: dict[str, Tensor] = {}
        #: The dict each registered module's hook holds, by module index.
        self._hook_rows: dict[int, HookRows] = {}
        self._names: dict[int, str] = {}
        #: Module index by ``id`` of its block (the graph input Dynamo traces).
        self._owners: dict[int, int] = {}
        #: Modules whose hook Dynamo traced in a sampled graph variant with no output
        #: tensor it could reduce (integer, empty or float8 outputs): no row tells that
        #: they ran, so this does (at trace time; see :func:`_note_unreduced`).
        self.traced_without_rows: set[int] = set()
        #: Module indices in the order their rows become pending (children before
        #: parents, siblings in definition order): forward positions follow it; and,
        #: by device, the same as a tensor (to gather the blocks in that order).
        self._order: list[int] = []
        self._order_index: dict[str, Tensor] = {}
        self._allocated = 0  # registered modules with rows on every device
        #: True once a compiled graph with reductions ran for this capture (traced code
        #: sets it, Dynamo replays the store after each run of the graph): also a graph
        #: compiled for an earlier observer of a model of the same class. Until then
        #: no graph writes rows of ours, and samples take none.
        self.graphs_ran = False
        #: Called (if set, and its observer alive) when Dynamo traces a hook of ours,
        #: once per compilation: see :func:`_traced_hook`.
        self.on_traced_while_idle: weakref.WeakMethod[Callable[[], None]] | None = None
        #: Set by traced code after each graph run that wrote rows (a side effect
        #: Dynamo replays), cleared when rows are taken: see :meth:`take_rows_so_far`.
        self.rows_pending = False
        #: True inside a sampled root forward. Traced code reads it, so Dynamo guards on
        #: it: a model has one compiled graph with the reductions (sampled forwards) and
        #: one without, each compiled once and chosen by its guard at every call.
        self.active = False
        #: (module, call index, signal, tensor path) whose rows held elements at a flush.
        self.measured: set[_Key] = set()
        #: Tensors that graphs reduced beyond a module's ``ROWS_PER_MODULE`` rows in a
        #: sample (counted at flushes), output tensors on a device without rows of their
        #: module (met while tracing).
        self.slots_dropped = 0
        #: Keys measured in graphs whose output gradient the graph left untapped.
        self.untapped: set[_Key] = set()
        #: Hook calls that compiled code made as graph breaks, traced under
        #: saved-tensor hooks (a compiled frame that ``torch.utils.checkpoint``
        #: recomputes), counted as they run (forwards and recomputations); and hooks
        #: that Dynamo met in a checkpoint region of a backend without AOTAutograd,
        #: counted while tracing: see :func:`_recomputable`.
        self.calls_under_saved_tensor_hooks = 0
        #: Sampled forwards whose output gradients are not recorded: more than
        #: ``MAX_GRADIENT_SETS`` sampled forwards before their backward passes, so
        #: that the backward passes of two samples sharing a gradient set both ran
        #: before a flush or the next sampled forward took the set's gradients; two
        #: backward passes over one sample (``retain_graph=True``); or a backward pass
        #: that left the sample's sinks out (``torch.autograd.grad(loss, params)``,
        #: ``loss.backward(inputs=params)``: only the graph up to the inputs runs).
        self.gradient_samples_lost = 0
        #: Each module's gradient sinks by device, one per gradient set: set ``k`` holds
        #: the output-gradient rows of the samples in ``_set_holders[k]``.
        self._sinks: dict[int, dict[str, list[Tensor]]] = {}
        #: Per gradient set, the samples whose backward fills it, oldest first (empty:
        #: free); more than one only once every set was in use.
        self._set_holders: list[list[int]] = [[]]
        #: Per gradient set, the gradient accumulators of its sinks by ``id`` (held, so
        #: that each sink keeps one accumulator, the node every graph links to).
        self._accumulators: list[dict[int, Any]] = [{}]
        #: Samples whose root output's graph reaches a sink of their gradient set: the
        #: accumulator found (see :meth:`end_sample`), until their backward starts.
        self._reaching: dict[int, Any] = {}
        #: Samples whose backward pass left their gradient sinks out (counted lost).
        self._not_reached: dict[int, None] = {}
        #: Per gradient set, when its gradients were last taken (a count of takes; -1:
        #: never): a sample opens on the free set taken longest ago.
        self._taken_at: list[int] = [-1]
        self._takes = 0
        #: Per free gradient set, the sample last recorded from it and its pending
        #: rows: gradients that reach the set later are another backward pass over
        #: that sample (``retain_graph=True``), which its rows do not include.
        self._last_recorded: dict[int, tuple[int, list[CompiledRows]]] = {}
        #: The gradient set the hooks hold now, and the one the open sample uses.
        self._current_set = 0
        self._sample_set = -1
        #: The direct-call sample whose rows wait in the buffers (-1: none), see
        #: :meth:`suspend_sample`.
        self._suspended = -1
        #: The first sample with rows from graphs (-1: none yet), and whether a flush
        #: has read it: until then it is not known which modules the graphs ran.
        self._first_sample = -1
        self._first_read = False

    def mode(self) -> str:
        """``coverage.compiled_capture.mode``: ``"in_graph"`` once a compiled graph
        reduced a module output; ``"graph_breaks: ..."`` where every hook Dynamo met
        ran under saved-tensor hooks and stayed a graph break (see
        :func:`_recomputable`); ``"unused"`` while Dynamo met none; ``"off: <reason>"``
        where hooks traced by Dynamo fall back to a graph break each."""
        if _status.startswith("off"):
            return _status
        if self.graphs_ran:
            return "in_graph"
        if self.calls_under_saved_tensor_hooks:
            return "graph_breaks: traced under saved-tensor hooks (activation checkpointing)"
        return "unused"

    def register(self, index: int, name: str) -> HookRows:
        """The dict that the forward hook of module ``index`` (called ``name``) holds;
        empty until the rows are allocated, before the next sampled forward."""
        rows: HookRows = {}
        self._hook_rows[index] = rows
        self._names[index] = name
        return rows

    @property
    def modules_known(self) -> bool:
        """False from the first sample with rows from graphs until a flush has read
        it: until then it is not known which modules those graphs ran."""
        return self._first_sample < 0 or self._first_read

    # ---------------------------------------------------------------- trace time
    def owns(self, block: Tensor) -> bool:
        """Whether ``block`` is the block of one of this capture's modules."""
        return id(block) in self._owners

    def assign(self, path: str, gradient: str) -> int:
        """At trace time only: the index in ``_PATHS`` of ``path``, for a tensor of an
        output of one of this capture's modules; ``gradient`` says what is done with its
        output gradient (``GRAD_OUTPUT``: tapped; ``"untapped"``: not tapped, told by the
        index, see :attr:`gradients_not_tapped`; ``""``: it has none)."""
        global _gradients_tapped
        if gradient == GRAD_OUTPUT:
            _gradients_tapped = True
        traced = TracedPath(path, gradient == _UNTAPPED)
        slot = _PATH_INDEX.get(traced)
        if slot is None:
            slot = _PATH_INDEX[traced] = len(_PATHS)
            _PATHS.append(traced)
        return slot

    @property
    def gradients_not_tapped(self) -> int:
        """The (module, call index, signal, tensor path) measured in graphs whose output
        gradient the graph left untapped (their rows say so: see
        :class:`~torchinstruments._records.TracedPath`), so also where the graph was
        compiled for an earlier observer."""
        return len(self.untapped)

    # ---------------------------------------------------------------- allocation
    def _allocate(self) -> None:
        """Rows and sinks of every registered module on each device of the model's
        parameters and buffers (not ``meta``; the CPU for a model with neither), where
        any is missing.

        Traced code reads each hook's dict, and Dynamo keeps its own view of a dict from
        its first read in a trace, so the entries are made before sampled forwards, not
        while tracing. A buffer that grows is made anew: the hooks get views of the new
        one (their shapes and strides, all Dynamo guards, stay the same). About 2.3 kB
        per module and device."""
        model = None if self._model is None else self._model()
        if model is None:
            return
        devices = sorted(
            {str(t.device) for t in itertools.chain(model.parameters(), model.buffers())} - {"meta"}
        ) or ["cpu"]  # a model without parameters or buffers: its outputs' device is unknown
        count = max(self._hook_rows, default=-1) + 1
        for device in devices:
            buffer = self.buffers.get(device)
            if buffer is not None and buffer.shape[0] >= count:
                continue
            capacity = max(64, 1 << (count - 1).bit_length())
            self.buffers[device] = torch.zeros(
                capacity, _BLOCK_ROWS, _ROW_WIDTH, dtype=torch.float64, device=device
            )
        self._owners = {}
        for index, hook_rows in self._hook_rows.items():
            sinks = self._sinks.setdefault(index, {})
            for device, buffer in self.buffers.items():
                sets = sinks.setdefault(device, [])
                while len(sets) < len(self._set_holders):
                    self._add_sink(sets, device)
                rows = buffer[index]
                hook_rows[device] = (rows, sets[self._current_set])
                self._owners[id(rows)] = index
        self._order = _post_order(model, self._names)
        self._order_index = {
            device: torch.tensor(self._order, dtype=torch.long, device=device)
            for device in self.buffers
        }
        self._allocated = len(self._hook_rows)

    def _add_sink(self, sets: list[Tensor], device: str) -> None:
        """Append a new gradient sink to ``sets`` (a module's sinks on ``device``, one per
        gradient set) and note its gradient accumulator."""
        sink = _new_sink(device)
        with torch.enable_grad():
            grad_fn = sink.view_as(sink).grad_fn
        if grad_fn is not None:
            accumulator = grad_fn.next_functions[0][0]
            self._accumulators[len(sets)][id(accumulator)] = accumulator
        sets.append(sink)

    # ---------------------------------------------------------------- run time
    def begin_sample(self, context: ForwardContext) -> None:
        """A sampled forward opens (after its sample index was taken): the gradient rows
        of earlier samples whose backward ran go to ``context.buffer``, the hooks get a
        free gradient set (see :meth:`_choose_gradient_set`), then the rows are cleared,
        so that rows no graph writes in this sample (a module not called) count 0
        elements. Never raises: an error is counted, and the sample runs without. Runs
        in :func:`passive`: a user's torch-function or dispatch mode sees none of it (the
        sinks' ``.grad`` reads, the buffers made and cleared)."""
        try:
            with passive():
                if self._allocated != len(self._hook_rows) and _status == "ready":
                    self._allocate()
                self.take_gradients(context)
                self._sample_set = self._choose_gradient_set()
                if self.graphs_ran:
                    with torch.no_grad():
                        for buffer in self.buffers.values():
                            buffer.zero_()
            self.active = True
        except Exception as error:  # never break training
            context.errors.record("compiled_capture", "", error)

    def suspend_sample(self, context: ForwardContext, output: object) -> Any:
        """A ``torch.compile`` wrapper called directly, which opened or joined the open
        direct-call sample, returned ``output``: graphs stop reducing (the unsampled
        variant runs) until another wrapper joins the sample (:meth:`resume_sample`);
        the rows stay in the buffers, so that a module's calls in the sample keep
        counting, and are taken when the sample ends (:meth:`finish_direct_sample`).
        Returns the sink accumulator that ``output``'s autograd graph reaches (or
        None), for :meth:`check_reached` when a backward pass reaches ``output``: a
        backward that never reaches it (a discriminator's loss on a generator's
        detached output) loses nothing there."""
        if not self.active:
            return None
        self.active = False
        self._suspended = context.sample
        chosen = self._sample_set
        try:
            if chosen >= 0 and torch.is_grad_enabled() and _gradients_tapped:
                with passive():
                    return self._sink_reached(output, chosen)
        except Exception as error:  # never break training
            context.errors.record("compiled_capture", "", error)
        return None

    def resume_sample(self, context: ForwardContext) -> None:
        """Another wrapper joins the open direct-call sample that :meth:`suspend_sample`
        suspended: graphs reduce again, into the same rows and gradient set."""
        if not self.active and self._suspended == context.sample:
            self.active = True

    def finish_direct_sample(self, context: ForwardContext) -> None:
        """End the direct-call sample that :meth:`suspend_sample` left in the buffers
        (before the next sample opens, and at the final report): its rows become pending
        as a root's do at :meth:`end_sample`. Nothing where none is suspended."""
        if self._suspended < 0 or self._suspended != context.sample or self.active:
            return
        self._suspended = -1
        self.active = True
        self.end_sample(context, None)

    def _choose_gradient_set(self) -> int:
        """The gradient set for the sample that opens, handed to the hooks: a set never
        used, else a new one (up to ``MAX_GRADIENT_SETS``), else the free set whose
        gradients were taken longest ago (so that another backward pass over a recent
        sample reaches its own set, see :meth:`take_gradients`), else the one whose
        newest sample is the oldest; that set then fills for two samples, whose
        gradients :meth:`take_gradients` tells apart only if one backward ran before the
        other's did."""
        holders = self._set_holders
        taken_at = self._taken_at
        free = [k for k, held in enumerate(holders) if not held]
        if free and (len(holders) >= MAX_GRADIENT_SETS or min(taken_at[k] for k in free) < 0):
            chosen = min(free, key=taken_at.__getitem__)
        elif len(holders) < MAX_GRADIENT_SETS:
            chosen = len(holders)
            holders.append([])
            taken_at.append(-1)
            self._accumulators.append({})
            with passive():
                for by_device in self._sinks.values():
                    for device, sets in by_device.items():
                        self._add_sink(sets, device)
        else:
            chosen = min(range(len(holders)), key=lambda k: holders[k][-1])
        self._last_recorded.pop(chosen, None)  # its gradients are the new sample's now
        if chosen != self._current_set:
            self._current_set = chosen
            for index, hook_rows in self._hook_rows.items():
                by_device = self._sinks.get(index, {})
                for device, (rows, _) in hook_rows.items():
                    hook_rows[device] = (rows, by_device[device][chosen])
        return chosen

    def end_sample(self, context: ForwardContext, output: object) -> None:
        """The root of the open sample returned ``output``: one device copy of each
        activation buffer becomes pending rows of ``context.buffer`` (read at its next
        flush), in module order, at forward positions after the calls observed eagerly.

        Where graphs tap output gradients, the autograd graph of ``output`` is searched
        (breadth first, at most ``MAX_NODES_SEARCHED`` nodes, no tensor read) for the
        gradient accumulator of a sink of the sample's gradient set: when the sample's
        backward starts, :meth:`backward_started` asks the engine whether it will run
        that node. Never raises (an error is counted). Runs in :func:`passive`, as
        :meth:`begin_sample` does."""
        if not self.active:
            return
        self.active = False
        drop_pending()  # attention rows no hook claimed (a graph break between them)
        chosen, self._sample_set = self._sample_set, -1
        try:
            with passive():
                if chosen >= 0:
                    self._set_holders[chosen].append(context.sample)
                    if output is not None and torch.is_grad_enabled() and _gradients_tapped:
                        found = self._sink_reached(output, chosen)
                        if found is not None:
                            remember_sample(self._reaching, context.sample, found)
                self._take_activations(context)
        except Exception as error:  # never break training
            context.errors.record("compiled_capture", "", error)

    def _sink_reached(self, output: object, chosen: int) -> Any:
        """The gradient accumulator of a sink of gradient set ``chosen`` that
        ``output``'s autograd graph reaches first (breadth first, at most
        ``MAX_NODES_SEARCHED`` nodes, no tensor read), or None."""
        targets = self._accumulators[chosen]
        if not targets or _will_engine_execute is None:
            return None
        queue = collections.deque(
            leaf.grad_fn
            for _, leaf in iter_output_tensors(output)
            if isinstance(leaf, Tensor) and leaf.grad_fn is not None
        )
        seen: dict[int, Any] = {}  # holds the nodes: their ids stay theirs meanwhile
        while queue and len(seen) < MAX_NODES_SEARCHED:
            node = queue.popleft()
            if id(node) in seen:
                continue
            seen[id(node)] = node
            for child, _ in node.next_functions:
                if child is None:
                    continue
                found = targets.get(id(child))
                if found is not None:  # a graph input: checked as it is met, not queued
                    return found
                queue.append(child)
        return None

    def backward_started(self, sample: int) -> None:
        """The first output gradient of ``sample`` arrived (inside its backward pass):
        where its graph reaches its gradient sinks but the engine will not run their
        accumulators (``torch.autograd.grad(loss, params)``,
        ``loss.backward(inputs=params)``), its compiled modules' output gradients will
        not come: counted in :attr:`gradient_samples_lost`."""
        self.check_reached(sample, self._reaching.pop(sample, None))

    def check_reached(self, sample: int, accumulator: Any) -> None:
        """Inside a backward pass of ``sample`` that reached an output whose graph
        reaches ``accumulator`` (a sink's, or None): where the engine will not run it,
        the sample's compiled output gradients will not come (counted once in
        :attr:`gradient_samples_lost`)."""
        if accumulator is None or _will_engine_execute is None or sample in self._not_reached:
            return
        if not _will_engine_execute(accumulator):
            remember_sample(self._not_reached, sample)
            self.gradient_samples_lost += 1

    def take_rows_so_far(self, context: ForwardContext) -> None:
        """A module is observed eagerly in the open sample after graphs wrote rows in it
        (a compiled block, or a compiled part of the model, ran before it): those rows
        become pending now, at forward positions before the eager call's, and are
        cleared in the buffers (the counters stay, so calls and rows count on), so that
        a later take has only the rows written after. Without it every row from graphs
        took positions after all of the sample's eager calls, and a module observed
        eagerly after a compiled sub-network came first in forward order. Never raises
        (an error is counted). Runs in :func:`passive`."""
        self.rows_pending = False
        if not self.active and self._suspended != context.sample:
            return
        try:
            with passive():
                self._take_activations(context, partial=True)
        except Exception as error:  # never break training
            context.errors.record("compiled_capture", "", error)

    def _take_activations(self, context: ForwardContext, *, partial: bool = False) -> None:
        """One device copy of each activation buffer becomes pending rows, at the next
        forward positions. ``partial``: the sample goes on (see
        :meth:`take_rows_so_far`): the rows copied are cleared in the buffers, and the
        copies' counters too, so that tensors beyond a module's rows are counted at the
        sample's last take only."""
        self.rows_pending = False
        sample = context.sample
        if not self.graphs_ran or not self.buffers:
            return
        pending = context.buffer.pending
        modules = tuple(self._order)
        with torch.no_grad():
            copies = {
                device: buffer.index_select(0, self._order_index[device])
                for device, buffer in self.buffers.items()
            }
            if partial:
                for device, buffer in self.buffers.items():
                    buffer[:, :_OVERFLOW_ROW].zero_()
                    copies[device][:, _COUNTER_ROW].zero_()
        for copy in copies.values():
            position = context.position
            pending.append(CompiledRows(sample, ACTIVATION, position, modules, _PATHS, copy))
            context.position = position + len(modules) * ROWS_PER_MODULE
        if self._first_sample < 0:
            self._first_sample = sample
        _note_streams(context.buffer, copies)

    def take_gradients(self, context: ForwardContext) -> None:
        """The output-gradient rows that backward passes put into the sinks' gradients,
        as pending rows of ``context.buffer``, per gradient set in sample order.

        A set with gradients is the sample's whose backward started (the only one, or
        the one the set holds alone; ``context.awaiting_backward`` holds the samples
        whose backward has not started). Not recorded, and counted in
        :attr:`gradient_samples_lost`: where the backward passes of two samples that
        share the set both started, or a second backward pass reached the sample
        (``retain_graph=True``, seen at the root's eager gradient hook): the rows in
        the set are then the sum of several gradients' rows, which are not the rows of
        their total. A sample whose backward ran with nothing in its sinks ran no graph
        with taps (a compiled block skipped, or run uncompiled past the recompile
        limit) and leaves its set, as does one older than a sample taken whose backward
        started. A sample whose backward has not started keeps its set, even where a
        later sample's backward ran first (backward passes out of forward order), until
        it leaves ``context.awaiting_backward`` (the latest
        ``MAX_SAMPLES_AWAITING_BACKWARD`` samples): a forward whose loss is never used
        holds a set that long, and a later sample may share it."""
        buffer = context.buffer
        awaiting = context.awaiting_backward
        repeated = context.capture.samples_with_repeated_backward
        not_reached = self._not_reached
        holders = self._set_holders
        # The set of a direct-call sample still suspended (see suspend_sample) has no
        # holder yet: its gradients wait for the sample to end.
        waiting = self._sample_set if self._suspended >= 0 else -1
        for chosen in range(len(holders)):
            if chosen == waiting:
                continue
            if not holders[chosen] and (late := self._take_set(chosen)):
                self._late_gradients(buffer, chosen, late)
        newest = -1
        for chosen in sorted(
            (k for k, held in enumerate(holders) if held), key=holders.__getitem__
        ):
            held = holders[chosen]
            grads = self._take_set(chosen)
            if grads:
                self._taken_at[chosen] = self._takes
                self._takes += 1
            held[:] = [sample for sample in held if sample not in not_reached]  # counted
            if not held:
                continue
            started = [sample for sample in held if sample not in awaiting]
            if not grads:
                held[:] = [sample for sample in held if sample in awaiting]
                continue
            if len(held) == 1 or len(started) == 1:
                owners = [started[0] if started else held[0]]
            else:
                owners = started or list(held)
            sample = max(owners)
            if len(owners) == 1 and sample not in repeated:
                records = self._append_gradients(buffer, sample, grads)
                self._last_recorded[chosen] = (sample, records)
            else:  # several gradients' rows summed in the set: not the rows of their total
                self.gradient_samples_lost += len(owners)
            newest = max(newest, sample)
            held[:] = [other for other in held if other not in owners]
        for held in holders:  # a sample older than one taken, its backward started
            held[:] = [sample for sample in held if sample >= newest or sample in awaiting]

    def _late_gradients(
        self, buffer: StatisticsBuffer, chosen: int, late: dict[str, list[tuple[int, Tensor]]]
    ) -> None:
        """Gradients ``late`` reached free set ``chosen`` after its sample's were taken.

        Where none of their modules had a gradient among those taken, they are those
        modules' first output gradients in the sample, which a later backward pass
        brought (a GAN's generator, whose output the discriminator's pass reached
        detached and the generator's pass reached in full): recorded for the sample.
        Otherwise another backward pass went over the sample (``retain_graph=True``,
        after a later forward): they are dropped, the sample's rows are taken back where
        not yet flushed, and the sample is counted in :attr:`gradient_samples_lost`
        (once flushed, its rows hold its first pass's gradients only)."""
        recorded = self._last_recorded.get(chosen)
        if recorded is None:
            return  # a sample already left out
        sample, records = recorded
        taken = {index for record in records for index in record[3]}
        if all(index not in taken for by_module in late.values() for index, _ in by_module):
            records.extend(self._append_gradients(buffer, sample, late))
            return
        del self._last_recorded[chosen]
        ids = {id(record) for record in records}
        buffer.pending[:] = [record for record in buffer.pending if id(record) not in ids]
        self.gradient_samples_lost += 1

    def _take_set(self, chosen: int) -> dict[str, list[tuple[int, Tensor]]]:
        """The gradients of gradient set ``chosen``'s sinks, by device, in module order
        (and the sinks' gradients cleared)."""
        by_device: dict[str, list[tuple[int, Tensor]]] = {}
        for index in self._order:
            for device, sets in self._sinks.get(index, {}).items():
                sink = sets[chosen]
                grad = sink.grad
                if grad is not None:
                    by_device.setdefault(device, []).append((index, grad))
                    sink.grad = None
        return by_device

    def _append_gradients(
        self, buffer: StatisticsBuffer, sample: int, grads: dict[str, list[tuple[int, Tensor]]]
    ) -> list[CompiledRows]:
        """Append ``sample``'s output-gradient rows from ``grads`` to the pending rows;
        the records appended."""
        records = []
        stacks: dict[str, Tensor] = {}
        for device, by_module in grads.items():
            with torch.no_grad():
                stacked = stacks[device] = torch.stack([grad for _, grad in by_module])
            modules = tuple(index for index, _ in by_module)
            records.append(CompiledRows(sample, GRAD_OUTPUT, -1, modules, _PATHS, stacked))
        buffer.pending.extend(records)
        if self._first_sample < 0:
            self._first_sample = sample
        _note_streams(buffer, stacks)
        return records

    def note_measured(
        self,
        keys: set[_Key],
        processed_through: int,
        rows_dropped: int,
        untapped: set[_Key],
    ) -> None:
        """After a flush: ``keys`` held elements in rows from graphs, ``untapped`` of
        them with their output gradient left untapped; every sample up to
        ``processed_through`` has been read (see :attr:`modules_known`); ``rows_dropped``
        tensors were reduced beyond their module's rows in the samples read."""
        self.measured |= keys
        self.untapped |= untapped
        self.slots_dropped += rows_dropped
        if 0 <= self._first_sample <= processed_through:
            self._first_read = True


def _post_order(model: nn.Module, names: dict[int, str]) -> list[int]:
    """The indices of ``names`` in the order their forward hooks fire in a nested
    forward: each module after its descendants, siblings in definition order
    (``named_modules`` order); names not found in ``model`` come last, by index."""
    rank: dict[str, int] = {}
    stack: list[str] = []
    for name, _ in model.named_modules(remove_duplicate=False):
        while stack and not name.startswith(stack[-1] + "." if stack[-1] else ""):
            rank.setdefault(stack.pop(), len(rank))
        stack.append(name)
    while stack:
        rank.setdefault(stack.pop(), len(rank))
    last = len(rank)
    return sorted(names, key=lambda index: (rank.get(names[index], last), index))


def _new_sink(device: str) -> Tensor:
    """A gradient sink: a zero float64 leaf on ``device`` of a module block's shape,
    ``(ROWS_PER_MODULE + 2, STAT_WIDTH + 2)``, that requires grad (the backward graph
    computes its gradient, the rows)."""
    return torch.zeros(
        _BLOCK_ROWS, _ROW_WIDTH, dtype=torch.float64, device=device, requires_grad=True
    )


def _note_streams(buffer: StatisticsBuffer, copies: dict[str, Tensor]) -> None:
    """Note the CUDA streams that made ``copies`` (see ``StatisticsBuffer.producer_streams``)."""
    for rows in copies.values():
        if rows.is_cuda:
            buffer.producer_streams.add(torch.cuda.current_stream(rows.device))


def _capture_owning(block: Tensor | None) -> CompiledCapture | None:
    """The live capture whose module has ``block`` (None for none)."""
    if block is None:
        return None
    return next((capture for capture in list(_CAPTURES) if capture.owns(block)), None)


#: The tracing context (one per compilation attempt) in which :func:`_traced_hook` last
#: asked the observers, by weak reference; None before.
_traced_in: weakref.ref[object] | None = None


def _traced_hook() -> bool:
    """At trace time, once per compilation attempt: tell the observer of each live
    capture that Dynamo traces a hook of ours (see ``Observer._compiled_while_idle``,
    which hooks ``torch.compile`` wrappers made after injection when no forward of its
    own is open; which observer's hook is traced is not read: traced code never tells
    them apart, and a hook's rows may not be allocated yet). True."""
    global _traced_in
    tracing: object = None
    try:
        from torch._guards import TracingContext

        tracing = TracingContext.try_get()
    except Exception:  # a torch without it: every hook traced asks
        pass
    if tracing is not None:
        if _traced_in is not None and _traced_in() is tracing:
            return True
        try:
            _traced_in = weakref.ref(tracing)
        except TypeError:
            _traced_in = None
    for capture in list(_CAPTURES):
        callback = capture.on_traced_while_idle() if capture.on_traced_while_idle else None
        if callback is not None:
            with contextlib.suppress(Exception):  # never into Dynamo's trace (nor training)
                callback()
    return True


def _assign(block: Tensor, path: str, gradient: str) -> int:
    """At trace time: the index of ``path`` among the tensor paths (see
    :meth:`CompiledCapture.assign`), for a tensor of an output of the module whose block
    is ``block``; -1 (not reduced) for a block of no live capture's module."""
    capture = _capture_owning(block)
    return -1 if capture is None else capture.assign(path, gradient)


def _recomputable(block: Tensor | None) -> bool:
    """True if the frame traced now runs under saved-tensor hooks (its hook calls are
    counted as they run, see :func:`_call_as_graph_break`), or inside a checkpoint
    region of a backend without AOTAutograd (counted now: Dynamo runs that region
    eagerly, hooks included).

    Non-reentrant activation checkpointing (``checkpoint(compiled_block, x,
    use_reentrant=False)``) saves nothing in the forward and recomputes the frame in the
    backward, where the sample that ran it is over: the recomputation would run the
    other graph variant (chosen by :attr:`CompiledCapture.active`), whose saved tensors
    differ, and ``torch.utils.checkpoint`` raises. Under any saved-tensor hooks (the
    checkpoint's, ``save_on_cpu``, a user's), the hook stays a graph break instead, the
    same graph serves sampled and unsampled forwards, and the eager path observes the
    call (it tells recomputations from forwards). Checkpointing traced by Dynamo
    (``torch.compile`` of a function that calls ``checkpoint``) runs no hooks while
    tracing, and keeps the in-graph capture, except under a backend that runs Dynamo's
    graph without AOTAutograd, which runs the region as ``torch.utils.checkpoint``
    itself (see :func:`_checkpoint_region`): the hook stays a graph break there, so
    Dynamo runs the checkpoint call eagerly and the eager path observes it under the
    checkpoint's saved-tensor hooks.

    Dynamo calls this once for every hook it traces, before anything else of the hook:
    it also asks the observers about ``torch.compile`` wrappers made after injection
    (:func:`_traced_hook`, once per compilation)."""
    _traced_hook()
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    except Exception:
        return False
    if hooks is not None:
        return True
    if _checkpoint_region() != _REGION_RUN_AS_IS:
        return False
    # Dynamo then runs the whole checkpoint call eagerly, hooks included: counted here.
    capture = _capture_owning(block)
    if capture is not None:
        capture.calls_under_saved_tensor_hooks += 1
    return True


#: Dynamo's backends that compile its graph through AOTAutograd, by name: they
#: functionalize an activation-checkpoint region, so writes into the rows inside it are
#: outputs of the region, not changes to its saved inputs.
_AOT_BACKENDS = frozenset(
    {
        "inductor",
        "aot_eager",
        "aot_eager_decomp_partition",
        "aot_eager_decomp_partition_crossref",
        "aot_eager_decomp_partition_with_mode",
        "aot_eager_default_partitioner",
        "aot_ts",
        "cudagraphs",
    }
)
#: Description that Dynamo gives the tracer of a ``torch.utils.checkpoint`` region.
_CHECKPOINT_REGION = "torch.utils.checkpoint.checkpoint"


#: :func:`_checkpoint_region`'s answers.
_OUTSIDE_REGION, _REGION_THROUGH_AOT, _REGION_RUN_AS_IS = 0, 1, 2


def _checkpoint_region() -> int:
    """At trace time: whether Dynamo is tracing the body of an activation-checkpoint
    region (``torch.utils.checkpoint`` called inside compiled code), and how its backend
    runs it.

    :data:`_OUTSIDE_REGION` outside one (and where Dynamo's tracer cannot be read: a
    torch that changed these internals). :data:`_REGION_THROUGH_AOT` for a backend that
    compiles the graph through AOTAutograd (its name in :data:`_AOT_BACKENDS`, or made by
    ``torch._dynamo.backends.common.aot_autograd``): the region is functionalized, and
    its backward recomputes the region's values from the graph's inputs as they are
    then, the rows already written by the forward among them, so a gradient tap's row
    and call index, which the forward reads from the rows, are wrong when recomputed
    (AOTAutograd's partitioner recomputes reads of inputs that the forward changes;
    pytorch pull request 197039, open, would save them instead); see
    :func:`traced_activation`. :data:`_REGION_RUN_AS_IS` for any other backend
    (``backend="eager"``, a user's backend that returns ``gm.forward``): the region runs
    as ``torch.utils.checkpoint`` itself, which saves the region's inputs, the rows
    among them, and raised in the backward once the capture had written them; see
    :func:`_recomputable`."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        output = InstructionTranslator.current_tx().output
        tracer = output.current_tracer
        while tracer is not None and tracer.description != _CHECKPOINT_REGION:
            tracer = tracer.parent
        if tracer is None:
            return _OUTSIDE_REGION
        backend = output.compiler_fn
        if getattr(backend, "_compiler_name", None) in _AOT_BACKENDS:
            return _REGION_THROUGH_AOT
        from torch._dynamo.backends.common import AotAutograd

        original = getattr(backend, "_torchdynamo_orig_backend", backend)
        return _REGION_THROUGH_AOT if isinstance(original, AotAutograd) else _REGION_RUN_AS_IS
    except Exception:
        return _OUTSIDE_REGION


#: :func:`_assign` as Dynamo sees it (called while tracing, its result a constant); set
#: by :func:`enable` once Dynamo is loaded, None before and where torch lacks it.
_assign_constant: Callable[..., int] | None = None


def _count_dropped(block: Tensor | None) -> bool:
    """Count, while tracing, an output tensor on a device without rows of its module
    (``block``: a block of the module on another device, or None)."""
    capture = _capture_owning(block)
    if capture is not None:
        capture.slots_dropped += 1
    return True


#: :func:`_count_dropped` as Dynamo sees it; set by :func:`enable`.
_count_dropped_constant: Callable[[Tensor | None], bool] = _count_dropped


def _note_unreduced(block: Tensor | None) -> bool:
    """At trace time: the module whose block is ``block`` had output tensors in this
    sampled graph, none of which can be reduced (see
    :attr:`CompiledCapture.traced_without_rows`)."""
    capture = _capture_owning(block)
    if capture is not None:
        capture.traced_without_rows.add(capture._owners[id(block)])
    return True


#: :func:`_note_unreduced` as Dynamo sees it; set by :func:`enable`.
_note_unreduced_constant: Callable[[Tensor | None], bool] = _note_unreduced

#: :func:`_recomputable` as Dynamo sees it (a constant of the traced frame); set by
#: :func:`enable`.
_recomputable_constant: Callable[[Tensor | None], bool] = _recomputable
#: :func:`_checkpoint_region` as Dynamo sees it; set by :func:`enable`.
_checkpoint_region_constant: Callable[[], int] = _checkpoint_region
#: ``ForwardHook.__call__`` as :func:`enable` found it (``torch.compiler.disable``d).
_opaque_call: Callable[..., Any] | None = None


def _call_as_graph_break(
    self: ForwardHook,
    module: nn.Module,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    output: object,
) -> object:
    """The hook call that compiled code makes as a graph break where Dynamo traced the
    hook under saved-tensor hooks (see :func:`_recomputable`): counted under
    ``calls_under_saved_tensor_hooks`` as it runs (so also in graphs compiled for an
    earlier observer), then the eager hook. ``torch.compiler.disable``d by
    :func:`enable`."""
    capture = self.compiled
    if isinstance(capture, CompiledCapture):
        capture.calls_under_saved_tensor_hooks += 1
    assert _opaque_call is not None
    return _opaque_call(self, module, args, kwargs, output)


#: :func:`_call_as_graph_break` as Dynamo sees it (a graph break); set by :func:`enable`.
_graph_break_call: Callable[..., Any] = _call_as_graph_break


def _run_root_hooks_eagerly() -> None:
    """Tell Dynamo never to compile the root's hooks as frames of their own.

    ``torch.compile(model)`` runs the root's ``_call_impl`` eagerly, and Dynamo compiles
    each Python frame called from it, our root pre- and post-hooks among them: each would
    be a graph break (and ``fullgraph=True`` would fail). They take the sampling decision
    and keep the sample context, which must run for real, so their code objects are
    marked to run eagerly with everything they call (Dynamo's frame execution strategy
    SKIP, recursively); nothing of this costs anything in eager training. Where they are
    traced inline instead (a compiled function that calls the model), they remain a
    graph break each. The hooks of ``torch.compile`` wrappers inside the model
    (:class:`~torchinstruments.capture.DirectCallPreHook` and its post-hook, which open
    and close direct-call samples around the wrapper's compiled frame) are marked for
    the same reason. The inert hooks of copies of an observed model
    (:class:`~torchinstruments._copies.InertHook`) are marked too: run eagerly, a copy's
    root placeholders remove every placeholder of the copy before its compiled forward
    is traced.
    """
    from torch._C._dynamo.eval_frame import (
        _FrameAction,
        _FrameExecStrategy,
        set_code_exec_strategy,
    )

    for hook in (RootPreHook, RootPostHook, DirectCallPreHook, DirectCallPostHook, InertHook):
        code = getattr(hook.__dict__.get("__call__"), "__code__", None)
        if isinstance(code, types.CodeType):
            set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))


def _forward_hook_call(
    self: ForwardHook,
    module: nn.Module,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    output: object,
) -> object:
    """``ForwardHook.__call__`` once Dynamo is loaded: eagerly the same as before
    (returns at once in unsampled forwards); traced by Dynamo, the in-graph capture.
    Traced code reads no attribute that tells modules apart (their index among them),
    nor which capture a hook holds, so that blocks of one class share their compiled
    graphs, and so do later observers of models of the same class."""
    if _is_compiling():
        compiled = self.compiled
        rows = self.rows
        if isinstance(compiled, CompiledCapture):
            if not _recomputable_constant(_any_block(rows)):
                return traced_activation(compiled, rows, output, args, kwargs)
            return _graph_break_call(self, module, args, kwargs, output)
        assert _opaque_call is not None
        return _opaque_call(self, module, args, kwargs, output)
    observer = self._observer()
    if observer is None or observer.state is SKIP:  # the fast path
        return None
    observer.on_forward(self._index, args, output)
    return None


def enable() -> None:
    """Called once Dynamo is loaded (it must not be imported for eager training), after
    the hooks were made opaque: run the root hooks eagerly, make the slot assignment a
    trace-time constant and let Dynamo trace forward hooks. Where torch lacks what this
    needs, forward hooks stay graph breaks and :meth:`CompiledCapture.mode` says why."""
    global _assign_constant, _count_dropped_constant, _opaque_call, _recomputable_constant
    global _checkpoint_region_constant, _graph_break_call, _note_unreduced_constant
    global _rows_in_region, _status
    if _assume_constant is None or _is_compiling is _never_compiling:
        _status = "off: torch without torch.compiler.assume_constant_result"
        return
    try:
        _run_root_hooks_eagerly()
        _assign_constant = _assume_constant(_assign)
        _recomputable_constant = _assume_constant(_recomputable)
        _count_dropped_constant = _assume_constant(_count_dropped)
        _note_unreduced_constant = _assume_constant(_note_unreduced)
        _checkpoint_region_constant = _assume_constant(_checkpoint_region)
        _graph_break_call = torch.compiler.disable(_call_as_graph_break, recursive=True)
        _rows_in_region = _nested_region(_masked_rows)
    except Exception as error:
        _assign_constant = None
        _status = f"off: {type(error).__name__}: {error}"[:200]
        return
    _opaque_call = ForwardHook.__dict__["__call__"]
    ForwardHook.__call__ = _forward_hook_call  # type: ignore[method-assign]
    _status = "ready"


on_compiler_loaded(enable)


def _masked_rows(flat: Tensor) -> Tensor:
    """The statistics row of the ``(1, n)`` tensor ``flat``, non-finite values masked."""
    return _statistics_rows(flat, masked=True)


#: Most graphs of :func:`_masked_rows` that Dynamo keeps for reuse in one compilation
#: (one per distinct element count and dtype among the reduced tensors). Dynamo raises
#: where a nested compile region would need more, which would stop training; far more
#: than any model has.
MAX_REGION_GRAPHS = 1 << 16

#: :func:`_masked_rows` as a nested compile region where torch has one
#: (``torch.compiler.nested_compile_region``, set by :func:`enable`): Dynamo traces the
#: reductions (about 35 operations) once per element count and dtype and reuses that
#: subgraph at every other tensor of the same count, where it traced them at each
#: (``benchmarks/compile_time.py`` times the first steps with and without it).
_rows_in_region: Callable[[Tensor], Tensor] = _masked_rows


def _row(value: Tensor) -> Tensor:
    """The statistics row of ``value``, shape ``(1, STAT_WIDTH)``, float64."""
    return _rows_in_region(value.reshape(1, -1))


def _nested_region(function: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``function`` as a nested compile region that keeps up to
    :data:`MAX_REGION_GRAPHS` graphs, or ``function`` itself where torch has no
    ``torch.compiler.nested_compile_region`` that takes ``max_reuse_entries`` (older
    ones keep 8 and raise beyond)."""
    region = getattr(torch.compiler, "nested_compile_region", None)
    if region is None:
        return function
    try:
        if "max_reuse_entries" not in inspect.signature(region).parameters:
            return function
        return region(function, max_reuse_entries=MAX_REGION_GRAPHS)
    except Exception:  # a signature torch cannot give, or a region it refuses
        return function


class _GradientTap(torch.autograd.Function):
    """Identity in the forward (a copy of its input); in the backward, the statistics row
    of the incoming gradient, then ``ids`` (its call index and tensor path index),
    becomes row ``row`` (a one-element long tensor) of the gradient of ``sink`` (the
    gradient itself passes on unchanged).

    The forward returns a copy, not a view: autograd forbids in-place changes to a view
    that a custom Function returned, and models change module outputs in place
    (``nn.ReLU(inplace=True)`` after a convolution, as in torchvision's ResNet). The copy
    is made in sampled forwards only, of the tensors that require grad."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, sink: Tensor, row: Tensor, ids: Tensor) -> Tensor:
        ctx.save_for_backward(row, ids)
        ctx.shape = sink.shape
        return x.clone()

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        grad: Tensor = grad_outputs[0]
        row, ids = ctx.saved_tensors
        value = grad.detach()
        if value.is_complex():
            value = value.abs()
        written = torch.cat((_row(value)[0], ids)).unsqueeze(0)
        # Row ``row`` of a zero block: out of place, so that taps of several rows add.
        block = torch.zeros(ctx.shape, dtype=torch.float64, device=ids.device)
        return grad, block.index_copy(0, row, written), None, None


def traced_activation(
    capture: CompiledCapture,
    rows: HookRows | None,
    output: object,
    args: tuple[object, ...],
    kwargs: dict[str, object],
) -> object:
    """Traced by Dynamo in place of a forward hook: the statistics rows of ``output``'s
    floating tensors (complex ones by magnitude) go to the next rows of the module's
    block, with this hook call's call index (the module's hook calls before it in the
    sample, counted in the block on the device: a block compiled on its own and called
    twice in one forward runs its graph twice and writes calls 0 and 1).

    Where gradients are on, each tensor of the output that requires grad and lies in
    plain tuples and namedtuples only (at any nesting the walk reaches: ``nn.LSTM``'s
    ``(out, (h, c))``), or in the output itself when that is a plain list, is passed
    through :class:`_GradientTap`, and the output rebuilt with the tapped copies is
    returned (the hook's result replaces the output in the graph: the same values, the
    same gradients); otherwise None. Tensors in other containers (dicts, lists inside
    the output, dataclasses, ``ModelOutput``) are not tapped (counted under
    ``gradients_not_tapped``): see :func:`_is_rebuildable`. A tensor that is one of the
    module's inputs (``nn.Identity``; positional or keyword, at any nesting that
    :func:`~torchinstruments.capture.iter_output_tensors` walks) is not tapped (counted
    under ``gradients_not_tapped``): the tap's copy would no longer be the input, and
    code that changes one of them in place expects the other to change too. A tensor at
    several places of the output (``return h, h``) is tapped once, and its one tapped
    copy takes each place: each place's row holds its whole gradient, as eagerly.
    Inside an activation-checkpoint region that AOTAutograd recomputes in the backward
    (``torch.utils.checkpoint`` called inside compiled code, see
    :func:`_checkpoint_region`), no tensor is tapped (counted under
    ``gradients_not_tapped``): the recomputed tap would take its row and call index
    from the rows as the whole forward left them.

    Args:
        capture: the observer's capture.
        rows: the hook's block and sink by device (see :meth:`CompiledCapture.register`);
            a tensor on a device without them is not reduced (counted under
            ``slots_dropped``).
        output: the module output, any nesting (see
            :func:`~torchinstruments.capture.iter_output_tensors`); at most
            ``MAX_TENSORS_PER_OUTPUT`` of its tensors are taken.
        args: the module's positional inputs (an output tensor among them is not
            tapped).
        kwargs: its keyword inputs (likewise).
    """
    assign = _assign_constant
    if assign is None or not capture.active or rows is None:
        return None  # an unsampled forward's graph: nothing of ours in it
    taken = 0
    grads = torch.is_grad_enabled()
    # Per tensor to tap: the tensor, its sink, and its rows, ids and paths in the output.
    taps: list[tuple[Tensor, Tensor, list[tuple[Tensor, Tensor]], list[str]]] = []
    calls: dict[str, Tensor] = {}  # this hook call's call index, by device
    inputs: list[object] | None = None  # the module's input tensors, once needed
    tappable: set[str] | None = None  # paths of the tensors the output can be rebuilt with
    in_region: bool | None = None  # inside a checkpoint region that AOTAutograd recomputes
    unreduced = False  # an output tensor that cannot be reduced
    # The attention logits of calls the module made, as eagerly before its output.
    for path, statistics in claimed_rows(_any_block(rows)):
        device = str(statistics.device)
        entry = rows.get(device)
        if entry is None:
            _count_dropped_constant(_any_block(rows))
            continue
        slot = assign(entry[0], path, _NO_GRADIENT)
        if slot >= 0:
            _write_row(capture, entry[0], calls, device, statistics, slot)
    for path, leaf in iter_output_tensors(output):
        if not reducible_when_traced(leaf):
            unreduced = unreduced or isinstance(leaf, Tensor)
            continue
        assert isinstance(leaf, Tensor)
        taken += 1
        if taken > MAX_TENSORS_PER_OUTPUT:
            break
        device = str(leaf.device)
        entry = rows.get(device)
        if entry is None:
            _count_dropped_constant(_any_block(rows))
            continue
        block, sink = entry
        gradient = _NO_GRADIENT
        if grads and leaf.requires_grad:
            if inputs is None:
                inputs = [tensor for _, tensor in iter_output_tensors((args, kwargs))]
            if tappable is None:
                tappable = set(_rebuildable_paths(output, "output", 0))
            if in_region is None:
                in_region = _checkpoint_region_constant() == _REGION_THROUGH_AOT
            if in_region or any(leaf is tensor for tensor in inputs) or path not in tappable:
                gradient = _UNTAPPED
            else:
                gradient = GRAD_OUTPUT
        slot = assign(block, path, gradient)
        if slot < 0:
            continue
        value = leaf.detach()
        if value.is_complex():
            value = value.abs()
        row, ids = _write_row(capture, block, calls, device, _row(value), slot)
        if gradient == GRAD_OUTPUT:
            tap = next((tap for tap in taps if tap[0] is leaf), None)
            if tap is None:
                taps.append((leaf, sink, [(row, ids)], [path]))
            else:
                tap[2].append((row, ids))
                tap[3].append(path)
    if unreduced and not taken:
        _note_unreduced_constant(_any_block(rows))
    tapped: dict[str, Tensor] = {}
    for leaf, sink, places, paths in taps:
        # One tap per place, chained: each sees the whole gradient of the one copy that
        # takes every place. (One tap of several rows let AOT's partitioner save the
        # block itself to recompute the rows in the backward, and a block whose graph
        # runs again before the backward changes it: autograd's version check fails.)
        copy = leaf
        for row, ids in places:
            copy = _GradientTap.apply(copy, sink, row, ids)
        tapped.update(dict.fromkeys(paths, copy))
    for block, _ in rows.values():
        block[_COUNTER_ROW, 0].add_(1)
    if not tapped:
        return None
    return _rebuilt(output, "output", tapped, 0)


def _write_row(
    capture: CompiledCapture,
    block: Tensor,
    calls: dict[str, Tensor],
    device: str,
    statistics: Tensor,
    slot: int,
) -> tuple[Tensor, Tensor]:
    """Traced: ``statistics`` (a ``(1, STAT_WIDTH)`` row), the hook call's call index
    (taken from the block's counters at the call's first row on ``device``, kept in
    ``calls``) and ``slot`` (the tensor path's index) into the next row of ``block``.
    Returns that row's index (a one-element long tensor) and its ids."""
    capture.graphs_ran = True  # a side effect: Dynamo stores it after each run
    capture.rows_pending = True  # likewise: rows to take before the next eager call
    counters = block[_COUNTER_ROW]
    call = calls.get(device)
    if call is None:
        call = calls[device] = counters[0].clone()
    row = counters[1].clamp(max=_OVERFLOW_ROW).long().reshape(1)
    ids = torch.stack((call, torch.full_like(call, slot)))
    block.index_copy_(0, row, torch.cat((statistics[0], ids)).unsqueeze(0))
    counters[1].add_(1)
    return row, ids


def _any_block(rows: HookRows | None) -> Tensor | None:
    """One of a hook's blocks (None if it has none yet): traced code names its capture to
    the trace-time calls by it, never by the capture object itself (see ``_CAPTURES``)."""
    if rows:
        for block, _ in rows.values():
            return block
    return None


def _is_rebuildable(node: object, depth: int) -> bool:
    """A container the traced hook returns a new one of, with tapped tensors in it: a
    plain tuple or a namedtuple at any depth (immutable: no code can tell the new one
    from the old by changing it), and a plain list as the output itself. Lists inside
    the output and dicts stay the very objects they are, shared or changed in place by
    the caller (a list of the inputs returned in a tuple, one list at two places), and
    their tensors are not tapped."""
    return (
        type(node) is tuple
        or (isinstance(node, tuple) and hasattr(node, "_fields"))
        or (depth == 0 and type(node) is list)
    )


def _rebuildable_paths(node: object, path: str, depth: int) -> Iterator[str]:
    """The tensor paths of ``node`` (named as
    :func:`~torchinstruments.capture.iter_output_tensors` names them) that lie inside
    rebuildable containers only (see :func:`_is_rebuildable`)."""
    if isinstance(node, Tensor):
        yield path
    elif depth < MAX_OUTPUT_DEPTH and _is_rebuildable(node, depth):
        for child, item in _children(node, path):
            yield from _rebuildable_paths(item, child, depth + 1)


def _rebuilt(node: object, path: str, tapped: dict[str, Tensor], depth: int) -> object:
    """``node`` with each tensor at a path of ``tapped`` replaced by its tapped copy,
    in new rebuildable containers (see :func:`_is_rebuildable`); everything else is the
    very object it was."""
    if isinstance(node, Tensor):
        return tapped.get(path, node)
    if depth >= MAX_OUTPUT_DEPTH or not _is_rebuildable(node, depth):
        return node
    values = [_rebuilt(item, child, tapped, depth + 1) for child, item in _children(node, path)]
    if type(node) is list:
        return values
    if type(node) is tuple:
        return tuple(values)
    return type(node)(*values)  # a namedtuple


def _children(node: object, path: str) -> list[tuple[str, object]]:
    """The (path, item) pairs of a rebuildable container, in order, with the paths
    :func:`~torchinstruments.capture.iter_output_tensors` gives them."""
    fields = getattr(node, "_fields", None)
    if isinstance(node, tuple) and fields is not None:
        return [(f"{path}.{field}", getattr(node, field)) for field in fields]
    return [(f"{path}[{index}]", item) for index, item in enumerate(node)]  # type: ignore[arg-type]
