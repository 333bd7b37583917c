"""Attention logits inside compiled graphs.

    F.scaled_dot_product_attention traced in a sampled forward (_attention's wrapper)
        -> traced_call: a ticket for the module that made the call (trace time), the
           statistics row of its logits block pending in the graph
    that module's forward hook traced (_compiled_capture.traced_activation)
        -> claimed_rows: its pending rows, written to its block before its output's rows

Eagerly the wrapper finds the module that made the call among Python's frames and
measures the logits at once (``_attention.py``). Traced by Dynamo, neither works as
is: the module's frame is one Dynamo interprets, not a Python frame, and what the graph
computes can only be written to the module's rows through tensors that traced code
reaches, those its forward hook holds. So the work is split:

* at the call, a trace-time constant (:func:`_ticket`, under
  ``torch.compiler.assume_constant_result``: run once while tracing, its result a
  constant of the graph) finds the module among the frames Dynamo is tracing (the
  innermost whose first argument is ``self`` and a module, as the eager path takes it)
  and gives the call a ticket, the call's number in the trace, with the blocks of the
  module's forward hook; the traced code computes the logits block
  (:func:`~._attention.dense_logits_block`, its mask as a mask of the reduction, since
  selecting scores would give a tensor whose size depends on the mask's values) and
  its statistics row, and appends ``(ticket, row)`` to :data:`_PENDING`, a list that
  Dynamo tracks as a side effect of the trace;
* the module's forward hook, traced after the module's forward returned, asks
  :func:`_claim` for the tickets taken for its blocks since (a bit mask, constant), and
  writes their rows under ``attention_logits``, ``attention_logits[1]``, ... with the
  hook call's call index, as the eager path names them.

Nothing reads which module or observer a ticket is for in traced code: graphs of blocks
of one class compiled one by one, and of later observers of the same class, stay
shared. A call whose module's hook is not traced in the same trace (a graph break
between them, a module without rows) is not measured: it is counted under
``coverage.compiled_capture.attention_calls_not_measured``, and its row is dropped at
the end of the sample (:func:`drop_pending`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn

from . import _attention
from ._attention import ATTENTION_LOGITS_PATH, dense_logits_block
from .capture import ForwardHook, on_compiler_loaded, trace_time_constant
from .reduce import _statistics_rows, reducible_when_traced

__all__ = ["claimed_rows", "drop_pending", "traced_call"]

#: Translators (frames Dynamo interprets) searched at most for the calling module.
MAX_TRACED_FRAMES = 64

#: ``(ticket, statistics row or None)`` of the calls traced in this trace whose rows are
#: not written yet. Traced code appends and reads it (Dynamo replays the changes after
#: the graph runs); emptied by the trace once every ticket is claimed, else at the end
#: of the sample.
_PENDING: list[tuple[int, Tensor | None]] = []

#: The trace the tickets are of (compile id and attempt), and per ticket the ids of the
#: module's blocks and whether its row is measured; None once claimed.
_tickets: tuple[object, list[tuple[frozenset[int], bool] | None]] = (None, [])


def _real(tensor: object) -> bool:
    """A query or key the eager path measures, as Dynamo traces the check."""
    return reducible_when_traced(tensor) and not cast(Tensor, tensor).is_complex()


def traced_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Traced by Dynamo at a ``scaled_dot_product_attention`` call of a sampled forward
    (the wrapper of ``_attention.py``, after torch's function): the call's ticket, and
    where its query and key can be measured, the statistics row of its logits block
    (float32, outside autograd and autocast, as eagerly) pending in :data:`_PENDING`."""
    if _ticket_constant is None:
        return
    given = dict(zip(_attention._ARGUMENTS, args, strict=False))
    given.update(kwargs)
    query, key, mask = given.get("query"), given.get("key"), given.get("attn_mask")
    measurable = all(_real(tensor) for tensor in (query, key)) and (
        mask is None or isinstance(mask, Tensor)
    )
    ticket = _ticket_constant(measurable)
    if ticket < 0:
        return
    row = None
    if measurable:
        assert isinstance(query, Tensor) and isinstance(key, Tensor)
        with torch.autocast(query.device.type, enabled=False):
            dense = dense_logits_block(
                query.detach(),
                key.detach(),
                mask.detach() if isinstance(mask, Tensor) else None,
                is_causal=bool(given.get("is_causal", False)),
                scale=given.get("scale"),
                enable_gqa=bool(given.get("enable_gqa", False)),
            )
            if dense is not None:
                logits, kept = dense
                row = _statistics_rows(
                    logits.reshape(1, -1),
                    masked=True,
                    kept=None if kept is None else kept.reshape(1, -1),
                )
    _PENDING.append((ticket, row))


def claimed_rows(block: Tensor | None) -> list[tuple[str, Tensor]]:
    """Traced by Dynamo in a module's forward hook of a sampled forward (``block``: one
    of the hook's blocks): the tensor paths and statistics rows of the attention calls
    the module made since its forward began, in call order (``attention_logits``, then
    ``attention_logits[1]``, ... as eagerly; a call that could not be measured keeps its
    name); empty where it made none, or ``block`` is None (no rows yet)."""
    if _claim_constant is None or block is None:
        return []
    claimed = _claim_constant(block)
    if not claimed:
        return []
    found: list[tuple[str, Tensor]] = []
    nth = 0
    for ticket, row in _PENDING:
        if claimed >> ticket & 1:
            if row is not None:
                path = ATTENTION_LOGITS_PATH if nth == 0 else f"{ATTENTION_LOGITS_PATH}[{nth}]"
                found.append((path, row))
            nth += 1
    if _all_claimed_constant is not None and _all_claimed_constant():
        _PENDING.clear()
    return found


def drop_pending() -> None:
    """Eagerly, at the end of a sample: drop rows of calls that no hook claimed."""
    if _PENDING:
        _PENDING.clear()


# ------------------------------------------------------------------- trace time
def _trace_tickets() -> list[tuple[frozenset[int], bool] | None]:
    """The tickets of the trace Dynamo runs now (a new list for a new trace or attempt)."""
    global _tickets
    key = _attention.trace_key()
    if _tickets[0] != key or key is None:
        _tickets = (key, [])
    return _tickets[1]


def _ticket(measurable: bool) -> int:
    """At trace time, at an attention call: the call's ticket, for the module that made
    it (:func:`traced_module`) if that module's forward hook has rows; -1 for none (a
    module not observed is noted, to be observed from the next sample on, as eagerly)."""
    module = traced_module()
    if module is None:
        return -1
    blocks = _hook_blocks(module)
    if not blocks:
        _attention.note_unobserved_caller(module)
        return -1
    tickets = _trace_tickets()
    tickets.append((blocks, measurable))
    return len(tickets) - 1


def _claim(block: Tensor) -> int:
    """At trace time, in a forward hook whose block is ``block``: the tickets taken for
    its module and not claimed yet, as a bit mask (bit ``t`` for ticket ``t``), now
    claimed; the measured ones are counted (``_attention.note_measured``)."""
    tickets = _trace_tickets()
    claimed = measured = 0
    for ticket, entry in enumerate(tickets):
        if entry is not None and id(block) in entry[0]:
            claimed |= 1 << ticket
            measured += entry[1]
            tickets[ticket] = None
    if measured:
        _attention.note_measured(measured)
    return claimed


def _all_claimed() -> int:
    """At trace time: 1 if every ticket of the trace is claimed, else 0."""
    return int(all(entry is None for entry in _trace_tickets()))


def _hook_blocks(module: nn.Module) -> frozenset[int]:
    """Ids of the blocks (one per device) of ``module``'s forward hook of ours."""
    for hook in list(module._forward_hooks.values()):
        if isinstance(hook, ForwardHook) and hook.rows:
            return frozenset(id(block) for block, _ in hook.rows.values())
    return frozenset()


def traced_module() -> nn.Module | None:
    """At trace time: the module whose method Dynamo traces innermost (a traced frame
    whose first argument is named ``self`` and holds a module, as the eager path finds
    the module among Python's frames), within :data:`MAX_TRACED_FRAMES` traced frames;
    None where there is none or Dynamo lacks what this reads."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslatorBase
    except Exception:
        return None
    seen: set[int] = set()
    frame = sys._getframe(1)
    while frame is not None and len(seen) < MAX_TRACED_FRAMES:
        translator = frame.f_locals.get("self")
        if isinstance(translator, InstructionTranslatorBase) and id(translator) not in seen:
            seen.add(id(translator))
            code = translator.f_code
            if code.co_argcount and code.co_varnames[0] == "self":
                module = _module_of(translator.symbolic_locals.get("self"), translator)
                if module is not None:
                    return module
        frame = frame.f_back
    return None


def _module_of(variable: object, translator: Any) -> nn.Module | None:
    """The module a Dynamo variable of a traced frame stands for, or None."""
    value = getattr(variable, "value", None)
    if isinstance(value, nn.Module):
        return value
    key = getattr(variable, "module_key", None)
    if isinstance(key, str):
        try:
            module = translator.output.get_submodule(key)
        except Exception:
            return None
        return module if isinstance(module, nn.Module) else None
    return None


#: :func:`_ticket`, :func:`_claim` and :func:`_all_claimed` as trace-time constants,
#: once Dynamo is loaded (None before, and where torch lacks them: calls then go
#: unmeasured, counted).
_ticket_constant: Callable[[bool], int] | None = None
_claim_constant: Callable[[Tensor], int] | None = None
_all_claimed_constant: Callable[[], int] | None = None


def _enable() -> None:
    global _ticket_constant, _claim_constant, _all_claimed_constant
    assume = getattr(getattr(torch, "compiler", None), "assume_constant_result", None)
    if assume is None:
        return
    try:
        ticket, claim = assume(_ticket), assume(_claim)
    except Exception:
        return
    _all_claimed_constant = trace_time_constant(_all_claimed)
    _ticket_constant, _claim_constant = ticket, claim  # (trace_time_constant: no arguments)
    _attention.traced_call = traced_call


on_compiler_loaded(_enable)
