"""Hook parking: submodule hooks (and the root's post-hook) taken out of their modules
while no forward needs them, and put back when one does.

In a forward that is not sampled every submodule hook would return at once, but
PyTorch's dispatch to it alone costs 1 to 2 us per module call; a module without hooks
takes ``nn.Module``'s hook-free fast path instead. :class:`HookParking` removes our hook
from each module's ``_forward_hooks`` (only where it is that module's only forward hook,
so hook order is unchanged) and puts it back in front of any hook registered meanwhile.
The forward context (``_context.py``) decides when. See ``docs/architecture.md``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from .capture import compiled_frames
from .compiled import hooks_guarded

if TYPE_CHECKING:
    from ._error_log import ErrorLog
    from .capture import ForwardHook, RootPostHook

__all__ = ["COMPILE_IN_USE", "HookParking", "find_caller_depth", "root_calls_on_stack"]

#: ``HookParking.status`` once ``torch.compile`` compiled anything in the process while
#: compiled code does not guard on the observed modules' hooks (see ``HookParking.park``).
COMPILE_IN_USE = "off: torch.compile in use"

#: Code of nn.Module._call_impl, whose frames show which module calls are running.
CALL_IMPL_CODE = getattr(getattr(nn.Module, "_call_impl", None), "__code__", None)
#: Code of nn.Module._wrapped_call_impl (torch >= 2.2), which calls _call_impl.
_WRAPPED_CALL_IMPL_CODE = getattr(getattr(nn.Module, "_wrapped_call_impl", None), "__code__", None)
_getframe = sys._getframe

#: (hooks dict, with-kwargs flags dict, handle id, hook) of one submodule hook.
_Slot = tuple[dict[int, Any], dict[int, bool], int, "ForwardHook"]


class HookParking:
    """The parked and parkable hooks of one observer.

    Args:
        root: returns the observed root module, or None once it was collected.
        errors: where an error invalidating compiled code is counted.
        status: ``"on"``, or ``"off: <reason>"`` when parking is never to be tried.
    """

    def __init__(self, root: Callable[[], nn.Module | None], errors: ErrorLog, status: str) -> None:
        self._root = root
        self._errors = errors
        #: ``"on"``, or ``"off: <reason>"`` (shown as ``run.hook_parking``).
        self.status = status
        #: Every submodule hook of ours, and those of them parked now.
        self.parkable: list[_Slot] = []
        self.parked: list[_Slot] = []
        #: ``compiled_frames()`` when the hooks were parked (0: nothing compiled).
        self.frames_at_park = 0
        #: The root's post-hook: (hooks dict, always-called dict, handle id, hook), or
        #: None where it cannot be parked (torch without ``always_call``).
        self.root_post: tuple[dict[int, Any], dict[int, bool], int, RootPostHook] | None = None
        self.root_post_parked = False
        #: To tell a root that calls itself: the code of its forward, and how many frames
        #: up from the root hooks the caller of the root is (0 until known).
        self.root_forward_code: object = None
        self.caller_depth = 0
        #: Why the root's post-hook is never parked, or "" while it may be.
        self.root_post_off = ""

    def park(self, *, reentrant_pending: bool) -> None:
        """Take the submodule hooks out (nothing while ``reentrant_pending``: a sampled
        forward's reentrant checkpoints will run again in backward).

        The hooks stay out across unsampled, eval and no-grad root forwards, and
        :meth:`restore` puts them back when a root forward that needs them opens
        (sampled, full sentinel, recomputation in backward) and at removal, so parking
        costs one pass over the modules per sample, not per forward. While parked,
        calls of submodules outside any root forward are not seen (they are only ever
        counted, under ``calls_outside_root_skipped``).

        Under ``torch.compile`` parking goes on while compiled code guards on the observed
        modules' hook dictionaries (:func:`~torchinstruments.compiled.hooks_guarded`, set
        up when Dynamo loads): the compiled frame then has two cache entries, one traced
        with our hooks in place (sampled forwards, whose reductions are traced into the
        graph) and one traced with them parked (an empty hook dictionary is a guard of its
        own), each compiled once, so parking and restoring never recompile. Where those
        guards are missing (a torch whose Dynamo lacks the guard that
        :func:`~torchinstruments.compiled.guard_on_hooks` scopes, with the user's
        ``skip_nnmodule_hook_guards`` set back to True), compiled code would not see the
        hooks come and go: parking stops for good once
        ``torch.compile`` has compiled anything in the process, and if something was
        compiled during a parked forward, that code of this model is invalidated
        (:func:`~torchinstruments.compiled.forget_compiled_code`, in :meth:`restore`) so
        that it is traced again with the hooks in place.
        """
        frames = compiled_frames()
        if frames != 0 and not hooks_guarded():
            self.status = COMPILE_IN_USE
            return
        if reentrant_pending:
            return
        self.frames_at_park = frames
        # Only where ours is the module's only forward hook (order stays as it was).
        parked = [entry for entry in self.parkable if len(entry[0]) == 1 and entry[2] in entry[0]]
        for hooks, flags, key, _ in parked:
            del hooks[key]
            # Its with-kwargs flag too: a parked module's hook dictionaries are then as
            # a module's without hooks, and so are the guards compiled code keeps on them.
            flags.pop(key, None)
        self.parked = parked

    def add(self, module: nn.Module, key: int, hook: ForwardHook) -> None:
        """Make ``hook``, registered on ``module`` with handle id ``key`` and
        ``with_kwargs=True``, parkable."""
        self.parkable.append((module._forward_hooks, module._forward_hooks_with_kwargs, key, hook))

    def shown_status(self) -> str:
        """:attr:`status` as the report shows it (``run.hook_parking``): where
        :meth:`park` would stop at its next try, already ``COMPILE_IN_USE``."""
        if self.status == "on" and compiled_frames() != 0 and not hooks_guarded():
            return COMPILE_IN_USE
        return self.status

    def compiled_while_parked(self) -> None:
        """Something was compiled since the hooks were parked (``compiled_frames()``
        moved). Where compiled code guards on hooks, that code runs only while they are
        out, and they stay out; otherwise they are put back and this model's compiled code
        is invalidated (see :meth:`park`)."""
        if hooks_guarded():
            self.frames_at_park = compiled_frames()
            return
        self.restore(reset=True)

    def restore(self, *, reset: bool) -> None:
        """Put parked hooks back; with ``reset``, also invalidate this model's compiled
        code if something was compiled since they were parked while compiled code does
        not guard on hooks (see :meth:`park`)."""
        parked = self.parked
        if not parked:
            return
        self.parked = []
        for hooks, flags, key, hook in parked:
            flags[key] = True
            if hooks:
                # A hook registered while ours was parked: ours goes back in front.
                others = list(hooks.items())
                hooks.clear()
                hooks[key] = hook
                hooks.update(others)
            else:
                hooks[key] = hook
        if compiled_frames() != self.frames_at_park and not hooks_guarded():
            self.status = COMPILE_IN_USE
            root = self._root()
            if reset and root is not None:
                # Code compiled while the hooks were parked would never call them.
                try:
                    from .compiled import forget_compiled_code

                    forget_compiled_code(root.modules())
                except Exception as error:
                    self._errors.record("compile_reset", "", error)

    def park_root_post(self) -> bool:
        """Take the root's post-hook out for an unsampled forward that needs no close
        (see ``ForwardContext.close_open_ended``), from the root hooks; False if it must
        stay: it is not the root's only forward hook, a submodule hook of ours is not
        parked (it would see the state between forwards), the root has been seen calling
        itself (:attr:`root_post_off`), or where its caller sits on the stack is unknown.

        Where the submodule hooks stay in place under ``torch.compile`` (:attr:`status`
        ``COMPILE_IN_USE``, see :meth:`park`) the post-hook is taken out all the same:
        the root's hooks run outside the compiled frame, so no guard reads them, and a
        submodule hook called eagerly between forwards returns on the SKIP state the
        open-ended forward leaves (as it would not be called at all while parked)."""
        slot = self.root_post
        if (
            slot is None
            or self.root_post_off
            or (self.status != COMPILE_IN_USE and len(self.parked) != len(self.parkable))
        ):
            return False
        hooks, always, key, _ = slot
        if len(hooks) != 1 or key not in hooks:
            return False
        if not self.caller_depth:
            root = self._root()
            if root is None:
                return False
            # From the caller's frame: ForwardContext.enter_root or leave_root, which a
            # root hook calls (the depth is counted from there).
            self.caller_depth = find_caller_depth(root, _getframe(1))
            if not self.caller_depth or self.root_forward_code is None:
                self.root_post_off = "caller of the root not found"
                return False
        del hooks[key]
        always.pop(key, None)  # so that a copy taken meanwhile carries no stale entry
        self.root_post_parked = True
        return True

    def restore_root_post(self) -> None:
        """Put the root's post-hook back (in front of any hook registered meanwhile)."""
        slot = self.root_post
        if not self.root_post_parked or slot is None:
            return
        self.root_post_parked = False
        hooks, always, key, hook = slot
        always[key] = True
        if not hooks:
            hooks[key] = hook
            return
        others = list(hooks.items())
        hooks.clear()
        hooks[key] = hook
        hooks.update(others)


def root_calls_on_stack(root: nn.Module, frame: Any) -> int:
    """How many calls of ``root`` run on the stack from ``frame`` up (its ``_call_impl``
    frames)."""
    calls = 0
    while frame is not None:
        if frame.f_code is CALL_IMPL_CODE and frame.f_locals.get("self") is root:
            calls += 1
        frame = frame.f_back
    return calls


def find_caller_depth(root: nn.Module, frame: Any) -> int:
    """How many frames up from ``frame`` (the root hook's callee's) the code that called
    ``root`` runs, past ``nn.Module``'s call machinery; 0 if the root's ``_call_impl``
    frame is not found."""
    depth = 0
    while frame is not None:
        if frame.f_code is CALL_IMPL_CODE and frame.f_locals.get("self") is root:
            frame = frame.f_back
            depth += 1
            if frame is not None and frame.f_code is _WRAPPED_CALL_IMPL_CODE:
                depth += 1
            return depth
        frame = frame.f_back
        depth += 1
    return 0
