"""Train a small MLP with DistributedDataParallel on the CPU, observed on every rank.

    torchrun --nproc-per-node 2 examples/distributed_training.py --output-dir stats-ddp
    python -m torchinstruments merge stats-ddp         # writes stats-ddp/global-report.json

Each rank draws its own batches of a synthetic regression task (inputs from a fixed
random "teacher" network, so nothing is downloaded), trains the same DDP model (gloo
backend) and, with ``rank_policy="all"``, writes ``rank-NNN/report.json`` and
``rank-NNN/index.md`` under ``--output-dir`` without any collective, lock or barrier of
the observer's. ``merge`` then states which ranks reported and names rank outliers.

``--rescale-rank R`` multiplies rank R's inputs by ``--rescale-factor`` (default 10) from
the middle of training on: a rank fed bad data. The merged report then names rank R.
Without ``torchrun`` the script runs as a world of one process.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchinstruments import inject_observer, remove_observer


class MLP(nn.Module):
    """inp -> LayerNorm -> two residual GELU layers -> head."""

    def __init__(self, inputs: int = 16, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(inputs, width)
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width)
        self.act1 = nn.GELU()
        self.fc2 = nn.Linear(width, width)
        self.act2 = nn.GELU()
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.inp(x))
        h = h + self.act1(self.fc1(h))
        h = h + self.act2(self.fc2(h))
        return self.head(h)


def make_batches(
    rank: int, steps: int, batch: int, seed: int, inputs: int = 16
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches: the same teacher on every rank, different inputs per rank."""
    teacher_generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(inputs, 1, generator=teacher_generator) / inputs**0.5
    generator = torch.Generator().manual_seed(seed + 1 + rank)
    batches = []
    for _ in range(steps):
        x = torch.randn(batch, inputs, generator=generator)
        y = torch.tanh(x @ teacher) + 0.05 * torch.randn(batch, 1, generator=generator)
        batches.append((x, y))
    return batches


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="stats-ddp", help="default: stats-ddp")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank (default: 32)")
    parser.add_argument("--seed", type=int, default=0, help="default: 0")
    parser.add_argument(
        "--rescale-rank", type=int, default=None, help="rank fed rescaled inputs (default: none)"
    )
    parser.add_argument(
        "--rescale-factor", type=float, default=10.0, help="input scale factor (default: 10)"
    )
    return parser.parse_args(argv)


def _init_process_group() -> bool:
    """Join the torchrun group, or start a world of one; True if we started it."""
    if dist.is_initialized():
        return False
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    else:
        store = Path(tempfile.mkdtemp(prefix="ti-ddp-")) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Train with DDP and ``rank_policy="all"``; return the exit status."""
    args = parse_args(argv)
    started = _init_process_group()
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        model = DistributedDataParallel(MLP())
        handle = inject_observer(model, output_dir=args.output_dir, rank_policy="all")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for step, (x, y) in enumerate(make_batches(rank, args.steps, args.batch_size, args.seed)):
            if rank == args.rescale_rank and step >= args.steps // 2:
                x = x * args.rescale_factor
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        remove_observer(model)
        print(
            f"rank {rank}/{world}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
            f"wrote {handle.output_dir}"
        )
        if rank == 0:
            print(f"merge with: python -m torchinstruments merge {args.output_dir}")
    finally:
        if started:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
