"""A forward frame that ``torch.compile`` compiles, for a root whose class has none.

``torch.compile(module)`` compiles the frame of the module's ``forward`` and runs the
module's hooks eagerly around it, where the root's hooks take the sampling decision.
Dynamo makes an exception for a ``forward`` it never compiles as a frame (that of a
``torch.nn`` class such as ``nn.Sequential``): the compiled wrapper then traces the
module's whole call, its hooks included (``OptimizedModule._initialize`` in
``torch/_dynamo/eval_frame.py`` chooses between the two when the wrapper is made). The
root's hooks would then be graph breaks (or, with ``fullgraph=True``, trace to nothing).

So at injection such a root gets an instance ``forward``, a :class:`RootFrame`: Dynamo
skips its own frame (``skip_code``, applied once Dynamo is loaded), and it calls a
function made for the root's class, with a code object of its own, that calls the
class's ``forward``. A compiled wrapper made after injection then takes the usual way,
and Dynamo compiles that function's frame: once per class, shared by every instance, as
a class's own ``forward`` would be. Eagerly the frame costs one more Python call per
root forward.

``module.compile()`` made before injection chose the same way (its compiled call traces
``nn.Module._call_impl`` whole where the ``forward`` is skipped): :func:`recompile_call`
compiles the call again with the same settings once the frame exists.

A wrapper made before injection chose the other way: at injection the wrappers of the
root are found (:func:`wrappers_of`, a pass over the objects the garbage collector
tracks, only where Dynamo is loaded) and made to choose again (:func:`rechoose`). One
that escapes it is found when Dynamo first traces the root's hooks inside it
(:func:`rechoose_wrappers_on_stack`, from the traced root pre-hook), at the cost of one
compiled forward that traces the root's call (and one cache entry of Dynamo's that
counts towards its recompile limit).

Removal leaves the frame in place where compiled code may run it: a wrapper of the
root exists (found at injection, on the stack while Dynamo traced the frame, or by the
same pass over the objects at removal) or ``module.compile()`` compiled the root's
call. Otherwise it takes the frame out and has a wrapper given to ``inject_observer``
choose again.

A deep copy of the model, and an unpickled one, carry a frame flagged ``copied``:
:func:`~._copies.remove_inert` takes it out at the copy's first forward, unless a
compiled wrapper of the copy is calling it (the wrapper chose to compile it).
"""

from __future__ import annotations

import gc
import inspect
import os
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._copies import WrapperCopies
from ._parking import CALL_IMPL_CODE
from .capture import _is_compiling, on_compiler_loaded, on_root_traced, trace_time_constant

__all__ = [
    "RootFrame",
    "needs_root_frame",
    "rechoose",
    "rechoose_wrappers_on_stack",
    "recompile_call",
    "wrappers_of",
]

#: Where torch's own code lives: Dynamo compiles no frame of a ``forward`` defined there.
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep

#: The frame function made for each class (see :func:`_frame_for`).
_frames: weakref.WeakKeyDictionary[type, Callable[..., Any]] = weakref.WeakKeyDictionary()


def needs_root_frame(root: nn.Module) -> bool:
    """True if ``torch.compile(root)`` would trace ``root``'s whole call rather than
    compile its ``forward`` as a frame: its class's ``forward`` is defined in torch's own
    code, or Dynamo (when loaded) says it skips it. False where ``root`` has an instance
    ``forward`` already."""
    if "forward" in root.__dict__:
        return False
    forward = getattr(type(root), "forward", None)
    code = getattr(forward, "__code__", None)
    if isinstance(code, types.CodeType) and code.co_filename.startswith(_TORCH_DIR):
        return True
    if "torch._dynamo" not in sys.modules:
        return False
    try:
        from torch._dynamo.eval_frame import OptimizedModule

        return OptimizedModule._forward_has_skip_rule(root) is True
    except Exception:
        return False


def _frame_for(cls: type) -> Callable[..., Any]:
    """A function ``(module, *args, **kwargs)`` that calls ``cls.forward``, with a code
    object made for ``cls`` (Dynamo keeps compiled code per code object: each class
    gets entries of its own, which all its instances share). Traced by Dynamo, it first
    notes the compiled wrappers on the stack (:func:`_note_wrappers_constant`)."""
    frame = _frames.get(cls)
    if frame is not None:
        return frame
    class_forward = cls.forward

    def forward(self: nn.Module, *args: object, **kwargs: object) -> object:
        if _is_compiling() and _note_wrappers_constant is not None:
            _note_wrappers_constant()
        return class_forward(self, *args, **kwargs)

    template = forward.__code__
    code = template.replace(co_qualname=f"{cls.__qualname__}.forward (observed root frame)")
    frame = types.FunctionType(code, forward.__globals__, "forward", None, forward.__closure__)
    frame.__wrapped__ = class_forward  # type: ignore[attr-defined]
    _frames[cls] = frame
    return frame


class RootFrame(WrapperCopies):
    """The instance ``forward`` of a root whose class's ``forward`` Dynamo does not
    compile as a frame (see the module docstring). Calls the class's ``forward``
    through the frame function made for the class; holds the module weakly. It refers
    to no observer: left on a model after removal (see :meth:`compiled`), it only keeps
    that model's compiled code running. Dynamo's guards may check its identity; it can
    be weakly referenced, so that their entries go when it does.

    Args:
        module: the observed root.
        copied: True for the frame of a copy of the model (``copy.deepcopy``,
            unpickling): :func:`~._copies.remove_inert` takes it out at the copy's first
            forward unless a compiled wrapper of the copy runs it (see :meth:`removable`).
    """

    __slots__ = ("__weakref__", "_frame", "_module", "copied", "wrappers")

    def __init__(self, module: nn.Module, copied: bool = False) -> None:
        self._module = weakref.ref(module)
        self._frame = _frame_for(type(module))
        #: The compiled wrappers (``OptimizedModule``) seen compiling this frame.
        self.wrappers: list[weakref.ref[nn.Module]] = []
        self.copied = copied

    def __call__(self, *args: object, **kwargs: object) -> object:
        module = self._module()
        if module is None:
            raise RuntimeError("torchinstruments: the observed root no longer exists")
        return self._frame(module, *args, **kwargs)

    def note_wrappers(self, wrappers: list[nn.Module]) -> None:
        """Remember ``wrappers`` (``OptimizedModule``) as compiling this frame."""
        for wrapper in wrappers:
            if not any(ref() is wrapper for ref in self.wrappers):
                self.wrappers.append(weakref.ref(wrapper))

    def compiled(self, module: nn.Module) -> bool:
        """True if compiled code of ``module`` may run this frame: ``module.compile()``
        compiled the module's call (whose code then calls this frame), or a compiled
        wrapper of ``module`` exists (one seen compiling the frame, or any that
        :func:`wrappers_of` finds: made since injection, it chose to compile the frame,
        and may run code that Dynamo compiled for another instance of the class, so
        without tracing it). Removal leaves the frame in place then."""
        if module.__dict__.get("_compiled_call_impl") is not None:
            return True
        self.note_wrappers(wrappers_of(module))
        return any(ref() is not None for ref in self.wrappers)

    def removable(self, module: nn.Module) -> bool:
        """For :func:`~._copies.remove_inert` (called from the first forward of a copy of
        the model): True unless a compiled wrapper of ``module`` is calling it (it chose
        to compile this frame when it was made), in which case the frame stays."""
        if not self.copied:
            return False
        if any(wrapper._orig_mod is module for wrapper, _ in _wrappers_on_stack()):
            self.copied = False
            return False
        return True

    def unwrapped(self, module: nn.Module) -> object | None:
        """None: without this frame the class's ``forward`` applies."""
        return None

    def __deepcopy__(self, memo: dict[int, object]) -> object:
        module = self._module()
        copied = memo.get(id(module)) if module is not None else None
        return RootFrame(copied, copied=True) if isinstance(copied, nn.Module) else self

    def __reduce__(self) -> tuple[Any, ...]:
        return (_copied_frame, (self._module(),))

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        """The frame function, whose code Dynamo compiles (``torchinstruments.compiled``
        follows ``__wrapped__`` to it, and from it to the class ``forward``)."""
        return self._frame

    @property
    def __code__(self) -> types.CodeType | None:
        """The class ``forward``'s code (``torch.export`` reads its name and place)."""
        return getattr(getattr(self._frame, "__wrapped__", None), "__code__", None)

    @property
    def __name__(self) -> str:
        return "forward"

    @property
    def __signature__(self) -> inspect.Signature | None:
        """The class ``forward``'s signature without ``self``, as ``inspect.signature``
        gives for the bound method; None where it has none."""
        module = self._module()
        if module is None:
            return None
        try:
            return inspect.signature(type(module).forward.__get__(module, type(module)))
        except (TypeError, ValueError):
            return None


def _copied_frame(module: nn.Module | None) -> RootFrame | None:
    """What a pickled :class:`RootFrame` unpickles as: the frame of a copy."""
    return RootFrame(module, copied=True) if isinstance(module, nn.Module) else None


#: :func:`_note_wrappers` as a trace-time constant, once Dynamo is loaded.
_note_wrappers_constant: Callable[[], int] | None = None


def _on_compiler_loaded() -> None:
    """Have Dynamo run :meth:`RootFrame.__call__` eagerly and compile the frames it calls
    (``torch._dynamo.eval_frame.skip_code``); make :func:`_note_wrappers` a trace-time
    constant."""
    global _note_wrappers_constant
    _note_wrappers_constant = trace_time_constant(_note_wrappers)
    try:
        from torch._dynamo.eval_frame import skip_code

        skip_code(RootFrame.__call__.__code__)
    except Exception:
        pass  # Dynamo then compiles the call too: guards per frame object, still correct


def _wrappers_on_stack() -> list[tuple[nn.Module, RootFrame]]:
    """The compiled wrappers (``OptimizedModule``) whose call runs on the stack, of
    roots that have a :class:`RootFrame`, each with that frame."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:
        return []
    found: list[tuple[nn.Module, RootFrame]] = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is CALL_IMPL_CODE:
            wrapper = frame.f_locals.get("self")
            if isinstance(wrapper, OptimizedModule):
                root = wrapper.__dict__.get("_modules", {}).get("_orig_mod")
                forward = root.__dict__.get("forward") if isinstance(root, nn.Module) else None
                if isinstance(forward, RootFrame):
                    found.append((wrapper, forward))
        frame = frame.f_back
    return found


def _note_wrappers() -> int:
    """While Dynamo traces a root frame: remember each compiled wrapper on the stack in
    its root's frame (see :meth:`RootFrame.compiled`). Returns 0."""
    for wrapper, frame in _wrappers_on_stack():
        frame.note_wrappers([wrapper])
    return 0


def rechoose_wrappers_on_stack() -> int:
    """While Dynamo traces an observed root's pre-hook: make each compiled wrapper on
    the stack whose root has a :class:`RootFrame` but that traces the root's whole call
    (made before injection) choose again (:func:`rechoose`), so that its next calls
    compile the frame. Returns the number of wrappers changed."""
    changed = 0
    for wrapper, frame in _wrappers_on_stack():
        callable_ = getattr(wrapper.__dict__.get("forward"), "_torchdynamo_orig_callable", None)
        if getattr(callable_, "__self__", None) is frame._module():
            continue  # it already calls the root's __call__, so compiles the frame
        changed += rechoose(wrapper)
        frame.note_wrappers([wrapper])
    return changed


def wrappers_of(root: nn.Module) -> list[nn.Module]:
    """The ``torch.compile`` wrappers (``OptimizedModule``) of ``root`` that exist now,
    found among the objects the garbage collector tracks (one pass over them: about
    0.1 s in a process with ``transformers`` loaded); none without Dynamo loaded (no
    wrapper can exist then)."""
    if "torch._dynamo" not in sys.modules:
        return []
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:
        return []
    return [
        candidate
        for candidate in gc.get_objects()
        # type(), not isinstance(): an object's __class__ may be a property with effects
        if issubclass(type(candidate), OptimizedModule)
        and candidate.__dict__.get("_modules", {}).get("_orig_mod") is root
    ]


def rechoose(*wrappers: object) -> int:
    """Make each ``torch.compile`` wrapper (``OptimizedModule``) in ``wrappers`` choose
    again how it compiles its module's call (``OptimizedModule._initialize``), now that
    the module has a :class:`RootFrame` or no longer has one; anything else is left
    alone. Their code is compiled again at their next call. Returns the number of
    wrappers changed; 0 without Dynamo loaded or where its wrapper lacks
    ``_initialize``."""
    if "torch._dynamo" not in sys.modules:
        return 0
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:
        return 0
    changed = 0
    for wrapper in wrappers:
        initialize = getattr(wrapper, "_initialize", None)
        if not isinstance(wrapper, OptimizedModule) or not callable(initialize):
            continue
        try:
            initialize()
        except Exception:
            continue
        changed += 1
    return changed


def recompile_call(root: nn.Module) -> int:
    """Where ``root.compile()`` ran before ``root`` had a :class:`RootFrame` (so its
    compiled call traces ``nn.Module._call_impl`` whole, the root's hooks included:
    graph breaks, or under ``fullgraph=True`` unobserved forwards), compile the call
    again with the same ``torch.compile`` settings now that the frame exists: the new
    compiled call runs the hooks eagerly and compiles the frame, as ``root.compile()``
    made after injection does. Nothing is compiled here; Dynamo compiles at the next
    call. The settings are those of the ``torch.compile`` context that made the
    compiled call, read from that call's closure (its free variable ``self``,
    ``_TorchDynamoContext.__call__`` in ``torch/_dynamo/eval_frame.py``).

    Returns 1 if it compiled the call again; 0 where ``root`` has no such compiled
    call, Dynamo is not loaded, or the context cannot be read (the call then stays
    traced whole: the root's hooks are counted in
    ``coverage.compiled_capture.root_hooks_traced``)."""
    compiled = root.__dict__.get("_compiled_call_impl")
    if compiled is None or "torch._dynamo" not in sys.modules:
        return 0
    # Dynamo wraps a call it would skip in a function of its own (external_utils.wrap_inline)
    traced_whole = getattr(compiled, "_torchdynamo_orig_callable", None)
    call = getattr(traced_whole, "__wrapped__", None)
    if getattr(call, "__self__", None) is not root or getattr(call, "__name__", "") != "_call_impl":
        return 0
    try:
        from torch._dynamo.eval_frame import _TorchDynamoContext

        code = compiled.__code__
        cells = dict(zip(code.co_freevars, compiled.__closure__ or (), strict=True))
        context = cells["self"].cell_contents
        if not isinstance(context, _TorchDynamoContext):
            return 0
        root._compiled_call_impl = context(root._call_impl)
    except Exception:
        return 0
    return 1


on_compiler_loaded(_on_compiler_loaded)
on_root_traced(rechoose_wrappers_on_stack)
