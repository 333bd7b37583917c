"""⑤ report: a byte-bounded, deterministic report dict, its JSON bytes and its Markdown.

Findings are taken round-robin across categories (rank 1 of each category, then rank 2,
...), at most ``top_k_per_category`` each; the longest prefix of that order whose exact
indented UTF-8 JSON fits ``max_bytes`` is kept, and what was left out is counted per
category. The same run gives the same report but for ``generated_at`` and ``run.elapsed_s``.

This module ranks, selects and bounds the findings and builds the summary and coverage
sections. Its parts: ``_report_sections`` (``run``, ``config``, histograms, errors,
``details.json``), ``_report_model_wide`` (the ``<model>`` findings),
``_report_markdown`` (``index.md``), ``_series_file`` (``series.json``) and
``_document`` (rounding, bounded names, the byte-bound search).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ._document import bounded_text, clean, longest_fitting_prefix, round_robin, shrink_to_fit
from ._jsonio import SCHEMA, dumps_report
from ._report_markdown import LLM_PROMPT, md_code, render_markdown, sparkline
from ._report_model_wide import _model_wide_findings, _special_parts
from ._report_sections import (
    DETAILS_SCHEMA,
    _config_section,
    _errors_section,
    _histogram_summary,
    _run_section,
    build_details,
)
from ._series_file import SERIES_SCHEMA, SeriesSummary
from ._series_file import build_series_summary as _build_series_summary
from .events import (
    QUIET_ROWS_PER_CATEGORY,
    Facet,
    SameTensor,
    build_events,
    dedupe,
    event_body,
    facet_row,
    modules_stopped,
    quiet_row,
)
from .find import (
    CATEGORIES,
    Candidate,
    NonFiniteBetweenSamples,
    display_module,
    format_value,
    run_rules,
)
from .find.base import MODEL, ONSET_TOLERANCE_SAMPLES, is_early, step_size
from .series import GRAD_OUTPUT

if TYPE_CHECKING:
    from ._snapshot import RunSnapshot

__all__ = [
    "DETAILS_SCHEMA",
    "LLM_PROMPT",
    "SCHEMA",
    "SERIES_SCHEMA",
    "build_details",
    "build_report",
    "build_series_summary",
    "dumps_report",
    "longest_fitting_prefix",
    "render_markdown",
    "sparkline",
]


def _module_count(observer: RunSnapshot) -> int:
    return len({s.module for s in observer.series.values()})


#: Most names listed under ``coverage.modules_not_observed``.
MAX_MODULES_NOT_OBSERVED = 16


def _modules_not_observed(observer: RunSnapshot) -> list[str]:
    """Selected modules without a series, in forward-selection order (at most
    ``MAX_MODULES_NOT_OBSERVED``): never called in a sampled training forward (for
    example a projection whose weights a parent uses through functional code, like
    ``nn.MultiheadAttention``'s ``out_proj``), or only with non-floating outputs."""
    seen = {s.module for s in observer.series.values()}
    missing = [display_module(name) for name in observer.names if name not in seen]
    return missing[:MAX_MODULES_NOT_OBSERVED]


def _modules_never_ran(observer: RunSnapshot) -> list[str]:
    """Selected modules whose forward hook never fired in a sampled forward (a child
    whose parent uses its weights functionally, a branch never taken), at most
    ``MAX_MODULES_NOT_OBSERVED``; empty before the first sample."""
    if not observer.counters.samples_observed:
        return []
    called = observer.modules_called
    names = [display_module(name) for i, name in enumerate(observer.names) if i and i not in called]
    return names[:MAX_MODULES_NOT_OBSERVED]


def _limits_hit(
    observer: RunSnapshot, omitted_bytes: int, omitted_top_k: int, replaced: Sequence[str] = ()
) -> list[str]:
    limits = []
    if replaced:
        limits.append("modules_replaced")
    if omitted_bytes:
        limits.append("max_bytes")
    if omitted_top_k:
        limits.append("top_k_per_category")
    if observer.counters.series_dropped:
        limits.append("max_series")
    if observer.counters.paths_dropped:
        limits.append("max_tensors_per_output")
    if len(observer.errors) > observer.report_config.max_error_entries:
        limits.append("max_error_entries")
    compiled = observer.compiled_capture
    if compiled.slots_dropped:
        limits.append("compiled_max_slots")
    if compiled.gradient_samples_lost:
        limits.append("compiled_gradient_samples")
    if compiled.recompile_limit_hits and not compiled.mode.startswith("off"):
        # Also where no graph of this model was captured: code that reached the limit
        # (another model's, or this one's) may be what left it uncompiled.
        limits.append("torch_compile_recompile_limit")
    return limits


#: Observed (module, call, signal) up to which each is named by at least one compact
#: row (a model of up to 16 modules).
SMALL_MODEL_SERIES = 32


def _quiet_choice(
    quiet: Sequence[Candidate], room: int, listed: set[tuple[str, int, str]]
) -> list[int]:
    """Indices (in rank order) of the compact rows of one category: its rank 1, then the
    best ranked whose (module, call, signal) no earlier category listed, so that the few
    rows of all categories name as many series as they can; then the next best."""
    if room <= 0 or not quiet:
        return []
    chosen = [0]
    fresh = [
        i
        for i, c in enumerate(quiet)
        if i
        and (c.series.module, c.series.call_index, c.series.signal) not in listed
        and (c.series.module, c.series.call_index, c.series.signal)
        != (quiet[0].series.module, quiet[0].series.call_index, quiet[0].series.signal)
    ]
    chosen += fresh[: room - 1]
    chosen += [i for i in range(1, len(quiet)) if i not in chosen][: room - len(chosen)]
    return sorted(chosen)


def _round_key(
    notable: bool,
    change_sample: int | None,
    early: bool,
    signal: str,
    size: float,
    non_finite: bool = False,
):
    # Within a round: notable first, then the earliest detected change, so the list reads
    # in the order things happened; at the same sample non-finite values first (they are
    # dated exactly, and where they appear every statistic over the finite values has
    # moved with them), then the category whose change is largest in its own noise units
    # (residual spreads); ties keep the fixed category order.
    return (
        not notable,
        change_sample is None,
        early,
        (change_sample or 0) + (ONSET_TOLERANCE_SAMPLES if signal == GRAD_OUTPUT else 0),
        not non_finite,
        -size,
    )


#: The headline of a report built with ``ranking=False``.
RANKING_FAILED_HEADLINE = (
    "Ranking the observed series failed (see errors, stage `report`): this report lists "
    "no findings. Its coverage counts what was observed; series.json, where written, "
    "holds the series themselves. The error is a defect of torchinstruments: please "
    "report it with the warning printed."
)


def build_report(observer: RunSnapshot, *, ranking: bool = True) -> dict[str, Any]:
    """Build the bounded report from an observer's snapshot (taken after a flush).

    Per category, the notable findings (at most ``top_k_per_category``) and then up to
    :data:`~torchinstruments.events.QUIET_ROWS_PER_CATEGORY` compact rows of findings that
    are not notable (for a model of at most ``SMALL_MODEL_SERIES`` observed module calls
    and signals, as many as name each once) are taken, round-robin across categories;
    each notable finding refers to its event (``events``), written once in full. The
    longest prefix of that order whose bytes fit is kept, with the events it refers to.

    Args:
        observer: the snapshot.
        ranking: ``False`` builds the report without running the rules (no findings, no
            events, no modules stopped; the headline says the ranking failed): the
            fallback the observer writes when building with ranking raised, so that the
            run's coverage and its errors still reach ``output_dir``.

    Returns:
        A JSON-safe dict whose :func:`dumps_report` bytes are at most
        ``observer.report_config.max_bytes`` long.
    """
    config = observer.report_config
    stopped = modules_stopped(observer) if ranking else []
    ranked = (
        run_rules(
            observer.series.values(),
            loss_scaled=observer.counters.loss_scaled_samples > 0,
            nonfinite_between_samples=_sentinel_hits(observer),
            stopped={(m["module"], m["call_index"]): m["last_sample"] for m in stopped},
        )
        if ranking
        else {category: [] for category in CATEGORIES}
    )
    same = SameTensor(observer.series.values())
    kinds = dict(observer.module_kinds)
    # Entries per category: a Facet (notable), a Candidate (a quiet row) or a <model>
    # finding dict; each with its round-robin key.
    per_category: dict[str, list[tuple[object, tuple[Any, ...]]]] = {}
    notable_counts: dict[str, int] = {}
    candidate_counts: dict[str, int] = {}
    notable_dropped: dict[str, int] = {}
    listed: set[tuple[str, int, str]] = set()  # (module, call, signal) of quiet rows
    # A small model's compact rows name each of its series once (every category's rank 1
    # and the series no earlier category listed); a larger model's, a few per category.
    small_model = (
        len({(s.module, s.call_index, s.signal) for s in observer.series.values()})
        <= SMALL_MODEL_SERIES
    )
    quiet_ranks: dict[int, int] = {}
    for number, category in enumerate(CATEGORIES):
        # Notable candidates of one tensor are one (named once, the others under
        # also_named); compact rows name every series as it was observed.
        candidates = [
            *dedupe([c for c in ranked[category] if c.notable], same),
            *(c for c in ranked[category] if not c.notable),
        ]
        items: list[tuple[object, tuple[Any, ...]]] = []
        specials = (
            _model_wide_findings(observer)
            if ranking and category == "gradient_scale_change"
            else []
        )
        for rank, special in enumerate(specials, 1):
            key = _round_key(
                special["notable"],
                special["change_sample"],
                False,
                special["signal"],
                special["change_in_residual_spreads"] or 0.0,
            )
            items.append(({**special, "rank": rank}, (*key, number)))
        notable = [c for c in candidates if c.notable]
        quiet = [c for c in candidates if not c.notable]
        room = config.top_k_per_category - len(items)
        notable_dropped[category] = max(len(notable) - max(room, 0), 0)
        for c in notable[: max(room, 0)]:
            size = max([step_size(c), *(step_size(e) for e in c.echoes)]) if c.change else 0.0
            key = _round_key(
                True, c.onset, is_early(c), c.series.signal, size, category == "non_finite"
            )
            items.append((Facet(category, len(items) + 1, c), (*key, number)))
        room = config.top_k_per_category - len(items)
        if not small_model:
            room = min(QUIET_ROWS_PER_CATEGORY, room)
        offset = len(specials) + len(notable)
        for index in _quiet_choice(quiet, max(room, 0), listed):
            c = quiet[index]
            listed.add((c.series.module, c.series.call_index, c.series.signal))
            quiet_ranks[id(c)] = offset + index + 1
            items.append((c, (*_round_key(False, None, False, c.series.signal, 0.0), number)))
        per_category[category] = items
        candidate_counts[category] = len(candidates) + len(specials)
        notable_counts[category] = len(notable) + sum(1 for x in specials if x["notable"])
    ranked_entries = round_robin(
        [per_category[category] for category in CATEGORIES], key=lambda item: item[1]
    )
    order: list[object] = [entry for entry, _ in ranked_entries]
    # Events, numbered in report order; rows of findings, each referring to its event.
    facets = [entry for entry in order if isinstance(entry, Facet)]
    events = build_events(facets)
    bodies: dict[int, dict[str, Any]] = {}
    rows: list[tuple[dict[str, Any], int | None]] = []  # (row, event number)
    number = 0
    numbers: dict[int, int] = {}
    for entry in order:
        if isinstance(entry, Facet):
            assert entry.event is not None
            event = entry.event
            if id(event) not in numbers:
                number += 1
                numbers[id(event)] = number
                event.number = number
                bodies[number] = event_body(
                    event, observer, kinds, same, config.max_echo_modules, stopped
                )
            rows.append((facet_row(entry, observer, same), numbers[id(event)]))
        elif isinstance(entry, Candidate):
            rows.append((quiet_row(entry, quiet_ranks[id(entry)], same), None))
        else:
            assert isinstance(entry, dict)
            row, body = _special_parts(entry)
            if body is None:
                rows.append((row, None))
                continue
            number += 1
            bodies[number] = {"id": f"E{number}", **body}
            row["event"] = f"E{number}"
            rows.append((row, number))
    del events
    first_non_finite = _first_non_finite(ranked["non_finite"], observer)
    replaced = [display_module(name) for name in observer.modules_replaced]
    never_ran = _modules_never_ran(observer)

    def assemble(kept: int) -> dict[str, Any]:
        findings = [row for row, _ in rows[:kept]]
        referred = sorted({n for _, n in rows[:kept] if n is not None})
        kept_events = [bodies[n] for n in referred]
        returned = {c: 0 for c in CATEGORIES}
        for finding in findings:
            returned[finding["category"]] += 1
        omitted = {
            c: {
                "by_top_k": notable_dropped[c],
                "by_bytes": len(per_category[c]) - returned[c],
                "not_notable": candidate_counts[c] - len(per_category[c]) - notable_dropped[c],
            }
            for c in CATEGORIES
        }
        omitted_bytes = sum(v["by_bytes"] for v in omitted.values())
        omitted_top_k = sum(v["by_top_k"] for v in omitted.values())
        notable_returned = sum(1 for f in findings if f["notable"])
        return clean(
            {
                "schema": SCHEMA,
                "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "run": _run_section(observer),
                "config": _config_section(observer),
                "summary": {
                    "notable_findings": sum(notable_counts.values()),
                    "notable_findings_returned": notable_returned,
                    "events": len(bodies),
                    "events_returned": len(kept_events),
                    "headline": (
                        _headline(kept_events, sum(notable_counts.values()), observer, stopped)
                        if ranking
                        else RANKING_FAILED_HEADLINE
                    ),
                    "first_non_finite": first_non_finite,
                },
                "coverage": {
                    "modules_selected": len(observer.names),
                    "modules_observed": _module_count(observer),
                    "modules_not_observed": _modules_not_observed(observer),
                    "modules_never_ran": never_ran,
                    "parents_observed": {
                        display_module(child): display_module(parent)
                        for child, parent in list(observer.parents_adopted.items())[
                            :MAX_MODULES_NOT_OBSERVED
                        ]
                    },
                    "attention_modules_observed": [
                        display_module(name)
                        for name in observer.attention_modules_adopted[:MAX_MODULES_NOT_OBSERVED]
                    ],
                    "modules_replaced": replaced[:MAX_MODULES_NOT_OBSERVED],
                    "modules_stopped": stopped,
                    "tensor_paths_observed": len(
                        {(s.module, s.call_index, s.tensor_path) for s in observer.series.values()}
                    ),
                    "tensor_series": len(observer.series),
                    "series": sum(len(s.trackers) for s in observer.series.values()),
                    "histograms": len(observer.histograms),
                    "histogram_summary": _histogram_summary(observer),
                    "forwards_seen": observer.counters.forwards_seen,
                    "samples_observed": observer.counters.samples_observed,
                    "backward_samples_observed": observer.counters.backward_samples_observed,
                    "eval_forwards_skipped": observer.counters.eval_forwards_skipped,
                    "recompute_calls_ignored": observer.counters.recompute_calls_ignored,
                    "direct_call_forwards": observer.counters.direct_call_forwards,
                    "calls_outside_root_skipped": observer.counters.calls_outside_root_skipped,
                    "repeated_backward_gradients": observer.counters.repeated_backward_gradients,
                    "backward_gradients_summed": observer.counters.backward_gradients_summed,
                    "backward_gradients_not_summed": (
                        observer.counters.backward_gradients_not_summed
                    ),
                    "loss_scaled_samples": observer.counters.loss_scaled_samples,
                    "sentinel_checks": observer.counters.sentinel_checks,
                    "sentinel_nonfinite_forwards": observer.counters.sentinel_nonfinite_forwards,
                    "tensors_skipped": dict(sorted(observer.skipped_tensors.items())),
                    "series_dropped": observer.counters.series_dropped,
                    "series_summary_omitted": observer.counters.series_summary_omitted,
                    "paths_dropped": observer.counters.paths_dropped,
                    "candidates": candidate_counts,
                    "notable": notable_counts,
                    "findings_returned": returned,
                    "findings_omitted": omitted,
                    "errors_total": observer.counters.errors_total,
                    "limits_hit": _limits_hit(observer, omitted_bytes, omitted_top_k, replaced),
                    "compiled_capture": dataclasses.asdict(observer.compiled_capture),
                    "file_write_mode": observer.file_write_mode,
                },
                "events": kept_events,
                "findings": findings,
                "errors": _errors_section(observer),
            }
        )

    report = longest_fitting_prefix(assemble, len(rows), config.max_bytes)
    return _fit_sections(report, config.max_bytes)


#: Sections emptied, in this order, when a report without findings still exceeds
#: ``max_bytes``: (section, key, what replaces it).
_SHRINKABLE: tuple[tuple[str, str, object], ...] = (
    ("coverage", "histogram_summary", []),
    ("coverage", "modules_not_observed", []),
    ("coverage", "modules_never_ran", []),
    ("coverage", "modules_replaced", []),
    ("coverage", "modules_stopped", []),
    ("coverage", "parents_observed", {}),
    ("", "errors", []),
    ("", "config", {}),
    ("coverage", "tensors_skipped", {}),
    ("summary", "headline", None),  # None: cut to 200 characters
)


def _fit_sections(report: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    """Leave out the fields of ``coverage.compiled_capture`` that are zero (or empty),
    then empty the bounded-but-sizeable sections of ``report`` (see ``_SHRINKABLE``) one
    by one until its bytes fit ``max_bytes``; each shortened one is named under
    ``coverage.sections_omitted`` and ``max_bytes`` joins ``coverage.limits_hit``.
    Findings were dropped first (all of them, if it comes to this)."""
    if len(dumps_report(report)) <= max_bytes:
        return report
    coverage = report["coverage"]
    omitted: list[str] = coverage.setdefault("sections_omitted", [])
    if "max_bytes" not in coverage["limits_hit"]:
        coverage["limits_hit"].append("max_bytes")

    def emptying(section: str, key: str, empty: object) -> Callable[[dict[str, Any]], bool]:
        def step(document: dict[str, Any]) -> bool:
            holder = document[section] if section else document
            if key not in holder or not holder[key]:
                return False
            holder[key] = bounded_text(holder[key], 200) if empty is None else empty
            omitted.append(f"{section}.{key}" if section else key)
            return True

        return step

    def compiled_counts_at_zero(document: dict[str, Any]) -> bool:
        compiled = document["coverage"].get("compiled_capture")
        if not isinstance(compiled, dict):
            return False
        kept = {key: value for key, value in compiled.items() if key == "mode" or value}
        if len(kept) == len(compiled):
            return False
        document["coverage"]["compiled_capture"] = kept
        omitted.append("coverage.compiled_capture: fields at zero")
        return True

    steps = [compiled_counts_at_zero, *(emptying(*shrinkable) for shrinkable in _SHRINKABLE)]
    shrink_to_fit(report, max_bytes, steps)
    return report


def _sentinel_hits(observer: RunSnapshot) -> tuple[NonFiniteBetweenSamples, ...]:
    """The non-finite values the sentinels saw between samples (the kept ones), in the
    order of their training forwards."""
    source = "full_sentinel" if observer.full_sentinel else "root_sentinel"
    events = sorted(observer.sentinel_events, key=lambda e: int(str(e["forward_index"])))
    return tuple(
        NonFiniteBetweenSamples(
            source=source,
            forward_index=int(str(event["forward_index"])),
            module=str(event["module"]),
            call_index=int(str(event["call_index"])),
            tensor_path=str(event["tensor_path"]),
            next_sample=int(str(event["next_sample"])),
        )
        for event in events
    )


def _first_non_finite(
    candidates: Sequence[Candidate], observer: RunSnapshot
) -> dict[str, object] | None:
    """Where non-finite values first appeared: in a sampled forward (exact sample,
    module, tensor path) or, earlier, caught by the sentinel between samples."""
    # Ranked candidates are in time order: the first notable one is the earliest sample
    # (an activation before a gradient of the same sample).
    chosen = next((c for c in candidates if c.notable), None)
    sampled: dict[str, object] | None = None
    first_sample: int | None = None
    if chosen is not None and chosen.tracker.first_nonzero is not None:
        s = chosen.series
        first_sample = chosen.tracker.first_nonzero.sample
        sampled = {
            "source": "sampled_forward",
            "sample": first_sample,
            "module": display_module(s.module),
            "call_index": s.call_index,
            "signal": s.signal,
            "tensor_path": s.tensor_path,
            "recovered": bool(chosen.tracker.latest and chosen.tracker.latest.value == 0),
        }
        forward = observer.sample_forwards.forward(first_sample)
        if forward is not None:
            sampled["forward_index"] = forward
    if not observer.sentinel_events:
        return sampled
    event = min(observer.sentinel_events, key=lambda e: int(str(e["forward_index"])))
    if first_sample is not None and int(str(event["next_sample"])) > first_sample:
        return sampled  # the sampled forward saw it first (the hit came after it)
    sentinel = {
        "source": "full_sentinel" if observer.full_sentinel else "root_sentinel",
        "forward_index": event["forward_index"],
        "module": display_module(str(event["module"])),
        "call_index": event["call_index"],
        "signal": "activation",
        "tensor_path": event["tensor_path"],
        "nonfinite_forwards_between_samples": observer.counters.sentinel_nonfinite_forwards,
    }
    if sampled is None:
        return sentinel
    return {**sampled, "earlier_between_samples": sentinel}


def _stopped_text(stopped: Sequence[dict[str, Any]], replaced: Sequence[str] = ()) -> str:
    """The headline's sentence on ``coverage.modules_stopped`` (one entry per module
    call): modules are counted once, whatever their calls; where the first was replaced
    in the model (``coverage.modules_replaced``), it says so."""
    if not stopped:
        return ""
    first = stopped[0]
    swap = (
        f" `{first['module']}` was replaced in the model by another module object, which "
        "is not observed: check what took its place and when."
        if first["module"] in replaced
        else ""
    )
    modules = len({entry["module"] for entry in stopped})
    calls = f" ({len(stopped)} calls)" if len(stopped) > modules else ""
    more = f" and {len(stopped) - 1} more call(s)" if len(stopped) > 1 else ""
    forward = first.get("last_forward")
    at = f", training forward {forward}" if forward is not None else ""
    return (
        f" {modules} module(s){calls} stopped being called: `{first['module']}` (call "
        f"{first['call_index']}) last ran at sample {first['last_sample']}{at}{more}.{swap}"
    )


def _headline(
    events: Sequence[dict[str, Any]],
    notable: int,
    observer: RunSnapshot,
    stopped: Sequence[dict[str, Any]] = (),
) -> str:
    if not observer.root_forward_seen and not observer.counters.forwards_seen:
        wrappers = observer.unhooked_compile_wrappers
        if wrappers:
            names = ", ".join(f"`{display_module(name)}`" for name in wrappers[:3])
            what = (
                "is a torch.compile wrapper" if len(wrappers) == 1 else "are torch.compile wrappers"
            )
            return (
                f"No training forward was observed. {names} {what} made after injection "
                "whose code was compiled before (for another model of its class): calls "
                "made outside the root's forward run unobserved there. Inject the "
                "observer after compiling, or train through the root."
            )
        if observer.root_traces_unobserved_since_injection:
            return (
                "No training forward was observed: torch.compile traced the root's own call "
                "with fullgraph=True (a compiled function calling the model), where the "
                "root's hooks do nothing, so forwards running that code are not observed. "
                "Compile the model itself with torch.compile(model) (fullgraph=True works "
                "there)."
            )
        return (
            f"No training forward was observed ({observer.counters.eval_forwards_skipped} forwards "
            "skipped as evaluation: eval mode, no_grad, inference_mode or inside a "
            "torch.func transform), so there is "
            "nothing to report. Train in model.train() mode with gradients enabled."
        )
    tail = _stopped_text(stopped, [display_module(name) for name in observer.modules_replaced])
    if notable == 0:
        if observer.sentinel_events:
            event = min(observer.sentinel_events, key=lambda e: int(str(e["forward_index"])))
            return (
                f"Non-finite values were seen between samples "
                f"({observer.counters.sentinel_nonfinite_forwards} training forward(s), "
                f"the first at "
                f"forward {event['forward_index']}, in `{display_module(str(event['module']))}`) "
                "but in no sampled forward; every ranked series stays within its noise floor."
            ) + tail
        return "No finding stands out: every ranked series stays within its noise floor." + tail
    if not events:
        return f"{notable} notable finding(s); none fit within the byte limit." + tail
    top = events[0]
    count = f"{notable} notable finding(s) in {len(events)} event(s)"
    onset = top.get("onset") or {}
    when = (
        f"at sample {onset.get('sample')}"
        if onset.get("sample") is not None
        else "over the whole run (no single onset)"
    ) + _forwards_text(onset)
    findings = top.get("findings", [])
    categories = ", ".join(sorted({f["category"] for f in findings if "module" not in f}))
    elsewhere = list(
        dict.fromkeys(
            f"{f['category']} at {md_code(f['module'])} ({f['signal']})"
            for f in findings
            if "module" in f
        )
    )
    if elsewhere:
        categories = "; ".join(x for x in (categories, ", ".join(elsewhere)) if x)
    if top["module"] == MODEL:
        share = (top.get("model_wide") or {}).get("share_of_modules")
        moved = f", {format_value(share * 100)}% of the observed modules" if share else ""
        return (
            f"{count}; the first ({top['id']}) is a model-wide event {when} ({md_code(MODEL)}"
            f"{moved}, {top['signal']}.{top['metric']}; {categories})." + tail
        )
    path = top.get("tensor_path")
    where = f"{md_code(path)}, " if isinstance(path, str) and path != "output" else ""
    return (
        f"{count}; the first ({top['id']}) is a {top['shape'].replace('_', '-')} at "
        f"{md_code(top['module'])} (call {top['call_index']}, {where}"
        f"{top['signal']}.{top['metric']}) {when} ({categories})." + tail
    )


def _forwards_text(onset: dict[str, Any]) -> str:
    """The training forwards of an onset: the one sampled, or the span from the one
    after the sample before it (the change began somewhere in it)."""
    forward, after = onset.get("forward"), onset.get("after_forward")
    if forward is None:
        return ""
    if isinstance(after, int) and after + 1 < forward:
        return f" (training forwards {after + 1} to {forward}: the change began in between)"
    return f" (training forward {forward})"


def build_series_summary(observer: RunSnapshot, max_bytes: int) -> SeriesSummary:
    """``series.json`` for the run of ``observer`` (see
    :func:`torchinstruments._series_file.build_series_summary`), with the report's
    ``run`` and ``config`` sections; at most ``max_bytes`` bytes as written."""
    return _build_series_summary(
        observer, max_bytes, run=_run_section(observer), config=_config_section(observer)
    )
