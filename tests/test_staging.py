"""Small CPU tensors are copied and reduced in batches at the next flush.

The batches must not change what the trackers see: each series in sample order, even
when its tensor crosses the staging size between samples, and one bad copy must not
cost the others.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from tests.harness import read_report, read_series
from torchinstruments import ReportConfig, inject_observer, remove_observer
from torchinstruments._staging import STAGE_MAX_ELEMENTS, STAGE_MAX_NUMEL

WIDE = ReportConfig(top_k_per_category=500, max_bytes=4_000_000)


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(64, 64)

    def forward(self, x: Tensor) -> Tensor:
        return self.emb(x).pow(2).mean()


def rms_finding(rows: list[dict], module: str) -> dict:
    return next(
        f
        for f in rows
        if f["module"] == module and f["signal"] == "activation" and f["metric"] == "rms"
    )


def test_series_stay_in_sample_order_across_the_staging_size(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Embed()
    lengths = [500, 520] * 3  # 32,000 and 33,280 elements: staged, then not
    assert 500 * 64 <= STAGE_MAX_NUMEL < 520 * 64
    inject_observer(model, output_dir=tmp_path, sampling=1, report_config=WIDE)
    expected = []
    for i, length in enumerate(lengths):
        x = torch.randn(length, 64) * (i + 1)
        with torch.no_grad():
            expected.append(model.emb(x).double().pow(2).mean().sqrt().item())
        model(x).backward()
    remove_observer(model)
    finding = rms_finding(read_series(tmp_path), "emb")
    assert [point[0] for point in finding["history"]] == list(range(6))
    for (_, value), truth in zip(finding["history"], expected, strict=True):
        assert abs(value - truth) <= 1e-5 * truth
    assert finding["first"]["sample"] == 0 and finding["latest"]["sample"] == 5


def test_calls_inside_vmap_are_skipped_and_training_calls_kept(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    inject_observer(model, output_dir=tmp_path, sampling=1, report_config=WIDE)

    def loss(params: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return (functional_call(model, params, (x.unsqueeze(0),)) - y).pow(2).mean()

    for _ in range(4):
        x, y = torch.randn(6, 8), torch.randn(6, 1)
        params = {k: v.detach() for k, v in model.named_parameters()}
        vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)  # per-sample gradients
        (model(x) - y).pow(2).mean().backward()
    remove_observer(model)
    report = read_series(tmp_path)
    coverage = read_report(tmp_path)["coverage"]
    assert coverage["errors_total"] == 0
    # The root forwards inside the transform are skipped whole, as eval forwards are.
    assert (coverage["forwards_seen"], coverage["eval_forwards_skipped"]) == (4, 4)
    for name in ("0", "1", "2"):
        assert rms_finding(report, name)["observations"] == 4


class VmapInside(nn.Module):
    """Runs a submodule under vmap inside an ordinary training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(vmap(self.inner)(x))


def test_a_submodule_run_under_vmap_inside_a_training_forward_is_skipped_and_counted(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = VmapInside()
    inject_observer(model, output_dir=tmp_path, sampling=1, report_config=WIDE)
    for _ in range(3):
        model(torch.randn(6, 8)).pow(2).mean().backward()
    remove_observer(model)
    report = read_series(tmp_path)
    coverage = read_report(tmp_path)["coverage"]
    assert coverage["errors_total"] == 0
    assert coverage["forwards_seen"] == 3
    assert coverage["tensors_skipped"] == {"functorch_transform": 3}
    assert rms_finding(report, "head")["observations"] == 3


class Residual(nn.Module):
    """Linear -> in-place ReLU -> residual add in place, and a LayerNorm head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(24, 24)
        self.act = nn.ReLU(inplace=True)
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        h += x  # after fc's hooks ran
        return self.head(self.norm(self.act(h)))


def _series_values(rows: list[dict]) -> dict[tuple[str, str, str], list[float]]:
    return {
        (f["module"], f["signal"], f["metric"]): [value for _, value in f["history"]]
        for f in rows
        if f["metric"] == "rms"
    }


def test_accelerator_batches_give_the_cpu_values(tmp_path: Path) -> None:
    """The accelerator staging path (copies reduced by device_statistics_batch, as on
    CUDA), run here on the CPU, gives the values of the CPU path, in sample order."""
    data = [(torch.randn(40, 24) * (1 + i % 3), torch.randint(0, 3, (40,))) for i in range(9)]
    reports = []
    for name, device_types in (("cpu", frozenset()), ("device", frozenset({"cpu"}))):
        torch.manual_seed(0)
        model = Residual()
        handle = inject_observer(model, output_dir=tmp_path / name, sampling=1, report_config=WIDE)
        observer = handle._observer
        assert observer is not None
        observer.buffer.device_path_types = device_types
        for x, y in data:
            nn.functional.cross_entropy(model(x), y).backward()
        remove_observer(model)
        reports.append(read_series(tmp_path / name))
    cpu, device = (_series_values(r) for r in reports)
    errors_total = read_report(tmp_path / name)["coverage"]["errors_total"]
    assert cpu.keys() == device.keys() and len(cpu) >= 10
    for key, values in cpu.items():
        assert len(values) == 9, key
        assert device[key] == pytest.approx(values, rel=1e-5), key
    assert errors_total == 0


class Lengths(nn.Module):
    """One scaling module per input, each input of its own length."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.parts = nn.ModuleList(Scale() for _ in range(count))

    def forward(self, inputs: list[Tensor]) -> Tensor:
        total = torch.zeros(())
        for part, x in zip(self.parts, inputs, strict=True):
            total = total + part(x).sum()
        return total


class Scale(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * 3.0


def test_more_lengths_than_staging_slabs_keep_exact_values(tmp_path: Path) -> None:
    """20 lengths of 20,000 to 21,900 elements: 16 slabs fit in the staging bound; the
    other lengths are copied on their own (no slab is made and dropped per copy), and
    every value is the one torch gives."""
    lengths = [20_000 + 100 * i for i in range(20)]
    model = Lengths(len(lengths))
    handle = inject_observer(model, output_dir=tmp_path, sampling=1, report_config=WIDE)
    expected: dict[str, list[float]] = {f"parts.{i}": [] for i in range(len(lengths))}
    for step in range(4):
        inputs = [torch.randn(n, requires_grad=True) * (1 + step) for n in lengths]
        for i, x in enumerate(inputs):
            expected[f"parts.{i}"].append((x.detach().double() * 3).pow(2).mean().sqrt().item())
        model(inputs).backward()
        observer = handle._observer
        assert observer is not None
        assert observer.buffer.slab_elements <= STAGE_MAX_ELEMENTS
    assert 0 < len(observer.buffer.slabs) < len(lengths)
    remove_observer(model)
    report = read_series(tmp_path)
    for module, truth in expected.items():
        finding = rms_finding(report, module)
        values = [value for _, value in finding["history"]]
        assert values == pytest.approx(truth, rel=1e-5), module
