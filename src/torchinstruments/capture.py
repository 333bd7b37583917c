"""Capture: hook objects and the walk over module outputs.

Hooks are small callable objects that hold only a weak reference to their observer's
forward context (``_context.py``), so a model never keeps a detached observer alive.
Each returns ``None`` (eager outputs are never replaced; a forward hook traced into a
compiled graph returns the same values, see ``_compiled_capture.py``) and never raises:
the observer catches and counts its own errors.

What the hooks become in copies of the model (inert placeholders) and what
``torch.jit.script`` compiles in their place (a stand-in without them) is in
``_copies.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
import threading
import types
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ._copies import CopiedAsInert, InertForward, InertHook, PrepareScriptable, WrapperCopies
from ._error_log import warn
from ._state import IDLE, SKIP

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from ._context import ForwardContext

__all__ = [
    "compiled_frames",
    "in_backward",
    "is_compile_wrapper",
    "iter_output_tensors",
    "passive",
    "recompile_limit_hits",
    "without_compile_wrappers",
]

#: Found here by the pickles of models saved before they moved to ``_copies.py``
#: (pickle names a class by module and name).
_PICKLED_HERE = (InertForward, InertHook, PrepareScriptable)

#: Deepest nesting of containers walked inside one module output.
MAX_OUTPUT_DEPTH = 6
#: Most tensors taken from one module output; the rest are counted as dropped paths.
MAX_TENSORS_PER_OUTPUT = 64

_graph_task_id: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)


#: ``__qualname__`` of every function marked by :func:`_opaque_to_compiler`, in this module.
_OPAQUE_NAMES: list[str] = []
_opaque_applied = False
_opaque_lock = threading.Lock()
_COMPILER_CALLBACKS: list[Callable[[], None]] = []


def on_compiler_loaded(callback: Callable[[], None]) -> None:
    """Call ``callback`` once Dynamo is loaded and our hooks were made opaque (now, if
    that happened already). The in-graph capture registers itself here, so that this
    module imports nothing of it."""
    with _opaque_lock:
        if not _opaque_applied:
            _COMPILER_CALLBACKS.append(callback)
            return
    callback()


def _opaque_to_compiler(function: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a hook to be kept from ``torch.compile``'s tracing: Dynamo calls it eagerly.

    Our hooks do Python bookkeeping that must run for real (and must not be baked into
    a compiled graph); Dynamo turns a disabled function into one clean graph break.
    The marked functions are wrapped by ``torch.compiler.disable`` only once Dynamo
    (``torch._dynamo``) is imported, see :func:`watch_for_compiler`: importing it takes
    about as long as importing torch, and eager training never needs it.
    """
    _OPAQUE_NAMES.append(function.__qualname__)
    return function


def _make_hooks_opaque() -> None:
    """Wrap every marked function with ``torch.compiler.disable``, once."""
    global _opaque_applied
    with _opaque_lock:
        if _opaque_applied:
            return
        _opaque_applied = True
        from .compiled import guard_on_hooks

        guard_on_hooks()  # before anything compiles: observed models' code then sees our hooks
        disable = getattr(getattr(torch, "compiler", None), "disable", None)
        if disable is None:
            return
        module = sys.modules[__name__]
        for qualname in _OPAQUE_NAMES:
            *owner_path, name = qualname.split(".")
            owner: Any = module
            for part in owner_path:
                owner = getattr(owner, part)
            setattr(owner, name, disable(getattr(owner, name)))
        for callback in _COMPILER_CALLBACKS:
            callback()


class _CompilerImportWatch(importlib.abc.MetaPathFinder):
    """Finds nothing itself; makes our hooks opaque right after ``torch._dynamo`` loads.

    It asks the other finders for Dynamo's module spec and runs
    :func:`_make_hooks_opaque` after the spec's loader executed the module, before
    anything can compile.
    """

    def __init__(self) -> None:
        self._busy = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch._dynamo" or self._busy or _opaque_applied:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        loader = spec.loader if spec is not None else None
        execute = getattr(loader, "exec_module", None)
        if spec is None or loader is None or execute is None:
            return None
        watch = self

        def exec_module(module: types.ModuleType) -> None:
            execute(module)
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(watch)
            try:
                _make_hooks_opaque()
            except Exception as error:  # never break the caller's import
                warnings.warn(
                    f"torchinstruments: hooks could not be hidden from torch.compile ({error!r}); "
                    "compiled code may trace into them",
                    RuntimeWarning,
                    stacklevel=2,
                )

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this module's loader only
        return spec


_compiler_watch: _CompilerImportWatch | None = None


def watch_for_compiler() -> None:
    """Make our hooks opaque to ``torch.compile`` now if Dynamo is loaded, else as soon
    as it is imported. Called whenever hooks are created; cheap after the first call."""
    global _compiler_watch
    if _opaque_applied:
        return
    if "torch._dynamo" in sys.modules:
        _make_hooks_opaque()
        return
    with _opaque_lock:
        if _compiler_watch is None:
            _compiler_watch = _CompilerImportWatch()
            sys.meta_path.insert(0, _compiler_watch)


def _never_compiling() -> bool:
    return False


#: True while Dynamo traces (it evaluates the call as a constant); False when run.
_is_compiling: Callable[[], bool] = getattr(
    getattr(torch, "compiler", None), "is_compiling", _never_compiling
)


def compiled_frames() -> int:
    """A count that grows whenever ``torch.compile`` (Dynamo) compiles in this process.

    The frames Dynamo tried to compile plus the graphs it built, from its own counters
    (``torch._dynamo.utils.counters``, which ``torch._dynamo.reset()`` leaves alone); 0
    when Dynamo never compiled anything (or was never imported), and -1 when the
    counters cannot be read (callers then assume compilation is in use).
    """
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    try:
        counters = utils.counters
        if not counters:
            return 0  # Dynamo counted nothing yet (eager training): the cheap answer
        # Frames Dynamo tried to convert, plus graphs it built: fullgraph=True compiles
        # through a path that does not count frames.
        return int(counters["frames"]["total"]) + int(counters["stats"]["unique_graphs"])
    except Exception:
        return -1


#: The attribute under which ``torch.compile``'s ``OptimizedModule`` holds the module it
#: wraps (``model.blocks[0] = torch.compile(block)`` names the block ``blocks.0._orig_mod``).
COMPILED_WRAPPER_ATTRIBUTE = "_orig_mod"


def without_compile_wrappers(name: str) -> str:
    """``name`` (a qualified module name) without the ``_orig_mod`` parts that modules
    replaced by their ``torch.compile`` wrapper add: ``blocks.0._orig_mod.fc`` becomes
    ``blocks.0.fc``, as it is named when the block is compiled after injection."""
    if COMPILED_WRAPPER_ATTRIBUTE not in name:
        return name
    return ".".join(part for part in name.split(".") if part != COMPILED_WRAPPER_ATTRIBUTE)


def is_compile_wrapper(module: nn.Module) -> bool:
    """True for ``torch.compile``'s ``OptimizedModule`` (the module it wraps does the
    work, and is the one observed)."""
    return type(module).__name__ == "OptimizedModule" and isinstance(
        getattr(module, COMPILED_WRAPPER_ATTRIBUTE, None), nn.Module
    )


def recompile_limit_hits() -> int:
    """How many times ``torch.compile`` (Dynamo) stopped compiling a code object in this
    process because it reached ``torch._dynamo.config.recompile_limit``: from then on
    that code runs uncompiled. From Dynamo's counters (``counters["unimplemented"]``,
    keyed by the reason's text); 0 when Dynamo was never imported or the counters cannot
    be read."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    try:
        reasons = utils.counters.get("unimplemented")
        if not reasons:
            return 0
        return sum(
            int(count)
            for reason, count in reasons.items()
            if str(reason).startswith("Dynamo recompile limit exceeded")
        )
    except Exception:
        return 0


_dispatch_depth: Callable[[], int] = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)
_DisableTorchFunction: Any = getattr(torch._C, "DisableTorchFunction", None)
_function_mode_enabled: Callable[[], bool] = getattr(
    torch._C, "_is_torch_function_mode_enabled", lambda: True
)


def user_modes_active() -> bool:
    """True while a torch-function mode or a ``TorchDispatchMode`` is active: only then
    does an op on a plain ``torch.Tensor`` (not a subclass) reach user code, so only then
    is :func:`passive` needed for it. True where torch cannot tell."""
    return bool(_function_mode_enabled() or _dispatch_depth())


class _Passive:
    """See :func:`passive`."""

    __slots__ = ("_function", "_modes")

    def __enter__(self) -> None:
        self._function = _DisableTorchFunction() if _DisableTorchFunction is not None else None
        if self._function is not None:
            self._function.__enter__()
        self._modes: Any = None
        if _dispatch_depth():
            from torch.utils._python_dispatch import _disable_current_modes

            self._modes = _disable_current_modes()
            self._modes.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._modes is not None:
            self._modes.__exit__(*exc)
        if self._function is not None:
            self._function.__exit__(*exc)


def passive() -> _Passive:
    """A context in which our own tensor work is invisible to user code: tensor
    subclasses' ``__torch_function__`` and torch-function modes are off
    (``torch._C.DisableTorchFunction``), and the user's ``TorchDispatchMode`` stack is
    set aside for the duration (``_disable_current_modes``), then restored. Ops on a
    subclass instance then return plain tensors. Costs a few microseconds; used on
    sampled paths only (and by the root sentinel, one forward in 8, where the root output
    is not a plain tensor or :func:`user_modes_active`).
    """
    return _Passive()


def in_backward() -> bool:
    """True while the calling thread runs inside an autograd backward pass.

    Forward calls made then are recomputations (activation checkpointing), never new
    samples.
    """
    return _graph_task_id is not None and _graph_task_id() != -1


def iter_output_tensors(output: object, prefix: str = "output") -> Iterator[tuple[str, object]]:
    """Yield ``(tensor_path, leaf)`` for every tensor-like leaf of a module output.

    Paths as in docs/report.md: ``output``, ``output[0]``, ``output['logits']`` (dicts),
    ``output.last_hidden_state`` (namedtuples, dataclasses and attribute-style mappings
    such as Hugging Face ``ModelOutput``). ``None`` and non-tensor leaves are skipped;
    tensor leaves are yielded whatever their dtype, for the caller to reduce or count.
    The walk stops at :data:`MAX_OUTPUT_DEPTH`; a caller bounds the number of leaves.
    """
    yield from _walk(output, prefix, 0)


def _walk(node: object, path: str, depth: int) -> Iterator[tuple[str, object]]:
    if isinstance(node, Tensor):
        yield path, node
        return
    if node is None or depth >= MAX_OUTPUT_DEPTH or isinstance(node, str | bytes | int | float):
        return
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        for field in node._fields:  # namedtuple
            yield from _walk(getattr(node, field), f"{path}.{field}", depth + 1)
    elif isinstance(node, list | tuple):
        for index, item in enumerate(node):
            yield from _walk(item, f"{path}[{index}]", depth + 1)
    elif isinstance(node, Mapping):
        # Attribute style (``output.logits``) only where the mapping really exposes its
        # keys as attributes, as Hugging Face ModelOutput does; dicts use ``['key']``.
        plain = type(node) in (dict, OrderedDict)
        for key, item in node.items():
            if (
                not plain
                and isinstance(key, str)
                and key.isidentifier()
                and getattr(node, key, None) is item
            ):
                yield from _walk(item, f"{path}.{key}", depth + 1)
            else:
                yield from _walk(item, f"{path}[{key!r}]", depth + 1)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            yield from _walk(getattr(node, field.name), f"{path}.{field.name}", depth + 1)


class _HookBase(CopiedAsInert):
    """Weakly bound to an observer; copies and pickles as an
    :class:`~torchinstruments._copies.InertHook`."""

    __slots__ = ("_observer",)

    def __init__(self, observer: ForwardContext) -> None:
        self._observer = weakref.ref(observer)
        watch_for_compiler()


class RootPreHook(_HookBase):
    """Forward pre-hook on the root: opens a root forward and decides sampling once.

    It runs on every root forward, so it is not wrapped by ``torch.compiler.disable``:
    inside a training step of ``benchmarks/overhead.py``'s CPU MLP, a no-op pre-hook so
    wrapped cost about 3 us a forward more than one that calls ``is_compiling()`` (same
    process, two runs). Dynamo, which reads ``is_compiling()`` as True, reaches the same
    code through :func:`_enter_root_opaque`, a clean graph break.
    """

    __slots__ = ()

    def __call__(self, module: nn.Module, args: object) -> None:
        if _is_compiling():
            if _root_traced_constant is not None and _root_traced_constant():
                return  # a trace that refuses graph breaks: nothing (see _warn_root_traced)
            _enter_root_opaque(self, module)
            return
        observer = self._observer()
        if observer is not None:
            observer.enter_root(module)


class RootPostHook(_HookBase):
    """Forward hook on the root, always called: observes the root output, closes.

    Not wrapped by ``torch.compiler.disable``, for the reason :class:`RootPreHook`
    gives (Dynamo reaches it through :func:`_leave_root_opaque`)."""

    __slots__ = ("_index",)

    def __init__(self, observer: ForwardContext, index: int) -> None:
        super().__init__(observer)
        self._index = index

    def __call__(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        if _is_compiling():
            if _breaks_refused_constant is not None and _breaks_refused_constant():
                return  # as the pre-hook in such a trace
            _leave_root_opaque(self, args, output)
            return
        observer = self._observer()
        if observer is not None:
            observer.leave_root(self._index, args, output)


class DirectCallPreHook(_HookBase):
    """Forward pre-hook on a ``torch.compile`` wrapper inside the observed model
    (``self.model = torch.compile(net)`` makes one), which runs eagerly around its
    compiled frame. Where training calls it directly, with no root forward open (a
    Lightning ``training_step`` that calls ``self.model(x)``), it opens the direct-call
    sample before the compiled frame runs (``ForwardContext.open_direct_entry``).
    Dynamo never compiles its frame (see ``_compiled_capture``); traced inline (a
    compiled function that calls the wrapper) it does nothing.

    Args:
        observer: the observer's forward context.
        entry: a negative number of the wrapper's own (the direct-call opener's
            identity, which no module index takes).
    """

    __slots__ = ("_entry",)

    def __init__(self, observer: ForwardContext, entry: int) -> None:
        super().__init__(observer)
        self._entry = entry

    def __call__(self, module: nn.Module, args: object) -> None:
        if _is_compiling():
            return
        observer = self._observer()
        if observer is not None and observer.state is IDLE:
            observer.open_direct_entry(self._entry, module)


class DirectCallPostHook(_HookBase):
    """Forward hook on a ``torch.compile`` wrapper: closes what
    :class:`DirectCallPreHook` opened (``ForwardContext.close_direct_entry``)."""

    __slots__ = ("_entry",)

    def __init__(self, observer: ForwardContext, entry: int) -> None:
        super().__init__(observer)
        self._entry = entry

    def __call__(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        if _is_compiling():
            return
        observer = self._observer()
        if observer is not None and observer.direct_entry == self._entry:
            observer.close_direct_entry(self._entry, output)


@_opaque_to_compiler
def _enter_root_opaque(hook: RootPreHook, module: nn.Module) -> None:
    observer = hook._observer()
    if observer is not None:
        observer.enter_root(module)


#: Advice given once per process where Dynamo traces a root's hooks inline.
ROOT_TRACED_ADVICE = (
    "torchinstruments: torch.compile traces the observed root's own call, its hooks "
    "included (its class's forward is one Dynamo does not compile as a frame of its "
    "own, as with a torch.nn class compiled before the observer was injected, or the "
    "model is called from a compiled function): the "
    "root's hooks, which take the sampling decision, run as graph breaks around the "
    "compiled forward, and where the compile refuses graph breaks (fullgraph=True) "
    "they do nothing, so forwards that run that code are not observed. Compile the "
    "model itself with torch.compile(model), after inject_observer where its class is a "
    "torch.nn class."
)
_root_traced_warned = False
#: Times Dynamo met an observed root's pre-hook while tracing, in this process.
_root_hook_traces = 0
#: Those of them in traces that refuse graph breaks.
_root_hook_traces_unobserved = 0


def root_hook_traces() -> int:
    """Times Dynamo met an observed root's pre-hook while tracing, in this process (any
    observer's; a trace that Dynamo restarts counts again):
    ``coverage.compiled_capture.root_hooks_traced``."""
    return _root_hook_traces


def root_hook_traces_unobserved() -> int:
    """Of :func:`root_hook_traces`, those in traces that refuse graph breaks
    (``fullgraph=True``), where the root's hooks trace to nothing and the forwards that
    run the code are not observed: ``coverage.compiled_capture.root_hooks_unobserved``."""
    return _root_hook_traces_unobserved


def graph_breaks_refused() -> bool:
    """While Dynamo traces: True if the trace refuses graph breaks (``fullgraph=True``,
    or ``torch._dynamo.error_on_graph_break(True)`` around the call), read from Dynamo's
    instruction translator of the trace; False where Dynamo lacks what this reads, and
    outside a trace."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        translator = InstructionTranslator.current_tx()
    except Exception:
        return False
    one_graph = getattr(translator, "one_graph", False)
    return one_graph is True or getattr(translator, "error_on_graph_break", False) is True


def _graph_breaks_refused_flag() -> int:
    return int(graph_breaks_refused())


#: Called (in order) when Dynamo traces a root pre-hook inline; each returns how many
#: compiled wrappers it made compile the root's forward frame from their next call on.
_ROOT_TRACED_CALLBACKS: list[Callable[[], int]] = []


def on_root_traced(callback: Callable[[], int]) -> None:
    """Call ``callback`` whenever Dynamo traces an observed root's pre-hook inline (see
    :func:`_warn_root_traced`). It returns the number of compiled wrappers it made
    compile the root's forward as a frame from their next call on (``_root_frame.py``
    registers one); where any did, the trace is a one-off, neither counted nor warned
    about."""
    _ROOT_TRACED_CALLBACKS.append(callback)


def _warn_root_traced() -> int:
    """Run by Dynamo while it traces a root pre-hook inline (a trace-time constant, see
    :data:`_root_traced_constant`): unless a callback of :func:`on_root_traced` made the
    compiled wrapper on the stack compile the root's frame from its next call on, count
    it and warn once per process with :data:`ROOT_TRACED_ADVICE`. Returns 1 where the
    trace refuses graph breaks: the root's hooks then trace to nothing (training goes
    on, its forwards unobserved, counted in :func:`root_hook_traces_unobserved`), and 0
    where they may break the graph."""
    global _root_traced_warned, _root_hook_traces, _root_hook_traces_unobserved
    refused = graph_breaks_refused()
    rechosen = 0
    for callback in _ROOT_TRACED_CALLBACKS:
        # Never break the compile: a callback that raises counts as one that changed nothing.
        with contextlib.suppress(Exception):
            rechosen += callback()
    if rechosen:
        return int(refused)  # one forward; the wrapper's next calls compile the frame
    _root_hook_traces += 1
    _root_hook_traces_unobserved += refused
    if not _root_traced_warned:
        _root_traced_warned = True
        warn(ROOT_TRACED_ADVICE)
    return int(refused)


#: :func:`_warn_root_traced` as Dynamo sees it (``torch.compiler.assume_constant_result``:
#: called once while tracing, its result a constant), once Dynamo is loaded; None before
#: and where torch lacks it.
_root_traced_constant: Callable[[], int] | None = None
#: :func:`graph_breaks_refused` as such a constant, for the root's post-hook.
_breaks_refused_constant: Callable[[], int] | None = None


def trace_time_constant(function: Callable[[], int]) -> Callable[[], int] | None:
    """``function`` as ``torch.compiler.assume_constant_result`` makes it (Dynamo calls
    it once while tracing and keeps its result), or None where torch lacks that or its
    Dynamo refuses the function. Call once Dynamo is loaded (:func:`on_compiler_loaded`)."""
    assume = getattr(getattr(torch, "compiler", None), "assume_constant_result", None)
    if assume is None:
        return None
    try:
        return assume(function)
    except Exception:
        return None


def _enable_root_traced_warning() -> None:
    global _root_traced_constant, _breaks_refused_constant
    _root_traced_constant = trace_time_constant(_warn_root_traced)  # None: no advice, no count
    _breaks_refused_constant = trace_time_constant(_graph_breaks_refused_flag)


@_opaque_to_compiler
def _leave_root_opaque(hook: RootPostHook, args: tuple[object, ...], output: object) -> None:
    observer = hook._observer()
    if observer is not None:
        observer.leave_root(hook._index, args, output)


if _is_compiling is _never_compiling:  # torch without torch.compiler.is_compiling
    _opaque_to_compiler(RootPreHook.__call__)
    _opaque_to_compiler(RootPostHook.__call__)
else:
    on_compiler_loaded(_enable_root_traced_warning)


class ForwardHook(_HookBase):
    """Forward hook on one observed module; returns at once in unsampled forwards.
    ``compiled``: the observer's capture inside compiled graphs (``_compiled_capture.py``
    replaces this ``__call__`` with one Dynamo traces, once Dynamo is loaded), and
    ``rows`` this module's rows for it by device (``CompiledCapture.register``).
    Registered with ``with_kwargs=True`` (see :meth:`register`): the capture inside
    graphs tells the module's keyword inputs from its outputs."""

    __slots__ = ("_index", "compiled", "rows")

    def __init__(
        self,
        observer: ForwardContext,
        index: int,
        compiled: object = None,
        rows: dict[str, tuple[Tensor, Tensor]] | None = None,
    ) -> None:
        super().__init__(observer)
        self._index = index
        self.compiled = compiled
        self.rows = rows

    def register(self, module: nn.Module) -> RemovableHandle:
        """Register this hook on ``module`` as a forward hook that also receives the
        module's keyword arguments; returns its handle."""
        return module.register_forward_hook(self, with_kwargs=True)

    @_opaque_to_compiler
    def __call__(
        self,
        module: nn.Module,
        args: tuple[object, ...],
        kwargs: dict[str, object],
        output: object,
    ) -> None:
        observer = self._observer()
        if observer is None or observer.state is SKIP:  # the fast path
            return
        observer.on_forward(self._index, args, output)


class GradHook:
    """Tensor hook that receives the output gradient of one sampled tensor.

    Holds no reference to the tensor itself (no cycle) and a weak one to the observer.
    """

    __slots__ = ("_key", "_observer", "_sample", "handle")

    def __init__(self, observer: ForwardContext, key: tuple[int, int, str], sample: int) -> None:
        self._observer = weakref.ref(observer)
        self._key = key
        self._sample = sample
        #: Set for hooks on leaf tensors, which outlive the graph: removed after firing.
        self.handle: Any = None

    @_opaque_to_compiler
    def __call__(self, grad: Tensor) -> None:
        observer = self._observer()
        if observer is not None:
            observer.on_grad(self._key, self._sample, grad)
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class NodeGradHook:
    """Pre-hook on the autograd node that produced a sampled tensor: receives the
    gradients of the node's outputs and passes on the one of that tensor.

    Registered with ``grad_fn.register_prehook``, which skips ``Tensor.register_hook``'s
    Python bookkeeping (its hook dictionary and removable handle).
    It fires where a tensor hook registered at that moment would: for the value the
    module returned, even if the tensor is changed in place later.
    """

    __slots__ = ("_key", "_observer", "_output_nr", "_sample")

    def __init__(
        self, observer: ForwardContext, key: tuple[int, int, str], sample: int, output_nr: int
    ) -> None:
        self._observer = weakref.ref(observer)
        self._key = key
        self._sample = sample
        self._output_nr = output_nr

    @_opaque_to_compiler
    def __call__(self, grad_outputs: tuple[Tensor | None, ...]) -> None:
        observer = self._observer()
        if observer is None or self._output_nr >= len(grad_outputs):
            return
        grad = grad_outputs[self._output_nr]
        if grad is not None:
            observer.on_grad(self._key, self._sample, grad)


class BackwardStartHook:
    """Pre-hook on the autograd node of a direct-call sample's output that no gradient
    hook of ours watches: tells the observer that the sample's backward started (see
    ``CallCapture.watch_backward``)."""

    __slots__ = ("_observer", "_sample", "_sink")

    def __init__(self, observer: ForwardContext, sample: int, sink: object) -> None:
        self._observer = weakref.ref(observer)
        self._sample = sample
        self._sink = sink

    @_opaque_to_compiler
    def __call__(self, grad_outputs: tuple[Tensor | None, ...]) -> None:
        observer = self._observer()
        if observer is not None:
            observer.capture.on_backward_start(observer, self._sample, self._sink)


# Entry points for ForwardWrapper, which itself must stay traceable (it runs the
# module's forward); hooks are opaque at their own ``__call__``, and the observer's
# methods they reach are plain (a nested opaque wrapper costs about 0.3 us a call).
@_opaque_to_compiler
def _wrapper_enter(observer: ForwardContext, module: nn.Module) -> None:
    observer.enter_root(module)


@_opaque_to_compiler
def _wrapper_leave(
    observer: ForwardContext, index: int, args: tuple[object, ...], output: object
) -> None:
    observer.leave_root(index, args, output)


@_opaque_to_compiler
def _wrapper_forward(
    observer: ForwardContext, index: int, args: tuple[object, ...], output: object
) -> None:
    if observer.state is not SKIP:
        observer.on_forward(index, args, output)


class ForwardWrapper(WrapperCopies):
    """Reversible instance-level ``forward`` that observes direct ``module.forward`` calls.

    Installed only with ``capture_direct_forwards=True``. ``module(x)`` and
    ``module.forward(x)`` both reach it exactly once. ``copy.deepcopy`` turns it into the
    class's plain ``forward`` bound to the copy; pickling raises with the fix.
    """

    __slots__ = ("_index", "_is_root", "_module", "_observer", "_original")

    def __init__(
        self,
        observer: ForwardContext,
        module: nn.Module,
        original: Callable[..., object],
        index: int,
        is_root: bool,
    ) -> None:
        self._observer = weakref.ref(observer)
        self._module = weakref.ref(module)
        watch_for_compiler()
        self._original = original
        self._index = index
        self._is_root = is_root

    def __call__(self, *args: object, **kwargs: object) -> object:
        observer = self._observer()
        module = self._module()
        if observer is None or module is None or not observer.attached:
            return self._original(*args, **kwargs)
        if self._is_root:
            _wrapper_enter(observer, module)
            output = None
            try:
                output = self._original(*args, **kwargs)
                return output
            finally:
                _wrapper_leave(observer, self._index, args, output)
        output = self._original(*args, **kwargs)
        _wrapper_forward(observer, self._index, args, output)
        return output

    @property
    def __signature__(self) -> inspect.Signature | None:
        """The wrapped ``forward``'s signature, for ``inspect.signature``: tools that
        name inputs by it (``torch.jit.trace`` names the graph's inputs so) see the
        module's own parameter names; None where it has none."""
        try:
            return inspect.signature(self._original)
        except (TypeError, ValueError):
            return None
