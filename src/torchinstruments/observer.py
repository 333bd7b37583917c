"""The Observer: owns the hooks and the sample context, and wires the stages.

    capture (hooks) -> reduce (device vectors) -> track (host, in batches) -> find -> report

Hooks call :meth:`Observer.enter_root`, :meth:`Observer.leave_root`,
:meth:`Observer.on_forward` and :meth:`Observer.on_grad`; each catches its own errors,
counts them and returns ``None``. Statistics stay on the tensor's device until a flush
moves a whole batch to the host; small CPU tensors are copied and reduced in batches at
the flush. Submodule hooks are parked (taken out of their modules) while no forward
needs them; see :meth:`Observer._park_hooks`.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import math
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import torch
from torch import Tensor, nn

from . import _amp
from .capture import (
    MAX_TENSORS_PER_OUTPUT,
    ForwardHook,
    ForwardWrapper,
    GradHook,
    NodeGradHook,
    RootPostHook,
    RootPreHook,
    _graph_task_id,
    compiled_frames,
    in_backward,
    iter_output_tensors,
    passive,
)
from .config import ReportConfig, TrackConfig
from .distributed import RankInfo
from .histogram import Histogram, HistogramSpec, histogram_counts
from .reduce import (
    BATCH_MAX_ELEMENTS,
    STAT_WIDTH,
    Subsample,
    cpu_statistics_batch,
    cpu_statistics_deferred,
    cpu_statistics_matrix_,
    cpu_statistics_subsamples,
    cpu_statistics_unchecked,
    device_statistics_batch_unchecked,
    finish_statistics,
    skip_reason,
    tensor_statistics,
)
from .sampling import SampleForwards, SamplingPolicy
from .series import ACTIVATION, GRAD_OUTPUT, RMS_TO_ROOT, TensorSeries
from .sinks import scalar_tag
from .track import SeriesTracker

__all__ = ["Observer", "RankInfo"]

#: Sampled forwards whose backward bookkeeping is kept (gradient accumulation over more
#: forwards than this before one backward loses loss-scale and repeat tracking).
MAX_SAMPLES_AWAITING_BACKWARD = 256
#: Most samples whose caller step (``ObserverHandle.set_step``) is kept for the sinks.
MAX_SAMPLE_STEPS = 4096
#: Records kept on the device before a flush moves them to the host.
MAX_PENDING_RECORDS = 4_096
#: Flush interval (training forwards) while CUDA statistics are pending: sentinel sums
#: are read at a flush, so a non-finite hit forces samples at most this much later.
DEVICE_FLUSH_INTERVAL_FORWARDS = 32
#: Measured rows awaiting processing that other keys share (oldest dropped beyond).
MAX_ALIASED_ROWS = 4_096
#: CPU tensors of at most this many elements are copied (as float32) when observed and
#: reduced later in batches (see Observer._measure); larger ones are reduced at once.
STAGE_MAX_NUMEL = 1 << 15
#: Most rows of one staging slab (see _Slab): a slab holds at most
#: ``BATCH_MAX_ELEMENTS`` elements (1 MiB), and no more rows than this.
SLAB_MAX_ROWS = 256
#: Accelerator (CUDA) tensors of at most this many elements are staged the same way:
#: each tensor operation there costs a kernel launch, several microseconds of host time,
#: so one ragged batch (all staged tensors of a device, any lengths, about 55 operations)
#: saves about 35 launches per tensor.
DEVICE_STAGE_MAX_NUMEL = 1 << 20
#: Staged CPU elements (float32) after which the staged copies are reduced (16 MiB);
#: also the bound on the elements of all staging slabs together.
STAGE_MAX_ELEMENTS = 1 << 22
#: The same for accelerator copies (32 MiB): fewer, larger batches save launches; while
#: one is reduced, about four times its size is held on the device.
DEVICE_STAGE_MAX_ELEMENTS = 1 << 23
_STAGED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Prefix of pending-record signals carrying histogram counts.
_HISTOGRAM = "histogram"
#: Pending-record signal carrying a device-side sentinel sum, non-finite where the
#: checked tensor held a non-finite value (CUDA).
_SENTINEL = "sentinel"
#: Index of the root among the observed modules (``select_modules`` puts it first).
ROOT_INDEX = 0
#: torch.jit.is_tracing without its Python wrapper (called once per root forward).
_is_tracing = getattr(torch._C, "_is_tracing", torch.jit.is_tracing)
#: Grad-mode and inference-mode checks, bound once (called once per root forward).
_grad_enabled = torch.is_grad_enabled
_monotonic = time.monotonic
_inference_mode_enabled = torch.is_inference_mode_enabled
#: Code of nn.Module._call_impl, whose frames show which module calls are running.
_CALL_IMPL_CODE = getattr(getattr(nn.Module, "_call_impl", None), "__code__", None)
#: Code of nn.Module._wrapped_call_impl (torch >= 2.2), which calls _call_impl.
_WRAPPED_CALL_IMPL_CODE = getattr(getattr(nn.Module, "_wrapped_call_impl", None), "__code__", None)
_getframe = sys._getframe
#: The innermost torch.func transform being run (None outside any): a root forward run
#: inside one (per-sample gradients through ``vmap(grad(...))``) has only wrapped
#: tensors, which cannot be measured, so it is skipped like an eval forward.
_transform_level: Callable[[], object] = getattr(
    getattr(torch._C, "_functorch", None), "peek_interpreter_stack", lambda: None
)
#: Pending-record signal carrying the GradScaler loss scale of a sample.
_LOSS_SCALE = "loss_scale"
#: Gradient values of these metrics are divided by the GradScaler loss scale.
_SCALE_METRICS = ("rms", "mean_abs", "max_abs")


@dataclass(slots=True)
class _ErrorEntry:
    stage: str
    module: str
    error_type: str
    message: str
    count: int = 0
    first_sample: int | None = None


#: (module index, call index, signal, tensor path) of one observed tensor.
_Key = tuple[int, int, str, str]
#: What a pending record says about its statistics row: (series key, sample, position).
_Meta = tuple[_Key, int, int]
#: A statistics record waiting for the host: its meta and its row (a device vector, or
#: host floats for CPU tensors). Hooks add one with a single ``list.append`` of a tuple,
#: which is atomic, so worker threads of one forward never interleave half records.
_Record = tuple[_Key, int, int, Tensor | list[float]]
#: A staged copy awaiting a batch: (key, sample, position, flat float32 copy, or the
#: subsample of a large CPU tensor whose full passes are done).
_Staged = tuple[_Key, int, int, "Tensor | Subsample"]


class _Slab:
    """Preallocated rows for the float32 copies of small CPU tensors of one length.

    A copy goes into the next free row and the rows are reduced in place when the slab
    is full or at a flush (:func:`~torchinstruments.reduce.cpu_statistics_matrix_`), then
    reused. Compared with one fresh tensor per copy, stacked at the flush, this saves
    the stacking copy and, above all, the allocator's churn: piles of fresh copies were
    handed back to the system after each flush and faulted in again (a copy of 16,384
    elements cost 15 us inside a training step; in a microbenchmark, 35 us against
    4.5 us once 64 or more copies were alive).
    """

    __slots__ = ("capacity", "matrix", "records", "rows", "used")

    def __init__(self, numel: int) -> None:
        self.capacity = self.capacity_for(numel)
        self.matrix = torch.empty(self.capacity, numel)
        #: One view per row, made on first use and kept (``select`` views: a row of
        #: ``unbind`` is a multi-output view, slower to view again).
        self.rows: list[Tensor] = []
        #: (key, sample, position) of the rows filled so far, in row order.
        self.records: list[_Meta] = []
        #: Whether a row was filled since the last flush (others may be freed).
        self.used = True

    @staticmethod
    def capacity_for(numel: int) -> int:
        """Rows of a slab for tensors of ``numel`` elements."""
        return max(1, min(SLAB_MAX_ROWS, BATCH_MAX_ELEMENTS // numel))

    def next_row(self) -> Tensor:
        """The view of the next free row."""
        filled = len(self.records)
        rows = self.rows
        if filled == len(rows):
            rows.append(self.matrix[filled])
        return rows[filled]


class Observer:
    """Observes one model; created by :func:`~torchinstruments.inject_observer`.

    Not meant to be constructed directly. Use the handle returned by ``inject_observer``.
    """

    SKIP = 0  # inside a root forward that is not sampled (or eval / no-grad)
    SAMPLED = 1  # inside a sampled training root forward
    IDLE = 2  # no root forward open: direct submodule calls or recomputation
    RECOMPUTE = 3  # inside a root forward re-run during backward (checkpointing)
    SENTINEL = 4  # unsampled training forward with the full sentinel: non-finite checks only

    #: Forwards sampled after a sentinel saw a non-finite value, to localise a recurrence.
    FORCED_SAMPLES_AFTER_NONFINITE = 8
    #: Without the full sentinel, the root output of one training forward in each run of
    #: this many is checked when that forward is not sampled: in run ``b`` (forwards
    #: ``8b`` to ``8b + 7``) the one at offset ``(b + 7) % 8`` (forwards 7, 8, 17, 26, ...,
    #: 63, then 71, 72, ...). The offset moves so that a fault recurring with any period
    #: and phase still meets a check (within 64 forwards; a fixed offset never saw one
    #: on every 4th forward between samples on even forwards); checks are at most 9
    #: forwards apart, so a persistent fault is caught within 9 forwards of its onset.
    #: One reduction of a fresh tensor costs 10 to 14 us inside a training step on the
    #: CPU (dispatch and allocation, in caches that the step's own kernels have just
    #: evicted; measured with ``benchmarks/overhead.py``): on every forward that was 1.6%
    #: of a 0.75 ms MLP step, over half of a 1.03x budget.
    ROOT_SENTINEL_INTERVAL = 8
    #: Pending statistics are flushed (reduced in batches, moved to the host, tracked)
    #: at training forwards whose count is a multiple of this (of
    #: ``DEVICE_FLUSH_INTERVAL_FORWARDS`` while CUDA work is pending). Fewer, larger
    #: flushes cost less: flushing every 128 forwards rather than every 32 took the
    #: whole of a 1,000-step run from 1.117x to 1.092x on the CPU MLP and from 1.125x to
    #: 1.105x on the example's model (``benchmarks/overhead.py`` workloads, 3 runs each,
    #: interleaved). The staged copies waiting meanwhile are bounded (16 MiB).
    FLUSH_INTERVAL_FORWARDS = 128
    #: Most sentinel events kept for the report (all are counted).
    MAX_SENTINEL_EVENTS = 16

    def __init__(
        self,
        *,
        target: nn.Module,
        root: nn.Module,
        modules: list[tuple[str, nn.Module]],
        policy: SamplingPolicy,
        report_config: ReportConfig,
        track_config: TrackConfig,
        capture_direct_forwards: bool,
        full_sentinel: bool,
        histograms: Sequence[HistogramSpec],
        rank_info: RankInfo,
        writer: Any,
        sinks: Iterable[Any],
        options: dict[str, object],
    ) -> None:
        # Weak: the registry maps the model to its handle, which holds this observer;
        # a strong reference back would keep a model dropped without remove_observer
        # alive for the life of the process.
        self._target = weakref.ref(target)
        self._root = weakref.ref(root)
        self.names = [name for name, _ in modules]
        self._modules = [weakref.ref(module) for _, module in modules]
        self.policy = policy
        self.report_config = report_config
        self.track_config = track_config
        self.capture_direct_forwards = capture_direct_forwards
        self.full_sentinel = full_sentinel
        self.histogram_specs = tuple(histograms)
        self.histograms: dict[tuple[int, int, str, str, int], Histogram] = {}
        # Per module and signal: indices of the specs that apply (resolved once).
        self._hist_plan = {
            (index, signal): tuple(
                n for n, spec in enumerate(self.histogram_specs) if spec.applies_to(name, signal)
            )
            for index, (name, _) in enumerate(modules)
            for signal in (ACTIVATION, GRAD_OUTPUT)
        }
        self.rank_info = rank_info
        self.writer = writer
        self.sinks = list(sinks)
        self._scalar_sinks = [
            sink for sink in self.sinks if callable(getattr(sink, "write_scalars", None))
        ]
        self._histogram_sinks = [
            sink for sink in self.sinks if callable(getattr(sink, "write_histogram", None))
        ]
        # Sinks whose loggers accept no step below their latest (wandb): every sample is
        # handed over by the start of the next training forward (see _maybe_flush).
        self._prompt_sinks = any(
            getattr(sink, "prompt", False) is True for sink in self._scalar_sinks
        ) or any(getattr(sink, "prompt", False) is True for sink in self._histogram_sinks)
        #: The caller's step (ObserverHandle.set_step) that samples opened from now take.
        self.caller_step: int | None = None
        # Per sample, the caller's step when it opened (bounded: oldest dropped first).
        self._sample_steps: dict[int, int] = {}
        self.options = options
        self.attached = False

        # Sample context (shared across threads on purpose: worker threads inside a
        # root forward belong to that forward).
        self.state = self.IDLE
        self._state_stack: list[int] = []
        self._sample = -1
        self._calls: dict[int, int] = {}
        self._position = 0
        # Tensors observed in the open sample, by id: (weak reference to the tensor,
        # version, activation key, output-gradient key or None). A module that returns
        # what a submodule returned (a container, the root) is measured once (see
        # _observe_call). Weak, so that an output autograd does not keep (checkpointing,
        # a branch summed away) is freed as it would be without the observer.
        self._sample_outputs: dict[int, tuple[weakref.ref[Tensor], int, _Key, _Key | None]] = {}
        # Per measured (key, sample): the keys and forward positions that share its row.
        self._aliases: dict[tuple[_Key, int], list[tuple[_Key, int]]] = {}
        self._implicit_opener: int | None = None
        self._implicit_backward_seen = False
        self._no_grad_calls: dict[int, list[tuple[int, int, object, int]]] = {}
        self._recompute_anchor = -1
        self._sample_in_backward = False
        self._unsampled_training = False
        self._no_grad_training_forwards = 0
        self._sample_open = False
        self._forced_samples = 0
        self._sentinel_calls: dict[int, int] = {}
        self.sentinel_checks = 0
        self.sentinel_nonfinite_forwards = 0
        self.sentinel_events: list[dict[str, object]] = []
        self._last_sentinel_forward = -1
        # Hook parking (see _park_hooks): (hooks dict, handle id, hook) per submodule.
        self._parkable: list[tuple[dict[int, Any], int, ForwardHook]] = []
        self._parked: list[tuple[dict[int, Any], int, ForwardHook]] = []
        self._frames_at_park = 0
        self.hook_parking = "off: capture_direct_forwards" if capture_direct_forwards else "on"
        # The root's post-hook, parked across unsampled forwards that need no close (see
        # _close_open_ended): (hooks dict, always-called dict, handle id, hook), or None.
        self._root_post: tuple[dict[int, Any], dict[int, bool], int, RootPostHook] | None = None
        # To tell a root that calls itself: the code of its forward, and how many frames
        # up from enter_root the caller of the root is (0 until known; see _park_root_post).
        self._root_forward_code: object = None
        self._caller_depth = 0
        self._root_post_parked = False
        # True while an unsampled root forward is open with no post-hook to close it:
        # the next root forward (or detach) closes it.
        self._open_ended = False
        # Why forwards are never left open-ended, or "" while they may be.
        self._open_ended_off = ""
        # Training forwards below this index continue the open-ended steady state with
        # nothing to do but count (see enter_root); 0 when none is known. The forward
        # at that index, if it only needs the root sentinel, is _quiet_sentinel (else -1).
        self._quiet_until = 0
        self._quiet_sentinel = -1

        # Pipeline state.
        self._pending: list[_Record] = []
        # A deque: hooks on worker threads append while a flush pops (both atomic).
        self._staged: deque[_Staged] = deque()
        self._staged_elements = 0
        self._device_staged_elements = 0
        #: Staging slabs of small CPU tensors by length (see _Slab); the lock orders
        #: hooks of several threads that fill them and the flush that reduces them.
        self._slabs: dict[int, _Slab] = {}
        self._slab_elements = 0
        self._slab_records = 0
        self._slab_lock = threading.Lock()
        self._slab_scratch: Tensor | None = None
        #: Lengths of small CPU tensors met without a slab since the last flush.
        self._lengths_seen: dict[int, None] = {}
        #: Device types that take the accelerator path: tensors up to
        #: ``DEVICE_STAGE_MAX_NUMEL`` elements are staged and reduced together, whatever
        #: their lengths, by ``device_statistics_batch_unchecked``; sentinel sums are read
        #: at the next flush; nothing is read back inside a hook. Tests add "cpu" to run
        #: that path without a GPU.
        self.device_path_types: frozenset[str] = frozenset({"cuda"})
        #: CUDA streams that made staged copies or pending device rows since the last
        #: flush: work on another stream that reads them must wait for these.
        self._producer_streams: set[Any] = set()
        self._in_flight: list[_InFlight] = []
        self.series: dict[tuple[int, int, str, str], TensorSeries] = {}
        self._grad_keys_seen: dict[int, set[tuple[int, int, str]]] = {}
        self._backward_counted: dict[int, None] = {}
        self._leaf_hooks: list[Any] = []
        self._awaiting_backward: dict[int, None] = {}
        self._loss_scales: dict[int, float] = {}

        # Counters.
        self.forwards_seen = 0
        self.samples_observed = 0
        self.backward_samples_observed = 0
        self._last_grad_samples: list[int] = []
        self.eval_forwards_skipped = 0
        self.recompute_calls = 0
        self.implicit_samples = 0
        #: True once a training forward went through the root (not only direct calls).
        self.root_forward_seen = False
        self.calls_outside_root = 0
        #: The training forward of each sample (runs of arithmetic progressions).
        self.sample_forwards = SampleForwards()
        self.repeated_gradients = 0
        self.loss_scale = SeriesTracker(track_config, log_scale=True, noise_floor=0.02)
        self.series_dropped = 0
        self.paths_dropped = 0
        self.skipped_tensors: Counter[str] = Counter()
        self.errors: dict[tuple[str, str, str], _ErrorEntry] = {}
        self.error_count = 0
        self.reports_written = 0
        self.telemetry_seconds = 0.0
        self.series_summary_omitted = 0
        self._next_sampled = _lookahead(policy)
        listener = getattr(policy, "note_cost", None)
        self._cost_listener = listener if callable(listener) else None
        self.started_at = time.time()
        self._last_write = time.monotonic()
        self._rewrite_interval_s = report_config.rewrite_interval_s
        self._warned_write = False
        #: True while a report is being built and written (see _TerminationWriter).
        self.writing = False
        #: In a process forked after injection: the parent's pid, and the training
        #: forwards seen before the fork (see :meth:`forked`); None in the original.
        self.forked_from_pid: int | None = None
        self.forwards_at_fork = 0
        #: Staged float32 copies of output gradients, by (key, sample), while they are
        #: not reduced yet: a later backward pass over the same sample adds into them
        #: (see _sum_repeated). Cleared whenever staged copies are reduced.
        self._grad_buffers: dict[tuple[_Key, int], Tensor] = {}
        self._last_staged: Tensor | None = None
        self.gradients_summed = 0
        self.gradients_not_summed = 0
        #: Indices of the observed modules that ran in a sampled forward.
        self.modules_called: set[int] = set()
        #: Module name -> the name of the parent observed in its place, because the
        #: module never ran in the first sampled forward (see _adopt_parents).
        self.parents_adopted: dict[str, str] = {}
        self._adoption_done = False
        self._handles: list[Any] = []
        self._wrapped: list[tuple[weakref.ref[nn.Module], bool, object]] = []
        self._atexit = _AtExit(self)

    @property
    def target(self) -> nn.Module | None:
        """The model given to ``inject_observer`` (None once it was collected)."""
        return self._target()

    @property
    def root(self) -> nn.Module | None:
        """The observed root module (the model inside DDP or compile wrappers), or None
        once it was collected."""
        return self._root()

    # ------------------------------------------------------------------ attach
    def attach(self) -> None:
        """Register hooks (or forward wrappers) on every selected module."""
        root = self.root
        for index, ref in enumerate(self._modules):
            module = ref()
            assert module is not None
            is_root = module is root
            if self.capture_direct_forwards:
                had = "forward" in module.__dict__
                previous = module.__dict__.get("forward")
                original = module.forward
                module.forward = ForwardWrapper(self, module, original, index, is_root)  # type: ignore[method-assign]
                self._wrapped.append((ref, had, previous))
                continue
            if is_root:
                self._handles.append(module.register_forward_pre_hook(RootPreHook(self)))
                post = RootPostHook(self, index)
                try:
                    handle = module.register_forward_hook(post, always_call=True)
                except TypeError:  # torch < 2.1 has no always_call
                    handle = module.register_forward_hook(post)
                    # A forward that raises would skip the post-hook: never park.
                    self.hook_parking = "off: torch without always_call forward hooks"
                else:
                    always = getattr(module, "_forward_hooks_always_called", None)
                    if isinstance(always, dict):
                        self._root_post = (module._forward_hooks, always, handle.id, post)
                    forward = inspect.unwrap(type(module).forward)
                    self._root_forward_code = getattr(forward, "__code__", None)
                self._handles.append(handle)
            else:
                hook = ForwardHook(self, index)
                handle = module.register_forward_hook(hook)
                self._handles.append(handle)
                self._parkable.append((module._forward_hooks, handle.id, hook))
        self.attached = True
        _amp.install(self)
        atexit.register(self._atexit)
        _on_termination.add(self)

    def detach(self) -> None:
        """Remove every hook and wrapper; restore previous instance attributes."""
        self._quiet_until = 0
        self._quiet_sentinel = -1
        self._open_ended = False
        self._restore_root_post()
        self._restore_hooks(reset=False)
        self._parkable.clear()
        for handle in self._handles + self._leaf_hooks:
            handle.remove()
        self._handles.clear()
        self._leaf_hooks.clear()
        for ref, had, previous in self._wrapped:
            module = ref()
            current = module.__dict__.get("forward") if module is not None else None
            if module is None or not isinstance(current, ForwardWrapper):
                continue  # gone, or replaced by the user after injection: leave it
            if had:
                module.__dict__["forward"] = previous
            else:
                del module.__dict__["forward"]
        self._wrapped.clear()
        self.attached = False
        _amp.uninstall(self)
        # Hooks that compiled code or stale references still call return at once.
        self.state = self.SKIP
        self._state_stack.clear()
        self._no_grad_calls.clear()
        atexit.unregister(self._atexit)
        _on_termination.discard(self)

    # ------------------------------------------------------------------ context
    def enter_root(self, module: nn.Module) -> None:
        """Open a root forward: decide once whether it is sampled."""
        index = self.forwards_seen
        try:
            quiet = (
                (index < self._quiet_until or index == self._quiet_sentinel)
                and _training_context(module)
                and compiled_frames() == self._frames_at_park
                and (  # not called by the root's own forward (see _nested_root_call)
                    (caller := _getframe(self._caller_depth)).f_code is not self._root_forward_code
                    or caller.f_locals.get("self") is not module
                )
            )
        except ValueError:  # fewer frames than that: the root's caller is not Python code
            quiet = False
        if quiet:
            # A quiet forward: the previous training forward was left open-ended (see
            # _close_open_ended) and this one is known, since then, to be unsampled and
            # to have no flush due. Closing the previous forward and opening this one
            # would leave every field as it is but the count.
            self.forwards_seen = index + 1
            if index == self._quiet_sentinel:
                # It has the root sentinel: the post-hook comes back to read the output,
                # and the forward is open on the stack as any other.
                self._quiet_until = 0
                self._quiet_sentinel = -1
                self._open_ended = False
                self._restore_root_post()
                self._state_stack.append(self.IDLE)
                if _monotonic() - self._last_write >= self._rewrite_interval_s:
                    self.write_report(block=False)
            return
        self._quiet_until = 0
        self._quiet_sentinel = -1
        if self._open_ended:
            if self._nested_root_call(module):
                # The root's forward calls the root: part of the open-ended forward, as
                # in any other forward. Forwards are no longer left open-ended.
                self._open_ended_off = "root module calls itself"
                return
            self._close_open_ended()
        stack = self._state_stack
        stack.append(self.state)
        decision: bool | None = None
        if (
            self._parked
            and len(stack) == 1
            and not self._forced_samples
            and not self.full_sentinel
            and _training_context(module)
            and compiled_frames() == self._frames_at_park
        ):
            # The steady state: a top-level training forward while the submodule hooks
            # are parked. Unsampled, it only counts the forward (no further calls): the
            # state _open_training_forward leaves, set here with fewer calls (this runs
            # on nearly every forward, inside a step whose kernels have evicted this code
            # from the caches, where every call costs).
            try:
                index = self.forwards_seen
                decision = bool(self.policy.should_sample(index))
                if not decision:
                    self.forwards_seen = index + 1
                    self._no_grad_training_forwards = 0
                    self._reset_forward_state()
                    self._sample_open = False
                    self._unsampled_training = True
                    self.state = 0  # SKIP
                    if _root_sentinel_due(index, self.ROOT_SENTINEL_INTERVAL):
                        self._restore_root_post()  # the sentinel reads the root output
                    elif self._root_post_parked or self._park_root_post():
                        stack.pop()
                        self._open_ended = True
                        self._plan_quiet_forwards()
                    if self._pending or self._staged or self._slab_records:
                        self._maybe_flush()
                    elif _monotonic() - self._last_write >= self._rewrite_interval_s:
                        self.write_report(block=False)
                    return
            except Exception as error:  # never break training (as _open_sample would)
                self.forwards_seen = index + 1  # once, whether or not it was counted
                self._no_grad_training_forwards = 0
                self._reset_forward_state()
                self.state = self.SKIP
                self.record_error("enter_root", "", error)
                return
        if self._root_post_parked:
            self._restore_root_post()
        if not self.attached:
            self.state = self.SKIP
            return
        if len(stack) > 1 and not self.capture_direct_forwards:
            self._drop_unclosed_forwards(module)
        try:
            parkable = self._open_root(module, decision)
            if parkable is None:
                return  # the root calling itself: the same forward
            if self._parked:
                # Hooks stay parked across unsampled forwards; back for a forward that
                # needs them, or once torch.compile appears (between forwards, or
                # compiling this very call up to this hook).
                if not parkable or compiled_frames() != self._frames_at_park:
                    self._restore_hooks(reset=False)
            elif parkable and self.hook_parking == "on":
                self._park_hooks()
        except Exception as error:  # never break training
            self.state = self.SKIP
            self.record_error("enter_root", "", error)

    def _nested_root_call(self, module: nn.Module) -> bool:
        """From enter_root, with a forward left open-ended: True if this call of the root
        comes from inside the root's own forward. Its direct caller is checked (the
        root's ``forward`` on this instance); for a call that is not a training forward
        (a no_grad teacher pass, say) the whole stack is walked, which catches calls
        through helper methods too. A training forward that calls the root through a
        helper is only seen at a forward with the post-hook in place (see
        :meth:`_close_open_ended`)."""
        try:
            caller = _getframe(self._caller_depth + 1)
        except ValueError:
            return False
        if caller.f_code is self._root_forward_code and caller.f_locals.get("self") is module:
            return True
        if _training_context(module):
            return False
        return _root_calls_on_stack(module, _getframe(1)) > 1

    def _plan_quiet_forwards(self) -> None:
        """Find the quiet forwards that follow the open-ended one just opened (see
        enter_root): up to the first that is sampled, checked by the root sentinel, or
        at which :meth:`_maybe_flush` would flush pending statistics. That one is quiet
        too if it needs only the root sentinel. Nothing is quiet unless the policy can
        tell its next sampled forward (``next_sampled``)."""
        if self._next_sampled is None or self._forced_samples:
            return
        start = self.forwards_seen
        sentinel = _next_root_sentinel(start, self.ROOT_SENTINEL_INTERVAL)
        every = (
            DEVICE_FLUSH_INTERVAL_FORWARDS
            if self._producer_streams
            else self.FLUSH_INTERVAL_FORWARDS
        )
        flush = (start + every) // every * every - 1  # forwards_seen a multiple of every
        try:
            sampled = int(self._next_sampled(start))
        except Exception as error:  # a user policy's: ask it about every forward instead
            self._next_sampled = None
            self.record_error("next_sampled", "", error)
            return
        until = min(sampled, sentinel, flush)
        self._quiet_until = until
        self._quiet_sentinel = until if until == sentinel < min(sampled, flush) else -1

    def _park_root_post(self) -> bool:
        """Take the root's post-hook out for an unsampled forward that needs no close
        (see :meth:`_close_open_ended`), from enter_root or leave_root; False if it must
        stay: it is not the root's only forward hook, a submodule hook of ours is not
        parked (it would see the state between forwards), the root has been seen calling
        itself, or where its caller sits on the stack is unknown."""
        slot = self._root_post
        if slot is None or self._open_ended_off or len(self._parked) != len(self._parkable):
            return False
        hooks, always, key, _ = slot
        if len(hooks) != 1 or key not in hooks:
            return False
        if not self._caller_depth:
            root = self.root
            if root is None:
                return False
            self._caller_depth = _find_caller_depth(root, _getframe(1))
            if not self._caller_depth or self._root_forward_code is None:
                self._open_ended_off = "caller of the root not found"
                return False
        del hooks[key]
        always.pop(key, None)  # so that a copy taken meanwhile carries no stale entry
        self._root_post_parked = True
        return True

    def _restore_root_post(self) -> None:
        """Put the root's post-hook back (in front of any hook registered meanwhile)."""
        slot = self._root_post
        if not self._root_post_parked or slot is None:
            return
        self._root_post_parked = False
        hooks, always, key, hook = slot
        always[key] = True
        if not hooks:
            hooks[key] = hook
            return
        others = list(hooks.items())
        hooks.clear()
        hooks[key] = hook
        hooks.update(others)

    def _close_open_ended(self) -> None:
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
        self.state = self.IDLE
        self._unsampled_training = False
        if self._parked and compiled_frames() != self._frames_at_park:
            self._restore_hooks(reset=True)  # something was compiled during that forward

    def _drop_unclosed_forwards(self, module: nn.Module) -> None:
        """Forget root forwards that never closed (a KeyboardInterrupt skips even the
        always-called post-hook): keep only as many open forwards as calls of the root
        on this thread's stack. The root calling itself is the one legitimate nesting."""
        open_calls = _root_calls_on_stack(module, sys._getframe(1))
        stack = self._state_stack
        if open_calls == 0 or open_calls >= len(stack):
            return  # cannot tell (compiled frames), or nothing was left open
        del stack[: len(stack) - open_calls]
        stack[0] = self.IDLE
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
                self._sample_in_backward = True
                return False
            self.state = self.RECOMPUTE
            self.recompute_calls += 1
            return False
        if len(self._state_stack) > 1 and self._state_stack[-1] in (
            self.SAMPLED,
            self.SKIP,
            self.SENTINEL,
        ):
            self._open_ended_off = "root module calls itself"
            return None  # the root calling itself: same forward
        if _is_tracing():
            self.state = self.SKIP
            self.eval_forwards_skipped += 1
            return False  # a trace must record the module calls as they are
        if (
            torch.is_inference_mode_enabled()
            or not module.training
            or _transform_level() is not None
        ):
            self.state = self.SKIP
            self.eval_forwards_skipped += 1
            return True
        if not torch.is_grad_enabled():
            # Evaluation in train mode, or the first pass of a reentrant checkpoint.
            self.state = self.SKIP
            self.eval_forwards_skipped += 1
            self._no_grad_training_forwards = min(self._no_grad_training_forwards + 1, 64)
            return True
        self._no_grad_training_forwards = 0
        self._open_training_forward(decision)
        return self.state == self.SKIP

    def _reset_forward_state(self) -> None:
        """Note a training root forward and reset what a root forward starts from."""
        self.root_forward_seen = True
        self._implicit_opener = None
        self._sample_in_backward = False
        self._recompute_anchor = -1

    def _open_training_forward(self, decision: bool | None = None) -> None:
        self._reset_forward_state()
        self._open_sample(decision)
        if self._sample_open:
            self.state = self.SAMPLED
        else:
            self._unsampled_training = True
            self._sentinel_calls = {}
            self.state = self.SENTINEL if self.full_sentinel else self.SKIP
        self._maybe_flush()

    def exit_root(self) -> None:
        """Close the innermost root forward."""
        if not self.attached:
            self._state_stack.clear()
            self.state = self.SKIP
            return
        stack = self._state_stack
        if stack:
            self.state = stack.pop()
        else:
            # A post-hook with no forward open: the root called itself inside a forward
            # left open-ended (whose inner call closed it). Never leave one open again.
            self._open_ended_off = "root module calls itself"
            self.state = self.IDLE
        if self._parked and not stack and compiled_frames() != self._frames_at_park:
            self._restore_hooks(reset=True)  # something was compiled during this forward
        if self.state == self.IDLE:
            self._unsampled_training = False

    def leave_root(self, index: int, args: tuple[object, ...], output: object) -> None:
        """The root returned (or raised, with ``output`` None): observe it, then close."""
        state = self.state
        stack = self._state_stack
        if state == 0 and self._unsampled_training and len(stack) == 1 and self.attached:
            # The steady state, an unsampled top-level training forward (SKIP): what the
            # branch below and exit_root do for it, in place.
            if not self.full_sentinel and _root_sentinel_due(
                self.forwards_seen - 1, self.ROOT_SENTINEL_INTERVAL
            ):
                self._root_sentinel(output)
            if self._parked and compiled_frames() != self._frames_at_park:
                self._restore_hooks(reset=True)  # something was compiled during this forward
            if self._parked and stack[0] == 2 and self._park_root_post():
                # Hooks stay parked: leave the forward open-ended, so that the next ones
                # can be quiet (this hook is called from a copy of the hook dict).
                stack.pop()
                self._open_ended = True
                self._plan_quiet_forwards()
                return
            self.state = state = stack.pop()
            if state == 2:  # IDLE
                self._unsampled_training = False
            return
        if state == self.SAMPLED or state == self.SENTINEL:
            self.on_forward(index, args, output)
            if self._sample_outputs and len(self._state_stack) == 1:
                self._sample_outputs = {}  # the forward is over: its outputs are not shared
            if not self._adoption_done and state == self.SAMPLED and len(stack) == 1:
                self._adoption_done = True
                try:
                    self._adopt_parents()
                except Exception as error:  # never break training
                    self.record_error("adopt_parents", "", error)
        elif (
            self._unsampled_training
            and len(self._state_stack) == 1  # the outer call, not the root calling itself
            and _root_sentinel_due(self.forwards_seen - 1, self.ROOT_SENTINEL_INTERVAL)
            and not self.full_sentinel
            and self.attached
        ):
            self._root_sentinel(output)
        self.exit_root()

    def _root_sentinel(self, output: object) -> None:
        """Check the root output of an unsampled training forward for non-finite values
        (one training forward in :attr:`ROOT_SENTINEL_INTERVAL`, see there).

        One reduction per output tensor. On the CPU the answer is read at once; on CUDA
        the count stays on the device and is read at the next flush (no host sync).
        A hit counts, is recorded, and makes the next forwards sampled.
        """
        try:
            with passive():
                if type(output) is Tensor and output.is_floating_point():
                    # The common case, kept short: one forward in 8 between samples.
                    self._sentinel_check(ROOT_INDEX, 0, "output", output)
                else:
                    self._sentinel_output(ROOT_INDEX, 0, output)
        except Exception as error:  # never break training
            self.record_error("sentinel", "", error)

    def _park_hooks(self) -> None:
        """Take the submodule hooks out of their modules while no forward needs them.

        In a forward that is not sampled every submodule hook would return at once, but
        PyTorch's dispatch to it alone costs 1 to 2 us per module call; a module without
        hooks takes ``nn.Module``'s hook-free fast path instead. Parking removes our hook
        from each module's ``_forward_hooks`` (only where it is that module's only forward
        hook, so hook order is unchanged). The hooks stay out across unsampled, eval and
        no-grad root forwards, and :meth:`_restore_hooks` puts them back when a root
        forward that needs them opens (sampled, full sentinel, recomputation in backward)
        and at removal, so parking costs one pass over the modules per sample, not per
        forward. While parked, calls of submodules outside any root forward are not seen
        (they are only ever counted, under ``calls_outside_root_skipped``), and nothing
        is parked while a sampled forward's reentrant checkpoints await their backward.

        Compiled code does not see hook changes (Dynamo does not guard on hooks), so
        parking stops for good once ``torch.compile`` has compiled anything in the
        process; if something was compiled during a parked forward, Dynamo's caches are
        reset so that the code is traced again with the hooks in place.
        """
        frames = compiled_frames()
        if frames != 0:
            self.hook_parking = "off: torch.compile in use"
            return
        if any(self._no_grad_calls.values()):
            return  # a sampled forward's reentrant checkpoints will run again in backward
        self._frames_at_park = frames
        # Only where ours is the module's only forward hook (order stays as it was).
        parked = [entry for entry in self._parkable if len(entry[0]) == 1 and entry[1] in entry[0]]
        for hooks, key, _ in parked:
            del hooks[key]
        self._parked = parked

    def _restore_hooks(self, *, reset: bool) -> None:
        """Put parked hooks back (see :meth:`_park_hooks`); with ``reset``, also reset
        Dynamo if something was compiled since they were parked."""
        parked = self._parked
        if not parked:
            return
        self._parked = []
        for hooks, key, hook in parked:
            if hooks:
                # A hook registered while ours was parked: ours goes back in front.
                others = list(hooks.items())
                hooks.clear()
                hooks[key] = hook
                hooks.update(others)
            else:
                hooks[key] = hook
        if compiled_frames() != self._frames_at_park:
            self.hook_parking = "off: torch.compile in use"
            if reset:
                # Code compiled while the hooks were parked would never call them.
                try:
                    torch._dynamo.reset()
                except Exception as error:
                    self.record_error("compile_reset", "", error)

    def _sentinel_output(self, index: int, call: int, output: object) -> None:
        for path, leaf in iter_output_tensors(output):
            if isinstance(leaf, Tensor) and skip_reason(leaf) is None:
                self._sentinel_check(index, call, path, leaf)

    def _sentinel_check(self, index: int, call: int, path: str, tensor: Tensor) -> None:
        self.sentinel_checks += 1
        forward = self.forwards_seen - 1
        value = tensor.detach()
        if value.is_complex():
            # Real and imaginary parts side by side: |z| could overflow where they do not.
            value = torch.view_as_real(value.resolve_conj())
        if value.is_cpu and "cpu" not in self.device_path_types:
            # A non-finite element makes the sum non-finite; one plain reduction is
            # cheaper than an isfinite mask (and a sum in the tensor's own dtype than one
            # with a dtype argument). Confirm before counting: a sum can overflow.
            if not math.isfinite(value.sum().item()):
                self._confirm_cpu_sentinel(index, call, path, value)
            return
        # One launch: a non-finite element makes the float64 sum non-finite, and float64
        # cannot overflow on a sum of finite float32 values. Float64 values can, so
        # their zero products are summed instead (NaN exactly where one is non-finite).
        if value.dtype == torch.float64:
            value = value * 0.0
        bad = value.sum(dtype=torch.float64).reshape(1)
        if value.is_cuda:
            self._producer_streams.add(torch.cuda.current_stream(value.device))
        # The position slot carries the index of the next sample, read when processed.
        self._pending.append(((index, call, _SENTINEL, path), forward, self.samples_observed, bad))

    def _confirm_cpu_sentinel(self, index: int, call: int, path: str, tensor: Tensor) -> None:
        """A CPU sentinel's sum was not finite: count a hit unless the sum only
        overflowed (every element finite)."""
        if not bool(torch.isfinite(tensor.detach()).all()):
            self._sentinel_hit(self.forwards_seen - 1, index, call, path, self.samples_observed)

    def _sentinel_hit(
        self, forward: int, index: int, call: int, path: str, next_sample: int
    ) -> None:
        """Count a non-finite value seen by a sentinel in unsampled training forward
        ``forward``; ``next_sample`` is the index the next sample takes."""
        self._forced_samples = self.FORCED_SAMPLES_AFTER_NONFINITE
        self._quiet_until = 0  # the next forwards are sampled
        self._quiet_sentinel = -1
        if forward == self._last_sentinel_forward:
            return  # only the first (earliest in forward order) per forward
        self._last_sentinel_forward = forward
        self.sentinel_nonfinite_forwards += 1
        if len(self.sentinel_events) < self.MAX_SENTINEL_EVENTS:
            self.sentinel_events.append(
                {
                    "forward_index": forward,
                    "module": self.names[index],
                    "call_index": call,
                    "tensor_path": path,
                    "next_sample": next_sample,
                }
            )

    def _open_sample(self, decision: bool | None = None) -> None:
        index = self.forwards_seen
        self.forwards_seen += 1
        if decision is None:  # user policies may return ints
            decision = bool(self.policy.should_sample(index))
        sampled = decision
        if self._forced_samples > 0:
            self._forced_samples -= 1
            sampled = True
        self._sample_open = sampled
        if sampled:
            self._sample = self.samples_observed
            self.samples_observed += 1
            if self.samples_observed == self.track_config.warmup_samples:
                # The first rewrite falls due at the end of warm-up (at the next
                # _maybe_flush), not only rewrite_interval_s after injection.
                self._last_write = -math.inf
            self.sample_forwards.append(index)
            if self.caller_step is not None:
                steps = self._sample_steps
                steps[self._sample] = self.caller_step
                if len(steps) > MAX_SAMPLE_STEPS:
                    del steps[next(iter(steps))]
            awaiting = self._awaiting_backward
            awaiting[self._sample] = None
            if len(awaiting) > MAX_SAMPLES_AWAITING_BACKWARD:
                del awaiting[next(iter(awaiting))]
            self._calls = {}
            self._position = 0
            self._no_grad_calls = {}
            self._sample_outputs = {}

    # ------------------------------------------------------------------ capture
    def on_forward(self, index: int, args: tuple[object, ...], output: object) -> None:
        """A selected module returned ``output`` (only called when not in SKIP state)."""
        started = time.perf_counter()
        try:
            with passive():
                self._on_forward(index, args, output)
        finally:
            self._note_cost(time.perf_counter() - started)

    def _note_cost(self, seconds: float) -> None:
        self.telemetry_seconds += seconds
        if self._cost_listener is not None:
            try:  # a user policy's method: whatever it raises stays here
                self._cost_listener(seconds)
            except Exception as error:
                self.record_error("policy.note_cost", "", error)

    def _on_forward(self, index: int, args: tuple[object, ...], output: object) -> None:
        if not self.attached:
            return
        try:
            state = self.state
            if state == self.SENTINEL:
                call = self._sentinel_calls.get(index, 0)
                self._sentinel_calls[index] = call + 1
                self._sentinel_output(index, call, output)
                return
            if state != self.SAMPLED:
                if in_backward():
                    self._on_recompute(index, args, output)
                    return
                if state != self.IDLE or not self._open_implicit(index):
                    return
            elif in_backward() and not self._sample_in_backward:
                return
            self._observe_call(index, args, output)
        except Exception as error:  # never break training
            self.record_error("forward", self.names[index], error)

    def _open_implicit(self, index: int) -> bool:
        """A module ran with no root forward open: group such calls into samples."""
        module = self._modules[index]()
        if (
            module is None
            or not torch.is_grad_enabled()
            or torch.is_inference_mode_enabled()
            or not module.training
            or _transform_level() is not None
        ):
            return False
        if self.root_forward_seen and not self.capture_direct_forwards:
            # Training goes through the root: a submodule called on its own (an auxiliary
            # loss, a probe) is a side computation, kept out of the training series
            # (capture_direct_forwards=True asks for such calls to be observed).
            self.calls_outside_root += 1
            return False
        if (
            self._implicit_opener is not None
            and not self._implicit_backward_seen
            and index != self._implicit_opener
        ):
            return self._sample_open
        self._implicit_opener = index
        self._implicit_backward_seen = False
        self.implicit_samples += 1
        self._open_sample()
        self._maybe_flush()
        return self._sample_open

    def _observe_call(self, index: int, args: tuple[object, ...], output: object) -> None:
        self.modules_called.add(index)
        calls = self._calls
        call = calls.get(index, 0)
        calls[index] = call + 1
        position = self._position
        self._position = position + 1
        sample = self._sample
        grad_enabled = torch.is_grad_enabled()
        outputs = self._sample_outputs
        taken = 0
        for path, leaf in iter_output_tensors(output):
            reason = skip_reason(leaf)
            if reason is not None:
                self.skipped_tensors[reason] += 1
                continue
            taken += 1
            if taken > MAX_TENSORS_PER_OUTPUT:
                self.paths_dropped += 1
                continue
            assert isinstance(leaf, Tensor)
            key = (index, call, ACTIVATION, path)
            version = _version(leaf)
            first = outputs.get(id(leaf)) if version is not None else None
            if first is not None and (first[0]() is not leaf or first[1] != version):
                first = None
            if first is None:
                self._measure(key, sample, position, leaf)
            else:
                # What an earlier call of this sample returned, unchanged since (a
                # container or the root passing on a submodule's output): the same
                # values and the same gradient, so its rows are shared, not measured.
                # (A change through ``.data`` bumps no version and goes unseen here.)
                self._add_alias(first[2], sample, key, position)
            if self.histogram_specs:
                self._histogram(index, call, ACTIVATION, path, sample, leaf)
            if leaf.requires_grad and grad_enabled:
                node = leaf.grad_fn
                if node is not None:
                    grad_key = (index, call, GRAD_OUTPUT, path)
                    if (
                        first is not None
                        and first[3] is not None
                        and not self._hist_plan.get((index, GRAD_OUTPUT))
                    ):
                        self._add_alias(first[3], sample, grad_key, -1)
                        continue
                    node.register_prehook(
                        NodeGradHook(self, (index, call, path), sample, leaf.output_nr)
                    )
                    if first is None and version is not None:
                        outputs[id(leaf)] = (weakref.ref(leaf), version, key, grad_key)
                    continue
                # A module that returns a parameter: a hook on a leaf outlives the
                # graph, so it removes itself after its first gradient (and at detach).
                hook = GradHook(self, (index, call, path), sample)
                hook.handle = leaf.register_hook(hook)
                self._leaf_hooks.append(hook.handle)
                if len(self._leaf_hooks) > MAX_SAMPLES_AWAITING_BACKWARD:
                    self._leaf_hooks.pop(0).remove()
            if first is None and version is not None:
                outputs[id(leaf)] = (weakref.ref(leaf), version, key, None)
        if not grad_enabled:
            # Under no_grad inside a training forward (reentrant checkpointing): the
            # gradient flows through a recomputation during backward.
            self._no_grad_calls.setdefault(index, []).append(
                (call, sample, _first_tensor_pointer(args), position)
            )

    def _on_recompute(self, index: int, args: tuple[object, ...], output: object) -> None:
        """A forward re-run during backward: attach gradient hooks for reentrant calls.

        Recomputations that no sampled call awaits are ignored and counted."""
        waiting = self._no_grad_calls.get(index)
        if not waiting or not torch.is_grad_enabled():
            self.recompute_calls += 1
            return
        # The first module of a recomputed region receives the region's saved inputs
        # (same storage as in the first pass); later ones replay the first pass's call
        # order, so continue from the last matched position.
        pointer = _first_tensor_pointer(args)
        chosen = next((item for item in waiting if pointer and item[2] == pointer), None)
        if chosen is None:
            later = [item for item in waiting if item[3] > self._recompute_anchor]
            chosen = min(later, key=lambda item: item[3]) if later else waiting[-1]
        waiting.remove(chosen)
        call, sample, _, position = chosen
        self._recompute_anchor = position
        for path, leaf in iter_output_tensors(output):
            if (
                isinstance(leaf, Tensor)
                and skip_reason(leaf) is None
                and leaf.requires_grad
                and not leaf.is_leaf
            ):
                leaf.register_hook(GradHook(self, (index, call, path), sample))

    def on_grad(self, key: tuple[int, int, str], sample: int, grad: Tensor) -> None:
        """An output gradient arrived for a sampled tensor."""
        started = time.perf_counter()
        try:
            with passive():
                self._on_grad(key, sample, grad)
        finally:
            self._note_cost(time.perf_counter() - started)

    def _on_grad(self, key: tuple[int, int, str], sample: int, grad: Tensor) -> None:
        if not self.attached:
            return
        try:
            seen = self._grad_keys_seen.get(sample)
            if seen is None:
                seen = set()
                self._grad_keys_seen[sample] = seen
                if len(self._grad_keys_seen) > MAX_SAMPLES_AWAITING_BACKWARD:
                    del self._grad_keys_seen[next(iter(self._grad_keys_seen))]
                if sample not in self._backward_counted:
                    self._backward_counted[sample] = None
                    if len(self._backward_counted) > 4 * MAX_SAMPLES_AWAITING_BACKWARD:
                        del self._backward_counted[next(iter(self._backward_counted))]
                    self.backward_samples_observed += 1
                self._awaiting_backward.pop(sample, None)
                if self._implicit_opener is not None and sample == self._sample:
                    self._implicit_backward_seen = True
            elif key in seen:
                self.repeated_gradients += 1  # retain_graph: another backward pass
                self._sum_repeated((key[0], key[1], GRAD_OUTPUT, key[2]), sample, grad)
                return
            seen.add(key)
            reason = skip_reason(grad)
            if reason is not None:
                self.skipped_tensors[f"grad_{reason}"] += 1
                return
            index, call, path = key
            grad_key = (index, call, GRAD_OUTPUT, path)
            self._last_staged = None
            self._measure(grad_key, sample, -1, grad)
            if self._last_staged is not None:
                buffers = self._grad_buffers
                buffers[(grad_key, sample)] = self._last_staged
                self._last_staged = None
                if len(buffers) > MAX_PENDING_RECORDS:
                    del buffers[next(iter(buffers))]
            if self.histogram_specs:
                self._histogram(index, call, GRAD_OUTPUT, path, sample, grad)
        except Exception as error:  # never break training
            self.record_error("backward", self.names[key[0]], error)

    def _sum_repeated(self, key: _Key, sample: int, grad: Tensor) -> None:
        """Another backward pass over sample ``sample`` (``retain_graph=True``) brought
        ``grad`` for ``key``: add it to the staged copy of the earlier passes' gradient,
        so that what is measured is the total gradient that reached the output. Only
        while that copy is not reduced yet (small tensors, until the next flush or the
        slab fills: backward passes run one after the other within a step); otherwise
        counted under ``coverage.backward_gradients_not_summed``."""
        buffer = self._grad_buffers.get((key, sample))
        if buffer is None or buffer.numel() != grad.numel() or skip_reason(grad) is not None:
            self.gradients_not_summed += 1
            return
        with self._slab_lock:
            buffer.view(grad.shape).add_(grad.detach())
        self.gradients_summed += 1

    def note_loss_scale(self, scale: Tensor) -> None:
        """``GradScaler.scale`` ran: the coming backward's gradients carry ``scale``.

        It applies to every sampled forward whose backward has not started yet (several
        forwards may share one scaled backward).
        """
        if not self.attached or not self._awaiting_backward:
            return
        try:
            with passive():
                value = _padded_row(scale.detach().reshape(-1)[:1].to(torch.float64))
            for sample in self._awaiting_backward:
                self._append_record((-1, 0, _LOSS_SCALE, ""), sample, value)
        except Exception as error:
            self.record_error("loss_scale", "", error)

    def _histogram(
        self, index: int, call: int, signal: str, path: str, sample: int, tensor: Tensor
    ) -> None:
        for number in self._hist_plan.get((index, signal), ()):
            spec = self.histogram_specs[number]
            if sample % spec.every_n_samples:
                continue
            key = (index, call, f"{_HISTOGRAM}{number}:{signal}", path)
            self._append_record(key, sample, histogram_counts(tensor, spec))

    def _measure(
        self, key: tuple[int, int, str, str], sample: int, position: int, tensor: Tensor
    ) -> None:
        """Reduce one observed tensor, or stage a float32 copy of it for a batch.

        Small tensors are copied and reduced later, many at a time (per-operation
        overhead, not arithmetic, is what reducing them costs: PyTorch's dispatch on the
        CPU, a kernel launch on CUDA): on the CPU into a row of the staging slab of their
        length (:class:`_Slab`), reduced when it is full or at a flush; on CUDA into a
        ragged device batch (:meth:`_reduce_staged`). The copy is needed: the tensor may
        be changed in place after the hook returns (``out += residual``, ``relu_``).
        Larger CPU tensors get their full passes at once and their subsample staged
        (:class:`~torchinstruments.reduce.Subsample`), and larger CUDA tensors are reduced
        to a device vector (no synchronisation).
        """
        numel = tensor.numel()
        device_type = tensor.device.type
        if (
            device_type in self.device_path_types
            and numel <= DEVICE_STAGE_MAX_NUMEL
            and tensor.dtype in _STAGED_DTYPES
        ):
            copy = tensor.detach().to(
                torch.float32, memory_format=torch.contiguous_format, copy=True
            )
            self._staged.append((key, sample, position, copy.view(-1)))
            if device_type == "cuda":
                self._producer_streams.add(torch.cuda.current_stream(tensor.device))
            self._device_staged_elements += numel
            self._last_staged = copy.view(-1)
            if self._device_staged_elements > DEVICE_STAGE_MAX_ELEMENTS:
                self._reduce_staged()
            return
        if device_type != "cpu":
            if device_type == "cuda":
                self._producer_streams.add(torch.cuda.current_stream(tensor.device))
            self._pending.append((key, sample, position, tensor_statistics(tensor)))
            return
        if numel <= STAGE_MAX_NUMEL and tensor.dtype in _STAGED_DTYPES:
            with self._slab_lock:
                slab = self._slabs.get(numel)
                if slab is None:
                    slab = self._new_slab(numel)
                if slab is not None:
                    # Copied (as float32, in logical order) into the slab's next free row.
                    row = slab.next_row()
                    if tensor.is_contiguous():
                        row.copy_(tensor.detach().view(-1))
                    else:
                        row.view(tensor.shape).copy_(tensor.detach())
                    records = slab.records
                    records.append((key, sample, position))
                    slab.used = True
                    self._slab_records += 1
                    self._last_staged = row
                    if len(records) == slab.capacity:
                        self._reduce_slab(slab)
                    return
            # More lengths than slabs (dynamic shapes): a copy of its own, reduced at the
            # flush with the other copies of its length.
            copy = tensor.detach().to(
                torch.float32, memory_format=torch.contiguous_format, copy=True
            )
            self._staged.append((key, sample, position, copy.view(-1)))
            self._staged_elements += numel
            self._last_staged = copy.view(-1)
            if self._staged_elements > STAGE_MAX_ELEMENTS:
                self._reduce_staged()
            return
        result = cpu_statistics_deferred(tensor)
        if isinstance(result, Subsample):
            # The full passes are done; the subsample's own statistics (about ten small
            # operations) are taken in a batch with the other staged tensors.
            self._staged.append((key, sample, position, result))
            self._staged_elements += result.part.numel()
            if self._staged_elements > STAGE_MAX_ELEMENTS:
                self._reduce_staged()
            return
        self._pending.append((key, sample, position, result))

    def _new_slab(self, numel: int) -> _Slab | None:
        """A slab for tensors of ``numel`` elements (lock held), or None: then the tensor
        is copied on its own.

        A length gets a slab the second time it is met between two flushes (with dynamic
        shapes most lengths come and go, and a slab is worth its making only for one
        that recurs); slabs then stay while they are used. While the slabs would exceed
        ``STAGE_MAX_ELEMENTS``, slabs unused since the last flush are freed; if that is
        not enough, None. Evicting busy slabs for new lengths made and dropped a slab per
        copy once a step had more lengths than fit (17 and more), four times the cost of
        a copy of its own.
        """
        seen = self._lengths_seen
        if numel not in seen:
            if len(seen) >= 4 * SLAB_MAX_ROWS:
                seen.clear()
            seen[numel] = None
            return None
        size = _Slab.capacity_for(numel) * numel
        slabs = self._slabs
        if self._slab_elements + size > STAGE_MAX_ELEMENTS:
            for length, stale in list(slabs.items()):
                if not stale.used and not stale.records:
                    del slabs[length]
                    self._slab_elements -= stale.matrix.numel()
                    if self._slab_elements + size <= STAGE_MAX_ELEMENTS:
                        break
            if self._slab_elements + size > STAGE_MAX_ELEMENTS:
                return None
        slab = _Slab(numel)
        self._slabs[numel] = slab
        self._slab_elements += slab.matrix.numel()
        return slab

    def _reduce_slab(self, slab: _Slab) -> None:
        """Reduce the filled rows of ``slab`` into pending host rows (lock held)."""
        records = slab.records
        if not records:
            return
        self._grad_buffers.clear()  # rows are reused: no gradient may be added any more
        self._last_staged = None
        slab.records = []
        self._slab_records -= len(records)
        matrix = slab.matrix[: len(records)]
        try:
            scratch = self._slab_scratch
            if scratch is None:
                scratch = self._slab_scratch = torch.empty(BATCH_MAX_ELEMENTS)
            rows = cpu_statistics_matrix_(matrix, scratch=scratch)
        except Exception as error:
            # The rows are workspace now: nothing to retry; the error is counted.
            self.record_error("reduce", self.names[records[0][0][0]], error)
            return
        pending = self._pending
        for (key, sample, position), row in zip(records, rows, strict=True):
            pending.append((key, sample, position, row))

    def _reduce_slabs(self) -> None:
        """Reduce every slab (a flush); free them all once the observer is detached."""
        with self._slab_lock:
            self._lengths_seen.clear()
            slabs = self._slabs
            for slab in slabs.values():
                self._reduce_slab(slab)
                slab.used = False
            if not self.attached:
                slabs.clear()
                self._slab_elements = 0
                self._slab_scratch = None

    def _reduce_staged(self) -> None:
        """Reduce the staged copies, grouped by length, into pending host rows."""
        if self._slabs or self._lengths_seen:
            self._reduce_slabs()
        staged = self._staged
        self._grad_buffers.clear()  # reduced below: no gradient may be added any more
        self._last_staged = None
        # Pop rather than swap lists: worker threads may be appending meanwhile.
        taken = [staged.popleft() for _ in range(len(staged))]
        self._staged_elements = self._device_staged_elements = 0
        if not taken:
            return
        # Subsamples of large CPU tensors and copies of small ones (lengths without a
        # slab) are batched by length; a device batch takes copies of any lengths.
        groups: dict[tuple[bool, torch.device, int], list[int]] = {}
        device_path_types = self.device_path_types
        for i, record in enumerate(taken):
            value = record[3]
            if isinstance(value, Subsample):
                key = (True, value.part.device, value.part.numel())
            elif value.device.type in device_path_types:
                key = (False, value.device, 0)
            else:
                key = (False, value.device, value.numel())
            groups.setdefault(key, []).append(i)
        pending = self._pending
        for (subsamples, device, length), indices in groups.items():
            rows: Sequence[Tensor | list[float] | None]
            values = [taken[i][3] for i in indices]
            try:
                if subsamples:
                    rows = cpu_statistics_subsamples(values)  # type: ignore[arg-type]
                elif length:
                    rows = cpu_statistics_batch(values)  # type: ignore[arg-type]
                else:
                    if device.type == "cuda":
                        self._order_streams(device, values)  # type: ignore[arg-type]
                    rows = device_statistics_batch_unchecked(values).unbind(0)  # type: ignore[arg-type]
            except Exception:
                # One bad value must not cost the whole batch: reduce them one by one.
                rows = [self._reduce_one(taken[i]) for i in indices]
            for i, row in zip(indices, rows, strict=True):
                if row is not None:
                    key, sample, position, _ = taken[i]
                    pending.append((key, sample, position, row))

    def _order_streams(self, device: torch.device, tensors: Sequence[Tensor]) -> None:
        """Make the current CUDA stream wait (on the device, no host sync) for the other
        streams that made ``tensors``, and keep their memory until it has used them
        (the caching allocator would otherwise hand it back to the making stream)."""
        current = torch.cuda.current_stream(device)
        others = [s for s in self._producer_streams if s.device == device and s != current]
        if not others:
            return
        for stream in others:
            current.wait_stream(stream)
        for tensor in tensors:
            tensor.record_stream(current)

    def _order_pending(self, pending: Sequence[_Record]) -> None:
        """:meth:`_order_streams` for the device rows about to be stacked and copied."""
        by_device: dict[torch.device, list[Tensor]] = {}
        for *_, row in pending:
            if isinstance(row, Tensor) and row.is_cuda:
                by_device.setdefault(row.device, []).append(row)
        for device, rows in by_device.items():
            self._order_streams(device, rows)

    def _reduce_one(self, record: _Staged) -> Tensor | list[float] | None:
        try:
            flat = record[3]
            if isinstance(flat, Subsample):
                return cpu_statistics_subsamples([flat])[0]
            return cpu_statistics_unchecked(flat) if flat.is_cpu else tensor_statistics(flat)
        except Exception as error:
            self.record_error("reduce", self.names[record[0][0]], error)
            return None

    def _append_record(
        self, key: tuple[int, int, str, str], sample: int, row: Tensor | list[float]
    ) -> None:
        if isinstance(row, Tensor) and row.is_cuda:
            self._producer_streams.add(torch.cuda.current_stream(row.device))
        self._pending.append((key, sample, -1, row))

    def _add_alias(self, measured: _Key, sample: int, key: _Key, position: int) -> None:
        """Give ``key`` (at forward ``position``) the row that ``measured`` gets in
        ``sample``, when it is processed (see :meth:`_process`)."""
        aliases = self._aliases
        entry = aliases.get((measured, sample))
        if entry is None:
            aliases[(measured, sample)] = [(key, position)]
            if len(aliases) > MAX_ALIASED_ROWS:
                # A row that never comes (a sample whose backward never ran).
                del aliases[next(iter(aliases))]
        else:
            entry.append((key, position))

    def record_error(self, stage: str, module: str, error: BaseException) -> None:
        """Count an error raised inside a hook; keep the first few distinct ones.

        Errors are grouped by kind and place (stage, module, exception type), never by
        message text, which may vary from one occurrence to the next (a temporary
        file name, a tensor shape): one failure repeated fills one entry, which keeps
        the first message, so a later, different error still gets an entry of its own.
        """
        self.error_count += 1
        try:
            text = str(error).strip()
        except Exception:  # a user exception whose __str__ raises
            text = ""
        message = text.splitlines()[0][:300] if text else ""
        key = (stage, module, type(error).__name__)
        entry = self.errors.get(key)
        if entry is None:
            if len(self.errors) >= max(self.report_config.max_error_entries, 1) * 4:
                return
            entry = _ErrorEntry(stage, module, type(error).__name__, message)
            entry.first_sample = self._sample if self._sample >= 0 else None
            self.errors[key] = entry
        entry.count += 1

    # ------------------------------------------------------------------ flush
    def _maybe_flush(self) -> None:
        pending = len(self._pending) + len(self._staged) + self._slab_records
        interval = (
            DEVICE_FLUSH_INTERVAL_FORWARDS
            if self._producer_streams
            else self.FLUSH_INTERVAL_FORWARDS
        )
        if pending and self._prompt_sinks:
            self.flush_statistics(block=True)  # the previous samples, complete by now
        elif pending >= MAX_PENDING_RECORDS or (pending and self.forwards_seen % interval == 0):
            self.flush_statistics(block=False)
        if time.monotonic() - self._last_write >= self._rewrite_interval_s:
            self.write_report(block=False)

    def flush_statistics(self, *, block: bool = True) -> None:
        """Move pending statistics to the host and update the trackers.

        Each flush stacks the pending vectors per device and starts one copy to the host
        (non-blocking into pinned memory on CUDA). With ``block=False`` (inside hooks)
        only batches whose copy has completed are processed, so no hook waits on the
        device; ``block=True`` waits for all of them.
        """
        with passive():
            self._flush_statistics(block)

    def _flush_statistics(self, block: bool) -> None:
        self._reduce_staged()
        pending = self._pending
        if pending:
            self._pending = []
            # Trackers need each series in sample order; rows of small tensors (staged)
            # come after rows of large ones (reduced at once) of later samples.
            pending.sort(key=itemgetter(1))  # by sample
            try:
                if self._producer_streams:
                    ordered = set(self._producer_streams)
                    self._order_pending(pending)
                    # What those streams made so far is ordered now; a stream another
                    # thread added meanwhile stays for the next flush.
                    self._producer_streams -= ordered
                self._in_flight.append(_launch_transfer(pending))
            except Exception as error:
                self.record_error("flush", "", error)
        while self._in_flight:
            batch = self._in_flight[0]
            if not block and not batch.ready():
                break
            self._in_flight.pop(0)
            try:
                self._process(batch.meta, batch.rows())
            except Exception as error:
                self.record_error("flush", "", error)

    def _process(self, meta: list[_Meta], rows: list[list[float]]) -> None:
        grad_groups: dict[int, list[tuple[tuple[int, int, str, str], dict[str, float | None]]]]
        grad_groups = {}
        loss_scales = self._loss_scales
        scalars: list[tuple[TensorSeries, int, dict[str, float | None]]] = []
        config = self.track_config
        aliases = self._aliases
        forward_of = self.sample_forwards.forward
        forwards: dict[int, int | None] = {}
        for (key, sample, position), row in zip(meta, rows, strict=True):
            if key[2] == _LOSS_SCALE:
                if row[0] > 0 and math.isfinite(row[0]):
                    loss_scales[sample] = row[0]
                    if len(loss_scales) > 4 * MAX_SAMPLES_AWAITING_BACKWARD:
                        del loss_scales[next(iter(loss_scales))]
                continue
            if key[2].startswith(_HISTOGRAM):
                self._add_histogram(key, sample, row)
                continue
            if key[2] == _SENTINEL:
                if not math.isfinite(row[0]):
                    self._sentinel_hit(sample, key[0], key[1], key[3], position)
                continue
            values = finish_statistics(row)
            shared = aliases.pop((key, sample), None) if aliases else None
            if key[2] == GRAD_OUTPUT:
                group = grad_groups.setdefault(sample, [])
                group.append((key, values))
                if shared:
                    # Copies: each is divided by the loss scale and the root RMS later.
                    group.extend((alias, dict(values)) for alias, _ in shared)
                continue
            for series_key, series_position in ((key, position), *(shared or ())):
                series = self._series_for(series_key)
                if series is None:
                    continue
                series.forward_position = series_position
                forward = forwards.get(sample, -1)
                if forward == -1:
                    forward = forwards[sample] = forward_of(sample)
                series.update(config, sample, values, forward)
                if self._scalar_sinks:
                    scalars.append((series, sample, values))
        for sample in sorted(grad_groups):
            group = grad_groups[sample]
            forward = forward_of(sample)
            loss_scale = loss_scales.get(sample)
            if loss_scale is not None:
                self.loss_scale.update(sample, loss_scale, forward)
                for _, values in group:
                    for metric in _SCALE_METRICS:
                        value = values[metric]
                        if value is not None:
                            values[metric] = value / loss_scale
            reference = next(
                (v["rms"] for k, v in group if k[0] == ROOT_INDEX and v["rms"] is not None),
                None,
            )
            for key, values in group:
                series = self._series_for(key)
                if series is None:
                    continue
                rms = values["rms"]
                if key[0] != ROOT_INDEX and reference and rms is not None:
                    # Net of the loss gradient: what the model between here and the
                    # output does to the gradient (loss scale and loss size cancel).
                    values[RMS_TO_ROOT] = rms / reference
                series.update(config, sample, values, forward)
                if self._scalar_sinks:
                    scalars.append((series, sample, values))
        if scalars:
            self._forward_scalars(scalars)

    def _forward_scalars(
        self, measured: list[tuple[TensorSeries, int, dict[str, float | None]]]
    ) -> None:
        """Hand one host batch of per-sample values to each scalar sink."""
        steps: dict[int, int] = {}
        for _, sample, _ in measured:
            if sample not in steps:
                steps[sample] = self.sink_step(sample)
        for sink in self._scalar_sinks:
            wanted = getattr(sink, "metrics", ("rms",))
            batch = [
                (
                    scalar_tag(s.module, s.call_index, s.signal, s.tensor_path, metric),
                    value,
                    steps[sample],
                )
                for s, sample, values in measured
                for metric in wanted
                if (value := values.get(metric)) is not None
            ]
            try:
                sink.write_scalars(batch)
            except Exception as error:
                self.record_error("sink", type(sink).__name__, error)

    def sink_step(self, sample: int) -> int:
        """The step that dashboard sinks log ``sample`` at: the caller's step when the
        sample opened (``ObserverHandle.set_step``), else the index of its training
        forward (0-based; the optimizer step with one forward per step), else (when
        that was not kept) the sample index."""
        step = self._sample_steps.get(sample)
        if step is not None:
            return step
        forward = self.sample_forwards.forward(sample)
        return sample if forward is None else forward

    def _add_histogram(self, key: tuple[int, int, str, str], sample: int, row: list[float]) -> None:
        number_text, signal = key[2][len(_HISTOGRAM) :].split(":", 1)
        number = int(number_text)
        histogram_key = (key[0], key[1], signal, key[3], number)
        histogram = self.histograms.get(histogram_key)
        if histogram is None:
            histogram = Histogram(self.histogram_specs[number])
            self.histograms[histogram_key] = histogram
        histogram.add(sample, row)
        if self._histogram_sinks:
            tag = scalar_tag(self.names[key[0]], key[1], signal, key[3], "histogram")
            for sink in self._histogram_sinks:
                try:
                    sink.write_histogram(tag, histogram.spec.edges, row, self.sink_step(sample))
                except Exception as error:
                    self.record_error("sink", type(sink).__name__, error)

    def _series_for(self, key: tuple[int, int, str, str]) -> TensorSeries | None:
        series = self.series.get(key)
        if series is not None:
            return series
        if len(self.series) >= self.track_config.max_series:
            self.series_dropped += 1
            return None
        index, call, signal, path = key
        series = TensorSeries(
            module=self.names[index],
            call_index=call,
            signal=signal,
            tensor_path=path,
            forward_position=-1,
            trackers={},
        )
        self.series[key] = series
        return series

    # ------------------------------------------------------------------ report
    def build_report(self, *, block: bool = True) -> dict[str, Any]:
        """Flush statistics and build the report dict (JSON-safe).

        ``block=False`` (inside hooks) uses only batches already on the host.
        """
        from .report import build_report

        self.flush_statistics(block=block)
        return build_report(self)

    def write_report(
        self, *, block: bool = True, flush: bool = True, files_only: bool = False
    ) -> None:
        """Build the report and hand it to the writer and sinks; never raises.

        ``flush=False`` writes what is on the host already (pending statistics stay
        pending): used from a signal handler that may have interrupted a flush.
        ``files_only=True`` writes the files of ``output_dir`` and nothing to the sinks
        (the first report, written at injection).
        """
        if self.forked_from_pid is not None and self.forwards_seen == self.forwards_at_fork:
            return  # a forked child that never trained: nothing of its own to write
        started = time.perf_counter()
        self.writing = True
        try:
            with passive():
                self._write_report(block, flush, files_only)
        except Exception as error:  # never into training, whatever the warning filters
            self.record_error("report", "", error)
        finally:
            self.writing = False
            self._note_cost(time.perf_counter() - started)
        _on_termination.deliver_deferred()

    def _adopt_parents(self) -> None:
        """After the first sampled training forward: observe the parent of every
        selected module that did not run in it, if the parent is not observed yet.

        A parent that computes with a child's weights in functional code never calls
        the child: ``nn.MultiheadAttention`` applies ``out_proj`` with
        ``F.multi_head_attention_forward``, so the attention output of every
        ``nn.TransformerEncoderLayer`` would go unobserved. Its parent's output is that
        output. Adopted parents are listed under ``coverage.parents_observed``.
        """
        root = self.root
        if root is None or self.capture_direct_forwards:
            return
        observed = {id(ref()) for ref in self._modules}
        for index, name in enumerate(list(self.names)):
            if index == ROOT_INDEX or index in self.modules_called:
                continue
            parent_name = name.rpartition(".")[0]
            if not parent_name or parent_name in self.parents_adopted.values():
                if parent_name:
                    self.parents_adopted[name] = parent_name
                continue
            try:
                parent = root.get_submodule(parent_name)
            except AttributeError:
                continue
            if id(parent) in observed or isinstance(parent, nn.ModuleList | nn.ModuleDict):
                continue  # observed already, or a container that is never called
            new_index = len(self.names)
            self.names.append(parent_name)
            self._modules.append(weakref.ref(parent))
            for kind in (ACTIVATION, GRAD_OUTPUT):
                self._hist_plan[(new_index, kind)] = tuple(
                    n
                    for n, spec in enumerate(self.histogram_specs)
                    if spec.applies_to(parent_name, kind)
                )
            hook = ForwardHook(self, new_index)
            handle = parent.register_forward_hook(hook)
            self._handles.append(handle)
            self._parkable.append((parent._forward_hooks, handle.id, hook))
            observed.add(id(parent))
            self.parents_adopted[name] = parent_name

    def modules_replaced(self) -> list[str]:
        """Names of observed modules that are no longer in their place in the model
        (``model.h[1].ln_1 = nn.Identity()`` after injection): the module now there
        carries no hook of ours, so that place is no longer observed."""
        root = self.root
        if root is None:
            return []
        replaced = []
        for index, name in enumerate(self.names):
            if index == ROOT_INDEX:
                continue
            try:
                current: object = root.get_submodule(name)
            except AttributeError:
                current = None
            if current is not self._modules[index]():
                replaced.append(name)
        return replaced

    def module_kinds(self) -> dict[str, str]:
        """Class name (``Linear``, ``LayerNorm``, ...) per selected module name, for the
        modules still alive (the report words its advice by the kind of module)."""
        kinds = {}
        for name, ref in zip(self.names, self._modules, strict=False):
            module = ref()
            if module is not None:
                kinds[name] = type(module).__name__
        return kinds

    def forked(self, parent_pid: int) -> None:
        """Called in a child process forked while this observer was attached.

        The child must never write the parent's files: its directory writers are
        pointed at ``fork-<pid>/`` under the parent's directory, other sinks (the
        parent's loggers) are dropped, and nothing at all is written unless the child
        runs a training forward of its own (a DataLoader worker never does; Hogwild
        training with ``torch.multiprocessing`` does, and then says so in ``run``).
        """
        from .sinks import DirectorySink

        def own(sink: object) -> object:
            if not isinstance(sink, DirectorySink):
                return None
            return DirectorySink(
                sink.path / f"fork-{os.getpid()}",
                write_full_details=sink.write_full_details,
                plots=sink.plots,
                write_series_summary=sink.write_series_summary,
            )

        self.forked_from_pid = parent_pid
        self.forwards_at_fork = self.forwards_seen
        self.writer = own(self.writer)
        self.sinks = [s for s in map(own, self.sinks) if s is not None]
        self._scalar_sinks = []
        self._histogram_sinks = []

    def write_on_signal(self) -> None:
        """Write the report from a signal handler, which runs on the main thread between
        two bytecodes, possibly inside one of our hooks: pending statistics are flushed
        only if the staging lock can be taken (the interrupted code may hold it)."""
        if self._slab_lock.acquire(timeout=0.5):
            self._slab_lock.release()
            self.write_report()
        else:
            self.write_report(flush=False)

    def _write_report(self, block: bool, flush: bool = True, files_only: bool = False) -> None:
        from .report import build_report, build_series_summary

        self._last_write = time.monotonic()
        sinks = () if files_only else self.sinks
        summarising = [
            target
            for target in (self.writer, *sinks)
            if target is not None and getattr(target, "write_series_summary", False)
        ]
        summary = None
        try:
            if flush:
                self.flush_statistics(block=block)
            if summarising:
                # Before the report, whose coverage counts the rows it omits.
                summary = build_series_summary(self, self.report_config.series_summary_max_bytes)
                self.series_summary_omitted = summary["omitted"]
        except Exception as error:
            self.record_error("series_summary", "", error)
        try:
            report = build_report(self)  # statistics flushed above
        except Exception as error:
            self.record_error("report", "", error)
            return
        writer = self.writer
        if writer is not None:
            try:
                writer.write(report)
                self.reports_written += 1
            except Exception as error:  # each file is written on its own: go on
                self.record_error("write", "", error)
                if not self._warned_write:
                    self._warned_write = True
                    _warn(
                        f"torchinstruments could not write its report ({error}); training "
                        "continues, the error is counted and the next write is retried"
                    )
        for sink in sinks:
            try:
                sink.write(report)
            except Exception as error:
                self.record_error("sink", type(sink).__name__, error)
        if summary is not None:
            for target in summarising:
                try:
                    target.write_summary(summary)
                except Exception as error:
                    self.record_error("series_summary", type(target).__name__, error)
        wanting = [
            target
            for target in (writer, *sinks)
            if target is not None and getattr(target, "write_full_details", False)
        ]
        if wanting:
            from .report import build_details

            details = build_details(self)
            for target in wanting:
                try:
                    target.write_details(details)
                except Exception as error:
                    self.record_error("details", type(target).__name__, error)


def _warn(message: str) -> None:
    """Issue a ``RuntimeWarning`` that never raises: under ``-W error`` (or a
    ``filterwarnings = error`` test setting) a warning becomes an exception, which must
    not reach the training loop; it is then dropped (the error it reports is counted in
    the report anyway)."""
    with contextlib.suppress(Exception):
        warnings.warn(message, RuntimeWarning, stacklevel=3)


class _TerminationWriter:
    """Writes the report of every live observer when the process gets ``SIGTERM``.

    torchrun, SLURM, Kubernetes and ``timeout`` stop a job with SIGTERM, whose default
    action ends the process without running ``atexit`` handlers. The handler is
    installed (from the main thread only, where Python allows it) when the first
    observer attaches and put back when the last one detaches, if it is still ours.
    On the signal it writes each live observer's report, then chains to the handler
    that was installed before (a callable is called; ``SIG_IGN`` ignores the signal;
    the default action is restored and the signal raised again, so the process ends
    as it would have, with the same exit status). A signal that arrives while a report
    is being written is handled once that write is over.
    """

    def __init__(self) -> None:
        self._live: weakref.WeakSet[Observer] = weakref.WeakSet()
        self._previous: Any = None
        self._installed = False
        self._deferred: int | None = None

    def live(self) -> list[Observer]:
        """The attached observers of this process."""
        return list(self._live)

    def add(self, observer: Observer) -> None:
        self._live.add(observer)
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        try:
            self._previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._handle)
        except (ValueError, OSError, AttributeError):  # no SIGTERM, or not allowed here
            return
        self._installed = True

    def discard(self, observer: Observer) -> None:
        self._live.discard(observer)
        if self._live or not self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGTERM) == self._handle:
                previous = self._previous
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        except (ValueError, OSError, TypeError):
            return
        self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        live = list(self._live)
        if any(getattr(observer, "writing", False) for observer in live):
            self._deferred = signum  # handled by deliver_deferred once the write is over
            return
        for observer in live:
            if observer.attached:
                with contextlib.suppress(Exception):
                    observer.write_on_signal()
        self._chain(signum, frame)

    def deliver_deferred(self) -> None:
        """Handle a SIGTERM that arrived during a report write (called after each)."""
        signum = self._deferred
        if signum is None:
            return
        self._deferred = None
        self._handle(signum, None)

    def _chain(self, signum: int, frame: Any) -> None:
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
            return
        if previous == signal.SIG_IGN:
            return
        # The default action (or a handler not set from Python): end as it would have.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


_on_termination = _TerminationWriter()
_parent_pid = os.getpid()


def _after_fork_in_child() -> None:
    """``os.register_at_fork`` hook: re-point every live observer (see
    :meth:`Observer.forked`); never raises into the child."""
    global _parent_pid
    parent, _parent_pid = _parent_pid, os.getpid()
    for observer in list(_on_termination.live()):
        with contextlib.suppress(Exception):
            observer.forked(parent)


def _before_fork() -> None:
    global _parent_pid
    _parent_pid = os.getpid()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


class _AtExit:
    """Writes the final report at interpreter exit, holding the observer weakly."""

    __slots__ = ("_observer",)

    def __init__(self, observer: Observer) -> None:
        self._observer = weakref.ref(observer)

    def __call__(self) -> None:
        observer = self._observer()
        if observer is not None and observer.attached:
            observer.write_report()


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
        and _transform_level() is None
    )


def _root_calls_on_stack(root: nn.Module, frame: Any) -> int:
    """How many calls of ``root`` run on the stack from ``frame`` up (its ``_call_impl``
    frames)."""
    calls = 0
    while frame is not None:
        if frame.f_code is _CALL_IMPL_CODE and frame.f_locals.get("self") is root:
            calls += 1
        frame = frame.f_back
    return calls


def _find_caller_depth(root: nn.Module, frame: Any) -> int:
    """How many frames up from ``frame`` (enter_root's or leave_root's, called by a root
    hook) the code that called ``root`` runs, past ``nn.Module``'s call machinery; 0 if
    the root's ``_call_impl`` frame is not found."""
    depth = 0
    while frame is not None:
        if frame.f_code is _CALL_IMPL_CODE and frame.f_locals.get("self") is root:
            frame = frame.f_back
            depth += 1
            if frame is not None and frame.f_code is _WRAPPED_CALL_IMPL_CODE:
                depth += 1
            return depth
        frame = frame.f_back
        depth += 1
    return 0


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


def _root_sentinel_due(forward: int, interval: int) -> bool:
    """True if the root sentinel checks training forward ``forward`` (0-based): one per
    run of ``interval`` forwards, at an offset that moves by one each run (see
    :attr:`Observer.ROOT_SENTINEL_INTERVAL`)."""
    return (forward - forward // interval) % interval == interval - 1


def _next_root_sentinel(start: int, interval: int) -> int:
    """The first forward from ``start`` on that :func:`_root_sentinel_due` picks: in run
    ``b`` (forwards ``b * interval`` on) the one at offset ``(b + interval - 1) % interval``,
    in the run of ``start`` or in the next one."""
    run = start // interval
    forward = run * interval + (run + interval - 1) % interval
    if forward < start:
        run += 1
        forward = run * interval + (run + interval - 1) % interval
    return forward


def _version(tensor: Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place change), or None for
    tensors without one (made in inference mode)."""
    try:
        return tensor._version
    except Exception:
        return None


def _padded_row(values: Tensor) -> Tensor:
    """A float64 row of ``STAT_WIDTH`` on the values' device: the values, then zeros."""
    return torch.nn.functional.pad(values, (0, STAT_WIDTH - values.numel()))


def _first_tensor_pointer(args: tuple[object, ...]) -> object:
    """Identify the first tensor argument: its storage address, shape and, on the CPU,
    its first and last values (a recomputed tensor can reuse a freed tensor's memory)."""
    for arg in args:
        if isinstance(arg, Tensor) and arg.layout == torch.strided and arg.device.type != "meta":
            try:
                identity: tuple[object, ...] = (arg.data_ptr(), tuple(arg.shape))
                if arg.device.type == "cpu" and arg.numel():
                    value = arg.detach()
                    first, last = (0,) * value.dim(), (-1,) * value.dim()
                    identity += (float(value[first]), float(value[last]))
                return identity
            except Exception:
                return 0
    return 0


class _InFlight:
    """One batch of statistics on its way to the host."""

    __slots__ = ("_events", "_host", "meta")

    def __init__(
        self,
        meta: list[_Meta],
        host: list[tuple[list[int], Tensor | list[list[float]]]],
        events: list[Any],
    ) -> None:
        self.meta = meta
        self._host = host
        self._events = events

    def ready(self) -> bool:
        return all(event.query() for event in self._events)

    def rows(self) -> list[list[float]]:
        for event in self._events:
            event.synchronize()
        rows: list[list[float]] = [[] for _ in range(len(self.meta))]
        for positions, host in self._host:
            values = host.tolist() if isinstance(host, Tensor) else host
            for i, row in zip(positions, values, strict=True):
                rows[i] = row
        return rows


def _launch_transfer(records: list[_Record]) -> _InFlight:
    """Stack the pending device vectors per device and start one host copy per device.

    Rows already on the host (CPU tensors are reduced to host floats) pass through.
    """
    meta: list[_Meta] = [(key, sample, position) for key, sample, position, _ in records]
    stats = [stat for *_, stat in records]
    by_device: dict[tuple[torch.device, int], list[int]] = {}
    host_rows: list[int] = []
    for i, item in enumerate(stats):
        if isinstance(item, Tensor):
            by_device.setdefault((item.device, item.numel()), []).append(i)
        else:
            host_rows.append(i)
    host: list[tuple[list[int], Tensor | list[list[float]]]] = []
    if host_rows:
        host.append((host_rows, [stats[i] for i in host_rows]))  # type: ignore[misc]
    events: list[Any] = []
    for (device, _), positions in by_device.items():
        stacked = torch.stack([stats[i] for i in positions])  # type: ignore[misc]
        if device.type == "cuda":
            buffer = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            buffer.copy_(stacked, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
            host.append((positions, buffer))
        else:
            host.append((positions, stacked.cpu()))
    return _InFlight(meta, host, events)
