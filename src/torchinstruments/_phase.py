"""The phase of the forward context: what the hooks do with a module call now.

Hooks compare with these members by identity (``context.state is SKIP``); the context
only ever stores members, never bare integers.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["IDLE", "RECOMPUTE", "SAMPLED", "SENTINEL", "SKIP", "Phase"]


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
