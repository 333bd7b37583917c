"""Rank detection for distributed training.

The rank comes from an initialised ``torch.distributed`` process group when there is
one, else from the ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` environment variables that
``torchrun`` sets (so injection before ``init_process_group`` also works), else rank 0 of 1.
Detection never calls a collective.
"""

from __future__ import annotations

import os

import torch

from .errors import ConfigError
from .observer import RankInfo

__all__ = ["RANK_POLICIES", "detect_rank"]

RANK_POLICIES = ("rank0", "all")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError as error:
        raise ConfigError(f"environment variable {name} must be an int, got {value!r}") from error


def detect_rank() -> RankInfo:
    """Return this process's rank, world size and local rank, and where they came from."""
    dist = torch.distributed
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
