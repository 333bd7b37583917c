"""Non-finite values between samples: the root sentinel and the opt-in full sentinel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from torchinstruments import inject_observer, remove_observer

from .conftest import read_report


class Gate(nn.Module):
    """Divides by a buffer; a zero entry makes one feature infinite."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("divisor", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.divisor


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.gate = Gate()
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(self.inp(x)))


def run(model: Net, bad_forwards: set[int], forwards: int = 30) -> None:
    generator = torch.Generator().manual_seed(0)
    for index in range(forwards):
        model.gate.divisor.fill_(1.0)
        if index in bad_forwards:
            model.gate.divisor[0] = 0.0
        x = torch.randn(4, 4, generator=generator)
        model(x).sum().backward()
    model.gate.divisor.fill_(1.0)


def test_root_sentinel_counts_a_one_off_between_samples_and_forces_sampling(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.inp.bias.zero_()
    inject_observer(model, output_dir=tmp_path, sampling=10)
    run(model, bad_forwards={13})
    remove_observer(model)
    report = read_report(tmp_path)
    coverage = report["coverage"]
    assert coverage["sentinel_nonfinite_forwards"] == 1
    # forwards 0, 10, 20 by the schedule, plus the 8 forced after forward 13 (14..21).
    assert coverage["samples_observed"] == 2 + 8
    first = report["summary"]["first_non_finite"]
    assert first == {
        "source": "root_sentinel",
        "forward_index": 13,
        "module": "<root>",
        "call_index": 0,
        "signal": "activation",
        "tensor_path": "output",
        "nonfinite_forwards_between_samples": 1,
    }


def test_full_sentinel_names_the_origin_module_of_a_one_off(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.inp.bias.zero_()
    inject_observer(model, output_dir=tmp_path, sampling=10, full_sentinel=True)
    run(model, bad_forwards={13})
    remove_observer(model)
    first = read_report(tmp_path)["summary"]["first_non_finite"]
    assert (first["source"], first["forward_index"], first["module"]) == (
        "full_sentinel",
        13,
        "gate",
    )


def test_recurring_fault_is_localised_in_the_forced_samples(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.inp.bias.zero_()
    inject_observer(model, output_dir=tmp_path, sampling=10)
    run(model, bad_forwards={13, 15})
    remove_observer(model)
    report = read_report(tmp_path)
    first = report["summary"]["first_non_finite"]
    assert first["source"] == "sampled_forward"
    assert first["module"] == "gate"
    assert first["earlier_between_samples"]["forward_index"] == 13
    non_finite = [f for f in report["findings"] if f["category"] == "non_finite"]
    assert non_finite[0]["module"] == "gate"


@pytest.mark.parametrize("full", [False, True])
def test_sentinels_leave_training_unchanged(tmp_path: Path, full: bool) -> None:
    torch.manual_seed(0)
    model, twin = Net(), Net()
    twin.load_state_dict(model.state_dict())
    inject_observer(model, output_dir=tmp_path, sampling=7, full_sentinel=full)
    run(model, bad_forwards={4})
    remove_observer(model)
    run(twin, bad_forwards={4})
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.equal(p.grad.nan_to_num(), q.grad.nan_to_num())
