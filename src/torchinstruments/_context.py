"""The forward context: the root-forward state machine that the hooks call.

    RootPreHook  -> ForwardContext.enter_root   decide once: sampled, sentinel, skipped
    ForwardHook  -> context.state is SKIP ?     return at once (the unsampled fast path)
                 -> ForwardContext.on_forward   -> CallCapture (``_calls.py``)
    GradHook     -> ForwardContext.on_grad      -> CallCapture
    RootPostHook -> ForwardContext.leave_root   observe the root output, close

Its whole state is declared in :class:`~._state.ForwardState` (``_state.py``): the
:class:`~._state.Phase` in ``state`` and the fields that decide what the next forward
does; the context adds only its settings and collaborators. It also decides
when a flush or a report write falls due (one check per forward) and asks the observer
to do it; that cadence, sample opening and the sentinel's hits are methods of its base
class, ``_context_cadence._ContextCadence``, on the same object. See
``docs/architecture.md``.
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ._attention import begin_sample as begin_attention_sample
from ._attention import end_sample as end_attention_sample
from ._context_cadence import (
    DEVICE_FLUSH_INTERVAL_FORWARDS,
    MAX_SAMPLES_AWAITING_BACKWARD,
    _ContextCadence,
)
from ._parking import COMPILE_IN_USE, root_calls_on_stack
from ._sentinel import ROOT_SENTINEL_INTERVAL, next_root_sentinel, root_sentinel_due
from ._state import IDLE, RECOMPUTE, SAMPLED, SENTINEL, SKIP
from .capture import _graph_task_id, compiled_frames, in_backward

if TYPE_CHECKING:
    from ._calls import CallCapture
    from ._compiled_capture import CompiledCapture
    from ._error_log import ErrorLog
    from ._parking import HookParking
    from ._sentinel import Sentinel
    from ._staging import StatisticsBuffer
    from ._store import SeriesStore
    from .observer import Observer
    from .sampling import SampleForwards, SamplingPolicy

__all__ = [
    "DEVICE_FLUSH_INTERVAL_FORWARDS",
    "MAX_SAMPLES_AWAITING_BACKWARD",
    "ForwardContext",
]

#: torch.jit.is_tracing without its Python wrapper (called once per root forward).
_is_tracing = getattr(torch._C, "_is_tracing", torch.jit.is_tracing)
#: Grad-mode and inference-mode checks, bound once (called once per root forward).
_grad_enabled = torch.is_grad_enabled
_monotonic = time.monotonic
_inference_mode_enabled = torch.is_inference_mode_enabled
_getframe = sys._getframe
#: The innermost torch.func transform being run (None outside any): a root forward run
#: inside one (per-sample gradients through ``vmap(grad(...))``) has only wrapped
#: tensors, which cannot be measured, so it is skipped like an eval forward.
transform_level: Callable[[], object] = getattr(
    getattr(torch._C, "_functorch", None), "peek_interpreter_stack", lambda: None
)


class ForwardContext(_ContextCadence):
    """Where one observer stands in the training loop; the object its hooks call.

    Shared across threads on purpose: worker threads inside a root forward belong to
    that forward. Built by the :class:`~torchinstruments.observer.Observer`, which it
    refers to weakly (to flush, write and adopt parents when those fall due).
    """

    #: Forwards sampled after a sentinel saw a non-finite value, to localise a recurrence.
    FORCED_SAMPLES_AFTER_NONFINITE = 8
    #: One training forward in this many has its root output checked when it is not
    #: sampled (see ``_sentinel.ROOT_SENTINEL_INTERVAL``, where the schedule is).
    ROOT_SENTINEL_INTERVAL = ROOT_SENTINEL_INTERVAL
    #: Pending statistics are flushed (reduced in batches, moved to the host, tracked)
    #: at training forwards whose count is a multiple of this (of
    #: ``DEVICE_FLUSH_INTERVAL_FORWARDS`` while CUDA work is pending): fewer, larger
    #: flushes cost less (benchmarks/README.md has the measurements). The staged copies
    #: waiting meanwhile are bounded (16 MiB).
    FLUSH_INTERVAL_FORWARDS = 128

    def __init__(
        self,
        *,
        owner: Observer,
        modules: list[weakref.ref[nn.Module]],
        policy: SamplingPolicy,
        warmup_samples: int,
        rewrite_interval_s: float,
        full_sentinel: bool,
        attention_logits: bool,
        capture_direct_forwards: bool,
        prompt_sinks: bool,
        sample_forwards: SampleForwards,
        buffer: StatisticsBuffer,
        store: SeriesStore,
        errors: ErrorLog,
        parking: HookParking,
        sentinel: Sentinel,
        capture: CallCapture,
        compiled: CompiledCapture | None,
    ) -> None:
        self._owner = weakref.ref(owner)
        #: Weak references to the observed modules, by index (the observer's list).
        self.modules = modules
        self.policy = policy
        self._next_sampled = _lookahead(policy)
        self._warmup_samples = warmup_samples
        self.full_sentinel = full_sentinel
        #: Measure F.scaled_dot_product_attention's logits in sampled forwards.
        self.attention_logits = attention_logits
        self.capture_direct_forwards = capture_direct_forwards
        #: A sink wants every sample by the start of the next training forward.
        self.prompt_sinks = prompt_sinks
        self.buffer = buffer
        self.store = store
        self.errors = errors
        self.parking = parking
        self.sentinel = sentinel
        self.capture = capture
        #: The capture inside torch.compile'd graphs (None with direct-forward wrappers).
        self.compiled = compiled
        #: How often the report is rewritten, in seconds.
        self.rewrite_interval_s = rewrite_interval_s
        #: The training forward of each sample (runs of arithmetic progressions).
        self.sample_forwards = sample_forwards
        super().__init__()

    # ------------------------------------------------------------------ entry points
    def on_forward(self, index: int, args: tuple[object, ...], output: object) -> None:
        """A selected module returned ``output`` (only called when not in SKIP state)."""
        self.capture.on_forward(self, index, args, output)

    def on_grad(self, key: tuple[int, int, str], sample: int, grad: Tensor) -> None:
        """An output gradient arrived for a sampled tensor."""
        self.capture.on_grad(self, key, sample, grad)

    def open_direct_entry(self, entry: int, module: nn.Module) -> None:
        """A ``torch.compile`` wrapper inside the model (``module``; ``entry`` a negative
        number of its own) is called with no root forward open: where direct calls are
        observed (see
        ``CallCapture._open_implicit``), open the direct-call sample now, before its
        compiled frame runs, or join the one open, so that a sampled call runs the
        graph variant that reduces its modules' outputs. Eagerly such a sample opens
        when the first module returns; inside a compiled frame no hook runs eagerly."""
        if self.state is not IDLE or self.direct_entry is not None or not self.attached:
            return  # inside a root forward (or between quiet ones), or another entry's call
        try:
            if not _training_context(module):
                return
            joined = self.direct_call(entry)
            if joined and self.sample_open and self.compiled is not None:
                self.compiled.resume_sample(self)
            if joined is not None and self.sample_open:
                self.direct_entry = entry
        except Exception as error:  # never break training
            self.errors.record("direct_call", "", error)

    def direct_call(self, opener: int) -> bool | None:
        """A training call of a module (``opener``: its index, or a ``torch.compile``
        wrapper's negative number) made with no root forward open. None where training
        goes through the root (counted under ``calls_outside_root_skipped``): such a
        call is a side computation unless ``capture_direct_forwards``. True where it
        joins the open direct-call sample (another opener's, whose backward has not
        started); False where it opens the next training forward of direct calls
        (counted under ``direct_call_forwards``; sampled as the policy says)."""
        if self.root_forward_seen and not self.capture_direct_forwards:
            self.calls_outside_root_skipped += 1
            return None
        if (
            self.implicit_opener is not None
            and not self.implicit_backward_seen
            and opener != self.implicit_opener
        ):
            return True
        self.implicit_opener = opener
        self.implicit_backward_seen = False
        self.direct_call_forwards += 1
        self.open_sample()
        self.maybe_flush()
        return False

    def close_direct_entry(self, entry: int, output: object) -> None:
        """The compile wrapper ``entry`` whose call :meth:`open_direct_entry` took into
        the open sample returned ``output``: its graphs stop reducing until another
        wrapper joins the sample (their rows are taken when the sample ends, see
        ``CompiledCapture.suspend_sample``), and the start of the sample's backward is
        watched for on ``output`` (no eager gradient hook tells it: the modules inside
        ran in the graph)."""
        self.direct_entry = None
        try:
            compiled = self.compiled
            sink = compiled.suspend_sample(self, output) if compiled is not None else None
            self.capture.watch_backward(self, self.sample, output, sink)
        except Exception as error:  # never break training
            self.errors.record("direct_call", "", error)

    def enter_root(self, module: nn.Module) -> None:
        """Open a root forward: decide once whether it is sampled."""
        index = self.forwards_seen
        parking = self.parking
        try:
            # Not asked here: whether torch.compile compiled something since the hooks
            # were parked. Code compiled in a quiet forward runs only in unsampled ones,
            # which need no hook, and the forward that ends the stretch (its post-hook, or
            # close_open_ended) asks and deals with it before any forward needs a hook.
            quiet = (
                (index < self._quiet_until or index == self._quiet_sentinel)
                and _training_context(module)
                and (  # not called by the root's own forward (see _nested_root_call)
                    (caller := _getframe(parking.caller_depth)).f_code
                    is not parking.root_forward_code
                    or _receiver(caller) is not module
                )
            )
        except ValueError:  # fewer frames than that: the root's caller is not Python code
            quiet = False
        if quiet:
            # A quiet forward: the previous training forward was left open-ended (see
            # close_open_ended) and this one is known, since then, to be unsampled and
            # to have no flush due. Closing the previous forward and opening this one
            # would leave every field as it is but the count.
            self.forwards_seen = index + 1
            if index == self._quiet_sentinel:
                # It has the root sentinel: the post-hook comes back to read the output,
                # and the forward is open on the stack as any other.
                self._quiet_until = 0
                self._quiet_sentinel = -1
                self._open_ended = False
                parking.restore_root_post()
                self._state_stack.append(IDLE)
                if _monotonic() - self.last_write >= self.rewrite_interval_s:
                    self._write()
            return
        self._quiet_until = 0
        self._quiet_sentinel = -1
        if self._open_ended:
            if self._nested_root_call(module):
                # The root's forward calls the root: part of the open-ended forward, as
                # in any other forward. Forwards are no longer left open-ended.
                parking.root_post_off = "root module calls itself"
                return
            self.close_open_ended()
        stack = self._state_stack
        stack.append(self.state)
        decision: bool | None = None
        if (
            (
                parking.status == COMPILE_IN_USE
                or (parking.parked and compiled_frames() == parking.frames_at_park)
            )
            and len(stack) == 1
            and not self._forced_samples
            and not self.full_sentinel
            and _training_context(module)
        ):
            # The steady state: a top-level training forward while the submodule hooks
            # are parked (or stay in place for good: torch.compile is in use, and each
            # returns inside the graph's unsampled variant). Unsampled, it only counts
            # the forward (no further calls): the state _open_training_forward leaves,
            # set here with fewer calls (this runs on nearly every forward, inside a
            # step whose kernels have evicted this code from the caches, where every
            # call costs).
            try:
                index = self.forwards_seen
                decision = bool(self.policy.should_sample(index))
                if not decision:
                    self.forwards_seen = index + 1
                    self._no_grad_training_forwards = 0
                    self._reset_forward_state()
                    self.sample_open = False
                    self._unsampled_training = True
                    self.state = SKIP
                    if root_sentinel_due(index, self.ROOT_SENTINEL_INTERVAL):
                        parking.restore_root_post()  # the sentinel reads the root output
                    elif parking.root_post_parked or parking.park_root_post():
                        stack.pop()
                        self._open_ended = True
                        self._plan_quiet_forwards()
                    buffer = self.buffer
                    if buffer.pending or buffer.staged or buffer.slab_records:
                        self.maybe_flush()
                    elif _monotonic() - self.last_write >= self.rewrite_interval_s:
                        self._write()
                    return
            except Exception as error:  # never break training (as open_sample would)
                self.forwards_seen = index + 1  # once, whether or not it was counted
                self._no_grad_training_forwards = 0
                self._reset_forward_state()
                self.state = SKIP
                self.errors.record("enter_root", "", error)
                return
        if parking.root_post_parked:
            parking.restore_root_post()
        if not self.attached:
            self.state = SKIP
            return
        if len(stack) > 1 and not self.capture_direct_forwards:
            self._drop_unclosed_forwards(module)
        try:
            parkable = self._open_root(module, decision)
            if parkable is None:
                return  # the root calling itself: the same forward
            if parking.parked:
                # Hooks stay parked across unsampled forwards; back for a forward that
                # needs them, or once torch.compile appears (between forwards, or
                # compiling this very call up to this hook).
                if not parkable or compiled_frames() != parking.frames_at_park:
                    parking.restore(reset=False)
            elif parkable and parking.status == "on":
                parking.park(reentrant_pending=any(self.no_grad_calls.values()))
        except Exception as error:  # never break training
            self.state = SKIP
            self.errors.record("enter_root", "", error)

    def _nested_root_call(self, module: nn.Module) -> bool:
        """From enter_root, with a forward left open-ended: True if this call of the root
        comes from inside the root's own forward. Its direct caller is checked (the
        root's ``forward`` on this instance); for a call that is not a training forward
        (a no_grad teacher pass, say) the whole stack is walked, which catches calls
        through helper methods too. A training forward that calls the root through a
        helper is only seen at a forward with the post-hook in place (see
        :meth:`close_open_ended`)."""
        parking = self.parking
        try:
            caller = _getframe(parking.caller_depth + 1)
        except ValueError:
            return False
        if caller.f_code is parking.root_forward_code and _receiver(caller) is module:
            return True
        if _training_context(module):
            return False
        return root_calls_on_stack(module, _getframe(1)) > 1

    def _plan_quiet_forwards(self) -> None:
        """Find the quiet forwards that follow the open-ended one just opened (see
        enter_root): up to the first that is sampled, checked by the root sentinel, or
        at which :meth:`maybe_flush` would flush pending statistics. That one is quiet
        too if it needs only the root sentinel. Nothing is quiet unless the policy can
        tell its next sampled forward (``next_sampled``)."""
        if self._next_sampled is None or self._forced_samples:
            return
        start = self.forwards_seen
        sentinel = next_root_sentinel(start, self.ROOT_SENTINEL_INTERVAL)
        every = (
            DEVICE_FLUSH_INTERVAL_FORWARDS
            if self.buffer.producer_streams
            else self.FLUSH_INTERVAL_FORWARDS
        )
        flush = (start + every) // every * every - 1  # forwards_seen a multiple of every
        try:
            sampled = int(self._next_sampled(start))
        except Exception as error:  # a user policy's: ask it about every forward instead
            self._next_sampled = None
            self.errors.record("next_sampled", "", error)
            return
        until = min(sampled, sentinel, flush)
        self._quiet_until = until
        self._quiet_sentinel = until if until == sentinel < min(sampled, flush) else -1

    def close_open_ended(self) -> None:
        """Close the unsampled root forward that was left open with its post-hook parked.

        In the steady state most root forwards are unsampled and need nothing at their
        end (no root sentinel, no records); the root's post-hook is then parked too, so
        that the forward costs one hook call rather than two, and the forward is closed
        here, when the next root forward opens (or at removal). The state in between is
        SKIP rather than IDLE; no forward is left open-ended while a hook of ours that
        could see that state is in place. A root that calls itself (seen by
        :meth:`_nested_root_call`, by :meth:`_open_root` or by a post-hook that finds no
        open forward) turns this off for good, since its inner call would close the outer.
        """
        self._open_ended = False
        self.state = IDLE
        self._unsampled_training = False
        parking = self.parking
        if parking.parked and compiled_frames() != parking.frames_at_park:
            parking.compiled_while_parked()  # something was compiled during that forward

    def _drop_unclosed_forwards(self, module: nn.Module) -> None:
        """Forget root forwards that never closed (a KeyboardInterrupt skips even the
        always-called post-hook): keep only as many open forwards as calls of the root
        on this thread's stack. The root calling itself is the one legitimate nesting."""
        open_calls = root_calls_on_stack(module, sys._getframe(1))
        stack = self._state_stack
        if open_calls == 0 or open_calls >= len(stack):
            return  # cannot tell (compiled frames), or nothing was left open
        end_attention_sample(self)  # the sampled forward left open is over
        del stack[: len(stack) - open_calls]
        stack[0] = IDLE
        self._unsampled_training = False

    def _open_root(self, module: nn.Module, decision: bool | None) -> bool | None:
        """Set the state for a root forward: True if its submodule hooks may be parked,
        False if it needs them, None if it continues the open forward (recursion).
        ``decision`` is the sampling policy's answer if it was already asked for this
        forward (it is asked once per training forward)."""
        if in_backward():
            if self._no_grad_training_forwards and module.training and torch.is_grad_enabled():
                # A reentrant checkpoint of the root: its first pass ran without
                # grad; this recomputation is the forward that gradients flow through.
                self._no_grad_training_forwards -= 1
                self.eval_forwards_skipped -= 1
                self._open_training_forward()
                self.sample_in_backward = True
                return False
            self.state = RECOMPUTE
            self.recompute_calls_ignored += 1
            return False
        if len(self._state_stack) > 1 and self._state_stack[-1] in (SAMPLED, SKIP, SENTINEL):
            self.parking.root_post_off = "root module calls itself"
            return None  # the root calling itself: same forward
        if _is_tracing():
            self.state = SKIP
            self.eval_forwards_skipped += 1
            return False  # a trace must record the module calls as they are
        if (
            torch.is_inference_mode_enabled()
            or not module.training
            or transform_level() is not None
        ):
            self.state = SKIP
            self.eval_forwards_skipped += 1
            return True
        if not torch.is_grad_enabled():
            # Evaluation in train mode, or the first pass of a reentrant checkpoint.
            self.state = SKIP
            self.eval_forwards_skipped += 1
            self._no_grad_training_forwards = min(self._no_grad_training_forwards + 1, 64)
            return True
        self._no_grad_training_forwards = 0
        self._open_training_forward(decision)
        return self.state is SKIP

    def _reset_forward_state(self) -> None:
        """Note a training root forward and reset what a root forward starts from."""
        if not self.root_forward_seen:
            # Training goes through the root: direct calls of compile wrappers are side
            # computations from now on, and their hooks only cost (the wrapper's hook
            # dispatch on every call).
            self.root_forward_seen = True
            owner = self._owner()
            if owner is not None:
                try:
                    owner.drop_compile_entries()
                except Exception as error:  # never break training
                    self.errors.record("compile_entries", "", error)
        self.implicit_opener = None
        self.sample_in_backward = False
        self.recompute_anchor = -1

    def _open_training_forward(self, decision: bool | None = None) -> None:
        self._reset_forward_state()
        self.open_sample(decision)
        if self.sample_open:
            self.state = SAMPLED
            if self.attention_logits:
                begin_attention_sample(self)
        else:
            self._unsampled_training = True
            self.sentinel.calls = {}
            self.state = SENTINEL if self.full_sentinel else SKIP
        self.maybe_flush()

    def exit_root(self) -> None:
        """Close the innermost root forward."""
        if not self.attached:
            self._state_stack.clear()
            self.state = SKIP
            return
        stack = self._state_stack
        if stack:
            self.state = stack.pop()
        else:
            # A post-hook with no forward open: the root called itself inside a forward
            # left open-ended (whose inner call closed it). Never leave one open again.
            self.parking.root_post_off = "root module calls itself"
            self.state = IDLE
        parking = self.parking
        if parking.parked and not stack and compiled_frames() != parking.frames_at_park:
            parking.compiled_while_parked()  # something was compiled during this forward
        if self.state is IDLE:
            self._unsampled_training = False

    def leave_root(self, index: int, args: tuple[object, ...], output: object) -> None:
        """The root returned (or raised, with ``output`` None): observe it, then close."""
        state = self.state
        stack = self._state_stack
        if state is SKIP and self._unsampled_training and len(stack) == 1 and self.attached:
            # The steady state, an unsampled top-level training forward (SKIP): what the
            # branch below and exit_root do for it, in place.
            if not self.full_sentinel and root_sentinel_due(
                self.forwards_seen - 1, self.ROOT_SENTINEL_INTERVAL
            ):
                self._root_sentinel(output)
            parking = self.parking
            if parking.parked and compiled_frames() != parking.frames_at_park:
                parking.compiled_while_parked()  # something was compiled during this forward
            if (
                (parking.parked or parking.status == COMPILE_IN_USE)
                and stack[0] is IDLE
                and parking.park_root_post()
            ):
                # Hooks stay parked: leave the forward open-ended, so that the next ones
                # can be quiet (this hook is called from a copy of the hook dict).
                stack.pop()
                self._open_ended = True
                self._plan_quiet_forwards()
                return
            self.state = state = stack.pop()
            if state is IDLE:
                self._unsampled_training = False
            return
        if state is SAMPLED or state is SENTINEL:
            if state is SAMPLED and len(stack) == 1:
                end_attention_sample(self)
            if self.compiled is not None and len(stack) == 1:
                self.compiled.end_sample(self, output)  # rows before the root's own
            self.on_forward(index, args, output)
            if self.sample_outputs and len(self._state_stack) == 1:
                self.sample_outputs = {}  # the forward is over: its outputs are not shared
            if not self._adoption_done and state is SAMPLED and len(stack) == 1:
                owner = self._owner()
                try:
                    if self.compiled is None or self.compiled.modules_known:
                        self._adoption_done = True
                        if owner is not None:
                            owner.adopt_parents()
                    elif owner is not None:
                        # Rows from compiled graphs tell which modules ran only once
                        # flushed: parents wait for a later sampled forward, attention
                        # modules need not.
                        owner.adopt_attention_callers()
                except Exception as error:  # never break training
                    self.errors.record("adopt_parents", "", error)
        elif (
            self._unsampled_training
            and len(self._state_stack) == 1  # the outer call, not the root calling itself
            and root_sentinel_due(self.forwards_seen - 1, self.ROOT_SENTINEL_INTERVAL)
            and not self.full_sentinel
            and self.attached
        ):
            self._root_sentinel(output)
        self.exit_root()

    # ------------------------------------------------------------------ cadence


def _receiver(frame: FrameType) -> object:
    """The first argument of the function running in ``frame`` (``self`` of a method,
    whatever it is named), or None for a function without arguments."""
    code = frame.f_code
    return frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None


def _training_context(module: nn.Module) -> bool:
    """True if a call of the root ``module`` made now is a training forward by its
    context: train mode, gradients enabled, outside inference mode, outside backward
    (a recomputation), outside ``torch.jit`` tracing and ``torch.func`` transforms."""
    return (
        module.training
        and _grad_enabled()
        and not _inference_mode_enabled()
        and (_graph_task_id is None or _graph_task_id() == -1)
        and not _is_tracing()
        and transform_level() is None
    )


def _lookahead(policy: SamplingPolicy) -> Callable[[int], int] | None:
    """The policy's ``next_sampled`` if it has one that it defines together with its
    ``should_sample``, in the same class or both on the instance (a subclass, or an
    instance, that overrides only ``should_sample`` gets None)."""
    method = getattr(policy, "next_sampled", None)
    if not callable(method):
        return None
    owners = [getattr(policy, "__dict__", {}), *(vars(cls) for cls in type(policy).__mro__)]
    owner_next = next((i for i, names in enumerate(owners) if "next_sampled" in names), None)
    owner_should = next((i for i, names in enumerate(owners) if "should_sample" in names), None)
    return method if owner_next is not None and owner_next == owner_should else None
