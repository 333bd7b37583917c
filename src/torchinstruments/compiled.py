"""``torch.compile`` support: per-model invalidation of compiled code.

Dynamo caches compiled code on the code objects it compiled (a model's ``forward``, a
compiled block's ``forward``, and the resume functions it generates after graph
breaks), each entry with guards that say when it may run. By default
(``torch._dynamo.config.skip_nnmodule_hook_guards = True``) those guards ignore module
hook dictionaries, so hooks added or removed after a model was compiled would go unseen:
the model would keep running code compiled without them (or with them).

Two measures make injection and removal take effect for the observed model only,
without ``torch._dynamo.reset()`` (which discards every model's compiled code):

* :func:`guard_on_hooks` sets ``skip_nnmodule_hook_guards = False`` (once Dynamo is
  loaded and whenever an observer is injected or removed). Code compiled from then on
  guards on the hook dictionaries of the modules it traced, so a hook change fails the
  guards of exactly the models whose hooks changed, and only those are compiled again.
* :func:`forget_compiled_code` invalidates, on the code objects of the observed
  model's modules, the cache entries compiled without hook guards (before the setting
  above): Dynamo's own per-entry invalidation, the one it applies when an object its
  guards refer to is freed. Models of other classes keep all of their compiled code.

Where the per-entry invalidation is not available (a torch whose Dynamo lacks it), the
code objects' caches are reset (``reset_code``), and failing that the whole of Dynamo
(``torch._dynamo.reset()``); :func:`last_invalidation` says which was used.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable
from typing import Any

from torch import nn

__all__ = ["forget_compiled_code", "guard_on_hooks", "last_invalidation"]

#: The Dynamo setting that :func:`guard_on_hooks` turns off.
HOOK_GUARD_FLAG = "skip_nnmodule_hook_guards"

#: Deepest chain of decorators followed from a ``forward`` (see :func:`_module_codes`).
_MAX_WRAPPERS = 16

#: How the last call of :func:`forget_compiled_code` invalidated compiled code.
_last_method = "none"


def _dynamo() -> Any:
    return sys.modules.get("torch._dynamo")


def guard_on_hooks() -> bool:
    """Make code that Dynamo compiles from now on guard on module hook dictionaries.

    Sets ``torch._dynamo.config.skip_nnmodule_hook_guards`` to False, a process-wide
    setting (Dynamo documents True as unsafe when hooks are added or removed after
    compiling). Code compiled before keeps its guards. Does nothing, and does not import
    Dynamo, when Dynamo is not loaded.

    Returns:
        True if Dynamo is loaded and the setting is False now.
    """
    dynamo = _dynamo()
    config = getattr(dynamo, "config", None) if dynamo is not None else None
    if config is None or not hasattr(config, HOOK_GUARD_FLAG):
        return False
    try:
        setattr(config, HOOK_GUARD_FLAG, False)
    except Exception:
        return False
    return True


def hooks_guarded() -> bool:
    """True if Dynamo is loaded and code it compiles guards on module hook dictionaries
    (``skip_nnmodule_hook_guards`` is False, as :func:`guard_on_hooks` sets it)."""
    dynamo = _dynamo()
    config = getattr(dynamo, "config", None) if dynamo is not None else None
    try:
        return config is not None and getattr(config, HOOK_GUARD_FLAG) is False
    except Exception:
        return False


def _module_codes(modules: Iterable[nn.Module]) -> set[types.CodeType]:
    """The ``forward`` code objects of ``modules`` (class and instance ``forward``), with
    those of the decorators' wrappers around them (``functools.wraps``' ``__wrapped__``
    chain): Dynamo compiles the outermost frame, a wrapper's where ``forward`` is
    decorated (``transformers``' GPT-2). A wrapper's code may be shared with other
    decorated functions, whose entries without hook guards are then invalidated too."""
    codes: set[types.CodeType] = set()
    for module in modules:
        for forward in (getattr(type(module), "forward", None), module.__dict__.get("forward")):
            function: object = forward
            for _ in range(_MAX_WRAPPERS):
                if function is None:
                    break
                code = getattr(function, "__code__", None)
                if isinstance(code, types.CodeType):
                    codes.add(code)
                function = getattr(function, "__wrapped__", None)
    return codes


def _with_resume_functions(codes: set[types.CodeType]) -> set[types.CodeType]:
    """``codes`` and every resume function Dynamo generated from them, transitively."""
    try:
        from torch._dynamo.resume_execution import ContinueExecutionCache

        cache = ContinueExecutionCache.cache
    except Exception:
        return codes
    found = set(codes)
    todo = list(codes)
    while todo:
        code = todo.pop()
        try:
            resumed = cache.get(code)
        except Exception:
            resumed = None
        if not resumed:
            continue
        for generated in resumed.values():
            if isinstance(generated, types.CodeType) and generated not in found:
                found.add(generated)
                todo.append(generated)
    return found


def _guards_on_hooks(guard_manager: object) -> bool:
    """True if a cache entry's guards check the forward-hook dictionaries of modules
    (``L['self']._modules['fc']._forward_hooks``; not the global ones)."""
    try:
        return "]._forward_hooks" in str(guard_manager)
    except Exception:
        return False


def forget_compiled_code(modules: Iterable[nn.Module]) -> int:
    """Invalidate compiled code that could run ``modules`` without seeing hook changes.

    Turns hook guards on (:func:`guard_on_hooks`), then invalidates each cache entry on
    the ``forward`` code objects of ``modules`` (and their resume functions) whose guards
    do not check hook dictionaries. Other code objects, and entries that guard on hooks
    (their guards see the change), keep their compiled code. Does nothing, and does not
    import Dynamo, when Dynamo is not loaded.

    Args:
        modules: the modules whose hooks changed (every module of the observed model).

    Returns:
        The number of cache entries invalidated; -1 if Dynamo's caches had to be reset
        as a whole.
    """
    global _last_method
    dynamo = _dynamo()
    if dynamo is None:
        _last_method = "none"
        return 0
    guard_on_hooks()
    codes = _with_resume_functions(_module_codes(modules))
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    except Exception:
        return _reset_all(dynamo)
    invalidated = 0
    reset_codes = 0
    for code in codes:
        try:
            entries = _debug_get_cache_entry_list(code)
        except Exception:
            continue
        stale = [entry for entry in entries if not _guards_on_hooks(entry.guard_manager)]
        if not stale:
            continue
        try:
            from torch._dynamo.guards import DeletedGuardManagerWrapper

            for entry in stale:
                manager = entry.guard_manager
                if isinstance(manager, DeletedGuardManagerWrapper):
                    continue
                state = manager.extra_state
                if state is None:
                    raise RuntimeError("cache entry without its extra state")
                state.invalidate(
                    entry,
                    DeletedGuardManagerWrapper("torchinstruments: hooks added or removed"),
                )
                invalidated += 1
        except Exception:
            try:
                from torch._C._dynamo.eval_frame import reset_code

                reset_code(code)
                reset_codes += 1
            except Exception:
                return _reset_all(dynamo)
    _last_method = "reset_code" if reset_codes else "cache_entries" if invalidated else "none"
    return invalidated


def _reset_all(dynamo: Any) -> int:
    global _last_method
    reset = getattr(dynamo, "reset", None)
    if callable(reset):
        reset()
    _last_method = "global_reset"
    return -1


def last_invalidation() -> str:
    """How the last :func:`forget_compiled_code` invalidated code: ``"none"`` (Dynamo not
    loaded, or no entry to invalidate), ``"cache_entries"`` (per entry), ``"reset_code"``
    (per code object) or ``"global_reset"`` (every model's compiled code)."""
    return _last_method
