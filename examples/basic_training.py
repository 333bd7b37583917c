"""Train a small residual MLP on scikit-learn's handwritten digits, observed by torchinstruments.

    uv run examples/basic_training.py                          # healthy run
    uv run examples/basic_training.py --modification drop-norm # blocks.2 loses its LayerNorm
    uv run examples/basic_training.py --modification shrink-residual

The digits (1,797 8x8 images, 10 classes) ship with scikit-learn: nothing is downloaded.
Halfway through training, ``--modification`` changes one block (``blocks.2``): its
normalization is dropped, or its residual branch is scaled by 0.01. The report in
``--output-dir`` (default ``stats``) should name that block first in its category.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import nn

from torchinstruments import inject_observer, remove_observer

MODIFIED_BLOCK = "blocks.2"
MODIFICATIONS = ("none", "drop-norm", "shrink-residual")


class Scale(nn.Module):
    """Multiplies by a fixed factor (the residual branch scale)."""

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class Block(nn.Module):
    """Pre-norm residual block: x + scale(fc2(act(fc1(norm(x)))))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * width, width)
        self.scale = Scale(1.0)
        self.use_norm = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x) if self.use_norm else x
        return x + self.scale(self.fc2(self.act(self.fc1(h))))


class ResidualMLP(nn.Module):
    def __init__(self, inputs: int = 64, width: int = 64, depth: int = 4, classes: int = 10):
        super().__init__()
        self.stem = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pixel intensities 0..16 as given (the blocks' LayerNorms handle the scale)."""
    data, target = load_digits(return_X_y=True)
    x = torch.tensor(data, dtype=torch.float32)
    y = torch.tensor(target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


def modify(model: ResidualMLP, modification: str) -> None:
    block = model.blocks[int(MODIFIED_BLOCK.rsplit(".", 1)[1])]
    assert isinstance(block, Block)
    if modification == "drop-norm":
        block.use_norm = False
    elif modification == "shrink-residual":
        block.scale.factor = 0.01


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modification", choices=MODIFICATIONS, default="none")
    parser.add_argument("--output-dir", default="stats", help="report directory (default stats)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be at least 2, got {args.steps}")

    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    model = ResidualMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = 64
    generator = torch.Generator().manual_seed(args.seed)

    inject_observer(model, output_dir=args.output_dir)  # the one line of instrumentation
    started = time.perf_counter()
    modify_at = args.steps // 2
    for step in range(args.steps):
        if step == modify_at and args.modification != "none":
            modify(model, args.modification)
            print(f"step {step}: applied modification {args.modification!r} to {MODIFIED_BLOCK}")
        index = torch.randint(0, len(x_train), (batch,), generator=generator)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x_train[index]), y_train[index])
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    remove_observer(model)  # writes the final report
    elapsed = time.perf_counter() - started
    print(f"test accuracy {accuracy:.3f}; {args.steps} steps in {elapsed:.1f} s")

    report_path = Path(args.output_dir) / "report.json"
    report = json.loads(report_path.read_text(encoding="utf-8"))
    print(f"\nreport: {report_path}  (people: {Path(args.output_dir) / 'index.md'})")
    print(report["summary"]["headline"])
    for event in report["events"]:
        categories = ", ".join(f["category"] for f in event["findings"])
        print(f"  {event['id']} ({event['shape']}; {categories}): {event['interpretation']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
