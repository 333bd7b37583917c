"""What the observer's hooks become in copies of the model, and for TorchScript.

Copying a model that carries hooks (``copy.deepcopy`` for EMA models, ``pickle``,
``torch.save``) copies the hook dictionaries too; our hooks then copy as inert
placeholders that do nothing (:class:`InertHook`, :class:`InertForward`), so a copy is
never observed by the original's observer.

``torch.jit.script`` of an observed model (or of any of its modules) compiles a clean
stand-in that :class:`PrepareScriptable` hands it (:func:`scriptable_copy`): the same
parameters and buffers, the user's own hooks, none of ours. The eager model keeps its
hooks.

The hooks of ``capture.py`` get this behaviour from the bases :class:`CopiedAsInert`
(hooks) and :class:`WrapperCopies` (``capture_direct_forwards`` wrappers), which is also
how :func:`scriptable_copy` recognises them; nothing here runs in a forward of the
observed model.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

#: True while Dynamo traces (it evaluates the call as a constant); False when run.
_is_compiling: Callable[[], bool] = getattr(
    getattr(torch, "compiler", None), "is_compiling", lambda: False
)

__all__ = [
    "PREPARE_ATTRIBUTE",
    "CopiedAsInert",
    "InertForward",
    "InertHook",
    "PrepareScriptable",
    "WrapperCopies",
    "remove_inert",
    "scriptable_copy",
]

_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs",
)


class _NotScriptable(AttributeError):
    """Raised when TorchScript (or anything) asks an observer hook for its ``__name__``.

    ``torch.jit.script`` never does (it compiles the stand-in of
    :class:`PrepareScriptable`); TorchScript asks when it compiles an observed module
    itself, as ``torch.jit.trace`` does for a module that has ``@torch.jit.export``
    methods. An AttributeError, so ``hasattr`` probes stay False, with a message that
    says how to proceed.
    """


#: What the message of :class:`_NotScriptable` says about the way out.
_SCRIPT_ADVICE = (
    "TorchScript is compiling the forward hooks of an observed module itself (as "
    "torch.jit.trace does for modules with @torch.jit.export methods), and an observer "
    "hook cannot be compiled; torch.jit.script(model) works, or call "
    "torchinstruments.remove_observer(model) first, then inject again"
)


class InertHook:
    """What an observer's hook becomes in a deep-copied or unpickled model.

    It does nothing, and on its first call (run eagerly) removes every inert placeholder
    from the module it is called for and from all of that module's submodules
    (:func:`remove_inert`), so a copy (an EMA model, a checkpoint loaded with
    ``torch.load``) ends up with exactly the hooks it would have had without the
    observer. The root's placeholders run first in a forward, so a copy compiled whole
    (``fullgraph=True`` too) is clean before Dynamo traces its submodules. Traced by
    Dynamo (a block of a copy compiled on its own, called before any eager forward of
    its parent), it is a no-op in the graph and stays until an eager call.
    """

    __slots__ = ()

    def __call__(self, module: nn.Module, *args: object, **kwargs: object) -> None:
        if _is_compiling():
            return  # Dynamo cannot trace the removal; the next eager call does it
        remove_inert(module)

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (InertHook, ())

    @property
    def __name__(self) -> str:
        raise _NotScriptable(
            "torchinstruments: this module was copied from an observed model and still "
            "carries an inert observer hook, which removes itself at the first forward; "
            f"run one forward first. {_SCRIPT_ADVICE}"
        )


class InertForward:
    """What a ``capture_direct_forwards`` wrapper becomes in a deep copy.

    On its first call it deletes itself from the copy's instance attributes (so the
    class's ``forward`` applies again) and runs that ``forward``.
    """

    __slots__ = ("_module",)

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)

    def __call__(self, *args: object, **kwargs: object) -> object:
        module = self._module()
        if module is None:
            raise RuntimeError("torchinstruments: the copied module no longer exists")
        if module.__dict__.get("forward") is self:
            del module.__dict__["forward"]
        _drop_copied_preparers(module)
        return type(module).forward(module, *args, **kwargs)


class CopiedAsInert:
    """Base of the observer's hooks: they copy and pickle as an :class:`InertHook`, and
    refuse TorchScript's request for their ``__name__`` with advice."""

    __slots__ = ()

    def __deepcopy__(self, memo: dict[int, object]) -> InertHook:
        return InertHook()

    def __copy__(self) -> InertHook:
        return InertHook()

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (InertHook, ())

    @property
    def __name__(self) -> str:
        raise _NotScriptable(f"torchinstruments: {_SCRIPT_ADVICE}")


class WrapperCopies:
    """Base of the ``capture_direct_forwards`` wrapper (``capture.ForwardWrapper``):
    a deep copy is an :class:`InertForward` of the copied module, pickling raises with
    the fix. The wrapper sets ``_module`` (a weak reference to its module) and
    ``_original`` (the ``forward`` it wraps)."""

    __slots__ = ()
    _module: weakref.ref[nn.Module]
    _original: Callable[..., object]

    def removable(self, module: nn.Module) -> bool:
        """Whether :func:`remove_inert` takes this ``forward`` out of ``module`` (a copy's):
        False here; a copied root frame (``_root_frame.RootFrame``) says otherwise."""
        return False

    def unwrapped(self, module: nn.Module) -> object | None:
        """What ``module.__dict__["forward"]`` would be without this wrapper: None where
        the class's ``forward`` applies, else the instance ``forward`` it wraps."""
        original = self._original
        class_forward = getattr(type(module), "forward", None)
        if getattr(original, "__self__", None) is module and (
            getattr(original, "__func__", None) is class_forward
        ):
            return None
        return original

    def __deepcopy__(self, memo: dict[int, object]) -> object:
        module = self._module()
        copied = memo.get(id(module)) if module is not None else None
        if isinstance(copied, nn.Module):
            return InertForward(copied)
        return InertHook()

    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError(
            "torchinstruments: this model carries capture_direct_forwards wrappers, which "
            "cannot be pickled; call remove_observer(model) first, or save model.state_dict()"
        )


class PrepareScriptable:
    """``__prepare_scriptable__`` of one module of an observed model (an instance
    attribute set at injection on every module of the model, removed at removal).

    ``torch.jit.script(module)`` first calls ``module.__prepare_scriptable__()`` and
    compiles the module returned, recursing into its submodules (torch/jit/_script.py,
    ``call_prepare_scriptable_func``). This returns a stand-in for the module's subtree
    (:func:`scriptable_copy`): TorchScript compiles no hook of ours, the ScriptModule
    shares the model's parameters and buffers as it would the original's, and the
    observed model is left as it was, so its observation goes on. A class's own
    ``__prepare_scriptable__`` is then applied to the stand-in.

    Copies of the model (``copy.deepcopy``, pickling) carry an inert one (``inert``):
    it works the same, and the copy's first forward removes it with the inert hooks.
    """

    __slots__ = ("_module", "inert")

    def __init__(self, module: nn.Module | None, inert: bool = False) -> None:
        self._module = weakref.ref(module) if module is not None else None
        self.inert = inert

    def __call__(self) -> nn.Module:
        module = self._module() if self._module is not None else None
        if module is None:
            raise RuntimeError("torchinstruments: the module to script no longer exists")
        stand_in = scriptable_copy(module, {})
        own = getattr(type(module), "__prepare_scriptable__", None)
        return own(stand_in) if callable(own) else stand_in

    def __deepcopy__(self, memo: dict[int, object]) -> PrepareScriptable:
        module = self._module() if self._module is not None else None
        copied = memo.get(id(module)) if module is not None else None
        return PrepareScriptable(copied if isinstance(copied, nn.Module) else None, inert=True)

    def __copy__(self) -> PrepareScriptable:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (PrepareScriptable, (self._module() if self._module is not None else None, True))


#: The attribute :class:`PrepareScriptable` is set as.
PREPARE_ATTRIBUTE = "__prepare_scriptable__"


def remove_inert(module: nn.Module) -> None:
    """Remove the inert placeholders of a copied observed model from ``module`` and its
    submodules: :class:`InertHook` entries of the hook dictionaries (with their flags),
    :class:`InertForward` instance attributes, copied root frames that no compiled
    wrapper runs, and inert :class:`PrepareScriptable` attributes. Nothing else
    changes; a module without them is left as it is."""
    for sub in module.modules():
        state = sub.__dict__
        inert = {
            key
            for name in ("_forward_pre_hooks", "_forward_hooks")
            if isinstance(hooks := state.get(name), dict)
            for key, hook in hooks.items()
            if isinstance(hook, InertHook)
        }
        for key in inert:
            for name in _HOOK_DICTS:
                entries = state.get(name)
                if isinstance(entries, dict):
                    entries.pop(key, None)
        forward = state.get("forward")
        if isinstance(forward, InertForward) or (
            isinstance(forward, WrapperCopies) and forward.removable(sub)
        ):
            del state["forward"]
    _drop_copied_preparers(module)


def _drop_copied_preparers(module: nn.Module) -> None:
    """Remove the inert :class:`PrepareScriptable` of ``module`` and its submodules."""
    for sub in module.modules():
        if isinstance(sub.__dict__.get(PREPARE_ATTRIBUTE), PrepareScriptable) and (
            sub.__dict__[PREPARE_ATTRIBUTE].inert
        ):
            del sub.__dict__[PREPARE_ATTRIBUTE]


def _ours(hook: object) -> bool:
    return isinstance(hook, CopiedAsInert | InertHook)


def scriptable_copy(module: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    """A copy of ``module``'s subtree for TorchScript to compile, without our residue.

    Each module is copied shallowly (``cls.__new__`` and its ``__dict__``): parameters,
    buffers, submodules outside ``_modules`` and other attributes are the same objects.
    Its parameter, buffer and submodule dictionaries are new (TorchScript's preparation
    writes into the submodule dictionary), submodules are copied the same way (a module
    shared by two parents stays shared, through ``memo``), and its forward-hook
    dictionaries are new and hold the user's hooks in their order, without ours. Our
    ``forward`` wrappers and ``__prepare_scriptable__`` attributes are left out.
    ScriptModules are returned as they are. Nothing of ``module`` itself is changed.
    """
    done = memo.get(id(module))
    if done is not None:
        return done
    if isinstance(module, torch.jit.ScriptModule):
        memo[id(module)] = module
        return module
    cls = type(module)
    copied: nn.Module = cls.__new__(cls)
    memo[id(module)] = copied
    state = dict(module.__dict__)
    if isinstance(state.get(PREPARE_ATTRIBUTE), PrepareScriptable):
        del state[PREPARE_ATTRIBUTE]
    forward = state.get("forward")
    if isinstance(forward, WrapperCopies | InertForward):
        kept = forward.unwrapped(module) if isinstance(forward, WrapperCopies) else None
        if kept is None:
            del state["forward"]
        else:
            state["forward"] = kept
    hooks = [state.get(name) for name in ("_forward_hooks", "_forward_pre_hooks")]
    ours = {key for d in hooks if isinstance(d, dict) for key, hook in d.items() if _ours(hook)}
    for name in _HOOK_DICTS:
        entries = state.get(name)
        if isinstance(entries, dict):
            kept_entries = entries.copy()
            for key in ours:
                kept_entries.pop(key, None)
            state[name] = kept_entries
    for name in ("_parameters", "_buffers"):
        if isinstance(state.get(name), dict):
            state[name] = state[name].copy()
    children = state.get("_modules")
    if isinstance(children, dict):
        copied_children = children.copy()
        for key, child in children.items():
            if isinstance(child, nn.Module):
                copied_children[key] = scriptable_copy(child, memo)
        state["_modules"] = copied_children
    copied.__dict__.update(state)
    return copied
