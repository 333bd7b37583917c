"""``index.md``: the report for people, with the prompt for an LLM; user-derived
text is escaped (:func:`md_text`, :func:`md_code`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from ._event_texts import with_article
from .find import format_value
from .series import LOG_SCALE_METRICS

LLM_PROMPT = """\
You are analysing passive telemetry from one PyTorch training run (torchinstruments).
The report lists events: each is one change at one module and onset, written once, with
the categories it moved (its "findings"), its echoes, its cross-section and its history.
Signals are module activations ("activation") and gradients of the loss with respect to
module outputs ("grad_output"). Tensor path "attention_logits" is an activation measured
inside the module: the pre-softmax scores (scale * Q K^T) of its
scaled_dot_product_attention call. "findings" ranks series within each category: notable
ones refer to their event ("event": "E1"); the others are compact rows below their
noise floor, context only.

Rules for your answer:
1. Cite every claim with the event id, module, call index, signal, tensor path, metric
   and the values: onset sample and training forward, the change's "trend_forecast",
   "value" and "in_residual_spreads", and first, latest, min, max with their samples.
2. Separate measurement (what the numbers show) from mechanism (why it might happen);
   label mechanisms as hypotheses.
3. Treat "warmup_complete": false as weak evidence. "young_reference": true means the
   series had fewer than 1.5 warm-ups of values before the change (its reference was
   still young, wherever the change sits in the run), so the change had to pass twice
   the usual residual spreads: weigh it by its size, and prefer a later change of
   similar size.
4. An event's module is where the change begins along depth. Its "cross_section" gives,
   at the onset, the module (offset 0) and its neighbours in forward order, each against
   its own trend: "before" (forecast), "after", "ratio" (or "difference" for fractions
   and kurtosis) and "in_spreads" (the departure in that series' own noise units). For
   activations, modules before it near 0 spreads and the module far from 0 place the
   origin there; output gradients flow backwards, so for them the modules after it stay
   near 0 and those before it move with it. Its "echoes" moved with it, at its sample
   or a few samples later (each one's "onset_sample"), because of it.
   "also_named" are other modules that output the same tensor. Module "<model>" is a
   model-wide event: most of the model moved at once, a run-level cause.
5. "shape" says what happened: a "step" that held, a "spike" that returned, a "bend"
   (the series left its course for a steeper one), a "non_finite" value, a
   "model_wide" move, an "oscillation", "volatility" or a "drift".
   History points are [sample, training forward, value], every observed sample around
   each change. "coverage.modules_stopped" lists modules that stopped being called.
6. Do not infer anything about labels, optimizer updates, inputs or parameter gradients:
   they are not observed (a loss is observed only where the model's own output carries
   it, as a tensor path of <root>). Samples are sampled forwards, not optimizer steps:
   a change dated at training forward F "after_forward" A began somewhere in A+1..F.
   Output gradients are judged as "rms_to_root", their RMS divided by the loss
   gradient's (the root output's gradient RMS) in the same sample.
7. End with the single narrowest next experiment (one change, same seed, data order and
   precision) that would confirm or refute your leading hypothesis.
"""
_SPARK_LEVELS = "▁▂▃▄▅▆▇█"


def sparkline(points: Sequence[Sequence[float]], *, log_scale: bool) -> str:
    """One-line picture of ``[sample, value]`` points: eight block heights, min to max.

    Scale metrics are drawn on a log axis (a 10x jump looks like a jump). Returns
    ``""`` for fewer than two points.

    Example:
        >>> sparkline([[0, 1.0], [1, 2.0], [2, 4.0]], log_scale=True)
        '▁▅█'
    """
    values = [float(v) for _, v in points]
    if len(values) < 2:
        return ""
    if log_scale:
        values = [math.log(max(v, 1e-30)) for v in values]
    low, high = min(values), max(values)
    if high - low <= 1e-12 * max(1.0, abs(high)):
        return _SPARK_LEVELS[0] * len(values)
    top = len(_SPARK_LEVELS) - 1
    return "".join(_SPARK_LEVELS[round((v - low) / (high - low) * top)] for v in values)


#: Characters that would end a Markdown line or hide text: C0/C1 controls (NUL, CR,
#: LF, ...) and Unicode line and paragraph separators.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape_controls(text: str) -> str:
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def md_text(value: object) -> str:
    r"""A user-derived string as Markdown text on one line: control characters shown as
    ``\xNN`` (so it cannot start a line, a heading or a fence), ``<`` and ``&`` as
    entities (no HTML), and a leading block marker (``#``, ``>``, ``-``, ...) escaped.

    Example:
        >>> md_text("# x\n<b>")
        '\\# x\\x0a&lt;b>'
    """
    text = _escape_controls(str(value)).replace("&", "&amp;").replace("<", "&lt;")
    if text[:1] in ("#", ">", "-", "+", "*", "=", "|", "`", "~"):
        text = "\\" + text
    return text


_CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)")


def md_spans(value: object) -> str:
    """Text that holds code spans of our own making (the headline, whose module names
    :func:`md_code` fenced): :func:`md_text` outside the spans, the spans as they are
    (control characters shown as ``\\xNN``), so ``<model>`` reads ``<model>``.

    Example:
        >>> md_spans("a <b> `<model>` c")
        'a &lt;b> `<model>` c'
    """
    text = str(value)
    parts, last = [], 0
    for match in _CODE_SPAN.finditer(text):
        parts.append(md_text(text[last : match.start()]) if match.start() > last else "")
        parts.append(_escape_controls(match.group(0)))
        last = match.end()
    tail = text[last:]
    parts.append(md_text(tail) if tail else "")
    return "".join(parts)


def md_code(value: object, *, in_table: bool = False) -> str:
    """A user-derived string (a module name) as one Markdown code span: control
    characters shown as ``\\xNN``, fenced with one backtick more than the longest run
    inside it (CommonMark), and ``|`` escaped inside a table cell.

    Example:
        >>> md_code("a`b")
        '``a`b``'
    """
    text = _escape_controls(str(value))
    runs = [len(run) for run in re.findall(r"`+", text)]
    fence = "`" * (max(runs, default=0) + 1)
    if text.startswith("`") or text.endswith("`"):
        text = f" {text} "
    span = f"{fence}{text}{fence}"
    return span.replace("|", "\\|") if in_table else span


def _echo_name(echo: dict[str, Any], event: dict[str, Any]) -> str:
    """An echo as index.md names it: its module (and call), then its signal, tensor
    path and the sample its change began at where they differ from the event's."""
    name = md_code(
        echo["module"] + (f" (call {echo['call_index']})" if echo.get("call_index") else "")
    )
    notes = []
    if echo.get("signal") and echo["signal"] != event.get("signal"):
        notes.append(str(echo["signal"]))
    path = echo.get("tensor_path")
    if isinstance(path, str) and path != (event.get("tensor_path") or "output"):
        notes.append(md_code(path))
    onset = (event.get("onset") or {}).get("sample")
    if echo.get("onset_sample") is not None and echo["onset_sample"] != onset:
        notes.append(f"from sample {echo['onset_sample']}")
    return name + (f" ({', '.join(notes)})" if notes else "")


def _returned_text(notable: int, listed: int, zero: int) -> str:
    """The findings of report.json, by where index.md shows them."""
    parts = [f"{notable} notable"]
    if listed:
        parts.append(f"{listed} below their noise floor, listed above")
    if zero:
        parts.append(f"{zero} with a ranking of 0, in report.json only")
    return f"{notable + listed + zero} ({', '.join(parts)})"


def _not_observed_text(coverage: dict[str, Any]) -> str:
    """The modules not observed, less those that never ran (:func:`_placement_text`
    names them, with the parent observed in their place)."""
    never = set(coverage.get("modules_never_ran") or [])
    names = [name for name in coverage.get("modules_not_observed") or [] if name not in never]
    if not names:
        return ""
    more = coverage["modules_selected"] - coverage["modules_observed"] > len(names)
    listed = ", ".join(md_code(name) for name in names) + ("..." if more else "")
    return (
        " Not observed (never called in a sampled training forward, or no floating "
        f"output): {listed}."
    )


def _blank(value: object) -> str:
    return "" if value is None else str(value)


def _stopped_markdown(coverage: dict[str, Any]) -> str:
    stopped = coverage.get("modules_stopped") or []
    if not stopped:
        return ""
    listed = ", ".join(
        f"{md_code(m['module'])} after sample {m['last_sample']}"
        + (f" (forward {m['last_forward']})" if m.get("last_forward") is not None else "")
        for m in stopped
    )
    return f" Stopped being called: {listed}."


def _placement_text(coverage: dict[str, Any]) -> str:
    """Sentences on modules that never ran, parents observed in their place and
    modules replaced after injection (their places are no longer observed)."""
    parts = []
    never = coverage.get("modules_never_ran") or []
    parents = coverage.get("parents_observed") or {}
    alone = [m for m in never if m not in parents]
    if alone:
        parts.append(" Never ran in a sampled forward: " + ", ".join(map(md_code, alone)) + ".")
    for lead, children in (
        (" Never ran in a sampled forward, observed through their parent: ", True),
        (" Observed through their parent: ", False),
    ):
        pairs = ", ".join(
            f"{md_code(c)} by {md_code(p)}" for c, p in parents.items() if (c in never) is children
        )
        if pairs:
            parts.append(f"{lead}{pairs}.")
    replaced = coverage.get("modules_replaced") or []
    if replaced:
        parts.append(
            " Replaced in the model after the observer was injected (the module now in "
            "their place is not observed): " + ", ".join(map(md_code, replaced)) + "."
        )
    return "".join(parts)


def _number_text(value: object) -> str:
    if isinstance(value, float):
        return format_value(value)
    if isinstance(value, dict) or value is None:
        return "n/a"
    return str(value)


def _markdown_event(e: dict[str, Any]) -> list[str]:
    call = "" if e.get("call_index") is None else f" (call {e['call_index']})"
    onset = e.get("onset") or {}
    when = (
        f"sample {onset.get('sample')}"
        if onset.get("sample") is not None
        else "over the whole run (no single onset)"
    )
    if onset.get("forward") is not None:
        when += f", training forward {onset['forward']}"
        if onset.get("after_forward") is not None:
            when += f" (after forward {onset['after_forward']}, the sample before)"
    kind = f", {md_text(with_article(e['module_kind']))}" if e.get("module_kind") else ""
    path = e.get("tensor_path")
    where = f", {md_code(path)}" if isinstance(path, str) and path != "output" else ""
    lines = [
        f"### {e['id']}: {e['shape'].replace('_', '-')} at {md_code(e['module'])}{call}{kind}, "
        f"{e['signal']}.{e['metric']}{where}, {when}",
        "",
        md_text(e["interpretation"]),
        "",
    ]
    facets = ", ".join(
        f"{f['category']} #{f['rank']} ({f['metric']})" for f in e.get("findings", [])
    )
    lines.append(f"- Findings: {facets}.")
    if e.get("young_reference"):
        lines.append(
            "- Young reference: the change came while its series had fewer than 1.5 "
            "warm-ups of values before it, so it had to pass twice the usual residual "
            "spreads, and it is listed after the events whose reference was older: weigh "
            "it by its size."
        )
    if e.get("also_named"):
        names = ", ".join(md_code(n) for n in e["also_named"])
        lines.append(f"- The same tensor is also the output of: {names}.")
    if e.get("echoes"):
        names = ", ".join(_echo_name(x, e) for x in e["echoes"])
        more = f" and {e['echoes_omitted']} more" if e.get("echoes_omitted") else ""
        lines.append(
            f"- Echoes (moved with it, at its sample, in its signal and tensor path unless "
            f"others are given; not listed separately): {names}{more}."
        )
    history = (e.get("history") or {}).get("points") or []
    if len(history) >= 2:
        metric = e["history"]["metric"]
        picture = sparkline([[p[0], p[2]] for p in history], log_scale=metric in LOG_SCALE_METRICS)
        lines.append(
            f"- {metric}, samples {history[0][0]} to {history[-1][0]} (training forwards "
            f"{history[0][1]} to {history[-1][1]}): `{picture}`"
        )
        change = e.get("change") or {}
        start = change.get("start_sample")
        if start is not None:
            near = [p for p in history if abs(p[0] - start) <= 3]
            listed = "; ".join(f"{p[0]} (forward {p[1]}): {_number_text(p[2])}" for p in near)
            lines.append(f"- Around the onset, sample (forward): value: {listed}.")
    plot = e.get("plot")
    if plot:
        lines.append(f"- Picture: [{plot}]({plot})")
    lines.append(f"- Next experiment: {md_text(e['next_experiment'])}")
    section = e.get("cross_section")
    if section and section.get("rows"):
        lines += [
            "",
            f"Cross-section at sample {section['sample']} ({section['metric']}, forward order; "
            "offset 0 is this module):",
            "",
            "| offset | module | call | before | after | "
            f"{'ratio' if any('ratio' in r for r in section['rows']) else 'difference'} "
            "| in spreads |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in section["rows"]:
            ratio = r.get("ratio", r.get("difference"))
            path = r.get("tensor_path")
            if isinstance(path, str) and path != "output":
                path_text = f" {md_code(path, in_table=True)}"
            else:
                path_text = ""
            lines.append(
                f"| {r['offset']} | {md_code(r['module'], in_table=True)}{path_text} "
                f"| {r['call_index']} "
                f"| {_number_text(r['before'])} | {_number_text(r['after'])} "
                f"| {_number_text(ratio)} | {_number_text(r['in_spreads'])} |"
            )
    lines.append("")
    return lines


#: Events written out in full in ``index.md`` (all of them are in ``report.json``).
MARKDOWN_EVENTS = 12


#: ``run.ended_by`` in words.
_ENDING_WORDS = {
    "remove_observer": "remove_observer was called",
    "interpreter_exit": "at interpreter exit",
    "uncaught_exception": "at interpreter exit, after an exception that nothing caught",
    "sigterm": "SIGTERM ended the process",
    "model_garbage_collected": "the model was garbage-collected without remove_observer",
}


def render_markdown(report: dict[str, Any]) -> str:
    """Render a report dict as ``index.md`` for people, with the LLM prompt."""
    run, coverage, summary = report["run"], report["coverage"], report["summary"]
    findings = report["findings"]
    lines = [
        "# torchinstruments report",
        "",
        f"**{md_spans(summary['headline'])}**",
        "",
        (
            "Single process"
            if run["world_size"] == 1
            else f"Distributed rank {run['rank']} (world size {run['world_size']})"
        )
        + f"; {run['forwards_seen']} training root "
        f"forwards, {run['samples_seen']} sampled ({coverage['backward_samples_observed']} "
        f"with a backward); generated {report['generated_at']}.",
        "",
    ]
    number = run.get("report_number")
    if isinstance(number, int) and number > 0:  # absent from reports of older versions
        final = run.get("final")
        ending = _ENDING_WORDS.get(str(run.get("ended_by")), "")
        if run.get("uncaught_exception"):
            ending += f": {md_text(str(run['uncaught_exception']))}"
        status = (
            f" It is the final report: training through the observer has ended"
            f"{f' ({ending})' if ending else ''}."
            if final
            else " Written while training ran: a later report replaces it."
            if final is False
            else ""  # absent from reports of older versions
        )
        lines += [
            f"Report {number} of the run started {md_text(str(run.get('started_at')))} "
            "(`run.report_number` and `run.started_at` of report.json)." + status,
            "",
        ]
    first = summary.get("first_non_finite")
    if first:
        where = (
            f"sample {first['sample']}"
            if "sample" in first
            else f"training forward {first['forward_index']} (between samples)"
        )
        lines += [
            f"First non-finite value: {where}, {md_code(first['module'])} call "
            f"{first['call_index']}, {first['signal']} {md_text(first['tensor_path'])}"
            + (" (the run recovered)." if first.get("recovered") else "."),
            "",
        ]
    events = report.get("events") or []
    if events:
        lines += ["## Events", ""]
        for e in events[:MARKDOWN_EVENTS]:
            lines += _markdown_event(e)
        if len(events) > MARKDOWN_EVENTS:
            lines += [f"{len(events) - MARKDOWN_EVENTS} more event(s) in report.json.", ""]
    notable = [f for f in findings if f["notable"]]
    if notable:
        lines += [
            "## Notable findings by category",
            "",
            "| category | rank | event | module | call | signal.metric | change sample |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for f in notable:
            lines.append(
                f"| {f['category']} | {f['rank']} | {f.get('event', '')} "
                f"| {md_code(f['module'], in_table=True)} | {_blank(f.get('call_index'))} "
                f"| {f['signal']}.{f['metric']} | {_blank(f.get('change_sample'))} |"
            )
        lines.append("")
    below = [f for f in findings if not f["notable"]]
    # A ranking of 0 ranks nothing (the loss gradient against itself, a series that
    # never moved): such rows stay in report.json only.
    others = [f for f in below if (f.get("ranking") or {}).get("value")]
    if others:
        lines += [
            "## Other ranked series (below their noise floor)",
            "",
            "| category | rank | module | call | signal.metric | path | ranking | latest |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for f in others:
            ranking = f.get("ranking") or {}
            latest = f.get("latest") or {}
            lines.append(
                f"| {f['category']} | {f['rank']} | {md_code(f['module'], in_table=True)} "
                f"| {_blank(f.get('call_index'))} | {f['signal']}.{f['metric']} "
                f"| {md_code(f['tensor_path'], in_table=True) if f.get('tensor_path') else ''} "
                f"| {ranking.get('basis')} {_number_text(ranking.get('value'))} "
                f"| {_number_text(latest.get('value'))} @{latest.get('sample')} |"
            )
        for f in others:
            follows = f.get("follows_output_change")
            if follows:
                # The ranking is the step's absolute log factor; the output's step has
                # the same direction.
                factor = math.exp((f.get("ranking") or {}).get("value") or 0.0)
                if follows["ratio"] < 1.0:
                    factor = 1.0 / factor
                lines += [
                    "",
                    f"The loss gradient ({md_code(f['module'])} {f['signal']}.{f['metric']}) "
                    f"changed {_number_text(factor)}x at sample {f.get('change_sample')}, "
                    f"after the model output's own step ({_number_text(follows['ratio'])}x at "
                    f"sample {follows['sample']}): it follows the output, and does not point "
                    "at the loss computation.",
                ]
        if len(below) > len(others):
            lines += ["", f"{len(below) - len(others)} more with a ranking of 0 in report.json."]
        lines.append("")
    returned = _returned_text(len(findings) - len(below), len(others), len(below) - len(others))
    lines += [
        "## Coverage and limits",
        "",
        f"- Modules observed: {coverage['modules_observed']} of {coverage['modules_selected']} "
        f"selected; tensor paths: {coverage['tensor_paths_observed']}; series: "
        f"{coverage['series']}.{_not_observed_text(coverage)}{_placement_text(coverage)}"
        f"{_stopped_markdown(coverage)}",
        f"- Eval or no-grad forwards kept out: {coverage['eval_forwards_skipped']}; "
        f"checkpoint recomputations ignored: {coverage['recompute_calls_ignored']}.",
        f"- Tensors skipped: {md_text(coverage['tensors_skipped'] or 'none')}.",
        f"- Findings in report.json: {returned}; limits that removed evidence: "
        f"{', '.join(coverage['limits_hit']) or 'none'}.",
        f"- Hook errors: {coverage['errors_total']}.",
        *_compiled_lines(coverage.get("compiled_capture") or {}),
        "",
    ]
    if report["errors"]:
        lines += ["## Errors caught in hooks", ""]
        for e in report["errors"]:
            lines.append(
                f"- {md_text(e['stage'])} {md_code(e['module'])}: {md_text(e['error_type'])}: "
                f"{md_text(e['message'])} ({e['count']}x)"
            )
        lines.append("")
    lines += [
        "## What is not measured",
        "",
        "Losses, labels, inputs, parameters, parameter gradients and optimizer updates are "
        "not observed; a sample is a sampled forward, not an optimizer step.",
        "",
        "## Prompt for an LLM",
        "",
        "Send `report.json` with this prompt:",
        "",
        "```text",
        LLM_PROMPT.rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def _compiled_lines(compiled: dict) -> list[str]:
    """The coverage line on ``torch.compile`` (none while no graph was met): what is
    captured inside compiled graphs and what is not."""
    if compiled.get("mode") != "in_graph":
        return []
    gaps = ["histograms", "the full sentinel"]
    if compiled.get("attention_calls_not_measured"):
        gaps.append(f"attention logits ({compiled['attention_calls_not_measured']} traced calls)")
    if compiled.get("gradients_not_captured"):
        gaps.append(
            f"output gradients of {compiled['gradients_not_captured']} traced outputs "
            "(in dicts, dataclasses or lists inside the output, one of the module's "
            "inputs, or inside an activation-checkpoint region that compiled code calls)"
        )
    if compiled.get("gradient_samples_lost"):
        gaps.append(f"output gradients of {compiled['gradient_samples_lost']} samples")
    line = (
        f"- torch.compile: {compiled.get('slots', 0)} (module, call, signal, tensor path) "
        f"measured inside compiled graphs; not measured there: {', '.join(gaps)}."
    )
    if compiled.get("root_hooks_traced"):
        unobserved = compiled.get("root_hooks_unobserved") or 0
        line += (
            f" Dynamo met the root's hooks while tracing {compiled['root_hooks_traced']} "
            "times in the process: it traced the root's own call (a model called from a "
            "compiled function, or a torch.nn class compiled before injection, for one "
            "call), where each hook is a graph break"
            + (
                f", and in {unobserved} of those traces (fullgraph=True) the hooks did "
                "nothing, so forwards running that code were not observed"
                if unobserved
                else ""
            )
            + "; compile the model itself with torch.compile(model)."
        )
    if compiled.get("recompile_limit_hits"):
        line += (
            f" Dynamo reached its recompile limit {compiled['recompile_limit_hits']} times in "
            "the process: that code ran uncompiled (observed eagerly)."
        )
    return [line]
