"""Attention logits measured inside compiled graphs (``_attention_graph.py``): the
same series as eagerly, with the masks models pass under ``torch.compile``, two calls in
one module call, and the calls that cannot be measured there counted."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import cast

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.harness import read_report
from tests.harness.scenarios import assert_same_telemetry, written_series
from torchinstruments import _attention_graph, inject_observer, remove_observer
from torchinstruments._attention import ATTENTION_LOGITS_PATH


class SelfAttention(nn.Module):
    """Two heads of width 4 over 6 positions. ``mask``: how the causal mask is given
    (``"flag"``: ``is_causal=True``, ``"bool"``, ``"float"``: an additive mask of the
    most negative float); ``calls``: attention calls per forward (the second on the
    first's output); ``break_after``: a graph break after the first call."""

    def __init__(self, mask: str = "flag", calls: int = 1, break_after: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)
        self.mask, self.calls, self.break_after = mask, calls, break_after

    def attend(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, 2, 4).permute(2, 0, 3, 1, 4)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        if self.mask == "bool":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        elif self.mask == "float":
            bias = torch.zeros(length, length).masked_fill(~causal, torch.finfo(x.dtype).min)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(batch, length, 8)

    def forward(self, x: Tensor) -> Tensor:
        y = self.attend(x)
        if self.break_after:
            torch._dynamo.graph_break()
        for _ in range(self.calls - 1):
            y = self.attend(y)
        return self.out(y)


class Net(nn.Module):
    def __init__(self, **options: object) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.attention = SelfAttention(**options)  # type: ignore[arg-type]
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.attention(self.embed(x)))


def train(model: nn.Module, steps: int) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        x = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def observe_both(
    tmp_path: Path, compiled_options: dict[str, object], *, fullgraph: bool = True
) -> tuple[dict, dict, dict]:
    """The same model observed eagerly with ``is_causal=True``, and compiled (aot_eager)
    with ``compiled_options``: series of each and the compiled run's report; training
    of the compiled model is checked against its compiled twin."""
    torch.manual_seed(0)
    base = Net(calls=compiled_options.get("calls", 1))
    eager, observed, twin = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    for model in (observed, twin):
        for name, value in compiled_options.items():
            setattr(model.attention, name, value)
    inject_observer(eager, output_dir=tmp_path / "eager", sampling=1)
    train(eager, 4)
    remove_observer(eager)
    inject_observer(observed, output_dir=tmp_path / "compiled", sampling=1)
    losses = train(
        cast(nn.Module, torch.compile(observed, backend="aot_eager", fullgraph=fullgraph)), 4
    )
    remove_observer(observed)
    twin_compiled = torch.compile(twin, backend="aot_eager", fullgraph=fullgraph)
    assert losses == train(cast(nn.Module, twin_compiled), 4)
    assert not _attention_graph._PENDING
    return (
        written_series(tmp_path / "eager"),
        written_series(tmp_path / "compiled"),
        read_report(tmp_path / "compiled"),
    )


def logits_keys(series: dict) -> set[tuple]:
    return {key[:4] for key in series if key[3].startswith(ATTENTION_LOGITS_PATH)}


@pytest.mark.parametrize("mask", ["flag", "bool", "float"])
def test_the_logits_in_a_graph_are_those_measured_eagerly_with_a_causal_flag(
    tmp_path: Path, mask: str, fresh_dynamo: None
) -> None:
    """Compiled with ``fullgraph=True``, the causal mask given as a flag, a boolean mask
    or a float mask: the logits' series (from the second sample, once the attention
    module, a parent, is observed) equal the eager path's with ``is_causal=True``."""
    eager, compiled, report = observe_both(tmp_path, {"mask": mask})
    assert (
        logits_keys(eager)
        == logits_keys(compiled)
        == {("attention", 0, "activation", ATTENTION_LOGITS_PATH)}
    )
    rms = compiled[("attention", 0, "activation", ATTENTION_LOGITS_PATH, "rms")]
    assert [sample for sample, _ in rms] == [1, 2, 3]
    assert_same_telemetry(eager, compiled)
    coverage = report["coverage"]
    assert coverage["attention_modules_observed"] == ["attention"]
    assert coverage["compiled_capture"]["attention_calls_not_measured"] == 1  # sample 0's


def test_two_calls_in_one_module_call_are_named_as_eagerly(
    tmp_path: Path, fresh_dynamo: None
) -> None:
    eager, compiled, _ = observe_both(tmp_path, {"calls": 2})
    assert (
        logits_keys(eager)
        == logits_keys(compiled)
        == {
            ("attention", 0, "activation", ATTENTION_LOGITS_PATH),
            ("attention", 0, "activation", f"{ATTENTION_LOGITS_PATH}[1]"),
        }
    )
    assert_same_telemetry(eager, compiled)


def test_a_graph_break_between_the_call_and_its_module_hook_counts_it_not_measured(
    tmp_path: Path, fresh_dynamo: None
) -> None:
    """The call's row is made in one graph, its module's hook runs in the next: not
    measured there (counted in every sample), training unchanged, nothing left
    pending; the module's output is measured as eagerly."""
    eager, compiled, report = observe_both(tmp_path, {"break_after": True}, fullgraph=False)
    assert logits_keys(compiled) == set()
    assert report["coverage"]["compiled_capture"]["attention_calls_not_measured"] >= 2
    assert_same_telemetry(
        {key: value for key, value in eager.items() if key[3] == "output"},
        {key: value for key, value in compiled.items() if key[3] == "output"},
    )
