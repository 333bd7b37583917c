"""What the report is built from: a frozen snapshot of one observer.

The :class:`~torchinstruments.observer.Observer` builds a :class:`RunSnapshot` after a
flush (:func:`take_snapshot`, which reads its stages) and hands it to
``report.build_report``, ``report.build_series_summary`` and ``report.build_details``,
which read nothing else of the observer. See ``docs/architecture.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._attention import calls_not_measured as attention_calls_not_measured
from ._records import ROOT_INDEX
from .capture import recompile_limit_hits, root_hook_traces, root_hook_traces_unobserved
from .compiled import last_invalidation

if TYPE_CHECKING:
    from ._error_log import ErrorEntry
    from .config import ReportConfig, TrackConfig
    from .distributed import RankInfo
    from .histogram import Histogram
    from .observer import Observer
    from .sampling import SampleForwards
    from .series import TensorSeries
    from .track import SeriesTracker

__all__ = [
    "CompiledCaptureCounts",
    "Counters",
    "RunSnapshot",
    "SeriesKey",
    "module_kinds",
    "modules_replaced",
    "take_snapshot",
]

#: (module index, call index, signal, tensor path) of one observed tensor.
SeriesKey = tuple[int, int, str, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Counters:
    """The run's counts, each named as the report's ``coverage`` key that shows it.

    All are counts since injection (0 at the start).
    """

    #: Training forwards of the root (or direct-call samples), sampled or not.
    forwards_seen: int = 0
    #: Sampled training forwards (the samples, the report's time axis).
    samples_observed: int = 0
    #: Samples whose backward brought at least one output gradient.
    backward_samples_observed: int = 0
    #: Root forwards that were not training forwards (eval, no_grad, inference mode,
    #: tracing, ``torch.func`` transforms).
    eval_forwards_skipped: int = 0
    #: Root forwards and module calls re-run during backward that no sample awaited.
    recompute_calls_ignored: int = 0
    #: Samples opened by a module called with no root forward open.
    direct_call_forwards: int = 0
    #: Training calls of submodules outside any root forward, not observed.
    calls_outside_root_skipped: int = 0
    #: Output gradients that arrived again for the same sample (``retain_graph``).
    repeated_backward_gradients: int = 0
    #: Of those, the ones added to the gradient of the earlier passes.
    backward_gradients_summed: int = 0
    #: Of those, the ones that came after that gradient was reduced.
    backward_gradients_not_summed: int = 0
    #: Samples whose gradients were divided by a GradScaler loss scale.
    loss_scaled_samples: int = 0
    #: Tensors checked for non-finite values in unsampled training forwards.
    sentinel_checks: int = 0
    #: Unsampled training forwards in which a sentinel saw a non-finite value.
    sentinel_nonfinite_forwards: int = 0
    #: Series not created because ``TrackConfig.max_series`` was reached.
    series_dropped: int = 0
    #: Series rows left out of ``series.json`` by its byte bound.
    series_summary_omitted: int = 0
    #: Output tensors beyond ``MAX_TENSORS_PER_OUTPUT`` of one module output.
    paths_dropped: int = 0
    #: Errors raised inside hooks (all of them, kept in the error table or not).
    errors_total: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class CompiledCaptureCounts:
    """How ``torch.compile`` was met, each field named as the key of the report's
    ``coverage.compiled_capture`` that shows it (see ``_compiled_capture.py``)."""

    #: ``"in_graph"`` once a compiled graph reduced an observed output, ``"unused"``
    #: while none did, ``"off: <reason>"`` where hooks traced by Dynamo are graph breaks.
    mode: str = "unused"
    #: (module, call index, signal, tensor path) reduced inside compiled graphs (rows
    #: that held elements at a flush).
    slots: int = 0
    #: Tensors of a module's calls in one sample beyond its ``ROWS_PER_MODULE`` (16)
    #: rows (summed over samples), and output tensors on a device the module has no
    #: rows on, met while tracing: not recorded.
    slots_dropped: int = 0
    #: Traced outputs whose gradient is not tapped (tensors outside tuples and
    #: namedtuples and a top-level list, as in dicts and dataclasses, and outputs that
    #: are one of the module's inputs, positional, keyword or nested in one).
    gradients_not_captured: int = 0
    #: Hook calls that Dynamo met under saved-tensor hooks (a compiled frame that
    #: non-reentrant checkpointing recomputes), left graph breaks and observed eagerly.
    calls_under_saved_tensor_hooks: int = 0
    #: Times Dynamo met an observed root's pre-hook while tracing, in this process
    #: (any observer's): it traced the root's own call (a ``torch.nn`` class compiled
    #: as the root, a model called from a compiled function), where the root's hooks
    #: are graph breaks.
    root_hooks_traced: int = 0
    #: Of those, the traces that refused graph breaks (``fullgraph=True``): the root's
    #: hooks traced to nothing there, and forwards that run that code are not observed.
    root_hooks_unobserved: int = 0
    #: Calls of ``scaled_dot_product_attention`` traced into compiled graphs in sampled
    #: forwards (once per compilation), whose attention logits are not measured.
    attention_calls_not_measured: int = 0
    #: Code objects Dynamo stopped compiling in this process (any model's) because they
    #: reached ``recompile_limit``; their frames run uncompiled from then on.
    recompile_limit_hits: int = 0
    #: Sampled forwards whose output gradients inside graphs were not recorded
    #: (``CompiledCapture.gradient_samples_lost``): more sampled forwards before their
    #: backward passes than gradient sets, ``retain_graph=True``, or a backward pass
    #: up to some inputs only.
    gradient_samples_lost: int = 0
    #: How injection or removal last invalidated compiled code (``compiled.last_invalidation``).
    compiled_code_invalidation: str = "none"


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSnapshot:
    """One observer's state, as the report reads it.

    Frozen and shallow: the mappings are copies, the series, trackers, histograms and
    ``sample_forwards`` are the observer's own objects, so a snapshot is meant to be
    read at once (the report is built right after it, on the same thread).
    """

    #: Names of the observed modules, by module index (the root, ``""``, first).
    names: tuple[str, ...]
    #: Series by key; each holds its trackers per metric.
    series: Mapping[SeriesKey, TensorSeries]
    #: Histograms by (module index, call index, signal, tensor path, spec number).
    histograms: Mapping[tuple[int, int, str, str, int], Histogram]
    #: The GradScaler loss scale per sample (log-scale tracker).
    loss_scale: SeriesTracker
    #: The training forward of each sample.
    sample_forwards: SampleForwards
    counters: Counters
    #: The first sentinel hits (``forward_index``, ``module``, ``call_index``,
    #: ``tensor_path``, ``next_sample``), at most ``MAX_SENTINEL_EVENTS``.
    sentinel_events: tuple[Mapping[str, object], ...]
    #: The error table's entries, in order of first occurrence.
    errors: tuple[ErrorEntry, ...]
    #: Tensors not measured, by reason (``grad_`` prefixed for output gradients).
    skipped_tensors: Mapping[str, int]
    #: Indices of the observed modules that ran in a sampled forward.
    modules_called: frozenset[int]
    #: Module name -> the parent observed in its place (see ``coverage.parents_observed``).
    parents_adopted: Mapping[str, str]
    #: Observed modules no longer in their place in the model.
    modules_replaced: tuple[str, ...]
    #: Class name (``Linear``, ``LayerNorm``, ...) per selected module.
    module_kinds: Mapping[str, str]
    #: ``torch.compile`` wrappers below the root without the observer's direct-call
    #: hooks (made after injection, their code compiled before: see
    #: ``Observer.unhooked_compile_wrappers``); looked for only while no training
    #: forward was seen.
    unhooked_compile_wrappers: tuple[str, ...]
    #: Traces of an observed root's hooks that refused graph breaks (any observer's)
    #: since this observer was made: where no training forward was seen, why.
    root_traces_unobserved_since_injection: int
    #: True once a training forward went through the root.
    root_forward_seen: bool
    report_config: ReportConfig
    track_config: TrackConfig
    #: The sampling policy's ``describe()`` (or what replaced it when that raised).
    sampling: object
    capture_direct_forwards: bool
    full_sentinel: bool
    #: ``"on"``, or ``"off: <reason>"``.
    hook_parking: str
    rank_info: RankInfo
    #: The other ``inject_observer`` settings shown under ``config``.
    options: Mapping[str, object]
    #: Injection time, seconds since the epoch.
    started_at: float
    #: Time spent inside the observer's hooks and report writes, in seconds.
    telemetry_seconds: float
    #: In a forked child: the parent's pid (None in the original process).
    forked_from_pid: int | None
    #: Training forwards seen before the fork (0 in the original process).
    forwards_at_fork: int
    #: The number of the report written from this snapshot (``run.report_number``):
    #: 1 for the first report of the run, one more at each write; a report built
    #: without a write (``ObserverHandle.report``) carries the last written one's.
    report_number: int = 0
    #: The report is the run's final one (``run.final``): see ``Observer.final_report``.
    final: bool = False
    #: What ended the run (``run.ended_by``): see ``observer.ENDINGS``; None while it runs.
    ended_by: str | None = None
    #: The last uncaught exception at interpreter exit (``run.uncaught_exception``).
    uncaught_exception: str | None = None
    #: The capture inside ``torch.compile``'d graphs (``coverage.compiled_capture``).
    compiled_capture: CompiledCaptureCounts = CompiledCaptureCounts()
    #: How the directory writer puts its files in place (``coverage.file_write_mode``):
    #: ``"linked_generations"``, ``"replace_each"``, or None (no directory writer, or
    #: none has written yet).
    file_write_mode: str | None = None
    #: Modules observed because they called ``scaled_dot_product_attention``
    #: (``coverage.attention_modules_observed``).
    attention_modules_adopted: tuple[str, ...] = ()


def take_snapshot(observer: Observer) -> RunSnapshot:
    """A frozen view of ``observer`` for the report, read from its stages.

    Call after a flush; the policy's ``describe()`` is asked here (an error it raises
    is counted, and the report shows the policy's class name instead).
    """
    try:
        sampling: object = observer.policy.describe()
    except Exception as error:  # a user policy's method
        observer.record_error("policy.describe", "", error)
        sampling = {"policy": type(observer.policy).__name__, "describe": "raised"}
    ctx, capture = observer.context, observer.capture
    sentinel, store = observer.sentinel, observer.store
    errors = observer.error_log
    counters = Counters(
        forwards_seen=ctx.forwards_seen,
        samples_observed=ctx.samples_observed,
        backward_samples_observed=capture.backward_samples_observed,
        eval_forwards_skipped=ctx.eval_forwards_skipped,
        recompute_calls_ignored=ctx.recompute_calls_ignored,
        direct_call_forwards=ctx.direct_call_forwards,
        calls_outside_root_skipped=ctx.calls_outside_root_skipped,
        repeated_backward_gradients=capture.repeated_backward_gradients,
        backward_gradients_summed=capture.backward_gradients_summed,
        backward_gradients_not_summed=capture.backward_gradients_not_summed,
        loss_scaled_samples=store.loss_scale.count,
        sentinel_checks=sentinel.sentinel_checks,
        sentinel_nonfinite_forwards=sentinel.sentinel_nonfinite_forwards,
        series_dropped=store.series_dropped,
        series_summary_omitted=observer.series_summary_omitted,
        paths_dropped=capture.paths_dropped,
        errors_total=errors.total,
    )
    return RunSnapshot(
        names=tuple(observer.names),
        series=dict(store.series),
        histograms=dict(store.histograms),
        loss_scale=store.loss_scale,
        sample_forwards=ctx.sample_forwards,
        counters=counters,
        sentinel_events=tuple(dict(event) for event in sentinel.sentinel_events),
        errors=tuple(dataclasses.replace(entry) for entry in errors.entries.values()),
        skipped_tensors=dict(capture.skipped_tensors),
        modules_called=frozenset(capture.modules_called),
        parents_adopted=dict(observer.parents_adopted),
        attention_modules_adopted=tuple(observer.attention_modules_adopted),
        modules_replaced=tuple(modules_replaced(observer)),
        module_kinds=module_kinds(observer),
        # Read only by the headline of a report without a training forward.
        unhooked_compile_wrappers=(
            tuple(observer.unhooked_compile_wrappers())
            if not ctx.root_forward_seen and not ctx.forwards_seen
            else ()
        ),
        root_traces_unobserved_since_injection=(
            root_hook_traces_unobserved() - observer.root_traces_unobserved_at_injection
        ),
        root_forward_seen=ctx.root_forward_seen,
        report_config=observer.report_config,
        track_config=observer.track_config,
        sampling=sampling,
        capture_direct_forwards=observer.capture_direct_forwards,
        full_sentinel=observer.full_sentinel,
        hook_parking=observer.parking.shown_status(),
        rank_info=observer.rank_info,
        options=dict(observer.options),
        started_at=observer.started_at,
        telemetry_seconds=capture.telemetry_seconds,
        forked_from_pid=observer.forked_from_pid,
        forwards_at_fork=observer.forwards_at_fork,
        report_number=observer.report_number,
        final=observer.final_report,
        ended_by=observer.ended_by,
        uncaught_exception=observer.uncaught_exception,
        compiled_capture=_compiled_counts(observer),
        file_write_mode=next(
            (
                mode
                for target in (observer.writer, *observer.sinks)
                if isinstance(mode := getattr(target, "write_mode", None), str)
            ),
            None,
        ),
    )


def _compiled_counts(observer: Observer) -> CompiledCaptureCounts:
    compiled = observer.compiled_capture
    if compiled is None:
        return CompiledCaptureCounts(
            mode="off: capture_direct_forwards", compiled_code_invalidation=last_invalidation()
        )
    return CompiledCaptureCounts(
        mode=compiled.mode(),
        slots=len(compiled.measured),
        slots_dropped=compiled.slots_dropped,
        gradients_not_captured=compiled.gradients_not_tapped,
        calls_under_saved_tensor_hooks=compiled.calls_under_saved_tensor_hooks,
        root_hooks_traced=root_hook_traces(),
        root_hooks_unobserved=root_hook_traces_unobserved(),
        attention_calls_not_measured=attention_calls_not_measured(observer.context),
        recompile_limit_hits=recompile_limit_hits(),
        gradient_samples_lost=compiled.gradient_samples_lost,
        compiled_code_invalidation=last_invalidation(),
    )


def modules_replaced(observer: Observer) -> list[str]:
    """Names of the observed modules that are no longer in their place in the model
    (``model.h[1].ln_1 = nn.Identity()`` after injection): the module now there
    carries no hook of ours, so that place is no longer observed."""
    root = observer.root
    if root is None:
        return []
    replaced = []
    for index, name in enumerate(observer.names):
        if index == ROOT_INDEX:
            continue
        try:
            current: object = root.get_submodule(name)
        except AttributeError:
            current = None
        if current is not observer.module(index):
            replaced.append(name)
    return replaced


def module_kinds(observer: Observer) -> dict[str, str]:
    """Class name (``Linear``, ``LayerNorm``, ...) per selected module name (the report
    words its advice by the kind of module): of the module in its place now, or, for a
    module gone with its model (a model collected while observed), as it was observed."""
    kinds = dict(observer.module_classes)
    for index, name in enumerate(observer.names):
        try:
            module = observer.module(index)
        except IndexError:  # a parent being adopted: its name is listed, not its module
            break
        if module is not None:
            kinds[name] = type(module).__name__
    return kinds
