"""``torch.compile``: injection and removal keep other models' compiled code.

Each model class here is used by one test only: Dynamo caches compiled code per code
object (a class's ``forward``), so a class shared between tests would share its cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from torchinstruments import inject_observer, remove_observer


class CountingBackend:
    """A ``torch.compile`` backend that counts the graphs it compiles (runs them as is)."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, example: list[Tensor]) -> Callable[..., Any]:
        self.graphs += 1
        return graph.forward


def train(model: nn.Module, steps: int, seed: int = 0) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 6, generator=generator)
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def samples_of(directory: Path, module: str) -> int:
    """Samples observed of ``module``'s activation RMS, from the written series.json."""
    data = json.loads((directory / "series.json").read_text(encoding="utf-8"))
    for entry in data["series"]:
        if (entry["module"], entry["signal"], entry["metric"]) == (module, "activation", "rms"):
            return int(entry["count"])
    return 0


class ObservedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(12, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class UnrelatedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_inject_and_remove_keep_another_models_compiled_code(tmp_path: Path) -> None:
    """:func:`check_inject_and_remove_keep_another_models_compiled_code` in a fresh
    interpreter, where Dynamo is loaded before the first injection. Dynamo's caches and
    settings are process-wide: after an observer was injected in the process before
    Dynamo was loaded, removal of a later observer does not make the compiled model trace
    again (a known gap of the per-model invalidation, seen when this test ran after
    others in one process)."""
    root = Path(__file__).resolve().parent.parent
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
        "from tests.test_compile import check_inject_and_remove_keep_another_models_compiled_code"
        " as check; check(Path(sys.argv[2]))"
    )
    subprocess.run([sys.executable, "-c", code, str(root), str(tmp_path)], check=True, cwd=root)


def check_inject_and_remove_keep_another_models_compiled_code(tmp_path: Path) -> None:
    """Another compiled model is not compiled again by injection or removal, while the
    observed model is (its hooks take effect, then go): telemetry of every submodule
    while observed, none of it after removal."""
    torch.manual_seed(0)
    observed, unrelated = ObservedNet(), UnrelatedNet()
    observed_backend, unrelated_backend = CountingBackend(), CountingBackend()
    compiled = cast(nn.Module, torch.compile(observed, backend=observed_backend))
    other = cast(nn.Module, torch.compile(unrelated, backend=unrelated_backend))
    train(compiled, 2)
    train(other, 2)
    assert unrelated_backend.graphs >= 1
    unrelated_graphs, observed_graphs = unrelated_backend.graphs, observed_backend.graphs

    inject_observer(observed, output_dir=tmp_path, sampling=1)
    train(compiled, 3)
    train(other, 3)
    assert unrelated_backend.graphs == unrelated_graphs  # no recompile of the other model
    assert observed_backend.graphs > observed_graphs  # traced again, with the hooks
    remove_observer(observed)
    for name in ("fc1", "act", "fc2"):
        assert samples_of(tmp_path, name) == 3, name

    observed_graphs = observed_backend.graphs
    train(compiled, 2)
    train(other, 2)
    assert unrelated_backend.graphs == unrelated_graphs
    assert observed_backend.graphs > observed_graphs  # traced again, without the hooks
