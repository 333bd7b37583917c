"""CUDA: no host synchronisation inside hooks (runs only where CUDA is present)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from torchinstruments import inject_observer, remove_observer

from .conftest import read_report

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(256, 256)
        self.norm = nn.LayerNorm(256)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.norm(self.fc(x)))


@pytest.mark.parametrize(
    "options",
    [{"sampling": 1}, {"sampling": 3}, {"sampling": 3, "full_sentinel": True}],
    ids=["every", "every-3-root-sentinel", "every-3-full-sentinel"],
)
def test_sampled_steps_never_synchronise(tmp_path: Path, options: dict[str, object]) -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), nn.Linear(256, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(20, 64, 256, device=device)
    targets = torch.randint(0, 10, (20, 64), device=device)
    inject_observer(model, output_dir=tmp_path, **options)  # type: ignore[arg-type]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(20):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(inputs[step]), targets[step])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    remove_observer(model)
    report = read_report(tmp_path)
    assert report["errors"] == []
    assert report["coverage"]["samples_observed"] >= 7
    assert report["coverage"]["backward_samples_observed"] == report["coverage"]["samples_observed"]
