"""The Observer: owns the hooks of one model and wires the stages of the data flow.

    hooks -> ForwardContext (_context.py) -> CallCapture (_calls.py)
          -> StatisticsBuffer (_staging.py) --flush--> SeriesStore (_store.py)
          -> RunSnapshot (_snapshot.py) -> report.py -> writer and sinks

The Observer registers the hooks and keeps their handles, builds the stages, flushes
the statistics buffer into the series store when the forward context says a flush is
due, writes the report from a snapshot, and keeps the error table. Hook parking is in
``_parking.py``, the sentinel in ``_sentinel.py``, the sequence of one report's writes
in ``_report_write.py``. ``docs/architecture.md`` draws the data flow and says which
file owns what.
"""

from __future__ import annotations

import atexit
import fnmatch
import inspect
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor, nn
from torch.jit import ScriptModule

from . import _amp
from ._attention import unobserved_callers
from ._calls import CallCapture
from ._compiled_capture import CompiledCapture
from ._context import ForwardContext
from ._copies import PREPARE_ATTRIBUTE, PrepareScriptable
from ._error_log import ErrorLog
from ._lifecycle import AtExit, on_termination, sink_for_child
from ._parking import HookParking
from ._records import ROOT_INDEX
from ._report_write import warn_if_never_written, write_report_files
from ._root_frame import RootFrame, needs_root_frame, rechoose, recompile_call, wrappers_of
from ._sentinel import Sentinel
from ._snapshot import RunSnapshot, take_snapshot
from ._staging import StatisticsBuffer
from ._state import IDLE
from ._store import SeriesStore
from .capture import (
    COMPILED_WRAPPER_ATTRIBUTE,
    DirectCallPostHook,
    DirectCallPreHook,
    ForwardHook,
    ForwardWrapper,
    RootPostHook,
    RootPreHook,
    is_compile_wrapper,
    passive,
    root_hook_traces,
    root_hook_traces_unobserved,
    without_compile_wrappers,
)
from .compiled import forget_code_with_hooks
from .config import ReportConfig, TrackConfig
from .distributed import RankInfo
from .histogram import HistogramSpec
from .sampling import SampleForwards, SamplingPolicy

__all__ = ["ENDINGS", "REPORT_LOCK_TIMEOUT_S", "Observer", "RankInfo"]

#: What can end a run (``run.ended_by`` of its final report): ``remove_observer`` (or
#: leaving the handle's ``with`` block), ``interpreter_exit``, ``uncaught_exception``
#: (interpreter exit after an exception that nothing caught, ``KeyboardInterrupt``
#: included), ``sigterm`` (whose default action then ends the process), and
#: ``model_garbage_collected`` (the model was dropped without ``remove_observer``).
ENDINGS = (
    "remove_observer",
    "interpreter_exit",
    "uncaught_exception",
    "sigterm",
    "model_garbage_collected",
)

#: Longest wait, in seconds, of a flush or report write asked for outside the hooks
#: (``handle.flush()``, ``handle.report()``, removal, exit) for one that another thread
#: is running.
REPORT_LOCK_TIMEOUT_S = 120.0


class Observer:
    """Observes one model; created by :func:`~torchinstruments.inject_observer`.

    Not meant to be constructed directly. Use the handle returned by ``inject_observer``.
    """

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
        attention_logits: bool,
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
        #: Class name of each observed module, by name, as it was observed (the report
        #: words its advice by it, also after the model is gone).
        self.module_classes = {name: type(module).__name__ for name, module in modules}
        self.policy = policy
        self.report_config = report_config
        self.track_config = track_config
        self.capture_direct_forwards = capture_direct_forwards
        self.full_sentinel = full_sentinel
        self.rank_info = rank_info
        self.writer = writer
        self.sinks = list(sinks)
        self.options = options
        #: Modules observed because they called scaled_dot_product_attention.
        self.attention_modules_adopted: list[str] = []
        self.started_at = time.time()
        self.reports_written = 0
        #: The number of the report being (or last) written: 1 for the first, one more
        #: at each write; ``report.json`` and ``index.md`` both state it (``run.report_number``).
        self.report_number = 0
        #: True from the final report on (``run.final``): written at removal or at
        #: interpreter exit, when training through this observer has ended.
        self.final_report = False
        #: What ended the run (``run.ended_by``, one of :data:`ENDINGS`); None while it
        #: runs.
        self.ended_by: str | None = None
        #: At interpreter exit, the last uncaught exception of the process, as
        #: ``"TypeError: message"`` (``run.uncaught_exception``); None otherwise.
        self.uncaught_exception: str | None = None
        self.series_summary_omitted = 0
        #: True once a failed write was warned of (one warning a run).
        self.warned_write = False
        #: True once a failed ranking was warned of (one warning a run).
        self.warned_ranking = False
        #: The last error a report write met (None while none failed).
        self.last_write_error: Exception | None = None
        #: True while a report is being built and written (see _lifecycle.py).
        self.writing = False
        #: The lock file of ``output_dir`` this process holds (``_dir_lock.py``),
        #: released at removal and at interpreter exit; None where none was taken.
        self.dir_lock: Path | None = None
        #: Held by each flush and report write: one at a time, whichever thread asks
        #: (the training thread's hooks, ``handle.flush()`` from another, a finalizer).
        self.report_lock = threading.RLock()
        #: In a process forked after injection: the parent's pid, and the training
        #: forwards seen before the fork (see :meth:`forked`); None in the original.
        self.forked_from_pid: int | None = None
        self.forwards_at_fork = 0
        #: Module name -> the name of the parent observed in its place, because the
        #: module never ran in the first sampled forward (see adopt_parents).
        self.parents_adopted: dict[str, str] = {}
        self._handles: list[Any] = []
        self._wrapped: list[tuple[weakref.ref[nn.Module], bool, object]] = []
        #: ``capture.root_hook_traces_unobserved()`` when this observer was made.
        self.root_traces_unobserved_at_injection = root_hook_traces_unobserved()
        #: The root's instance ``forward`` where its class's is one that torch.compile
        #: does not compile as a frame (``_root_frame.py``), else None.
        self._root_frame: RootFrame | None = None
        self._preparers: list[tuple[weakref.ref[nn.Module], PrepareScriptable]] = []
        self._atexit = AtExit(self)
        #: The ``torch.compile`` wrappers below the root given direct-call hooks, by
        #: ``id`` (see :meth:`_attach_compile_entries`).
        self._compile_entries: dict[int, weakref.ref[nn.Module]] = {}
        #: Handles of the compile wrappers' direct-call hooks (see drop_compile_entries).
        self._entry_handles: list[Any] = []
        self._entries_made = 0

        # The stages, in data-flow order (see the module docstring).
        self.error_log = ErrorLog(report_config.max_error_entries)
        sample_forwards = SampleForwards()
        self.buffer = StatisticsBuffer(self.names, self.error_log)
        self.store = SeriesStore(
            names=self.names,
            track_config=track_config,
            histogram_specs=histograms,
            sample_forwards=sample_forwards,
            errors=self.error_log,
            sinks=self.sinks,
        )
        listener = getattr(policy, "note_cost", None)
        self.capture = CallCapture(
            names=self.names,
            histogram_specs=histograms,
            buffer=self.buffer,
            store=self.store,
            errors=self.error_log,
            cost_listener=listener if callable(listener) else None,
        )
        self.parking = HookParking(
            self._root,
            self.error_log,
            "off: capture_direct_forwards" if capture_direct_forwards else "on",
        )
        self.sentinel = Sentinel(self.names, self.buffer)
        #: Statistics of submodule outputs reduced inside torch.compile'd graphs (see
        #: _compiled_capture.py); None with forward wrappers, whose calls Dynamo skips.
        self.compiled_capture = None if capture_direct_forwards else CompiledCapture(self._root)
        #: The state machine the hooks call (see _context.py).
        self.context = ForwardContext(
            owner=self,
            modules=self._modules,
            policy=policy,
            warmup_samples=track_config.warmup_samples,
            rewrite_interval_s=report_config.rewrite_interval_s,
            full_sentinel=full_sentinel,
            attention_logits=attention_logits,
            capture_direct_forwards=capture_direct_forwards,
            prompt_sinks=self.store.prompt,
            sample_forwards=sample_forwards,
            buffer=self.buffer,
            store=self.store,
            errors=self.error_log,
            parking=self.parking,
            sentinel=self.sentinel,
            capture=self.capture,
            compiled=self.compiled_capture,
        )

    @property
    def target(self) -> nn.Module | None:
        """The model given to ``inject_observer`` (None once it was collected)."""
        return self._target()

    @property
    def root(self) -> nn.Module | None:
        """The observed root module (the model inside DDP or compile wrappers), or None
        once it was collected."""
        return self._root()

    def module(self, index: int) -> nn.Module | None:
        """The observed module of index ``index`` (None once it was collected)."""
        return self._modules[index]()

    @property
    def attached(self) -> bool:
        """True between :meth:`attach` and :meth:`detach`."""
        return self.context.attached

    @property
    def caller_step(self) -> int | None:
        """The caller's step (``ObserverHandle.set_step``) that samples opened from now
        take, or None."""
        return self.context.caller_step

    @caller_step.setter
    def caller_step(self, step: int | None) -> None:
        self.context.caller_step = step

    # ------------------------------------------------------------------ attach
    def attach(self) -> None:
        """Register hooks (or forward wrappers) on every selected module."""
        root = self.root
        context = self.context
        parking = self.parking
        for index, ref in enumerate(self._modules):
            module = ref()
            assert module is not None
            is_root = module is root
            if self.capture_direct_forwards:
                had = "forward" in module.__dict__
                previous = module.__dict__.get("forward")
                original = module.forward
                wrapper = ForwardWrapper(context, module, original, index, is_root)
                module.forward = wrapper  # type: ignore[method-assign]
                self._wrapped.append((ref, had, previous))
                continue
            if is_root:
                if needs_root_frame(module):
                    self._root_frame = module.__dict__["forward"] = RootFrame(module)
                self._handles.append(module.register_forward_pre_hook(RootPreHook(context)))
                post = RootPostHook(context, index)
                try:
                    handle = module.register_forward_hook(post, always_call=True)
                except TypeError:  # torch < 2.1 has no always_call
                    handle = module.register_forward_hook(post)
                    # A forward that raises would skip the post-hook: never park.
                    parking.status = "off: torch without always_call forward hooks"
                else:
                    always = getattr(module, "_forward_hooks_always_called", None)
                    if isinstance(always, dict):
                        parking.root_post = (module._forward_hooks, always, handle.id, post)
                    forward = inspect.unwrap(type(module).forward)
                    parking.root_forward_code = getattr(forward, "__code__", None)
                self._handles.append(handle)
            else:
                hook = self._forward_hook(index, self.names[index])
                handle = hook.register(module)
                self._handles.append(handle)
                parking.add(module, handle.id, hook)
        if self._root_frame is not None and root is not None:
            wrappers = wrappers_of(root)  # made before injection: they compile the frame now
            rechoose(self.target, *wrappers)
            self._root_frame.note_wrappers(wrappers)
            recompile_call(root)  # root.compile() made before injection: the same
        if not self.capture_direct_forwards:
            self._attach_compile_entries()
            if self.compiled_capture is not None:
                self.compiled_capture.on_traced_while_idle = weakref.WeakMethod(
                    self._compiled_while_idle
                )
        self._prepare_for_scripting()
        context.attached = self.buffer.attached = True
        _amp.install(self)
        atexit.register(self._atexit)
        on_termination.add(self)

    def _attach_compile_entries(self) -> None:
        """Give each ``torch.compile`` wrapper below the root (``self.model =
        torch.compile(net)`` makes one) that has none yet a
        :class:`~.capture.DirectCallPreHook` and a :class:`~.capture.DirectCallPostHook`:
        the wrapper's own hooks run eagerly around its compiled frame, so that calls of
        it made with no root forward open are observed inside that frame (see
        ``ForwardContext.open_direct_entry``). Called at injection, and again when Dynamo
        traces a hook of ours with no forward open (:meth:`_compiled_while_idle`): a
        wrapper made after injection is then hooked while its first call compiles, and
        its calls are observed from the next one on."""
        root = self.root
        if root is None:
            return
        context = self.context
        for _, module in _compile_wrappers_below(root):
            if _hooked(self._compile_entries, module):
                continue
            self._entries_made += 1
            entry = -self._entries_made  # the opener's identity: no module index is negative
            self._compile_entries[id(module)] = weakref.ref(module)
            self._entry_handles.append(
                module.register_forward_pre_hook(DirectCallPreHook(context, entry))
            )
            self._entry_handles.append(
                module.register_forward_hook(DirectCallPostHook(context, entry))
            )

    def drop_compile_entries(self) -> None:
        """Remove the compile wrappers' direct-call hooks: called by the context at the
        first training forward through the root, after which direct calls are side
        computations (see ``ForwardContext.direct_call``). Each hook made the wrapper
        take ``nn.Module``'s full hook dispatch on every call: 3.5 % of a step of the
        example model with each block a wrapper, root eager
        (``benchmarks/compiled_step_parts.py --compile wrappers``)."""
        for handle in self._entry_handles:
            handle.remove()
        self._entry_handles.clear()

    def unhooked_compile_wrappers(self) -> list[str]:
        """Names (without ``_orig_mod``) of the ``torch.compile`` wrappers below the
        root that have no direct-call hooks of this observer: made after injection, and
        never compiled while no forward of ours was open (their code was compiled
        before, for another model of the same class). Calls of them made with no root
        forward open are not observed. Empty with ``capture_direct_forwards`` (where
        direct calls are observed eagerly) or once the root is gone."""
        root = self.root
        if root is None or self.capture_direct_forwards:
            return []
        return [
            without_compile_wrappers(name)
            for name, module in _compile_wrappers_below(root)
            if not _hooked(self._compile_entries, module)
        ]

    def _compiled_while_idle(self) -> None:
        """Dynamo traces a hook of ours (at trace time, from ``_compiled_capture.py``):
        where no forward of ours is open (no root forward, no direct call through a
        hooked wrapper) and training does not go through the root, a ``torch.compile``
        wrapper that training calls directly may have been made after injection: hook
        the new wrappers now (:meth:`_attach_compile_entries`)."""
        context = self.context
        if (
            context.attached
            and context.state is IDLE
            and context.direct_entry is None
            and not context.root_forward_seen
        ):
            try:
                self._attach_compile_entries()
            except Exception as error:  # never into Dynamo's trace (nor training)
                self.record_error("compile_entries", "", error)

    def _prepare_for_scripting(self) -> None:
        """Give every module of the model a :class:`~._copies.PrepareScriptable`, so
        that ``torch.jit.script`` of the model or of any module in it compiles a stand-in
        without our hooks. Modules that have an instance ``__prepare_scriptable__`` of
        their own, and ScriptModules, are left alone."""
        target = self.target
        if target is None:
            return
        for module in target.modules():
            if isinstance(module, ScriptModule):
                continue
            present = module.__dict__.get(PREPARE_ATTRIBUTE)
            if present is None or isinstance(present, PrepareScriptable):
                preparer = PrepareScriptable(module)
                module.__dict__[PREPARE_ATTRIBUTE] = preparer
                self._preparers.append((weakref.ref(module), preparer))

    def detach(self) -> None:
        """Remove every hook and wrapper; restore previous instance attributes."""
        self.context.detach()
        hook_ids = [handle.id for handle in self._handles]
        for handle in self._handles + self.capture.leaf_hooks:
            handle.remove()
        self._handles.clear()
        if root_hook_traces():
            # Code that traced the root's hooks inline guards on their ids: stale now.
            forget_code_with_hooks(hook_ids)
        self.drop_compile_entries()
        self.capture.leaf_hooks.clear()
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
        frame, self._root_frame = self._root_frame, None
        root = self.root
        if (
            frame is not None
            and root is not None
            and root.__dict__.get("forward") is frame
            and not frame.compiled(root)  # else compiled code runs it: it stays
        ):
            del root.__dict__["forward"]
            rechoose(self.target)
        for ref, preparer in self._preparers:
            module = ref()
            if module is not None and module.__dict__.get(PREPARE_ATTRIBUTE) is preparer:
                del module.__dict__[PREPARE_ATTRIBUTE]
        self._preparers.clear()
        self.buffer.attached = False
        if self.compiled_capture is not None:
            self.compiled_capture.active = False
        _amp.uninstall(self)
        atexit.unregister(self._atexit)
        on_termination.discard(self)

    def note_loss_scale(self, scale: Tensor) -> None:
        """``GradScaler.scale`` ran: the coming backward's gradients carry ``scale``."""
        self.capture.note_loss_scale(self.context, scale)

    def record_error(self, stage: str, module: str, error: BaseException) -> None:
        """Count an error raised inside a hook (see :class:`~._error_log.ErrorLog`)."""
        self.error_log.record(stage, module, error)

    # ------------------------------------------------------------------ flush
    def _take_report_lock(self, from_hook: bool) -> bool:
        """Take :attr:`report_lock`: at once or not at all from a hook (training never
        waits on a write of another thread; that write carries the statistics on), else
        waiting up to :data:`REPORT_LOCK_TIMEOUT_S` (a timeout is counted as an error)."""
        if from_hook:
            return self.report_lock.acquire(blocking=False)
        if self.report_lock.acquire(timeout=REPORT_LOCK_TIMEOUT_S):
            return True
        self.record_error("report", "", _lock_timeout())
        return False

    def flush_statistics(self, *, block: bool = True, from_hook: bool = False) -> None:
        """Move pending statistics to the host and update the trackers.

        Each flush stacks the pending vectors per device and starts one copy to the host
        (non-blocking into pinned memory on CUDA). With ``block=False`` (inside hooks)
        only batches whose copy has completed are processed, so no hook waits on the
        device; ``block=True`` waits for all of them. Flushes and report writes of one
        observer run one at a time (:attr:`report_lock`); with ``from_hook=True`` a
        flush is skipped while another thread's runs.
        """
        if not self._take_report_lock(from_hook):
            return
        try:
            self._flush_statistics(block)
        finally:
            self.report_lock.release()

    def _flush_statistics(self, block: bool) -> None:
        with passive():
            buffer = self.buffer
            if self.compiled_capture is not None:
                try:  # the last compiled sample's output gradients, if its backward ran
                    self.compiled_capture.take_gradients(self.context)
                except Exception as error:
                    self.record_error("flush", "", error)
            buffer.launch()
            for records, rows in buffer.arrived(block=block):
                try:
                    hits = self.store.process(records, rows)
                except Exception as error:
                    self.record_error("flush", "", error)
                    continue
                for (index, call, _, path), forward, next_sample, _ in hits:
                    self.context.on_nonfinite(forward, index, call, path, next_sample)
            store = self.store
            if self.compiled_capture is not None and store.compiled_through >= 0:
                measured = store.compiled_measured
                self.capture.modules_called.update(key[0] for key in measured)
                self.capture.modules_called.update(self.compiled_capture.traced_without_rows)
                self.compiled_capture.note_measured(
                    measured,
                    store.compiled_through,
                    store.compiled_rows_dropped,
                    store.compiled_untapped,
                )
                store.compiled_measured = set()
                store.compiled_untapped = set()
                store.compiled_rows_dropped = 0

    # ------------------------------------------------------------------ report
    def build_report(self, *, block: bool = True) -> dict[str, Any]:
        """Flush statistics and build the report dict (JSON-safe).

        ``block=False`` uses only batches already on the host.

        Raises:
            TimeoutError: when another thread held :attr:`report_lock` for
                :data:`REPORT_LOCK_TIMEOUT_S`.
        """
        from .report import build_report

        if not self._take_report_lock(from_hook=False):
            raise _lock_timeout()
        try:
            self._flush_statistics(block)
            return build_report(self.snapshot())
        finally:
            self.report_lock.release()

    def write_report(
        self,
        *,
        block: bool = True,
        flush: bool = True,
        files_only: bool = False,
        from_hook: bool = False,
    ) -> None:
        """Build the report and hand it to the writer and sinks; never raises.

        ``flush=False`` writes what is on the host already (pending statistics stay
        pending): used from a signal handler that may have interrupted a flush.
        ``files_only=True`` writes the files of ``output_dir`` and nothing to the sinks
        (the first report, written at injection). Writes run one at a time
        (:attr:`report_lock`): ``handle.flush()`` from another thread waits for a write
        under way; a write asked for by a hook (``from_hook=True``) is skipped while
        another thread writes, and one asked for inside a write of the same thread (a
        garbage-collector finalizer run in the middle of it) is skipped too.
        """
        forwards = self.context.forwards_seen
        if self.forked_from_pid is not None and forwards == self.forwards_at_fork:
            return  # a forked child that never trained: nothing of its own to write
        if not self._take_report_lock(from_hook):
            return
        started = time.perf_counter()
        try:
            if self.writing:  # this thread's own write is under way
                return
            self.writing = True
            try:
                with passive():
                    write_report_files(self, block, flush, files_only)
            except Exception as error:  # never into training, whatever the warning filters
                self.record_error("report", "", error)
            finally:
                self.writing = False
                self.capture.note_cost(time.perf_counter() - started)
        finally:
            self.report_lock.release()
        on_termination.deliver_deferred()

    def write_final_report(self, ended_by: str, uncaught_exception: str | None = None) -> None:
        """The last report of the run (at removal or interpreter exit); then, if no
        report ever reached a directory of this observer, a warning that says so, with
        the last write error. Never raises.

        Args:
            ended_by: what ended the run, one of :data:`ENDINGS` (``run.ended_by``).
            uncaught_exception: at interpreter exit, the last uncaught exception of the
                process (``"TypeError: message"``), if there was one.
        """
        self.final_report = True
        self.ended_by = ended_by
        self.uncaught_exception = uncaught_exception
        if self.compiled_capture is not None:
            # The last direct-call sample's rows, still in the buffers.
            self.compiled_capture.finish_direct_sample(self.context)
        self.write_report()
        try:
            warn_if_never_written(self)
        except Exception as error:  # never into training, whatever the warning filters
            self.record_error("write", "", error)

    def adopt_parents(self) -> None:
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
        adopted = set(self.attention_modules_adopted)  # observed after that forward
        for index, name in enumerate(list(self.names)):
            if index == ROOT_INDEX or index in self.capture.modules_called or name in adopted:
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
            self._observe_from_now(parent_name, parent)
            observed.add(id(parent))
            self.parents_adopted[name] = parent_name
        self._adopt_attention_callers(root, observed)

    def adopt_attention_callers(self) -> None:
        """Observe, from the next sample on, the unobserved modules that called
        ``scaled_dot_product_attention`` in sampled forwards so far (see
        :meth:`_adopt_attention_callers`); :meth:`adopt_parents` does it too."""
        root = self.root
        if root is None or self.capture_direct_forwards:
            return
        self._adopt_attention_callers(root, {id(ref()) for ref in self._modules})

    def _forward_hook(self, index: int, name: str) -> ForwardHook:
        """The forward hook of module ``index`` (called ``name``), with its rows for the
        capture inside compiled graphs."""
        compiled = self.compiled_capture
        rows = None if compiled is None else compiled.register(index, name)
        return ForwardHook(self.context, index, compiled, rows)

    def _observe_from_now(self, name: str, module: nn.Module) -> None:
        """Add ``module`` (called ``name``) to the observed modules, with its forward
        hook (parkable, as the others)."""
        index = len(self.names)
        self.names.append(name)
        self._modules.append(weakref.ref(module))
        self.module_classes[name] = type(module).__name__
        self.capture.plan_histograms(index, name)
        hook = self._forward_hook(index, name)
        handle = hook.register(module)
        self._handles.append(handle)
        self.parking.add(module, handle.id, hook)

    def _adopt_attention_callers(self, root: nn.Module, observed: set[int]) -> None:
        """Observe the modules of ``root`` that called ``scaled_dot_product_attention``
        in the first sampled forward without being observed (an attention module whose
        children all run, as Llama's), and the other modules of their classes: their
        attention logits, and their outputs, are series from the next sample on; listed
        under ``coverage.attention_modules_observed``.
        Not where ``include`` or ``module_types`` chose the modules, nor modules that
        ``exclude`` names."""
        callers = unobserved_callers.pop(self.context, {})
        options = self.options
        if not callers or options.get("include") or options.get("module_types"):
            return  # the user chose the modules
        excluded = [str(p) for p in options.get("exclude") or ()]  # type: ignore[union-attr]
        classes = {
            type(module) for module in (ref() for ref in callers.values()) if module is not None
        }
        names = {}
        for name, module in root.named_modules():
            if not name:
                continue
            names[id(module)] = without_compile_wrappers(name)
            # Modules of a caller's class run the same code, so call it too: where compiled
            # graphs are shared (blocks compiled one by one), only one of them was traced.
            if type(module) in classes:
                callers.setdefault(id(module), weakref.ref(module))
        for key, ref in callers.items():
            module = ref()
            name = names.get(key)
            if module is None or name is None or key in observed:
                continue  # gone, or another model's (a teacher called inside the forward)
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in excluded):
                continue
            self._observe_from_now(name, module)
            observed.add(key)
            self.attention_modules_adopted.append(name)

    def snapshot(self) -> RunSnapshot:
        """A frozen view of this observer for the report (see :func:`take_snapshot`)."""
        return take_snapshot(self)

    def forked(self, parent_pid: int) -> None:
        """Called in a child process forked while this observer was attached.

        The child must never write the parent's files: its directory writers are
        pointed at ``fork-<pid>/`` under the parent's directory, other sinks (the
        parent's loggers) are dropped, and nothing at all is written unless the child
        runs a training forward of its own (a DataLoader worker never does; Hogwild
        training with ``torch.multiprocessing`` does, and then says so in ``run``).
        """
        self.forked_from_pid = parent_pid
        self.forwards_at_fork = self.context.forwards_seen
        self.writer = sink_for_child(self.writer)
        self.sinks = [s for s in map(sink_for_child, self.sinks) if s is not None]
        self.store.set_sinks(())

    def write_on_signal(self) -> None:
        """Write the report from a signal handler, which runs on the main thread between
        two bytecodes, possibly inside one of our hooks: pending statistics are flushed
        only if the staging lock can be taken (the interrupted code may hold it)."""
        lock = self.buffer.lock
        if lock.acquire(timeout=0.5):
            lock.release()
            self.write_report()
        else:
            self.write_report(flush=False)


def _lock_timeout() -> TimeoutError:
    return TimeoutError(f"another thread held the report lock for {REPORT_LOCK_TIMEOUT_S:.0f} s")


def _hooked(entries: dict[int, weakref.ref[nn.Module]], module: nn.Module) -> bool:
    """True if ``module`` is among ``entries`` (not another object at a reused ``id``)."""
    ref = entries.get(id(module))
    return ref is not None and ref() is module


def _compile_wrappers_below(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The ``torch.compile`` wrappers inside ``root`` (not one that wraps ``root``
    itself), with their qualified names."""
    for name, module in root.named_modules():
        if is_compile_wrapper(module) and getattr(module, COMPILED_WRAPPER_ATTRIBUTE) is not root:
            yield name, module
