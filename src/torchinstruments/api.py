"""Public entry points: :func:`inject_observer` and :func:`remove_observer`."""

from __future__ import annotations

import fnmatch
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import torch
from torch import nn

from ._copies import remove_inert
from ._dir_lock import claim, release
from ._validate import shown
from .capture import (
    COMPILED_WRAPPER_ATTRIBUTE,
    ForwardHook,
    is_compile_wrapper,
    without_compile_wrappers,
)
from .compiled import note_observed
from .config import ReportConfig, TrackConfig
from .distributed import RANK_POLICIES, detect_rank
from .errors import ConfigError, ObserverStateError
from .histogram import HistogramSpec
from .observer import Observer
from .sampling import SamplingPolicy, resolve_sampling
from .sinks import DirectorySink, Sink

__all__ = ["ObserverHandle", "inject_observer", "remove_observer"]

_REGISTRY: weakref.WeakKeyDictionary[nn.Module, ObserverHandle] = weakref.WeakKeyDictionary()
_ACTIVE_DIRS: dict[str, weakref.ref[ObserverHandle]] = {}
_LOCK = threading.Lock()


class ObserverHandle:
    """What :func:`inject_observer` returns: flush the report now, or remove the observer.

    Attributes:
        output_dir: the directory this observer writes to (``rank-NNN`` under the given
            directory with ``rank_policy="all"``), or None on a rank that does not observe.
        active: False on a rank that ``rank_policy="rank0"`` leaves unobserved.

    Works as a context manager: leaving the ``with`` block removes the observer.
    """

    def __init__(self, model: nn.Module, observer: Observer | None, output_dir: Path | None):
        self._model = weakref.ref(model)
        self._observer = observer
        self.output_dir = output_dir
        self.active = observer is not None
        self.removed = False
        #: Calls :meth:`_model_collected` once the model is garbage-collected while
        #: observed (set by :func:`inject_observer`; None before, and on a rank that does
        #: not observe).
        self._on_collected: weakref.finalize | None = None

    def flush(self) -> Path | None:
        """Write the report now; return the path of ``report.json`` (None if not observing).

        Safe from any thread: a write another thread is running is waited for (up to
        120 s; then this one is skipped and counted as an error). Errors while writing
        are counted in the report, never raised.
        """
        if self._observer is None or self.removed:
            return None
        self._observer.write_report()
        return self.output_dir / "report.json" if self.output_dir is not None else None

    def set_step(self, step: int) -> None:
        """Give the caller's step (an optimizer step, ``trainer.global_step``) for the
        samples that open from now on: dashboard sinks log their scalars at it instead of
        at the training-forward index. The integrations call it before every batch;
        a training loop may too. It changes nothing in the report.

        Args:
            step: a non-negative int below ``2**63`` (the loggers store steps as signed
                64-bit integers), the x position of the caller's own metrics.

        Raises:
            ConfigError: ``step`` is not an int in ``[0, 2**63)``.
        """
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 1 << 63:
            raise ConfigError(
                f"ObserverHandle.set_step: step must be an int >= 0 and below 2**63, "
                f"got {shown(step)}"
            )
        if self._observer is not None:
            self._observer.caller_step = step

    def report(self) -> dict[str, Any] | None:
        """Build and return the current report dict without writing it; None on a rank
        that does not observe. Waits for a flush or write another thread is running.

        Raises:
            TimeoutError: when another thread's write held the observer's report lock
                for ``REPORT_LOCK_TIMEOUT_S`` (120 s).
        """
        if self._observer is None:
            return None
        return self._observer.build_report()

    def remove(self) -> None:
        """Detach, write the final report and restore the model; a second call does nothing."""
        model = self._model()
        if model is not None:
            remove_observer(model)
        else:
            self._finish()

    def _model_collected(self) -> None:
        """The observed model was garbage-collected without :func:`remove_observer` (a
        training function returned, say): what removal does, the final report first.
        Called from the garbage collector, at any allocation of any thread, so the
        registry lock is only tried: where it is held, the directory stays marked as
        used until this handle is gone (a dead reference, which frees it)."""
        self._finish(collected=True)

    def _finish(self, collected: bool = False) -> None:
        if self.removed:
            return
        self.removed = True
        if self._on_collected is not None:
            self._on_collected.detach()
        observer = self._observer
        if observer is not None:
            observer.detach()
            observer.write_final_report(
                "model_garbage_collected" if collected else "remove_observer"
            )
            for sink in observer.sinks:
                try:
                    sink.flush()
                except Exception as error:
                    observer.record_error("sink", type(sink).__name__, error)
        if observer is not None:
            release(observer.dir_lock)
        if self.output_dir is not None and _LOCK.acquire(blocking=not collected):
            try:
                key = str(self.output_dir.resolve())
                ref = _ACTIVE_DIRS.get(key)
                if ref is not None and ref() is self:
                    del _ACTIVE_DIRS[key]
            finally:
                _LOCK.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self.removed else ("active" if self.active else "inactive rank")
        return f"<ObserverHandle {state} output_dir={str(self.output_dir)!r}>"


_WRAPPERS = {
    "DistributedDataParallel": "module",
    "DataParallel": "module",
    "FullyShardedDataParallel": "module",
    "OptimizedModule": COMPILED_WRAPPER_ATTRIBUTE,  # torch.compile(model)
}


def _unwrap(model: nn.Module) -> nn.Module:
    """The module that does the work inside DDP / DataParallel / FSDP1 / torch.compile
    wrappers, so that names carry no ``module.`` or ``_orig_mod.`` prefix."""
    inner: nn.Module = model
    while type(inner).__name__ in _WRAPPERS:
        wrapped = getattr(inner, _WRAPPERS[type(inner).__name__], None)
        if not isinstance(wrapped, nn.Module):
            break
        inner = wrapped
    return inner


#: Most glob patterns in ``include`` or ``exclude``, and the longest one, in characters
#: (each pattern is matched against every module name at injection).
MAX_PATTERNS = 10_000
MAX_PATTERN_CHARS = 1_024
#: Most histogram specs.
MAX_HISTOGRAM_SPECS = 64


def _listed(name: str, value: Iterable[Any]) -> list[Any]:
    """``list(value)``, or ``ConfigError`` naming ``name`` if iterating raises."""
    try:
        return list(value)
    except Exception as error:
        raise ConfigError(
            f"inject_observer: {name} must be an iterable, got {shown(value)}, whose "
            f"iteration raised {type(error).__name__}"
        ) from error


def _as_patterns(name: str, value: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        patterns = tuple(value)
        longest = max((len(p) for p in patterns), default=0)
        if len(patterns) <= MAX_PATTERNS and longest <= MAX_PATTERN_CHARS:
            return patterns
        raise ConfigError(
            f"inject_observer: {name} must hold at most {MAX_PATTERNS:,} patterns of at "
            f"most {MAX_PATTERN_CHARS} characters, got {len(patterns)} patterns, the "
            f"longest of {longest} characters"
        )
    raise ConfigError(
        f"inject_observer: {name} must be a glob pattern string or a sequence of them, "
        f"got {shown(value)}"
    )


def _as_types(value: type | Sequence[type] | None) -> tuple[type, ...] | None:
    if value is None:
        return None
    try:
        types = (value,) if isinstance(value, type) else tuple(value)
    except TypeError:  # not iterable: an instance such as nn.Linear(1, 1)
        types = ()
    if not types or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
        raise ConfigError(
            "inject_observer: module_types must be an nn.Module subclass or a sequence of "
            f"them, got {shown(value)}"
        )
    return types


def select_modules(
    root: nn.Module,
    include: tuple[str, ...] | None,
    exclude: tuple[str, ...] | None,
    module_types: tuple[type, ...] | None,
) -> list[tuple[str, nn.Module]]:
    """Pick the observed modules, in ``named_modules()`` order, root first.

    Default: the root and every leaf module (one without children). With ``include``
    (glob patterns on qualified names, ``""`` is the root) and/or ``module_types``, the
    modules matching any pattern or type, plus the root. ``exclude`` patterns remove
    modules and everything inside them (``"blocks.0"`` removes ``blocks.0.fc1``; never
    the root, whose hooks define the sample). TorchScript submodules
    (``torch.jit.script`` or ``trace`` results) take no hooks and are never selected.
    A submodule replaced by its ``torch.compile`` wrapper is selected as the module it
    wraps, named without the wrapper's ``_orig_mod`` (as after injection). Containers
    without a ``forward`` of their own (``nn.ModuleList``, ``nn.ModuleDict``,
    ``nn.ParameterList``: :func:`has_no_forward`) are never called, so never selected.
    """
    chosen: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    excluded: set[str] = set()  # names matched by exclude: their submodules go too
    for qualified, module in root.named_modules():
        name = without_compile_wrappers(qualified)
        if (
            module is not root
            and exclude is not None
            and (
                name.rpartition(".")[0] in excluded  # its parent was excluded
                or any(fnmatch.fnmatchcase(name, p) for p in exclude)
            )
        ):
            excluded.add(name)
            continue
        if id(module) in seen or (
            module is not root
            and (_is_scripted(module) or is_compile_wrapper(module) or has_no_forward(module))
        ):
            continue
        if module is root:
            selected = True
        elif include is None and module_types is None:
            selected = next(module.children(), None) is None
        else:
            by_name = include is not None and any(fnmatch.fnmatchcase(name, p) for p in include)
            by_type = module_types is not None and isinstance(module, module_types)
            selected = by_name or by_type
        if selected:
            seen.add(id(module))
            chosen.append((name, module))
    return chosen


def has_no_forward(module: nn.Module) -> bool:
    """True for a module whose class keeps ``nn.Module``'s unimplemented ``forward``
    (``nn.ModuleList``, ``nn.ModuleDict``, ``nn.ParameterList``, ``nn.ParameterDict``):
    calling it raises, so its hooks never fire."""
    return getattr(type(module), "forward", None) is getattr(nn.Module, "forward", None)


def _submodules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """``root``'s submodules named as patterns are matched against them: in
    ``named_modules()`` order, without compile wrappers and their ``_orig_mod``."""
    return [
        (without_compile_wrappers(qualified), module)
        for qualified, module in root.named_modules()
        if module is not root and not is_compile_wrapper(module)
    ]


def _examples(submodules: list[tuple[str, nn.Module]]) -> list[str]:
    """The first five names of :func:`_submodules`, for messages."""
    return list(dict.fromkeys(name for name, _ in submodules))[:5]


def selection_warnings(
    root: nn.Module,
    include: tuple[str, ...] | None,
    exclude: tuple[str, ...] | None,
) -> tuple[list[str], list[str]]:
    """What :func:`select_modules` ignored of what was asked: messages for patterns
    (an ``include`` or ``exclude`` pattern that matches no module name), and messages
    for containers (an ``include`` pattern that matches only containers without a
    ``forward``, whose children are observed only when a pattern matches them, as
    ``"blocks.*"`` does).
    """
    submodules = _submodules(root)
    unmatched: list[str] = []
    containers: list[str] = []
    for argument, patterns in (("include", include), ("exclude", exclude)):
        for pattern in patterns or ():
            matched = [m for name, m in submodules if fnmatch.fnmatchcase(name, pattern)]
            if not matched:
                unmatched.append(
                    f"inject_observer: {argument} pattern {pattern!r} matches no module; "
                    f"module names look like {_examples(submodules)!r}"
                )
            elif argument == "include" and all(has_no_forward(m) for m in matched):
                containers.append(
                    f"inject_observer: include pattern {pattern!r} matches only "
                    f"{', '.join(sorted({type(m).__name__ for m in matched}))} "
                    "container(s), which are never called and are not observed; to "
                    f"observe the modules they hold, include {pattern + '.*'!r}"
                )
    return unmatched, containers


def _is_scripted(module: nn.Module) -> bool:
    script_module = getattr(getattr(torch, "jit", None), "ScriptModule", None)
    return script_module is not None and isinstance(module, script_module)


def scripted_submodules(root: nn.Module) -> list[str]:
    """Names of the TorchScript submodules of ``root`` (not their own children)."""
    names: list[str] = []
    for name, module in root.named_modules():
        if name and _is_scripted(module) and not any(name.startswith(f"{n}.") for n in names):
            names.append(name)
    return names


def inject_observer(
    model: nn.Module,
    *,
    output_dir: str | os.PathLike[str] = "stats",
    sampling: int | SamplingPolicy | None = None,
    report_config: ReportConfig | None = None,
    track_config: TrackConfig | None = None,
    rank_policy: str = "rank0",
    capture_direct_forwards: bool = False,
    full_sentinel: bool = False,
    attention_logits: bool = True,
    histograms: Iterable[HistogramSpec] = (),
    plots: bool = False,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    module_types: type | Sequence[type] | None = None,
    sinks: Iterable[Sink] = (),
    write_files: bool = True,
) -> ObserverHandle:
    """Attach a passive observer to ``model`` in place; train as usual.

    Hooks record activations (module outputs) and output gradients of the selected
    modules on sampled training forwards; the report is written at once, at the end of
    warm-up, every ``report_config.rewrite_interval_s`` seconds, on ``SIGTERM`` (then
    the handler installed before runs, or the signal takes its default course), at
    :func:`remove_observer` and at interpreter exit. Outputs, gradients, parameters
    and ``state_dict()`` are unchanged; no parameter, buffer or submodule is added.

    Args:
        model: the root module (a DDP or DataParallel wrapper is unwrapped; names are
            shown without its ``module.`` prefix).
        output_dir: directory for ``report.json`` and ``index.md``. Default ``"stats"``.
            A leading ``~`` is the user's home directory (``os.path.expanduser``); a
            relative path is resolved against the working directory once, at
            injection. Two live observers may not share one directory.
        sampling: ``None`` for :class:`~torchinstruments.DefaultSampling` (dense first,
            then one forward in 256), an int N to sample every N-th training forward
            (``1`` = every forward), or a :class:`~torchinstruments.SamplingPolicy`.
        report_config: report limits; default :class:`~torchinstruments.ReportConfig`.
        track_config: tracker settings; default :class:`~torchinstruments.TrackConfig`.
        rank_policy: ``"rank0"`` (only rank 0 observes and writes) or ``"all"`` (each
            rank writes ``rank-NNN/`` under ``output_dir``).
        capture_direct_forwards: also observe ``module.forward(...)`` calls that bypass
            ``module(...)``, by reversibly wrapping ``forward`` on each selected module
            instance. Every call is still observed exactly once. Without it, submodules
            called on their own are observed (as samples of their own) only while the
            root has never run a training forward; once it has, such calls (an auxiliary
            loss, a probe) are skipped, and counted under
            ``coverage.calls_outside_root_skipped`` where the module's hook is in place
            (between unsampled eager forwards, hooks are taken out of the modules
            whose only forward hook they are, and then see no call).
        full_sentinel: on every unsampled training forward, check every observed
            module's output for non-finite values (one reduction per tensor), so that a
            one-off NaN is localised to the first module in forward order that produced
            it. Off by default: without it only the root output of one training forward
            in 8 is checked between samples (one reduction; the checked offset moves
            from one run of 8 to the next, so a persistent fault is caught within 9
            forwards, a periodic one within 64, a one-off only on a checked forward),
            and a hit makes the next 8 forwards sampled.
        attention_logits: measure the attention logits (``scale * Q K^T``, at most
            65,536 per call) of every ``torch.nn.functional.scaled_dot_product_attention``
            call in a sampled training forward, as an activation of the calling module
            under the tensor path ``attention_logits``; for that, the function is
            replaced by a wrapper (which returns torch's result unchanged) for the
            duration of each sampled forward, and only then. Default True; False leaves
            ``torch.nn.functional`` untouched.
        histograms: fixed-edge histograms to take, each from
            :func:`~torchinstruments.histogram` (opt-in; default none). They reach
            ``details.json``, TensorBoard and a bounded summary under ``coverage``.
        plots: also write ``plots/*.png`` of the notable findings' series, linked from
            ``index.md`` (needs the ``plots`` extra, matplotlib). Default False.
        include: glob pattern(s) of qualified module names to observe (``"blocks.*"``).
        exclude: glob pattern(s) of module names not to observe, each with every module
            inside it (``"blocks.0"`` also removes ``blocks.0.fc1``).
        module_types: observe modules of these types (``nn.Linear``, ...).
        sinks: extra sinks that receive every report (see :class:`~torchinstruments.Sink`).
        write_files: write ``report.json`` and ``index.md`` to ``output_dir``. Default True.

    Returns:
        An :class:`ObserverHandle`.

    Raises:
        ConfigError: an argument is invalid (the message names it, what was expected
            and what was given), or ``include``, ``exclude`` and ``module_types`` leave
            no module but the root of a model that has submodules.
        ObserverStateError: ``model`` already carries an observer, or another live
            observer writes to ``output_dir``: in this process, or in another process
            that still runs on this host (its ``.writer.lock`` there).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> handle = inject_observer(model, output_dir=tempfile.mkdtemp())  # doctest: +SKIP
        >>> model(torch.randn(2, 4)).sum().backward()  # doctest: +SKIP
        >>> remove_observer(model)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"inject_observer: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    _check_output_dir(output_dir)
    policy = resolve_sampling(sampling)
    reporting: ReportConfig = _typed("report_config", report_config, ReportConfig)
    tracking: TrackConfig = _typed("track_config", track_config, TrackConfig)
    if not isinstance(rank_policy, str) or rank_policy not in RANK_POLICIES:
        raise ConfigError(
            f"inject_observer: rank_policy must be one of {RANK_POLICIES}, got {shown(rank_policy)}"
        )
    if not isinstance(capture_direct_forwards, bool):
        raise ConfigError(
            "inject_observer: capture_direct_forwards must be a bool, "
            f"got {shown(capture_direct_forwards)}"
        )
    if not isinstance(full_sentinel, bool):
        raise ConfigError(
            f"inject_observer: full_sentinel must be a bool, got {shown(full_sentinel)}"
        )
    if not isinstance(attention_logits, bool):
        raise ConfigError(
            f"inject_observer: attention_logits must be a bool, got {shown(attention_logits)}"
        )
    if not isinstance(plots, bool):
        raise ConfigError(f"inject_observer: plots must be a bool, got {shown(plots)}")
    if plots:
        from .plots import require_matplotlib

        require_matplotlib()
    if not isinstance(write_files, bool):
        raise ConfigError(f"inject_observer: write_files must be a bool, got {shown(write_files)}")
    sink_list = _checked_sinks(sinks)
    if isinstance(histograms, HistogramSpec) or not isinstance(histograms, Iterable):
        raise ConfigError(
            "inject_observer: histograms must be an iterable of histogram(...) specs, "
            f"got {shown(histograms)}"
        )
    histogram_specs = tuple(_listed("histograms", histograms))
    if len(histogram_specs) > MAX_HISTOGRAM_SPECS:
        raise ConfigError(
            f"inject_observer: histograms must hold at most {MAX_HISTOGRAM_SPECS} specs, "
            f"got {len(histogram_specs)}"
        )
    for spec in histogram_specs:
        if not isinstance(spec, HistogramSpec):
            raise ConfigError(
                "inject_observer: each histograms entry must come from histogram(...), "
                f"got {shown(spec)}"
            )
    include_patterns = _as_patterns("include", include)
    exclude_patterns = _as_patterns("exclude", exclude)
    types = _as_types(module_types)

    root = _unwrap(model)
    if _is_scripted(root):
        raise ConfigError(
            f"inject_observer: model must be an eager nn.Module, got the TorchScript module "
            f"{type(root).__name__}; observe the module before scripting it"
        )
    with _LOCK:
        for candidate in {id(model): model, id(root): root}.values():
            existing = _REGISTRY.get(candidate)
            if existing is not None and not existing.removed:
                raise ObserverStateError(
                    "inject_observer: this model already carries an observer; call "
                    "remove_observer(model) before injecting again"
                )
        rank_info = detect_rank()
        # Resolved once: an os.chdir during training must not move later writes.
        directory = Path(os.path.abspath(os.path.expanduser(output_dir)))
        if rank_policy == "all":
            directory = directory / f"rank-{rank_info.rank:03d}"
        if rank_policy == "rank0" and rank_info.rank != 0:
            handle = ObserverHandle(model, None, None)
            _REGISTRY[model] = handle
            return handle
        try:
            is_file = directory.exists() and not directory.is_dir()
            key = str(directory.resolve())
        except OSError as error:  # a name longer than the file system allows, a loop
            raise ConfigError(
                f"inject_observer: output_dir must be a path the file system accepts, got "
                f"{str(directory)[:200]!r} ({error.strerror or error})"
            ) from error
        if write_files and is_file:
            raise ConfigError(
                f"inject_observer: output_dir must be a directory (or not exist yet), got "
                f"{str(directory)!r}, which is an existing file"
            )
        holder = _ACTIVE_DIRS.get(key)
        if holder is not None and holder() is not None and not holder().removed:  # type: ignore[union-attr]
            raise ObserverStateError(
                f"inject_observer: output_dir {str(directory)!r} is already used by another "
                "live observer; give each observed model its own output_dir (a model "
                "dropped without remove_observer keeps it until the garbage collector "
                "frees the model: call remove_observer, or gc.collect())"
            )
        modules = select_modules(root, include_patterns, exclude_patterns, types)
        examples = _examples(_submodules(root))
        given = {
            "include": include_patterns,
            "exclude": exclude_patterns if examples else None,
            "module_types": [t.__name__ for t in types] if types is not None else None,
        }
        chosen = [f"{name}={list(value)!r}" for name, value in given.items() if value is not None]
        unmatched, containers = selection_warnings(
            root, include_patterns, exclude_patterns if examples else None
        )
        if chosen and len(modules) == 1:
            hint = containers[0].removeprefix("inject_observer: ") if containers else ""
            raise ConfigError(
                f"inject_observer: {' and '.join(chosen)} select"
                f"{'s' if len(chosen) == 1 else ''} no module besides the root; module "
                f"names look like {examples!r}" + (f" ({hint})" if hint else "")
            )
        for message in (*unmatched, *containers):
            warnings.warn(message, UserWarning, stacklevel=2)
        # A DirectorySink for the same directory (say with write_full_details=True)
        # replaces the default writer instead of writing the same files twice.
        own_sink = any(
            isinstance(sink, DirectorySink) and sink.path.resolve() == directory.resolve()
            for sink in sink_list
        )
        observer = Observer(
            target=model,
            root=root,
            modules=modules,
            policy=policy,
            report_config=reporting,
            track_config=tracking,
            capture_direct_forwards=capture_direct_forwards,
            full_sentinel=full_sentinel,
            attention_logits=attention_logits,
            histograms=histogram_specs,
            rank_info=rank_info,
            writer=DirectorySink(directory, plots=plots) if write_files and not own_sink else None,
            sinks=sink_list,
            options={
                "rank_policy": rank_policy,
                "attention_logits": attention_logits,
                "include": list(include_patterns) if include_patterns else None,
                "exclude": list(exclude_patterns) if exclude_patterns else None,
                "module_types": [t.__name__ for t in types] if types else None,
                "scripted_modules_skipped": scripted_submodules(root) or None,
            },
        )
        # Across processes, one writer per directory (a lock file in it).
        lock = observer.dir_lock = claim(directory) if write_files else None
        handle = ObserverHandle(model, observer, directory)
        try:
            observer.attach()
        except Exception as error:
            observer.detach()  # all or nothing: no hook of ours stays behind
            release(lock)
            raise ObserverStateError(
                f"inject_observer: could not attach to the model ({type(error).__name__}: "
                f"{error}); no hook was left on it"
            ) from error
        # A first report at once: a run stopped before its first rewrite (at the end
        # of warm-up, then every rewrite_interval_s) still leaves one.
        observer.write_report(files_only=True)
        note_observed(root, ForwardHook)  # before anything compiles it with our hooks
        _forget_compiled_code(model, root=root)
        _REGISTRY[model] = handle
        if root is not model:
            _REGISTRY[root] = handle
        _ACTIVE_DIRS[key] = weakref.ref(handle)
        # A model dropped without remove_observer still gets its final report. Not at
        # interpreter exit: the exit handler writes it then.
        handle._on_collected = weakref.finalize(root, handle._model_collected)
        handle._on_collected.atexit = False
    return handle


#: Longest ``output_dir`` accepted, in bytes of its file-system encoding (Linux's
#: PATH_MAX is 4,096, including the names written under it).
MAX_OUTPUT_DIR_BYTES = 3_072


def _check_output_dir(output_dir: object) -> None:
    """Raise ``ConfigError`` unless ``output_dir`` is a non-empty ``str`` path (or a
    path-like giving one) without NUL, at most ``MAX_OUTPUT_DIR_BYTES`` long."""
    expected = (
        "inject_observer: output_dir must be a non-empty path (a str or os.PathLike[str] "
        f"without NUL, at most {MAX_OUTPUT_DIR_BYTES} bytes)"
    )
    try:
        text = os.fspath(output_dir) if isinstance(output_dir, str | os.PathLike) else None
    except Exception:
        text = None
    if not isinstance(text, str) or text == "" or "\x00" in text:
        raise ConfigError(f"{expected}, got {shown(output_dir)}")
    try:
        size = len(os.fsencode(text))
    except UnicodeError:  # lone surrogates that the file-system encoding cannot write
        raise ConfigError(f"{expected}, got {shown(output_dir)} (not encodable)") from None
    if size > MAX_OUTPUT_DIR_BYTES:
        raise ConfigError(f"{expected}, got a path of {size} bytes")


def _checked_sinks(sinks: object) -> list[Sink]:
    """``sinks`` as a list, each with a ``write`` method.

    Raises:
        ConfigError: ``sinks`` is not an iterable (or is a str), or holds an object
            without ``write(report)``.
    """
    if isinstance(sinks, str | bytes) or not isinstance(sinks, Iterable):
        raise ConfigError(
            f"inject_observer: sinks must be an iterable of sinks, got {shown(sinks)}"
        )
    sink_list = _listed("sinks", sinks)
    for sink in sink_list:
        if not callable(getattr(sink, "write", None)):
            raise ConfigError(
                f"inject_observer: each sink needs a write(report) method, got {shown(sink)}"
            )
    return sink_list


def _typed(name: str, value: object, kind: type) -> Any:
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise ConfigError(
            f"inject_observer: {name} must be a {kind.__name__} or None, "
            f"got {type(value).__name__} {shown(value)}"
        )
    return value


def _forget_compiled_code(model: nn.Module, *, root: nn.Module | None = None) -> None:
    """Invalidate code that ``torch.compile`` compiled for ``model`` without guarding on
    its hooks, so that hooks just added or removed take effect; with ``root`` (the
    observed model, at injection) also such code compiled elsewhere that may run it (see
    :func:`torchinstruments.compiled.forget_compiled_code`). Other models keep their
    compiled code. Nothing happens unless Dynamo is loaded; recompilation of ``model``
    follows on its next call."""
    if "torch._dynamo" not in sys.modules:
        return
    from .compiled import forget_compiled_code

    forget_compiled_code(model.modules(), root=root)


def remove_observer(model: nn.Module) -> None:
    """Detach the observer of ``model``, write its final report, restore the model.

    Every hook and wrapper of ours is removed and instance attributes are restored
    (except the instance ``forward`` given to a root of a ``torch.nn`` class where
    compiled code may still run it, see ``_root_frame.py``); a second call (or a call
    on a model without an observer) does nothing, except on a copy of an observed model
    (``copy.deepcopy``, ``torch.load``): the inert placeholders that its first forward
    would remove are removed at once.

    Raises:
        ConfigError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"remove_observer: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    with _LOCK:
        handle = _REGISTRY.get(model)
        if handle is None:
            handle = _REGISTRY.get(_unwrap(model))
        if handle is None:
            remove_inert(_unwrap(model))
            return
        for key in [k for k, v in list(_REGISTRY.items()) if v is handle]:
            del _REGISTRY[key]
    handle._finish()
    if handle.active:
        _forget_compiled_code(model)


def observer_of(model: nn.Module) -> ObserverHandle | None:
    """The live handle attached to ``model``, or None. ``model`` may also be a wrapper
    of the observed model (``torch.compile``, DDP, DataParallel, FSDP1), as for
    :func:`remove_observer`."""
    handle = _REGISTRY.get(model)
    if handle is None and isinstance(model, nn.Module):
        handle = _REGISTRY.get(_unwrap(model))
    return handle if handle is not None and not handle.removed else None
