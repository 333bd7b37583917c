"""Rank detection and rank directory names for distributed training.

The rank comes from an initialised ``torch.distributed`` process group when there is
one, else from the ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` environment variables that
``torchrun`` sets (so injection before ``init_process_group`` also works), else rank 0 of 1.
Detection never calls a collective.

With ``rank_policy="all"`` each rank writes into its own ``rank-NNN`` directory (three
digits at least: ``rank-007``, ``rank-1234``); :func:`rank_directory_name` and
:func:`parse_rank_directory` are the two directions of that naming, shared by the writer
and by :func:`~torchinstruments.merge_rank_reports`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .errors import ConfigError

__all__ = [
    "RANK_POLICIES",
    "RankInfo",
    "detect_rank",
    "parse_rank_directory",
    "rank_directory_name",
]

RANK_POLICIES = ("rank0", "all")

_RANK_DIRECTORY = re.compile(r"rank-(\d{3,})")


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Where this process sits in a distributed job (rank 0 of 1 when not distributed)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    source: str = "single_process"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError as error:
        raise ConfigError(f"environment variable {name} must be an int, got {value!r}") from error


def detect_rank() -> RankInfo:
    """Return this process's rank, world size and local rank, and where they came from.

    Returns:
        A :class:`RankInfo` whose ``source`` is
        ``"process_group"`` (an initialised default process group), ``"environment"``
        (``RANK`` and ``WORLD_SIZE`` set, as by ``torchrun``) or ``"single_process"``.

    Raises:
        ConfigError: ``RANK``, ``WORLD_SIZE`` or ``LOCAL_RANK`` is set but not an int.
    """
    import torch.distributed as dist  # here, so that reading rank directories needs no torch

    if dist.is_available() and dist.is_initialized():
        local = _env_int("LOCAL_RANK")
        rank = dist.get_rank()
        return RankInfo(
            rank=rank,
            world_size=dist.get_world_size(),
            local_rank=local if local is not None else rank,
            source="process_group",
        )
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is not None and world is not None:
        local = _env_int("LOCAL_RANK")
        return RankInfo(rank, world, local if local is not None else rank, "environment")
    return RankInfo()


def rank_directory_name(rank: int) -> str:
    """The directory a rank writes into with ``rank_policy="all"``.

    Args:
        rank: global rank, ``>= 0``.

    Returns:
        ``"rank-"`` followed by the rank, zero-padded to three digits.

    Raises:
        ConfigError: ``rank`` is not an int ``>= 0``.

    Example:
        >>> rank_directory_name(7)
        'rank-007'
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ConfigError(f"rank_directory_name: rank must be an int >= 0, got {rank!r}")
    return f"rank-{rank:03d}"


def parse_rank_directory(name: str) -> int | None:
    """The rank of a ``rank-NNN`` directory name, or None for any other name.

    Args:
        name: a directory name (not a path).

    Returns:
        The rank, or None when ``name`` is not ``rank-`` followed by three or more digits.

    Example:
        >>> parse_rank_directory("rank-012"), parse_rank_directory("stats")
        (12, None)
    """
    match = _RANK_DIRECTORY.fullmatch(name)
    return int(match.group(1)) if match else None
