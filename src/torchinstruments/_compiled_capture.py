"""Capture inside compiled graphs: the observer's stage for ``torch.compile``.

    ForwardHook traced by Dynamo -> traced_activation: each output's statistics row into
        a slot of a device buffer; each output that requires grad through _GradientTap
    ForwardContext.open_sample (sampled)  -> CompiledCapture.begin_sample
    ForwardContext.leave_root (sampled)   -> CompiledCapture.end_sample: rows -> pending
    Observer.flush_statistics, next sample -> CompiledCapture.take_gradients

When Dynamo traces a submodule's forward hook of ours (``torch.compile`` of the model,
of a block, with or without ``fullgraph=True``), the hook does not break the graph: it
traces :func:`traced_activation`, which reduces every floating tensor of the module
output to its statistics row (:func:`~torchinstruments.reduce._statistics_rows`, the
device path's masked reductions, float32 accumulation) and copies the row into a slot of
a preallocated float64 buffer on the tensor's device (``MAX_SLOTS`` rows of
``STAT_WIDTH``). Each output tensor that requires grad (of an output that is a tensor,
or a tuple or list of tensors) passes through :class:`_GradientTap`, an identity whose
backward makes the incoming gradient's row the gradient of a small leaf sink. The slot
of a (module, call index, signal, tensor path) is assigned once, while tracing
(``torch.compiler.assume_constant_result``), so the graph holds it as a constant.

The sampling decision is taken where it always is, in the root's forward pre-hook,
which runs eagerly around the compiled model (see :func:`_run_root_hooks_eagerly`).
Traced code reads :attr:`CompiledCapture.active`, so Dynamo guards on it: a sampled
forward runs a graph variant with the reductions and taps, an unsampled one a variant
without them (in the steady state the variant traced with the hooks parked, see
``_parking.py``, whose hook dictionaries are empty); each is compiled once and chosen
by its guards at every call, so the sampling decision never recompiles. A sampled
forward zeroes the buffers first (:meth:`CompiledCapture.begin_sample`); when the root
returns (:meth:`CompiledCapture.end_sample`) one device copy of each buffer becomes that
sample's pending rows in the statistics buffer; once its backward has run, the next
flush or sampled forward makes the sinks' gradients its output-gradient rows
(:meth:`CompiledCapture.take_gradients`). Nothing is read back to the host inside a
forward; a slot that no graph wrote in a sample (its row counts 0 elements) is left out
by the series store.

What is not captured inside compiled graphs: histograms, the full sentinel and attention
logits (counted, see ``_attention.py``); output gradients of outputs that are other
containers (counted); output gradients of a sample whose backward ran only after the
next sampled forward (two sampled forwards before one backward); output gradients of a
compiled frame that a reentrant checkpoint recomputes (``checkpoint(compiled_block, x,
use_reentrant=True)``: the recomputation runs in the backward, after the sample, and
takes the unsampled graph). A frame traced under saved-tensor hooks
(``use_reentrant=False``) keeps its hooks as graph breaks, observed eagerly (see
:func:`_recomputable`). Where Dynamo cannot take the capture (a torch without
``torch.compiler.assume_constant_result``), forward hooks stay
``torch.compiler.disable``d: each observed module call is a graph break, and
``fullgraph=True`` fails; :meth:`CompiledCapture.mode` says so in the report.
"""

from __future__ import annotations

import itertools
import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ._records import Statistics
from ._state import SKIP
from .capture import (
    MAX_TENSORS_PER_OUTPUT,
    ForwardHook,
    RootPostHook,
    RootPreHook,
    _is_compiling,
    _never_compiling,
    iter_output_tensors,
    on_compiler_loaded,
    passive,
)
from .reduce import STAT_WIDTH, _statistics_rows
from .series import ACTIVATION, GRAD_OUTPUT

if TYPE_CHECKING:
    from ._context import ForwardContext
    from ._staging import StatisticsBuffer

__all__ = ["MAX_SLOTS", "SINK_ROWS", "CompiledCapture", "enable", "traced_activation"]

#: Rows of each device buffer: the (module, call index, tensor path) slots one observer
#: can fill inside compiled graphs; further ones are counted under ``slots_dropped``.
MAX_SLOTS = 4_096
#: Rows of one gradient sink (a float64 leaf of ``(SINK_ROWS, STAT_WIDTH)``): a tap's
#: backward produces a gradient of that size, so sinks stay small.
SINK_ROWS = 64
#: Signal name under which :func:`traced_activation` counts an untapped gradient.
_UNTAPPED = "untapped"

_assume_constant: Callable[[Callable[..., Any]], Callable[..., Any]] | None = getattr(
    getattr(torch, "compiler", None), "assume_constant_result", None
)
#: Live captures by key: the traced graph names its capture by this int.
_CAPTURES: weakref.WeakValueDictionary[int, CompiledCapture] = weakref.WeakValueDictionary()
_keys = itertools.count(1)
#: ``"waiting for Dynamo"``, ``"ready"`` once :func:`enable` ran, or ``"off: <reason>"``.
_status = "waiting for Dynamo"

_Key = tuple[int, int, str, str]  # module index, call index, signal, tensor path


def _trace_id() -> object:
    """Dynamo's id of the trace running now (frame, compile and attempt), or None."""
    try:
        from torch._guards import CompileContext

        return CompileContext.current_trace_id()
    except Exception:
        return None


class CompiledCapture:
    """Slots and device buffers of one observer's capture inside compiled graphs.

    Built by the :class:`~torchinstruments.observer.Observer` (None with
    ``capture_direct_forwards``) and handed to its forward hooks and its forward
    context; it holds no reference to either. Each (module index, call index, signal,
    tensor path) met while tracing gets a slot: a row of the activation buffer of its
    device (written by the forward graph) or of a gradient sink of its device (the
    gradient the backward graph computes for the sink holds the row).
    """

    def __init__(self, model: Callable[[], nn.Module | None] | None = None) -> None:
        """``model``: the observed model, by weak reference (or None): before the first
        sampled forward once Dynamo is loaded, the buffers and sinks of the devices of
        its parameters and buffers are allocated (see :meth:`_allocate`)."""
        self.key = next(_keys)
        self._model = model
        self._devices_allocated = False
        _CAPTURES[self.key] = self
        #: Activation buffers by device string (``"cpu"``, ``"cuda:0"``): float64,
        #: ``(MAX_SLOTS, STAT_WIDTH)``; row ``slot`` is written by every sampled graph.
        self.buffers: dict[str, Tensor] = {}
        #: Gradient sinks by ``"<device>#<slot // SINK_ROWS>"``: float64
        #: ``(SINK_ROWS, STAT_WIDTH)`` leaves that require grad; backward passes
        #: accumulate output-gradient rows into their ``.grad``.
        self.sinks: dict[str, Tensor] = {}
        #: True inside a sampled root forward. Traced code reads it, so Dynamo guards on
        #: it: a model has one compiled graph with the reductions (sampled forwards) and
        #: one without, each compiled once and chosen by its guard at every call.
        self.active = False
        self.slots: dict[_Key, int] = {}
        self.slot_keys: list[_Key] = []
        self.slot_devices: list[str] = []
        #: Slots that did not fit (more than ``MAX_SLOTS``), and outputs whose gradient
        #: is not captured in graphs (containers other than a tuple or list of tensors).
        self.slots_dropped = 0
        self.gradients_not_tapped = 0
        #: Hook calls traced under saved-tensor hooks (a compiled frame that
        #: ``torch.utils.checkpoint`` recomputes), left graph breaks: see
        #: :func:`_recomputable`.
        self.calls_under_saved_tensor_hooks = 0
        #: Sampled forwards whose output gradients no backward took before the next
        #: sampled forward (two sampled forwards before one backward): not recorded.
        self.gradient_samples_lost = 0
        # Calls traced per (module, signal, path) in this sample and trace.
        self._calls: dict[tuple[int, str, str], int] = {}
        self._trace: object = None
        #: The sample whose output-gradient rows :meth:`take_gradients` takes (-1: none).
        self._gradient_sample = -1

    def mode(self) -> str:
        """``coverage.compiled_capture.mode``: ``"in_graph"`` once a compiled graph
        reduced a module output; ``"graph_breaks: ..."`` where every hook Dynamo met
        ran under saved-tensor hooks and stayed a graph break (see
        :func:`_recomputable`); ``"unused"`` while Dynamo met none; ``"off: <reason>"``
        where hooks traced by Dynamo fall back to a graph break each."""
        if _status.startswith("off"):
            return _status
        if self.slot_keys:
            return "in_graph"
        if self.calls_under_saved_tensor_hooks:
            return "graph_breaks: traced under saved-tensor hooks (activation checkpointing)"
        return "unused"

    # ---------------------------------------------------------------- trace time
    def assign(self, index: int, signal: str, path: str, device: str) -> int:
        """The slot for the next traced call of module ``index`` (``signal`` at ``path``)
        in this sample, at trace time only; -1 when every slot is taken."""
        # Calls are counted per trace (a frame, or one attempt at it: Dynamo restarts
        # its analysis at a graph break, and compiles the frames after a break on their
        # own); a module called in two frames of one forward gets call index 0 in each.
        trace = _trace_id()
        if trace != self._trace:
            self._trace = trace
            self._calls = {}
        if signal == _UNTAPPED:
            self.gradients_not_tapped += 1
            return -1
        counter = (index, signal, path)
        call = self._calls.get(counter, 0)
        self._calls[counter] = call + 1
        key = (index, call, signal, path)
        slot = self.slots.get(key)
        if slot is None:
            if len(self.slot_keys) >= MAX_SLOTS:
                self.slots_dropped += 1
                return -1
            slot = len(self.slot_keys)
            self.slots[key] = slot
            self.slot_keys.append(key)
            self.slot_devices.append(device)
        if device not in self.buffers:
            self._allocate(device)
        return slot

    def _allocate(self, device: str) -> None:
        """The activation buffer and every gradient sink of ``device``, at once.

        Traced code reads :attr:`buffers` and :attr:`sinks`, and Dynamo keeps its own
        view of a dict from its first read in a trace: an entry added later in that
        trace (by :meth:`assign`, which runs for real) is missing from that view, the
        lookup fails while tracing, and Dynamo runs the whole frame eagerly. So the
        entries of a device are made together, at its first slot, and for the model's
        own devices before the first sampled forward (:meth:`begin_sample`): about
        0.6 MB a device (a ``(MAX_SLOTS, STAT_WIDTH)`` float64 buffer and
        ``MAX_SLOTS // SINK_ROWS`` sinks)."""
        self.buffers[device] = torch.zeros(
            MAX_SLOTS, STAT_WIDTH, dtype=torch.float64, device=device
        )
        for first in range(0, MAX_SLOTS, SINK_ROWS):
            self.sinks[_sink_key(device, first)] = torch.zeros(
                SINK_ROWS, STAT_WIDTH, dtype=torch.float64, device=device, requires_grad=True
            )

    def _allocate_model_devices(self) -> None:
        """:meth:`_allocate` for each device of the model's parameters and buffers (not
        ``meta``), once; called when Dynamo is loaded."""
        self._devices_allocated = True
        model = None if self._model is None else self._model()
        if model is None:
            return
        devices = {str(t.device) for t in itertools.chain(model.parameters(), model.buffers())}
        for device in sorted(devices - {"meta"} - set(self.buffers)):
            self._allocate(device)

    # ---------------------------------------------------------------- run time
    def begin_sample(self, context: ForwardContext) -> None:
        """A sampled forward opens (after its sample index was taken): the previous
        sample's gradient rows go to ``context.buffer``, then the rows are cleared, so
        that slots no graph writes in this sample (a module not called) count 0
        elements. Never raises: an error is counted, and the sample runs without."""
        try:
            if not self._devices_allocated and _status == "ready":
                with passive():  # made under a user's dispatch mode, it would see them
                    self._allocate_model_devices()
            if self._gradient_sample >= 0:
                self.take_gradients(context.buffer)
                if self._gradient_sample >= 0 and any(k[2] == GRAD_OUTPUT for k in self.slot_keys):
                    # No backward reached its taps before this sample: its output
                    # gradients arrive with this sample's, and are not told apart.
                    self.gradient_samples_lost += 1
            self._gradient_sample = -1
            self._calls = {}
            self._trace = None
            if self.slot_keys:
                with torch.no_grad():
                    for rows in self.buffers.values():
                        rows.zero_()
                    for sink in self.sinks.values():
                        sink.grad = None
            self.active = True
        except Exception as error:  # never break training
            context.errors.record("compiled_capture", "", error)

    def end_sample(self, context: ForwardContext) -> None:
        """The root of the open sample returned: one device copy of each activation
        buffer becomes pending rows of ``context.buffer`` (read at its next flush), in
        slot order, at forward positions after the calls observed eagerly. Never
        raises (an error is counted)."""
        if not self.active:
            return
        self.active = False
        self._gradient_sample = context.sample
        try:
            self._take_activations(context)
        except Exception as error:  # never break training
            context.errors.record("compiled_capture", "", error)

    def _take_activations(self, context: ForwardContext) -> None:
        sample = context.sample
        count = len(self.slot_keys)
        if not count or not self.buffers:
            return
        with torch.no_grad():
            copies = {device: rows[:count].clone() for device, rows in self.buffers.items()}
        pending = context.buffer.pending
        called = context.capture.modules_called
        position = context.position
        for slot, (key, device) in enumerate(zip(self.slot_keys, self.slot_devices, strict=True)):
            rows = copies.get(device)
            if key[2] != ACTIVATION or rows is None:
                continue
            pending.append(Statistics(key, sample, position, rows[slot]))
            called.add(key[0])
            position += 1
        context.position = position
        _note_streams(context.buffer, copies)

    def take_gradients(self, buffer: StatisticsBuffer) -> None:
        """The output-gradient rows that the backward of the last sampled forward put
        into the sinks' gradients, as pending rows of ``buffer``; nothing (and the
        sample still waits) while no backward reached a gradient tap."""
        sample = self._gradient_sample
        if sample < 0:
            return
        copies: dict[str, Tensor] = {}
        with torch.no_grad():
            for name, sink in self.sinks.items():
                if sink.grad is not None:
                    copies[name] = sink.grad.clone()
                    sink.grad = None
        if not copies:
            return
        self._gradient_sample = -1
        pending = buffer.pending
        for slot, (key, device) in enumerate(zip(self.slot_keys, self.slot_devices, strict=True)):
            rows = copies.get(_sink_key(device, slot))
            if key[2] == GRAD_OUTPUT and rows is not None:
                pending.append(Statistics(key, sample, -1, rows[slot % SINK_ROWS]))
        _note_streams(buffer, copies)


def _note_streams(buffer: StatisticsBuffer, copies: dict[str, Tensor]) -> None:
    """Note the CUDA streams that made ``copies`` (see ``StatisticsBuffer.producer_streams``)."""
    for rows in copies.values():
        if rows.is_cuda:
            buffer.producer_streams.add(torch.cuda.current_stream(rows.device))


def _sink_key(device: str, slot: int) -> str:
    """The gradient sink that holds ``slot``'s row: ``"<device>#<slot // SINK_ROWS>"``."""
    return f"{device}#{slot // SINK_ROWS}"


def _assign(key: int, index: int, signal: str, path: str, device: str) -> int:
    capture = _CAPTURES.get(key)
    return -1 if capture is None else capture.assign(index, signal, path, device)


def _recomputable(key: int) -> bool:
    """True (and counted) if the frame traced now runs under saved-tensor hooks.

    Non-reentrant activation checkpointing (``checkpoint(compiled_block, x,
    use_reentrant=False)``) saves nothing in the forward and recomputes the frame in the
    backward, where the sample that ran it is over: the recomputation would run the
    other graph variant (chosen by :attr:`CompiledCapture.active`), whose saved tensors
    differ, and ``torch.utils.checkpoint`` raises. Under any saved-tensor hooks (the
    checkpoint's, ``save_on_cpu``, a user's), the hook stays a graph break instead, the
    same graph serves sampled and unsampled forwards, and the eager path observes the
    call (it tells recomputations from forwards). Checkpointing traced by Dynamo
    (``torch.compile`` of a function that calls ``checkpoint``) runs no hooks while
    tracing, and keeps the in-graph capture."""
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    except Exception:
        return False
    if hooks is None:
        return False
    capture = _CAPTURES.get(key)
    if capture is not None:
        capture.calls_under_saved_tensor_hooks += 1
    return True


#: :func:`_assign` as Dynamo sees it (called while tracing, its result a constant); set
#: by :func:`enable` once Dynamo is loaded, None before and where torch lacks it.
_assign_constant: Callable[..., int] | None = None
#: :func:`_recomputable` as Dynamo sees it (a constant of the traced frame); set by
#: :func:`enable`.
_recomputable_constant: Callable[[int], bool] = _recomputable
#: ``ForwardHook.__call__`` as :func:`enable` found it (``torch.compiler.disable``d).
_opaque_call: Callable[..., Any] | None = None


def _run_root_hooks_eagerly() -> None:
    """Tell Dynamo never to compile the root's hooks as frames of their own.

    ``torch.compile(model)`` runs the root's ``_call_impl`` eagerly, and Dynamo compiles
    each Python frame called from it, our root pre- and post-hooks among them: each would
    be a graph break (and ``fullgraph=True`` would fail). They take the sampling decision
    and keep the sample context, which must run for real, so their code objects are
    marked to run eagerly with everything they call (Dynamo's frame execution strategy
    SKIP, recursively); nothing of this costs anything in eager training. Where they are
    traced inline instead (a compiled function that calls the model), they remain a
    graph break each.
    """
    from torch._C._dynamo.eval_frame import (
        _FrameAction,
        _FrameExecStrategy,
        set_code_exec_strategy,
    )

    for hook in (RootPreHook, RootPostHook):
        code = getattr(hook.__dict__.get("__call__"), "__code__", None)
        if isinstance(code, types.CodeType):
            set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))


def _forward_hook_call(
    self: ForwardHook, module: nn.Module, args: tuple[object, ...], output: object
) -> object:
    """``ForwardHook.__call__`` once Dynamo is loaded: eagerly the same as before
    (returns at once in unsampled forwards); traced by Dynamo, the in-graph capture."""
    if _is_compiling():
        compiled = self.compiled
        if isinstance(compiled, CompiledCapture) and not _recomputable_constant(compiled.key):
            return traced_activation(compiled, self._index, output)
        assert _opaque_call is not None
        return _opaque_call(self, module, args, output)
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
    global _assign_constant, _opaque_call, _recomputable_constant, _status
    if _assume_constant is None or _is_compiling is _never_compiling:
        _status = "off: torch without torch.compiler.assume_constant_result"
        return
    try:
        _run_root_hooks_eagerly()
        _assign_constant = _assume_constant(_assign)
        _recomputable_constant = _assume_constant(_recomputable)
    except Exception as error:
        _assign_constant = None
        _status = f"off: {type(error).__name__}: {error}"[:200]
        return
    _opaque_call = ForwardHook.__dict__["__call__"]
    ForwardHook.__call__ = _forward_hook_call  # type: ignore[method-assign]
    _status = "ready"


on_compiler_loaded(enable)


def _row(value: Tensor) -> Tensor:
    """The statistics row of ``value``, shape ``(1, STAT_WIDTH)``, float64."""
    return _statistics_rows(value.reshape(1, -1), masked=True)


class _GradientTap(torch.autograd.Function):
    """Identity in the forward (a copy of its input); in the backward, the statistics row
    of the incoming gradient becomes row ``row`` of the gradient of ``sink`` (the
    gradient itself passes on unchanged).

    The forward returns a copy, not a view: autograd forbids in-place changes to a view
    that a custom Function returned, and models change module outputs in place
    (``nn.ReLU(inplace=True)`` after a convolution, as in torchvision's ResNet). The copy
    is made in sampled forwards only, of the tensors that require grad."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, sink: Tensor, row: int) -> Tensor:
        ctx.row = row
        ctx.rows = sink.shape[0]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        grad: Tensor = grad_outputs[0]
        value = grad.detach()
        if value.is_complex():
            value = value.abs()
        # Row ``row`` of a zero (SINK_ROWS, STAT_WIDTH) gradient: padding, no mutation.
        rows = torch.nn.functional.pad(_row(value), (0, 0, ctx.row, ctx.rows - ctx.row - 1))
        return grad, rows, None


def _reducible(leaf: object) -> bool:
    return (
        isinstance(leaf, Tensor)
        and leaf.layout == torch.strided
        and (leaf.is_floating_point() or leaf.is_complex())
        and leaf.numel() > 0
    )


def traced_activation(capture: CompiledCapture, index: int, output: object) -> object:
    """Traced by Dynamo in place of a forward hook: the statistics rows of ``output``'s
    floating tensors (complex ones by magnitude) go to their slots.

    Where gradients are on and the output is a tensor, or a tuple or list of tensors,
    each tensor that requires grad is passed through :class:`_GradientTap`, and the
    tapped output is returned (the hook's result replaces the output in the graph: the
    same values, the same gradients); otherwise None.

    Args:
        capture: the observer's capture.
        index: the module's index.
        output: the module output, any nesting (see
            :func:`~torchinstruments.capture.iter_output_tensors`); at most
            ``MAX_TENSORS_PER_OUTPUT`` of its tensors are taken.
    """
    assign = _assign_constant
    if assign is None or not capture.active:
        return None  # an unsampled forward's graph: nothing of ours in it
    taken = 0
    grads = torch.is_grad_enabled()
    tapped: dict[str, Tensor] = {}
    for path, leaf in iter_output_tensors(output):
        if not _reducible(leaf):
            continue
        assert isinstance(leaf, Tensor)
        taken += 1
        if taken > MAX_TENSORS_PER_OUTPUT:
            break
        device = str(leaf.device)
        slot = assign(capture.key, index, ACTIVATION, path, device)
        if slot >= 0:
            value = leaf.detach()
            if value.is_complex():
                value = value.abs()
            capture.buffers[device][slot].copy_(_row(value)[0])
        if grads and leaf.requires_grad:
            if isinstance(output, Tensor) or (
                type(output) in (tuple, list) and path.count("[") == 1
            ):
                grad_slot = assign(capture.key, index, GRAD_OUTPUT, path, device)
                if grad_slot >= 0:
                    tapped[path] = _GradientTap.apply(
                        leaf, capture.sinks[_sink_key(device, grad_slot)], grad_slot % SINK_ROWS
                    )
            else:
                assign(capture.key, index, _UNTAPPED, path, device)
    if not tapped:
        return None
    if isinstance(output, Tensor):
        return tapped.get("output", output)
    items = [tapped.get(f"output[{i}]", item) for i, item in enumerate(output)]  # type: ignore[arg-type]
    return tuple(items) if type(output) is tuple else items
