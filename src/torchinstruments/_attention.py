"""Attention logits: the pre-softmax scores of ``scaled_dot_product_attention`` calls.

    ForwardContext._open_training_forward (sampled) -> begin_sample: wrapper in place
    F.scaled_dot_product_attention (the wrapper)    -> _measure -> StatisticsBuffer.measure
    ForwardContext.leave_root (sampled)             -> end_sample: the original back

``torch.nn.functional.scaled_dot_product_attention`` fuses ``Q K^T``, the softmax and
the weighted sum of the values, so the attention scores are no module's output: a wrong
attention scale (the ``1/sqrt(d)`` left out, or applied twice) changes them by a
constant factor, while the attention module's own output moves by no more than its
noise. Attention logits that grow until the softmax saturates are a known cause of
unstable transformer training (Dehghani et al. 2023, "Scaling Vision Transformers to 22
Billion Parameters", section 3.1.1; Wortsman et al. 2023, "Small-scale proxies for
large-scale Transformer training instabilities", section 3.1).

For the duration of a sampled training forward only, ``F.scaled_dot_product_attention``
is replaced by a wrapper that calls the original first and returns its result
unchanged; then, outside autograd, it recomputes a bounded block of the logits
(``scale * Q K^T``, plus an additive float mask) from the call's own arguments and
measures it as an activation of the module that made the call (the innermost module
whose method is on the stack, found by the ``self`` argument of its frame; a call by a
module that is not observed is counted and left out), under the tensor path
``attention_logits`` (``attention_logits[1]``, ... for further calls in the same module
call). Unsampled forwards, and everything outside a forward, see torch's
own function. Code that bound the function before (``from torch.nn.functional import
scaled_dot_product_attention``) and attention computed without it are not seen.

Which logits (deterministic, chosen from the shapes alone, so nothing is read back to
the host and no random number is drawn):

* query rows (batch and heads flattened) and query positions are thinned by slicing
  with a step, so that at most :data:`MAX_LOGITS` scores are computed per call;
* with ``is_causal=True`` (a top-left causal mask: query ``i`` sees keys ``j <= i``),
  the queries are the last half of the positions and the keys those that all of them
  see (``0 .. L - ceil(L/2)``): a block of scores that the mask keeps whole;
* a boolean ``attn_mask`` keeps the scores where it is True, a float mask is added and
  the scores where the sum is not finite are dropped; with a mask and as many queries
  as keys, the block is the one ``is_causal=True`` takes (a causal mask then gives the
  flag's scores); eagerly, on a device other than the CPU selecting them would read the
  mask back to the host, so such calls are not measured there (counted under
  ``coverage.tensors_skipped`` as ``attention_mask_on_device``).

Inside compiled graphs (``torch.compile``) the wrapper, traced in a sampled forward,
calls torch's function and then :data:`traced_call` (``_attention_graph.py``), which
measures the same block inside the graph as a row of the calling module's forward hook;
the calls it cannot measure there are counted (once per compilation, under
``coverage.compiled_capture.attention_calls_not_measured``).
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._state import SAMPLED
from .capture import _is_compiling, on_compiler_loaded, passive, trace_time_constant
from .reduce import skip_reason
from .series import ACTIVATION, ATTENTION_LOGITS_PATH

if TYPE_CHECKING:
    from ._context import ForwardContext

__all__ = [
    "ATTENTION_LOGITS_PATH",
    "MAX_LOGITS",
    "begin_sample",
    "dense_logits_block",
    "end_sample",
    "logits_block",
]

#: Most scores computed and measured per ``scaled_dot_product_attention`` call.
MAX_LOGITS = 1 << 16
#: Frames walked up from the call to find the observed module that made it.
MAX_FRAMES = 64
#: ``coverage.tensors_skipped`` reason of a masked call on a device other than the CPU.
MASK_ON_DEVICE = "attention_mask_on_device"
#: ``coverage.tensors_skipped`` reason of a call made by a module that is not observed.
NOT_OBSERVED = "attention_module_not_observed"

_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")

#: The function the wrapper replaced (None while it is not in place).
_original: Callable[..., Any] | None = None
#: The contexts in a sampled training forward, with per context the sample and the
#: number of calls seen per (module index, call index) in it.
_active: dict[int, tuple[weakref.ref[ForwardContext], list[Any]]] = {}
#: ``bool(_active)``, what the wrapper reads: traced by Dynamo, a read of ``_active``
#: itself would guard on its keys (ids of contexts), and a later observer's sampled
#: forward would compile the model's frame again.
_any_active = False
#: Per context: (number of observed modules, {id(module): index}).
_module_indices: weakref.WeakKeyDictionary[ForwardContext, tuple[int, dict[int, int]]] = (
    weakref.WeakKeyDictionary()
)


#: Per context: modules that called the function in the first sampled forward without
#: being observed (by ``id``); the observer observes them from the next sample on.
unobserved_callers: weakref.WeakKeyDictionary[ForwardContext, dict[int, weakref.ref[nn.Module]]] = (
    weakref.WeakKeyDictionary()
)


def begin_sample(ctx: ForwardContext) -> None:
    """A sampled training forward of ``ctx`` opens: put the wrapper in place."""
    global _original, _any_active
    _active[id(ctx)] = (weakref.ref(ctx), [ctx.sample, {}])
    _any_active = True
    if _original is None:
        current = F.scaled_dot_product_attention
        if getattr(current, "__wrapped_by_torchinstruments__", False):
            return
        _original = current
        F.scaled_dot_product_attention = _observed_attention  # type: ignore[assignment]


def end_sample(ctx: ForwardContext) -> None:
    """The sampled forward of ``ctx`` closed (or ``ctx`` detached): once no context is
    in a sampled forward, torch's function is back in place."""
    _active.pop(id(ctx), None)
    if not _active:
        _put_back()


def _put_back() -> None:
    global _original, _any_active
    _any_active = bool(_active)
    if _original is not None:
        if F.scaled_dot_product_attention is _observed_attention:
            F.scaled_dot_product_attention = _original  # type: ignore[assignment]
        _original = None


def _observed_attention(*args: Any, **kwargs: Any) -> Any:
    original = _original
    if original is None:  # put back while a caller held the wrapper
        original = torch._C._nn.scaled_dot_product_attention
    result = original(*args, **kwargs)
    if _any_active:
        if not _is_compiling():
            _measure(args, kwargs, sys._getframe(1))
        else:
            if _count_traced is not None:
                _count_traced()
            if traced_call is not None:
                traced_call(args, kwargs)
    return result


#: What the wrapper runs, traced by Dynamo, to measure the call inside the graph
#: (``_attention_graph.traced_call``, set once Dynamo is loaded); None before.
traced_call: Callable[[tuple[Any, ...], dict[str, Any]], None] | None = None

#: Per context, the calls of the wrapper that Dynamo traced into compiled graphs in
#: sampled forwards, and of them those measured there, by compilation (Dynamo's compile
#: id) and attempt at it: Dynamo may restart a trace, and only the attempt it kept
#: counts (see :func:`calls_not_measured`).
_traced: weakref.WeakKeyDictionary[ForwardContext, dict[object, dict[int, list[int]]]] = (
    weakref.WeakKeyDictionary()
)


def calls_not_measured(ctx: ForwardContext) -> int:
    """Calls of ``scaled_dot_product_attention`` that Dynamo traced into the compiled
    graphs of ``ctx``'s sampled forwards and whose attention logits the graph does not
    measure (see ``_attention_graph.py``): per compilation, those of its last attempt
    (``coverage.compiled_capture.attention_calls_not_measured``)."""
    total = 0
    for attempts in _traced.get(ctx, {}).values():
        traced, measured = attempts[max(attempts)]
        total += max(0, traced - measured)
    return total


def trace_key() -> tuple[object, int] | None:
    """While Dynamo traces: the compilation (its compile id) and attempt at it; None
    outside a trace or where torch lacks trace ids."""
    try:
        from torch._guards import CompileContext

        trace = CompileContext.current_trace_id()
    except Exception:
        return None
    return None if trace is None else (trace.compile_id, trace.attempt)


def _count(column: int, count: int) -> None:
    """At trace time: add ``count`` to column ``column`` (0: traced calls, 1: measured)
    of the trace's counts, for each context in a sampled forward."""
    compile_id, attempt = trace_key() or (None, 0)  # without trace ids every attempt counts
    for ref, _ in list(_active.values()):
        ctx = ref()
        if ctx is not None:
            attempts = _traced.setdefault(ctx, {}).setdefault(compile_id, {})
            attempts.setdefault(attempt, [0, 0])[column] += count


def _count_calls_traced() -> int:
    """At trace time: one more traced call for each context in a sampled forward."""
    _count(0, 1)
    return 0


def note_measured(count: int) -> None:
    """At trace time: ``count`` traced calls are measured inside the graph."""
    _count(1, count)


#: :func:`_count_calls_traced` as a trace-time constant (Dynamo calls it once per trace
#: of the call and keeps its result), once Dynamo is loaded; None before.
_count_traced: Callable[[], int] | None = None


def _enable_count() -> None:
    global _count_traced
    _count_traced = trace_time_constant(_count_calls_traced)  # None: the calls go uncounted


on_compiler_loaded(_enable_count)


_observed_attention.__wrapped_by_torchinstruments__ = True  # type: ignore[attr-defined]
try:
    # TorchScript compiles a call of the wrapper as torch's own operator, so scripting a
    # module during a sampled forward works as it would without the wrapper.
    from torch.jit._builtins import _register_builtin

    _register_builtin(_observed_attention, "aten::scaled_dot_product_attention")
except Exception:  # a torch without this table: scripting then fails inside samples only
    pass


def _measure(args: tuple[Any, ...], kwargs: dict[str, Any], frame: Any) -> None:
    for key, (ref, state) in list(_active.items()):
        ctx = ref()
        if ctx is None or not ctx.attached or ctx.state is not SAMPLED:
            # Its sampled forward ended without the root's post-hook (a
            # KeyboardInterrupt skips even an always-called hook): torch's function back.
            _active.pop(key, None)
            if not _active:
                _put_back()
            continue
        index = None
        try:
            index = _calling_module(ctx, frame)
            if index is None:
                continue
            with passive(), torch.no_grad():
                _measure_call(ctx, state, index, args, kwargs)
        except Exception as error:  # never break training
            name = ctx.capture._names[index] if index is not None else ""
            ctx.errors.record("attention_logits", name, error)
        return


def _calling_module(ctx: ForwardContext, frame: Any) -> int | None:
    """Index of the module of ``ctx`` that made the call: the innermost module whose
    method is on the stack from ``frame`` up (a frame whose first argument, ``self``, is
    an ``nn.Module``). None when that module is not observed: in the first sampled
    forward it is noted in :data:`unobserved_callers` (observed from the next sample on,
    as the parents of modules that never ran are), later counted under
    ``coverage.tensors_skipped`` as :data:`NOT_OBSERVED`."""
    count, indices = _module_indices.get(ctx, (-1, {}))
    if count != len(ctx.modules):
        indices = {}
        for i, ref in enumerate(ctx.modules):
            module = ref()
            if module is not None:
                indices[id(module)] = i
        _module_indices[ctx] = (len(ctx.modules), indices)
    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module):
                index = indices.get(id(owner))
                if index is None:
                    if ctx._adoption_done:
                        ctx.capture.skipped_tensors[NOT_OBSERVED] += 1
                    else:  # observed from the next sample on (Observer.adopt_parents)
                        callers = unobserved_callers.setdefault(ctx, {})
                        callers.setdefault(id(owner), weakref.ref(owner))
                return index
        frame = frame.f_back
    return None


def note_unobserved_caller(module: nn.Module) -> None:
    """At trace time: ``module``, which made an attention call in a sampled forward of
    each context in one, has no rows in compiled graphs: where it is not observed and
    the first samples' adoption is not done, note it in :data:`unobserved_callers` (as
    :func:`_calling_module` does eagerly)."""
    for ref, _ in list(_active.values()):
        ctx = ref()
        if ctx is None or ctx._adoption_done:
            continue
        if any(observed() is module for observed in ctx.modules):
            continue
        unobserved_callers.setdefault(ctx, {}).setdefault(id(module), weakref.ref(module))


def _measure_call(
    ctx: ForwardContext,
    state: list[Any],
    index: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    given = dict(zip(_ARGUMENTS, args, strict=False))
    given.update(kwargs)
    # The call's name within its module call is taken before anything can skip it, so
    # that a skipped call never hands its name to the next one.
    sample = ctx.sample
    if state[0] != sample:
        state[0], state[1] = sample, {}
    call = ctx.call_counts.get(index, 0)
    seen = state[1]
    nth = seen.get((index, call), 0)
    seen[(index, call)] = nth + 1
    query, key = given.get("query"), given.get("key")
    if skip_reason(query) is not None or skip_reason(key) is not None:
        return
    assert isinstance(query, Tensor) and isinstance(key, Tensor)
    mask = given.get("attn_mask")
    if isinstance(mask, Tensor) and query.device.type != "cpu":
        ctx.capture.skipped_tensors[MASK_ON_DEVICE] += 1
        return
    with torch.autocast(query.device.type, enabled=False):
        logits = logits_block(
            query,
            key,
            mask if isinstance(mask, Tensor) else None,
            is_causal=bool(given.get("is_causal", False)),
            scale=given.get("scale"),
            enable_gqa=bool(given.get("enable_gqa", False)),
        )
    if logits is None or logits.numel() == 0:
        return
    path = ATTENTION_LOGITS_PATH if nth == 0 else f"{ATTENTION_LOGITS_PATH}[{nth}]"
    position = ctx.position
    ctx.position = position + 1
    ctx.buffer.measure((index, call, ACTIVATION, path), sample, position, logits)


def logits_block(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    max_logits: int = MAX_LOGITS,
) -> Tensor | None:
    """The block of attention logits that is measured for one call (module docstring):
    :func:`dense_logits_block`'s scores, those its mask keeps only.

    Returns:
        A float32 tensor of the scores kept (with a mask, 1-D), or None when no score is
        kept. Non-finite scores stay (they are measured as such).
    """
    dense = dense_logits_block(
        query,
        key,
        attn_mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        max_logits=max_logits,
    )
    if dense is None:
        return None
    logits, kept = dense
    return logits if kept is None else logits[kept]


def dense_logits_block(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    max_logits: int = MAX_LOGITS,
) -> tuple[Tensor, Tensor | None] | None:
    """The block of attention logits of one call before its mask selects from it: the
    form that compiled graphs reduce (selecting would give a tensor whose size depends
    on the mask's values).

    Args:
        query: ``(..., L, E)``.
        key: ``(..., S, E)``, batch dimensions broadcastable with the query's (with
            ``enable_gqa``, fewer heads in dimension -3, each serving
            ``query heads / key heads`` query heads, as the function does).
        attn_mask: boolean (True takes part) or additive float mask, broadcastable to
            ``(..., L, S)``. A float entry that is not finite, or at most half the most
            negative finite number of its dtype (``torch.finfo(dtype).min`` is a common
            way to mask), masks its score out. With a mask and ``L == S`` the block is
            the one ``is_causal=True`` takes (the last half of the query positions
            against the keys all of them see), so that a model that passes its causal
            mask (as ``transformers`` does under ``torch.compile``) has the same scores
            measured as with ``is_causal=True``.
        is_causal: a top-left causal mask (ignored with ``attn_mask``, as the function
            raises for both).
        scale: the scores' factor; default ``1 / sqrt(E)``, as the function's.
        max_logits: most scores computed (rows, then queries, then keys are thinned).

    Returns:
        ``(logits, kept)``: the float32 scores of the block (``scale * Q K^T``, the float
        mask added), and where there is a mask, the boolean tensor of the same shape
        that tells which of them it keeps (else None); None when the block is empty.
    """
    length, width = query.shape[-2], query.shape[-1]
    keys = key.shape[-2]
    if length == 0 or keys == 0 or width == 0:
        return None
    factor = 1.0 / math.sqrt(width) if scale is None else float(scale)
    group = 1
    if enable_gqa and query.dim() >= 3 and key.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
    key_batch = list(key.shape[:-2])
    if group > 1:
        key_batch[-1] = query.shape[-3]
    shapes = [query.shape[:-2], torch.Size(key_batch)]
    if attn_mask is not None:
        shapes.append(attn_mask.shape[:-2])
    batch = tuple(torch.broadcast_shapes(*shapes))
    first_query, key_count = 0, keys
    if (is_causal and attn_mask is None) or (attn_mask is not None and length == keys):
        first_query = length // 2
        key_count = min(keys, first_query + 1)
    queries = length - first_query
    # Thinning steps, so that rows * queries * keys <= max_logits (each count being
    # what a slice with that step keeps, ceil(n / step)).
    key_step = math.ceil(key_count / max_logits)
    kept_keys = math.ceil(key_count / key_step)
    query_step = math.ceil(queries / max(1, max_logits // kept_keys))
    kept_queries = math.ceil(queries / query_step)
    steps = _row_steps(batch, max(1, max_logits // (kept_queries * kept_keys)))
    rows = tuple(slice(None, None, step) for step in steps)
    q = query.expand(*batch, length, width)[(*rows, slice(first_query, None, query_step))]
    if group > 1:
        # Views up to the head dimension, then the key heads of the kept query heads
        # (only those are copied): query head h reads key head h // group.
        kb = key.expand(*batch[:-1], key.shape[-3], keys, width)
        kb = kb[(*rows[:-1], slice(None), slice(0, key_count, key_step))]
        heads = torch.arange(0, batch[-1], steps[-1], device=key.device) // group
        k = kb.index_select(-3, heads)
    else:
        k = key.expand(*batch, keys, width)[(*rows, slice(0, key_count, key_step))]
    logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * factor
    if attn_mask is None:
        return logits, None
    m = attn_mask.expand(*batch, length, keys)
    m = m[(*rows, slice(first_query, None, query_step), slice(0, key_count, key_step))]
    if m.dtype == torch.bool:
        return logits, m
    bias = m.float()
    kept = torch.isfinite(bias) & (m > torch.finfo(m.dtype).min / 2)
    return logits + bias, kept


def _row_steps(batch: tuple[int, ...], most: int) -> list[int]:
    """Slicing steps per batch dimension (outermost first) that leave at most ``most``
    rows (batch elements times heads): each dimension is thinned only as far as the
    ones before it left too many."""
    steps = []
    count = math.prod(batch)
    for size in batch:
        step = 1
        if count > most and size > 1:
            rest = count // size
            step = min(size, math.ceil(size / max(1, most // rest)))
            count = rest * math.ceil(size / step)
        steps.append(step)
    return steps
