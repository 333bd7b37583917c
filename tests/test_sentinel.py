"""Non-finite values between samples: the root sentinel and the opt-in full sentinel."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tests.harness import event_of, read_report
from tests.harness.scenarios import check_poisoned_report, inject, train_poisoned
from torchinstruments import inject_observer, remove_observer


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


ACCELERATOR = pytest.mark.parametrize("accelerator", [False, True], ids=["cpu", "accelerator"])


@ACCELERATOR
def test_root_sentinel_counts_a_one_off_between_samples_and_forces_sampling(
    tmp_path: Path, accelerator: bool
) -> None:
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.inp.bias.zero_()
    inject(model, tmp_path, accelerator, sampling=10)
    run(model, bad_forwards={17})  # checked: the root sentinel takes forwards 7, 8, 17, 26
    remove_observer(model)
    report = read_report(tmp_path)
    coverage = report["coverage"]
    assert coverage["sentinel_nonfinite_forwards"] == 1
    if accelerator:
        # The device-side sum is read at the next flush (forward 32, after the run):
        # forwards 0, 10, 20 by the schedule, none forced.
        assert coverage["samples_observed"] == 3
        assert coverage["sentinel_checks"] == 4  # forwards 7, 8, 17 and 26
    else:
        # forwards 0, 10, 20 by the schedule, plus the 8 forced after forward 17 (18..25).
        assert coverage["samples_observed"] == 2 + 8
        assert coverage["sentinel_checks"] == 4  # forwards 7, 8, 17 and 26
    # No sampled forward saw it: the headline says so rather than "nothing stands out".
    assert report["summary"]["headline"].startswith(
        "Non-finite values were seen between samples (1 training forward(s), the first at "
        "forward 17, in `<root>`) but in no sampled forward"
    )
    first = report["summary"]["first_non_finite"]
    assert first == {
        "source": "root_sentinel",
        "forward_index": 17,
        "module": "<root>",
        "call_index": 0,
        "signal": "activation",
        "tensor_path": "output",
        "nonfinite_forwards_between_samples": 1,
    }


@ACCELERATOR
def test_full_sentinel_names_the_origin_module_of_a_one_off(
    tmp_path: Path, accelerator: bool
) -> None:
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.inp.bias.zero_()
    inject(model, tmp_path, accelerator, sampling=10, full_sentinel=True)
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
    run(model, bad_forwards={17, 19})
    remove_observer(model)
    report = read_report(tmp_path)
    first = report["summary"]["first_non_finite"]
    assert first["source"] == "sampled_forward"
    assert first["module"] == "gate"
    assert first["earlier_between_samples"]["forward_index"] == 17
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


@ACCELERATOR
@pytest.mark.parametrize("full_sentinel", [False, True], ids=["root", "full"])
def test_fault_between_samples_that_reaches_the_weights(
    tmp_path: Path, full_sentinel: bool, accelerator: bool
) -> None:
    report = train_poisoned(
        tmp_path,
        torch.device("cpu"),
        contextlib.nullcontext,
        accelerator,
        full_sentinel=full_sentinel,
    )
    check_poisoned_report(report, full_sentinel, accelerator)


class Inp(nn.Linear):
    """A linear layer that can be made to output NaN."""

    broken = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        y = super().forward(input)
        return y * float("nan") if self.broken else y


class StaleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = Inp(4, 8)
        self.gate = Gate()
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(self.inp(x)))


@ACCELERATOR
@pytest.mark.parametrize("full_sentinel", [False, True], ids=["root", "full"])
def test_an_old_one_off_is_not_the_origin_of_a_later_fault(
    tmp_path: Path, full_sentinel: bool, accelerator: bool
) -> None:
    """A one-off inf in ``gate`` at forward 7, then NaN from ``inp`` from forward 209 on
    (both forwards the root sentinel checks): the finding links the hit just before its
    first non-finite sample (forward 209), not the run's first hit; the summary still
    says the run's first was at forward 7."""
    torch.manual_seed(0)
    model = StaleNet()
    with torch.no_grad():
        model.inp.bias.zero_()
    inject(model, tmp_path, accelerator, sampling=100, full_sentinel=full_sentinel)
    generator = torch.Generator().manual_seed(0)
    for index in range(260):
        model.gate.divisor.fill_(1.0)
        if index == 7:
            model.gate.divisor[0] = 0.0
        model.inp.broken = index >= 209
        model(torch.randn(4, 4, generator=generator)).sum().backward()
    model.gate.divisor.fill_(1.0)
    remove_observer(model)
    report = read_report(tmp_path)
    first = report["findings"][0]
    assert (first["category"], first["module"], first["signal"]) == (
        "non_finite",
        "inp",
        "activation",
    )
    # Samples: forward 0, the forced ones after the one-off, 100, 200, then sample 11.
    assert first["evidence"]["first_nonfinite_sample"] == 11
    earlier = first["evidence"]["earlier_between_samples"]
    assert earlier["forward_index"] == 209
    assert earlier["this_series"] is full_sentinel
    assert "forward 7" not in event_of(report, first)["interpretation"]
    summary = report["summary"]["first_non_finite"]
    assert summary["module"] == "inp" and summary["sample"] == 11
    assert summary["earlier_between_samples"]["forward_index"] == 7


class NanGrad(torch.autograd.Function):
    """Identity forward; NaN backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        return grad_outputs[0] * float("nan")


class Mid(nn.Linear):
    poison = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        y = super().forward(input)
        return NanGrad.apply(y) if self.poison else y


class GradNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.mid = Mid(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(self.inp(x)))


@pytest.mark.parametrize("full_sentinel", [False, True], ids=["root", "full"])
def test_non_finite_that_starts_in_a_gradient_ranks_before_the_next_forward(
    tmp_path: Path, full_sentinel: bool
) -> None:
    """NaN starts in the backward of sample 1 (forward 10) and reaches every weight
    through the optimizer step: the gradient at sample 1 is the first finding and the
    summary's first non-finite value, before the activations of sample 2."""
    torch.manual_seed(0)
    model = GradNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inject_observer(model, output_dir=tmp_path, sampling=10, full_sentinel=full_sentinel)
    generator = torch.Generator().manual_seed(0)
    for index in range(40):
        model.mid.poison = index == 10
        loss = model(torch.randn(4, 4, generator=generator)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    remove_observer(model)
    report = read_report(tmp_path)
    non_finite = [f for f in report["findings"] if f["category"] == "non_finite"]
    first = non_finite[0]
    assert (first["signal"], first["evidence"]["first_nonfinite_sample"]) == ("grad_output", 1)
    assert "earlier_between_samples" not in first["evidence"]
    summary = report["summary"]["first_non_finite"]
    assert (summary["signal"], summary["sample"], summary["forward_index"]) == (
        "grad_output",
        1,
        10,
    )
    assert "earlier_between_samples" not in summary  # the hit at forward 11 came later


@ACCELERATOR
def test_complex_outputs_take_the_sentinel_by_their_parts(
    tmp_path: Path, accelerator: bool
) -> None:
    """Finite complex64 outputs near float32's maximum: |z| would overflow, their parts
    do not. No false hit, no error."""

    class Complex(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.fc(x)).clamp(-0.99, 0.99)
            return torch.complex(h, h) * 3.3e38

    torch.manual_seed(0)
    model = Complex()
    inject(model, tmp_path, accelerator, sampling=100)
    for _ in range(24):
        out = model(torch.randn(2, 4))
        assert torch.isfinite(out).all()
        out.real.sum().backward()
    remove_observer(model)
    coverage = read_report(tmp_path)["coverage"]
    assert coverage["errors_total"] == 0
    assert coverage["sentinel_checks"] == 3  # forwards 7, 8 and 17
    assert coverage["sentinel_nonfinite_forwards"] == 0


class _CountingFunctions(TorchFunctionMode):
    calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        _CountingFunctions.calls += 1
        return func(*args, **(kwargs or {}))


class _CountingOps(TorchDispatchMode):
    calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        _CountingOps.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", [None, _CountingFunctions, _CountingOps])
def test_the_root_sentinel_is_invisible_to_user_modes(
    tmp_path: Path, mode: type[_CountingFunctions] | type[_CountingOps] | None
) -> None:
    """The root sentinel's check of a plain tensor skips passive() only while no user
    mode is active; under a torch-function or dispatch mode the user's mode sees the
    ops of training and nothing of the check, nor of the sampled forwards' work, and the
    one-off is found either way. Dynamo is loaded first, so that the observer sets up
    its capture inside compiled graphs, whose sample openings read the gradient sinks
    (seen by a torch-function mode before they ran in passive())."""
    import torch._dynamo  # what any compiled model in the process does

    def counted_run(model: Net) -> int:
        if mode is None:
            run(model, bad_forwards={17})
            return 0
        mode.calls = 0
        with mode():
            run(model, bad_forwards={17})
        return mode.calls

    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.inp.bias.zero_()
    plain_calls = counted_run(model)
    inject_observer(model, output_dir=tmp_path, sampling=100)
    observed_calls = counted_run(model)
    remove_observer(model)
    assert observed_calls == plain_calls
    assert mode is None or plain_calls > 0
    coverage = read_report(tmp_path)["coverage"]
    assert coverage["errors_total"] == 0
    assert coverage["sentinel_checks"] == 4  # forwards 7, 8, 17 and 26
    assert coverage["sentinel_nonfinite_forwards"] == 1


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("kind", ["float8", "nested"])
def test_root_outputs_that_cannot_be_reduced_are_skipped_not_errors(
    tmp_path: Path, kind: str
) -> None:
    """A float8 or a nested root output (no CPU reduction takes them) is skipped, by the
    root sentinel between samples as in sampled forwards: no error is counted."""

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 4)
            self.hidden = torch.zeros(0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.hidden = self.fc(x)
            if kind == "float8":
                return self.hidden.detach().to(torch.float8_e4m3fn)
            return torch.nested.nested_tensor(
                [self.hidden[0].detach(), self.hidden[1, :2].detach()]
            )

    torch.manual_seed(0)
    model = Odd()
    inject_observer(model, output_dir=tmp_path, sampling=100)
    for _ in range(20):
        model(torch.randn(4, 6))
        model.hidden.square().mean().backward()
    remove_observer(model)
    report = read_report(tmp_path)
    assert report["errors"] == []
    assert report["coverage"]["errors_total"] == 0
    assert report["coverage"]["sentinel_checks"] == 0  # forwards 7, 8 and 17: skipped
    assert report["coverage"]["tensors_skipped"] == {kind: 1}  # the sampled forward 0


@pytest.mark.parametrize("phase", [0, 1, 2, 3])
def test_a_fault_recurring_every_4th_forward_meets_the_root_sentinel(
    tmp_path: Path, phase: int
) -> None:
    """NaN inputs on every 4th forward from forward 200 (steps with a non-finite loss
    skipped, as a GradScaler would), never on a sampled forward of the default
    schedule at some phases: the sentinel's moving offset still meets one within 64
    forwards, at every phase."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inject_observer(model, output_dir=tmp_path)
    generator = torch.Generator().manual_seed(0)
    for step in range(300):
        x = torch.randn(4, 4, generator=generator)
        if step >= 200 and step % 4 == phase:
            x[0, 0] = float("nan")
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        if torch.isfinite(loss):
            optimizer.step()
    remove_observer(model)
    report = read_report(tmp_path)
    assert report["coverage"]["sentinel_nonfinite_forwards"] > 0
    first = report["summary"]["first_non_finite"]
    hit = first.get("earlier_between_samples", first)
    assert 200 <= hit["forward_index"] < 264
    assert hit["forward_index"] % 4 == phase


def test_a_hit_read_at_a_flush_between_quiet_forwards_forces_the_next_samples(
    tmp_path: Path, fresh_dynamo: None
) -> None:
    """On the accelerator path the root sentinel's sum is read at a flush. Read between
    forwards 7 and 8 (``flush()``), its hit must make forward 8 sampled, although 8 was
    planned as a quiet forward that only has the root sentinel."""
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.inp.bias.zero_()
    handle = inject_observer(model, output_dir=tmp_path, sampling=100)
    observer = handle._observer
    assert observer is not None
    observer.buffer.device_path_types = frozenset({"cpu"})
    generator = torch.Generator().manual_seed(0)
    for index in range(20):
        model.gate.divisor.fill_(0.0 if index == 7 else 1.0)
        model(torch.randn(4, 4, generator=generator)).sum().backward()
        if index == 7:
            assert observer.context._quiet_sentinel == 8  # planned at the end of forward 7
            handle.flush()
    model.gate.divisor.fill_(1.0)
    remove_observer(model)
    coverage = read_report(tmp_path)["coverage"]
    assert coverage["sentinel_nonfinite_forwards"] == 1
    assert coverage["samples_observed"] == 1 + 8  # forward 0, then 8 to 15 forced
    assert coverage["sentinel_checks"] == 2  # forwards 7 and 17 (8 is sampled)


@pytest.mark.parametrize("interval", [1, 3, 8, 16])
def test_the_next_root_sentinel_forward_is_the_first_one_checked(interval: int) -> None:
    from torchinstruments._sentinel import next_root_sentinel as _next_root_sentinel
    from torchinstruments._sentinel import root_sentinel_due as _root_sentinel_due

    checked = [f for f in range(600) if _root_sentinel_due(f, interval)]
    for start in range(checked[-1] + 1):
        assert _next_root_sentinel(start, interval) == next(f for f in checked if f >= start)
    assert [_next_root_sentinel(s, 8) for s in (0, 8, 9, 18, 27)] == [7, 8, 17, 26, 35]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_the_root_check_on_the_cpu_answers_what_its_sum_can_tell() -> None:
    """The root sentinel's short path: finite, non-finite and overflowing sums answered
    and counted; integers answered, not counted; tensors it cannot sum left to the full
    check, after which it is not tried again; off the CPU or on the emulated device
    path, left to the full check while staying on."""
    from torchinstruments._error_log import ErrorLog
    from torchinstruments._sentinel import Sentinel
    from torchinstruments._staging import StatisticsBuffer

    names = ["root"]
    sentinel = Sentinel(names, StatisticsBuffer(names, ErrorLog(4)))
    half_max = torch.tensor([60000.0, 60000.0], dtype=torch.float16)  # sums to inf
    leaf = torch.ones(3, requires_grad=True)
    answers = [
        sentinel.check_root_on_cpu(torch.ones(4)),
        sentinel.check_root_on_cpu(torch.tensor([1.0, float("nan")])),
        sentinel.check_root_on_cpu(torch.tensor([float("-inf"), 2.0], dtype=torch.bfloat16)),
        sentinel.check_root_on_cpu(half_max),
        sentinel.check_root_on_cpu(torch.ones(0)),
        sentinel.check_root_on_cpu(leaf * 2),
    ]
    assert answers == [False, True, True, False, False, False]
    assert sentinel.sentinel_checks == 6
    assert torch.is_grad_enabled()
    assert sentinel.check_root_on_cpu(torch.ones(3, dtype=torch.int64)) is False
    assert sentinel.check_root_on_cpu(torch.ones(3, dtype=torch.bool)) is False
    assert sentinel.sentinel_checks == 6
    assert sentinel.check_root_on_cpu(torch.ones(3, device="meta")) is None
    sentinel._buffer.device_path_types = frozenset({"cpu"})
    assert sentinel.check_root_on_cpu(torch.ones(3)) is None
    sentinel._buffer.device_path_types = frozenset({"cuda"})
    assert sentinel.check_root_on_cpu(torch.ones(3)) is False  # still tried
    for refused in (
        torch.ones(2, dtype=torch.complex64),
        torch.ones(2).to(torch.float8_e4m3fn),
        torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    ):
        fresh = Sentinel(names, StatisticsBuffer(names, ErrorLog(4)))
        assert fresh.check_root_on_cpu(refused) is None
        assert fresh.check_root_on_cpu(torch.tensor([float("nan")])) is None  # not tried
        assert fresh.sentinel_checks == 0
        assert torch.is_grad_enabled()
