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
class's ``forward``. The compiled wrapper then takes the usual way, and Dynamo compiles
that function's frame: once per class, shared by every instance, as a class's own
``forward`` would be. Compiled wrappers of the root made before injection are made to
choose again (:func:`rechoose_compiled_wrappers`), at injection and at removal.
Eagerly the frame costs one more Python call per root forward.

A deep copy of the model carries an :class:`~._copies.InertForward` in its place, as
the ``capture_direct_forwards`` wrappers do, and a pickled one unpickles as one.
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

from ._copies import InertForward, WrapperCopies
from .capture import on_compiler_loaded

__all__ = ["RootFrame", "needs_root_frame", "rechoose_compiled_wrappers"]

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
    gets entries of its own, which all its instances share)."""
    frame = _frames.get(cls)
    if frame is not None:
        return frame
    class_forward = cls.forward

    def forward(self: nn.Module, *args: object, **kwargs: object) -> object:
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
    through the frame function made for the class; holds the module weakly.

    Args:
        module: the observed root.
    """

    __slots__ = ("__wrapped__", "_frame", "_module", "_original")

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)
        self._frame = _frame_for(type(module))
        self._original = self._frame
        #: For ``torchinstruments.compiled``: the frame function, whose code Dynamo compiles.
        self.__wrapped__ = self._frame

    def __call__(self, *args: object, **kwargs: object) -> object:
        module = self._module()
        if module is None:
            raise RuntimeError("torchinstruments: the observed root no longer exists")
        return self._frame(module, *args, **kwargs)

    def unwrapped(self, module: nn.Module) -> object | None:
        """None: without this frame the class's ``forward`` applies."""
        return None

    def __reduce__(self) -> tuple[Any, ...]:
        return (InertForward, (self._module(),))

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


def _skip_own_frame() -> None:
    """Have Dynamo run :meth:`RootFrame.__call__` eagerly, and compile the frames it
    calls (``torch._dynamo.eval_frame.skip_code``)."""
    try:
        from torch._dynamo.eval_frame import skip_code

        skip_code(RootFrame.__call__.__code__)
    except Exception:
        pass  # Dynamo then compiles the call too: guards per frame object, still correct


on_compiler_loaded(_skip_own_frame)


def rechoose_compiled_wrappers(root: nn.Module, *known: nn.Module) -> int:
    """Make each ``torch.compile`` wrapper of ``root`` (``OptimizedModule``: those in
    ``known``, and any other that the garbage collector tracks) choose again how it
    compiles ``root``'s call, now that ``root`` has a :class:`RootFrame` or no longer
    has one. Their code is compiled again at their next call. Returns the number of
    wrappers changed; 0 without Dynamo loaded or where its wrapper lacks
    ``_initialize``."""
    if "torch._dynamo" not in sys.modules:
        return 0
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:
        return 0
    if not callable(getattr(OptimizedModule, "_initialize", None)):
        return 0
    wrappers = {id(w): w for w in known if isinstance(w, OptimizedModule)}
    for candidate in gc.get_objects():
        # type(), not isinstance(): an object's __class__ may be a property with effects
        if issubclass(type(candidate), OptimizedModule):
            wrappers.setdefault(id(candidate), candidate)
    changed = 0
    for wrapper in wrappers.values():
        if wrapper.__dict__.get("_modules", {}).get("_orig_mod") is not root:
            continue
        try:
            wrapper._initialize()
        except Exception:
            continue
        changed += 1
    return changed
