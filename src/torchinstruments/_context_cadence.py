"""What the forward context does between its hooks' decisions: opening a sample, the
sentinel's checks of unsampled training forwards and what a hit forces, and the cadence
of flushes and report writes. :class:`~._context.ForwardContext` inherits them from
:class:`_ContextCadence`; they run on the same object as its per-forward fast path.
"""

from __future__ import annotations

import math
import time
import weakref
from typing import TYPE_CHECKING, Any, cast

from torch import Tensor

from ._attention import end_sample as end_attention_sample
from ._records import ROOT_INDEX
from ._staging import MAX_PENDING_RECORDS
from ._state import SKIP, ForwardState
from .capture import passive, user_modes_active
from .reduce import skip_reason

if TYPE_CHECKING:
    from ._calls import CallCapture
    from ._compiled_capture import CompiledCapture
    from ._context import ForwardContext
    from ._error_log import ErrorLog
    from ._parking import HookParking
    from ._sentinel import Sentinel
    from ._staging import StatisticsBuffer
    from ._store import SeriesStore
    from .observer import Observer
    from .sampling import SampleForwards, SamplingPolicy

#: Sampled forwards whose backward bookkeeping is kept (gradient accumulation over more
#: forwards than this before one backward loses loss-scale and repeat tracking).
MAX_SAMPLES_AWAITING_BACKWARD = 256


def remember_sample(samples: dict[int, Any], sample: int, value: Any = None) -> None:
    """Set ``samples[sample] = value``, keeping the latest
    ``MAX_SAMPLES_AWAITING_BACKWARD`` entries (the oldest inserted is dropped)."""
    samples[sample] = value
    if len(samples) > MAX_SAMPLES_AWAITING_BACKWARD:
        del samples[next(iter(samples))]


#: Flush interval (training forwards) while CUDA statistics are pending: sentinel sums
#: are read at a flush, so a non-finite hit forces samples at most this much later.
DEVICE_FLUSH_INTERVAL_FORWARDS = 32


class _ContextCadence(ForwardState):
    """Sample opening, sentinel hits and the flush and write cadence of
    :class:`~._context.ForwardContext` (its settings and collaborators are set there)."""

    FORCED_SAMPLES_AFTER_NONFINITE: int
    ROOT_SENTINEL_INTERVAL: int
    FLUSH_INTERVAL_FORWARDS: int
    _owner: weakref.ref[Observer]
    policy: SamplingPolicy
    _warmup_samples: int
    full_sentinel: bool
    prompt_sinks: bool
    buffer: StatisticsBuffer
    store: SeriesStore
    errors: ErrorLog
    parking: HookParking
    sentinel: Sentinel
    capture: CallCapture
    compiled: CompiledCapture | None
    rewrite_interval_s: float
    sample_forwards: SampleForwards

    def _root_sentinel(self, output: object) -> None:
        """Check the root output of an unsampled training forward for non-finite values
        (one training forward in :attr:`ROOT_SENTINEL_INTERVAL`, see there)."""
        try:
            if type(output) is Tensor and not user_modes_active():
                # The common case, kept short (one forward in 8 between samples): ops on a
                # plain tensor reach no user code while no mode is active, so the check
                # needs no passive() around it.
                forward, next_sample = self.forwards_seen - 1, self.samples_observed
                nonfinite = self.sentinel.check_root_on_cpu(output)
                if nonfinite is None:
                    nonfinite = skip_reason(output) is None and self.sentinel.check(
                        ROOT_INDEX, 0, "output", output, forward, next_sample
                    )
                if nonfinite:
                    self.on_nonfinite(forward, ROOT_INDEX, 0, "output", next_sample)
                return
            with passive():
                self.sentinel_output(ROOT_INDEX, 0, output)
        except Exception as error:  # never break training
            self.errors.record("sentinel", "", error)

    def sentinel_output(self, index: int, call: int, output: object) -> None:
        """Check every tensor of ``output`` (call ``call`` of module ``index``) in the
        open unsampled training forward."""
        forward = self.forwards_seen - 1
        next_sample = self.samples_observed
        for path in self.sentinel.check_output(index, call, output, forward, next_sample):
            self.on_nonfinite(forward, index, call, path, next_sample)

    def on_nonfinite(
        self, forward: int, index: int, call: int, path: str, next_sample: int
    ) -> None:
        """A sentinel saw a non-finite value in unsampled training forward ``forward``
        (``next_sample`` is the index the next sample takes): count it and sample the
        next :attr:`FORCED_SAMPLES_AFTER_NONFINITE` forwards."""
        self._forced_samples = self.FORCED_SAMPLES_AFTER_NONFINITE
        self._quiet_until = 0  # the next forwards are sampled
        self._quiet_sentinel = -1
        self.sentinel.note_hit(forward, index, call, path, next_sample)

    def open_sample(self, decision: bool | None = None) -> None:
        """Count a training forward (or a direct call that opens a sample) and open a
        sample if the policy (or a sentinel hit before) asks for one."""
        if self.compiled is not None:
            # A direct-call sample's rows wait in the buffers until the next one opens.
            self.compiled.finish_direct_sample(cast("ForwardContext", self))
        index = self.forwards_seen
        self.forwards_seen += 1
        if decision is None:  # user policies may return ints
            decision = bool(self.policy.should_sample(index))
        sampled = decision
        if self._forced_samples > 0:
            self._forced_samples -= 1
            sampled = True
        self.sample_open = sampled
        if sampled:
            self.sample = self.errors.sample = self.samples_observed
            self.samples_observed += 1
            if self.samples_observed == self._warmup_samples:
                # The first rewrite falls due at the end of warm-up (at the next
                # maybe_flush), not only rewrite_interval_s after injection.
                self.last_write = -math.inf
            self.sample_forwards.append(index)
            if self.compiled is not None:
                # The cadence runs on the ForwardContext itself (its base class).
                self.compiled.begin_sample(cast("ForwardContext", self))
            if self.caller_step is not None:
                self.store.note_step(self.sample, self.caller_step)
            remember_sample(self.awaiting_backward, self.sample)
            self.call_counts = {}
            self.position = 0
            self.no_grad_calls = {}
            self.sample_outputs = {}

    def backward_started(self, sample: int) -> None:
        """The first output gradient of ``sample`` arrived."""
        self.awaiting_backward.pop(sample, None)
        if self.compiled is not None:
            self.compiled.backward_started(sample)
        if self.implicit_opener is not None and sample == self.sample:
            self.implicit_backward_seen = True

    def maybe_flush(self) -> None:
        """Ask the observer for a flush if one is due (pending records and a forward
        count that is a multiple of the interval, or too many records, or a sink that
        wants every sample at once, or rows from compiled graphs of which none was read
        yet), and for a report write if one is due."""
        buffer = self.buffer
        pending = buffer.waiting()
        interval = (
            DEVICE_FLUSH_INTERVAL_FORWARDS
            if buffer.producer_streams
            else self.FLUSH_INTERVAL_FORWARDS
        )
        owner = self._owner()
        if owner is None:
            return
        if pending and self.prompt_sinks:
            owner.flush_statistics(block=True, from_hook=True)  # the previous samples
        elif (
            pending >= MAX_PENDING_RECORDS
            or (pending and self.forwards_seen % interval == 0)
            or (pending and self.compiled is not None and not self.compiled.modules_known)
        ):
            # Rows from compiled graphs are flushed at once until the first have been
            # read: the parents of modules that did not run wait for them.
            owner.flush_statistics(block=False, from_hook=True)
        if time.monotonic() - self.last_write >= self.rewrite_interval_s:
            owner.write_report(block=False, from_hook=True)

    def _write(self) -> None:
        owner = self._owner()
        if owner is not None:
            owner.write_report(block=False, from_hook=True)

    def detach(self) -> None:
        """Close what is open; hooks that compiled code or stale references still call
        return at once from now on."""
        self._quiet_until = 0
        self._quiet_sentinel = -1
        self._open_ended = False
        self.parking.restore_root_post()
        self.parking.restore(reset=False)
        self.parking.parkable.clear()
        self.attached = False
        self.state = SKIP
        end_attention_sample(cast("ForwardContext", self))
        self._state_stack.clear()
        self.no_grad_calls.clear()
