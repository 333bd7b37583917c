"""``torch.compile`` support: compiled code that sees the observer's hooks come and go,
for observed models only, without ``torch._dynamo.reset()``.

Dynamo caches compiled code on the code objects it compiled (a model's ``forward``, a
compiled block's ``forward``, and the resume functions it generates after graph
breaks), each entry with guards that say when it may run. By default
(``torch._dynamo.config.skip_nnmodule_hook_guards = True``) those guards ignore empty
module hook dictionaries, so hooks added after a model was compiled would go unseen: the
model would keep running code compiled without them. Observers add and remove hooks all
the time (hook parking, ``_parking.py``), so their models' compiled code must guard on
them, and other models' code should not pay for it.

* :func:`guard_on_hooks` makes Dynamo keep the guard on an empty ``_forward_hooks``
  dictionary (one dictionary-length check) where it belongs to a module of an observed
  model (:func:`note_observed`), or to any module traced in compiled code that another
  call could run with an observed model (the compiled frame's outermost module, its
  ``self`` or the module a compiled function or Dynamo's wrapper takes, is of the class
  of an observed module: another instance of that class, an EMA copy or a teacher,
  shares the code object and its cache entries), and on the empty ``_forward_pre_hooks``
  of instances of an observed root's class (where the root pre-hook goes). Every other
  module's empty hook dictionaries stay unguarded, as Dynamo's default leaves them. It
  does so by wrapping Dynamo's ``GuardBuilder.EMPTY_NN_MODULE_HOOKS_DICT`` (the guard
  that ``skip_nnmodule_hook_guards`` switches); where that guard or Dynamo's inlining of
  built-in modules (``inline_inbuilt_nn_modules``) is missing, it falls back to
  ``skip_nnmodule_hook_guards = False`` for the whole process (every compiled model then
  guards on its six hook dictionaries per module). A non-empty hook dictionary is always
  guarded by Dynamo (its length), whatever the setting.
* :func:`forget_compiled_code` invalidates the cache entries compiled without hook
  guards (before the model was observed) that may run the observed model: on the code
  objects of its modules, and, at injection, on any other code whose guards check its
  class or identity (a compiled step function, a model holding it). It uses Dynamo's
  own per-entry invalidation, the one it applies when an object its guards refer to is
  freed. Models of other classes keep all of their compiled code.

Where the per-entry invalidation is not available (a torch whose Dynamo lacks it), the
code objects' caches are reset (``reset_code``), and failing that the whole of Dynamo
(``torch._dynamo.reset()``); :func:`last_invalidation` says which was used.
"""

from __future__ import annotations

import functools
import re
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

__all__ = [
    "forget_code_with_hooks",
    "forget_compiled_code",
    "guard_on_hooks",
    "hooks_guarded",
    "last_invalidation",
    "note_observed",
]

#: The Dynamo setting that :func:`guard_on_hooks` turns off where it cannot scope the
#: hook guards to observed models.
HOOK_GUARD_FLAG = "skip_nnmodule_hook_guards"

#: The Dynamo guard method that :func:`guard_on_hooks` wraps.
EMPTY_HOOKS_GUARD = "EMPTY_NN_MODULE_HOOKS_DICT"

#: Marks our wrapper of :data:`EMPTY_HOOKS_GUARD` (its value: the wrapped method).
_WRAPPED_MARK = "_torchinstruments_wrapped"

#: Every module of every model observed in this process (while it lives), the
#: ``forward`` codes and the classes of those modules, and the classes of the observed
#: roots: whose empty hook dictionaries stay guarded (see :func:`guard_on_hooks`).
_observed_modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_observed_codes: set[types.CodeType] = set()
_observed_types: weakref.WeakSet[type] = weakref.WeakSet()
_observed_root_types: weakref.WeakSet[type] = weakref.WeakSet()
#: ``id`` of the class of the observers' forward hooks (:func:`note_observed`).
_observer_hook_types: set[int] = set()
#: Whether the last :func:`guard_on_hooks` scoped the hook guards to observed models.
_scoped = False

#: Deepest chain of decorators followed from a ``forward`` (see :func:`_module_codes`).
_MAX_WRAPPERS = 16
#: Longest chain of guard sources followed to the outermost module (see :func:`_top_module`).
_MAX_SOURCE_DEPTH = 64

#: How the last call of :func:`forget_compiled_code` invalidated compiled code.
_last_method = "none"


def _dynamo() -> Any:
    return sys.modules.get("torch._dynamo")


def note_observed(root: nn.Module, hook_type: type) -> None:
    """Record ``root`` and its modules as observed, so that code Dynamo compiles from
    now on (this process, while they live) guards on their hook dictionaries (see
    :func:`guard_on_hooks`); ``hook_type`` is the class of the observer's forward hooks
    (a cache entry whose guards check it in a module's forward hooks was compiled with
    them in place, see :func:`forget_compiled_code`). Cheap; does not import Dynamo."""
    _observer_hook_types.add(id(hook_type))
    modules = list(root.modules())
    _observed_modules.update(modules)
    _observed_codes.update(_module_codes(modules))
    _observed_types.update(type(module) for module in modules)
    _observed_root_types.add(type(root))


def guard_on_hooks() -> bool:
    """Make code that Dynamo compiles from now on guard on the hook dictionaries of
    observed models (:func:`note_observed`).

    Wraps ``torch._dynamo.guards.GuardBuilder.EMPTY_NN_MODULE_HOOKS_DICT``, once: where
    ``skip_nnmodule_hook_guards`` is True (Dynamo's default) the wrapper still guards an
    empty hook dictionary (its length, the check Dynamo makes with the setting False)
    where our hooks come and go or tell models apart. That is the ``_forward_hooks`` of
    an observed module; of any module inside a module of an observed root's class (a
    model holding another instance of it: :func:`_inside_observed_root_class`); of any
    module whose guard source starts at a module of an
    observed module's class (:func:`_top_module`: the frame's ``self``, or the module a
    compiled function or Dynamo's wrapper of a ``torch.nn`` module takes, which another
    call of the same code may pass an observed model as); and of any module traced in a
    frame whose code is an observed module class's ``forward`` (or its decorators'
    wrappers, or a resume function Dynamo made from them). And the
    ``_forward_pre_hooks`` of a module of an observed root's class: the root pre-hook is
    never parked, so this tells an observed root from another instance of its class.
    Every other guard is left to Dynamo. Where the wrapper cannot be installed, or
    Dynamo does not inline built-in modules (where the guards of a module traced whole
    are filtered before that method runs), sets ``skip_nnmodule_hook_guards`` to False,
    a process-wide setting (Dynamo documents True as unsafe when hooks are added or
    removed after compiling). Code compiled before keeps its guards. Does nothing, and
    does not import Dynamo, when Dynamo is not loaded.

    Returns:
        True if Dynamo is loaded and compiled code guards on observed models' hooks now.
    """
    config = _dynamo_config()
    if config is None or not hasattr(config, HOOK_GUARD_FLAG):
        return False
    global _scoped
    _scoped = _wrap_empty_hooks_guard() and _inlines_builtin_modules(config)
    if _scoped:
        return True
    try:
        setattr(config, HOOK_GUARD_FLAG, False)
    except Exception:
        return False
    return True


def hooks_guarded() -> bool:
    """True if Dynamo is loaded and code it compiles guards on the hook dictionaries of
    observed models: ``skip_nnmodule_hook_guards`` is False, or :func:`guard_on_hooks`'s
    wrapper is in place and Dynamo inlines built-in modules (as of the last
    :func:`guard_on_hooks`)."""
    config = _dynamo_config()
    try:
        if config is None:
            return False
        if getattr(config, HOOK_GUARD_FLAG) is False:
            return True
        guards = sys.modules.get("torch._dynamo.guards")
        builder = getattr(guards, "GuardBuilder", None)
        method = getattr(builder, EMPTY_HOOKS_GUARD, None)
        return _scoped and getattr(method, _WRAPPED_MARK, None) is not None
    except Exception:
        return False


def _inlines_builtin_modules(config: Any) -> bool:
    """Dynamo's ``inline_inbuilt_nn_modules`` (read once per injection or removal: the
    torch versions where it is always True warn when it is read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bool(getattr(config, "inline_inbuilt_nn_modules", False))


def _dynamo_config() -> Any:
    dynamo = _dynamo()
    return getattr(dynamo, "config", None) if dynamo is not None else None


def _wrap_empty_hooks_guard() -> bool:
    """Wrap ``GuardBuilder.EMPTY_NN_MODULE_HOOKS_DICT`` (see :func:`guard_on_hooks`);
    True if the wrapper is in place."""
    try:
        from torch._dynamo.guards import GuardBuilder
    except Exception:
        return False
    original = GuardBuilder.__dict__.get(EMPTY_HOOKS_GUARD)
    if getattr(original, _WRAPPED_MARK, None) is not None:
        return True
    if not callable(original) or not callable(getattr(GuardBuilder, "SEQUENCE_LENGTH", None)):
        return False
    config = _dynamo_config()

    @functools.wraps(original)  # keeps the name and the guard_check_spec Dynamo reads
    def empty_hooks_dict(builder: Any, guard: Any) -> None:
        if getattr(config, HOOK_GUARD_FLAG, True) and _keeps_hook_guard(builder, guard):
            builder.SEQUENCE_LENGTH(guard)  # what the guard does with the setting False
            return
        original(builder, guard)

    setattr(empty_hooks_dict, _WRAPPED_MARK, original)
    try:
        setattr(GuardBuilder, EMPTY_HOOKS_GUARD, empty_hooks_dict)
    except Exception:
        return False
    return True


def _keeps_hook_guard(builder: Any, guard: Any) -> bool:
    """Whether the guard on an empty hook dictionary stays (see :func:`guard_on_hooks`);
    True where that cannot be told (the safe side: one more guard)."""
    try:
        source = guard.originating_source
        member = getattr(source, "member", None)
        if member == "_forward_pre_hooks":  # our pre-hook goes on roots only
            return type(builder.get(source.base)) in _observed_root_types
        if member != "_forward_hooks":
            return False
        if builder.get(source.base) in _observed_modules:
            return True
        top = _top_module(builder, source.base)
        if top is None or type(top) in _observed_types:
            return True
        if _inside_observed_root_class(builder, source.base):
            return True
        code = getattr(builder, "f_code", None)
        return (
            code is None
            or code in _observed_codes
            or code in _with_resume_functions(set(_observed_codes))
        )
    except Exception:
        return True


def _top_module(builder: Any, source: Any) -> nn.Module | None:
    """The outermost module on ``source``'s chain of bases (the frame's ``self``, or the
    module a compiled function or Dynamo's wrapper takes): what another call of the
    same compiled code may pass in its place."""
    chain = []
    while source is not None and len(chain) < _MAX_SOURCE_DEPTH:
        chain.append(source)
        source = getattr(source, "base", None)
    for outer in reversed(chain):
        try:
            value = builder.get(outer)
        except Exception:
            continue
        if isinstance(value, nn.Module):
            return value
    return None


def _inside_observed_root_class(builder: Any, source: Any) -> bool:
    """Whether a module on ``source``'s chain of bases (``source`` included) is of an
    observed root's class: a model holding another instance of it (a teacher, an EMA
    copy, the same class observed later) runs that class's submodules inline, and
    without hook guards each injection would invalidate (and recompile) its code."""
    depth = 0
    while source is not None and depth < _MAX_SOURCE_DEPTH:
        try:
            value = builder.get(source)
        except Exception:
            value = None
        if isinstance(value, nn.Module) and type(value) in _observed_root_types:
            return True
        source = getattr(source, "base", None)
        depth += 1
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


def forget_compiled_code(modules: Iterable[nn.Module], *, root: nn.Module | None = None) -> int:
    """Invalidate compiled code that could run ``modules`` without seeing hook changes.

    Turns hook guards on (:func:`guard_on_hooks`), then invalidates each cache entry on
    the ``forward`` code objects of ``modules`` (and their resume functions) that calls
    submodules and whose guards neither require a module's forward hooks to be empty nor
    check an observer's forward hook in one (compiled as if hooks never change; a guard
    on a user's non-empty hook dictionary does not count). With ``root``
    (at injection), also each such entry on any other code Dynamo compiled (a
    training-step function, a wrapper model, Dynamo's own wrapper frame of a ``torch.nn``
    module) whose guards say it may run the observed model: they check a type against
    ``root``'s class at any depth, against the class of one of ``modules`` on a frame's
    local or global itself or an item of it (the module a compiled function takes, alone
    or in a list), or an object's identity against one of ``modules``, and check a
    submodule of that object (it ran the model inline). Other entries,
    and entries that guard on hooks (their guards see the change), keep their compiled
    code. Does nothing, and does not import Dynamo, when Dynamo is not loaded.

    Args:
        modules: the modules whose hooks changed (every module of the observed model).
        root: the observed model, at injection; None at removal, where code compiled
            without hook guards was traced without our hooks and stays right.

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
    modules = list(modules)
    codes = _with_resume_functions(_module_codes(modules))
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    except Exception:
        return _reset_all(dynamo)
    # Each code with what else an entry of it must show to be invalidated.
    candidates: list[tuple[types.CodeType, Callable[[str], bool]]]
    candidates = [(code, _runs_submodules) for code in codes]
    if root is not None:
        may_run_observed = _Identities(root, modules).may_run_observed
        candidates += [(code, may_run_observed) for code in _compiled_codes() if code not in codes]
    invalidated = 0
    reset_codes = 0
    for code, also_required in candidates:
        try:
            entries = _debug_get_cache_entry_list(code)
        except Exception:
            continue
        stale = []
        for entry in entries:
            text = _guard_text(entry.guard_manager)
            if _guards_on_hooks(text):
                continue
            if also_required(text):
                stale.append(entry)
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


def forget_code_with_hooks(hook_ids: Iterable[int]) -> int:
    """At removal: reset Dynamo's caches of the code objects that hold an entry compiled
    with one of the hooks of ``hook_ids`` (handle ids) traced in place: its guards
    require a module's ``_forward_hooks_always_called`` (or another hook dictionary) to
    contain that id. Such code traced a root's hooks inline (a compiled function that
    calls the model, a model compiled whole that holds the observed one); the hooks are
    gone, so the entry never runs again, yet it counts towards Dynamo's
    ``recompile_limit`` on its code, and each injection (new handle ids) adds one: after
    eight, ``fullgraph=True`` code would fail. The code compiles again at its next call.
    Uses ``torch._C._dynamo.eval_frame.reset_code``; does nothing without it, or without
    Dynamo loaded.

    Returns:
        The number of code objects reset.
    """
    dynamo = _dynamo()
    ids = set(hook_ids)
    if dynamo is None or not ids:
        return 0
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list, reset_code
    except Exception:
        return 0
    reset = 0
    for code in _compiled_codes():
        try:
            entries = _debug_get_cache_entry_list(code)
        except Exception:
            continue
        if any(_requires_hook(_guard_text(entry.guard_manager), ids) for entry in entries):
            try:
                reset_code(code)
            except Exception:
                continue
            reset += 1
    return reset


#: A guard that a hook dictionary contain a handle id (not its negation): Dynamo writes
#: it where traced code looked the hook up (``_forward_hooks_always_called``).
_HOOK_KEY = re.compile(r"(?<!not )___dict_contains\((\d+), [^)]*\._forward\w*hooks\w*\)")


def _requires_hook(text: str, ids: set[int]) -> bool:
    """Whether guard text ``text`` requires a hook dictionary to contain one of ``ids``."""
    return any(int(number) in ids for number in _HOOK_KEY.findall(text))


#: Dynamo's type and identity guards as their text shows them: (source, id).
_TYPE_CHECK = re.compile(r"___check_type_id\((.+?), (\d+)\)")
_IDENTITY_CHECK = re.compile(r"___check_obj_id\((.+?), (\d+)\)")
#: A frame's local or global itself, or items of it, no attribute (``L['model']``,
#: ``L['blocks'][0]``, ``L['args'][0]``): what a compiled function takes.
_FRAME_VARIABLE = re.compile(r"[LG]\[(?:'[^']*'|\"[^\"]*\")\](?:\[[^\[\]]+\])*")
#: A guard that a module's forward hooks be empty: Dynamo writes it only where hook
#: guards are on for that module (the user's setting, or :func:`guard_on_hooks`); an
#: entry without any was compiled as if hooks never change (a guard on the length of a
#: user's non-empty hook dictionary is not one).
_EMPTY_FORWARD_HOOKS = re.compile(r"\bnot \S+\._forward_hooks\b(?!_)")
#: An item of a module's forward hooks.
_HOOK_ITEM = re.compile(r"\._forward_hooks\[")


def _guards_on_hooks(text: str) -> bool:
    """Whether a cache entry with guard text ``text`` sees hooks added or removed: it
    requires some module's forward hooks to be empty (compiled with hook guards on,
    before injection or in an unsampled forward, whose hooks are parked), or it checks
    the type of an observer's hook in a module's forward hooks (compiled with them in
    place: Dynamo guards every hook dictionary it inlined). A guard on a user's own hook
    is neither: an entry compiled with hook guards off checks the dictionaries that held
    hooks then, and no others."""
    if _EMPTY_FORWARD_HOOKS.search(text):
        return True
    return any(
        int(number) in _observer_hook_types and _HOOK_ITEM.search(source)
        for source, number in _TYPE_CHECK.findall(text)
    )


class _Identities:
    """What tells, from a cache entry's guard text, that it may run an observed model
    (see :func:`forget_compiled_code`)."""

    def __init__(self, root: nn.Module, modules: list[nn.Module]) -> None:
        self.root_type = id(type(root))
        self.types = {id(type(module)) for module in modules}
        self.modules = {id(module) for module in modules}

    def may_run_observed(self, text: str) -> bool:
        for source, number in _TYPE_CHECK.findall(text):
            type_id = int(number)
            source = source.strip()
            if (
                type_id == self.root_type
                or (type_id in self.types and _FRAME_VARIABLE.fullmatch(source))
            ) and _reaches_into(text, source):
                return True
        return any(
            int(number) in self.modules and _reaches_into(text, source.strip())
            for source, number in _IDENTITY_CHECK.findall(text)
        )


def _reaches_into(text: str, source: str) -> bool:
    """Whether guards of ``text`` check a submodule of the module at ``source``: code
    that ran the module's forward inline does (each submodule it calls is looked up in
    ``_modules``); an entry that does not stopped before calling it (a compiled function
    that meets the observed root's pre-hook, a graph break, and calls the model in a
    resume function; a decorator's frame around ``forward`` that breaks before calling
    it), and runs no hook of ours."""
    return f"{source}._modules[" in text


def _runs_submodules(text: str) -> bool:
    """Whether an entry on a module's ``forward`` (or a resume function of it) with
    guard text ``text`` calls submodules, whose hooks it would then run or skip: it
    checks some module's ``_modules`` item (see :func:`_reaches_into`). A module's own
    hooks run outside its ``forward`` frame, in its ``_call_impl``."""
    return "._modules[" in text


def _compiled_codes() -> list[types.CodeType]:
    """Every code object Dynamo met in this process (most without cache entries)."""
    try:
        from torch._dynamo.convert_frame import input_codes

        seen = list(input_codes.seen)
    except Exception:
        return []
    codes = []
    for reference in seen:
        code = reference() if callable(reference) else None
        if isinstance(code, types.CodeType):
            codes.append(code)
    return codes


def _guard_text(guard_manager: object) -> str:
    try:
        return str(guard_manager)
    except Exception:
        return ""


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
