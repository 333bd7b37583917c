"""The declared state of the forward context: its phase and every field that decides
what the next forward does (see ``_context.py`` for the machine that changes them).

Hooks compare the phase with these members by identity (``context.state is SKIP``);
the context only ever stores members, never bare integers.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from torch import Tensor

__all__ = ["IDLE", "RECOMPUTE", "SAMPLED", "SENTINEL", "SKIP", "ForwardState", "Phase"]


class Phase(IntEnum):
    """Phases of :class:`~torchinstruments._context.ForwardContext`."""

    #: Inside a root forward that is not sampled (or eval / no-grad): hooks return.
    SKIP = 0
    #: Inside a sampled training root forward: every observed call is measured.
    SAMPLED = 1
    #: No root forward open: direct submodule calls or recomputation.
    IDLE = 2
    #: Inside a root forward re-run during backward (checkpointing).
    RECOMPUTE = 3
    #: An unsampled training forward with the full sentinel: non-finite checks only.
    SENTINEL = 4


# Module-level names: reading ``Phase.SKIP`` goes through the enum's class machinery
# (about 0.15 us on Python 3.11), a global is one dictionary lookup.
SKIP = Phase.SKIP
SAMPLED = Phase.SAMPLED
IDLE = Phase.IDLE
RECOMPUTE = Phase.RECOMPUTE
SENTINEL = Phase.SENTINEL


@dataclass(eq=False)
class ForwardState:
    """Where one observer stands in the training loop: every field the forward context
    reads or changes (its collaborators aside), with its starting value.

    Shared across threads on purpose: worker threads inside a root forward belong to
    that forward. Fields with a leading underscore are the state machine's own; the
    others are also read by per-call capture, the observer and the snapshot.
    """

    #: The phase of the innermost open root forward (IDLE when none is open).
    state: Phase = IDLE
    #: The phases to return to, one per open root forward below the innermost.
    _state_stack: list[Phase] = field(default_factory=list)
    #: The sample open now (-1 before the first).
    sample: int = -1
    #: Per module index, its calls so far in the open sample.
    call_counts: dict[int, int] = field(default_factory=dict)
    #: The forward position of the next observed call in the open sample.
    position: int = 0
    #: Tensors observed in the open sample, by id: (weak reference to the tensor,
    #: version, activation key, output-gradient key or None). A module that returns
    #: what a submodule returned (a container, the root) is measured once (see
    #: ``_calls.py``). Weak, so that an output autograd does not keep (checkpointing, a
    #: branch summed away) is freed as it would be without the observer.
    sample_outputs: dict[int, tuple[weakref.ref[Tensor], int, Any, Any]] = field(
        default_factory=dict
    )
    #: Direct-call samples: the module that opened the open one, and whether its
    #: backward has started (a call of it again then opens the next sample).
    implicit_opener: int | None = None
    implicit_backward_seen: bool = False
    #: The compile entry (see ``ForwardContext.open_direct_entry``) whose call opened
    #: or joined the open direct-call sample and has not returned yet.
    direct_entry: int | None = None
    #: Calls under no_grad in the open sample, per module index: (call, sample,
    #: first-argument identity, position), matched by their recomputation in backward.
    no_grad_calls: dict[int, list[tuple[int, int, object, int]]] = field(default_factory=dict)
    #: Forward position of the last recomputed call matched.
    recompute_anchor: int = -1
    #: The open sample is a root recomputed in backward (reentrant checkpoint).
    sample_in_backward: bool = False
    #: An unsampled training forward is open (it closes to IDLE).
    _unsampled_training: bool = False
    #: Training forwards in a row run without grad (first passes of checkpoints).
    _no_grad_training_forwards: int = 0
    #: The open training forward is sampled.
    sample_open: bool = False
    #: Forwards still to be sampled after a sentinel hit.
    _forced_samples: int = 0
    #: Samples whose backward has not started (their loss scale is still to come).
    awaiting_backward: dict[int, None] = field(default_factory=dict)
    #: True while an unsampled root forward is open with no post-hook to close it: the
    #: next root forward (or detach) closes it.
    _open_ended: bool = False
    #: Training forwards below this index continue the open-ended steady state with
    #: nothing to do but count (see ``ForwardContext.enter_root``); 0 when none is
    #: known. The forward at that index, if it only needs the root sentinel, is
    #: ``_quiet_sentinel`` (else -1).
    _quiet_until: int = 0
    _quiet_sentinel: int = -1
    #: The caller's step (``ObserverHandle.set_step``) that samples opened from now take.
    caller_step: int | None = None
    #: When the last report was written (``time.monotonic()``, seconds).
    last_write: float = field(default_factory=time.monotonic)
    #: Parents of modules that never ran were looked for (after the first sample).
    _adoption_done: bool = False
    #: Between attach and detach.
    attached: bool = False
    #: True once a training forward went through the root (not only direct calls).
    root_forward_seen: bool = False
    # Counters, named as the report's coverage keys.
    forwards_seen: int = 0
    samples_observed: int = 0
    eval_forwards_skipped: int = 0
    recompute_calls_ignored: int = 0
    direct_call_forwards: int = 0
    calls_outside_root_skipped: int = 0
