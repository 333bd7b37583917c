"""Attention logits of ``scaled_dot_product_attention`` calls (``_attention.py``)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.harness import act, attach, finish, fit, make_batches, observe_against_twin, series
from tests.harness.scenarios import assert_same_telemetry, written_series
from torchinstruments import _attention, remove_observer
from torchinstruments._attention import ATTENTION_LOGITS_PATH, dense_logits_block, logits_block

LOGITS = act("attention", path=ATTENTION_LOGITS_PATH)


class Attention(nn.Module):
    """Causal self-attention over 8 features read as 4 positions of 2 features, 2 heads
    of width 1 (weights are parameters of this module, so it is a leaf and observed)."""

    def __init__(self, *, causal: bool = True, scale: float | None = None) -> None:
        super().__init__()
        self.wq = nn.Parameter(torch.randn(2, 2))
        self.wk = nn.Parameter(torch.randn(2, 2))
        self.wv = nn.Parameter(torch.randn(2, 2))
        self.causal = causal
        self.scale = scale

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        tokens = x.view(x.shape[0], 4, 2)  # (batch, positions, features)
        q = self._heads(tokens, self.wq)
        return q, self._heads(tokens, self.wk), self._heads(tokens, self.wv)

    def _heads(self, tokens: Tensor, w: Tensor) -> Tensor:
        return (tokens @ w).view(tokens.shape[0], 4, 2, 1).transpose(1, 2)  # (B, H, L, 1)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.scale)
        return out.transpose(1, 2).reshape(x.shape[0], 8)


class Net(nn.Module):
    def __init__(self, **options: object) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.attention = Attention(**options)  # type: ignore[arg-type]
        self.out = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.attention(torch.tanh(self.inp(x))))


def _net() -> Net:
    torch.manual_seed(3)
    return Net()


def _expected_rms(attention: Attention, tokens: Tensor, *, causal: bool) -> float:
    """The RMS of the measured block for input ``tokens``, in float64 numpy: queries
    from position 2 on against keys 0..2 under the causal mask, every score otherwise."""
    with torch.no_grad():
        q, k, _ = attention.qkv(tokens)
    factor = 1.0 if attention.scale is None else attention.scale  # width 1: 1/sqrt(1)
    scores = np.einsum("bhle,bhse->bhls", q.double().numpy(), k.double().numpy()) * factor
    if causal:
        scores = scores[:, :, 2:, :3]
    return float(np.sqrt(np.mean(scores**2)))


def test_the_block_without_a_mask_is_every_score() -> None:
    q, k = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 6, 4)
    block = logits_block(q, k)
    assert block is not None
    torch.testing.assert_close(block, q @ k.transpose(-1, -2) / 2.0, rtol=0, atol=1e-6)


def test_under_a_causal_mask_the_block_is_the_last_half_of_queries_against_keys_all_see() -> None:
    q, k = torch.randn(1, 1, 6, 2), torch.randn(1, 1, 6, 2)
    block = logits_block(q, k, is_causal=True, scale=0.5)
    assert block is not None
    assert block.shape == (1, 1, 3, 4)  # queries 3, 4, 5; keys 0..3, all visible to them
    torch.testing.assert_close(block, (q[..., 3:, :] @ k[..., :4, :].transpose(-1, -2)) * 0.5)


def test_a_boolean_mask_keeps_its_true_scores_and_a_float_mask_is_added() -> None:
    q, k = torch.randn(1, 2, 3, 2), torch.randn(1, 2, 4, 2)  # 3 queries, 4 keys
    full = q @ k.transpose(-1, -2) / math.sqrt(2)
    keep = torch.tensor(
        [[True, False, True, True], [True, True, False, False], [False, False, True, True]]
    )
    block = logits_block(q, k, keep)
    assert block is not None
    torch.testing.assert_close(block, full[keep.expand(1, 2, 3, 4)])
    bias = torch.zeros(3, 4).masked_fill(~keep, -math.inf) + 0.25
    added = logits_block(q, k, bias)
    assert added is not None
    torch.testing.assert_close(added, full[keep.expand(1, 2, 3, 4)] + 0.25)
    dense = dense_logits_block(q, k, keep)
    assert dense is not None and dense[1] is not None
    torch.testing.assert_close(dense[0], full)
    assert torch.equal(dense[1], keep.expand(1, 2, 3, 4))


def test_with_a_mask_and_as_many_queries_as_keys_the_block_is_the_causal_one() -> None:
    """Queries 3..5 against keys 0..3 of 6, as with ``is_causal=True``: a causal mask
    keeps all of it, so it gives the scores ``is_causal=True`` gives."""
    q, k = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    by_flag = logits_block(q, k, is_causal=True)
    by_mask = logits_block(q, k, causal)
    assert by_flag is not None and by_mask is not None
    assert by_flag.shape == (2, 2, 3, 4)
    torch.testing.assert_close(by_mask, by_flag.reshape(-1))
    padded = causal.clone()
    padded[:, 0] = False  # the first key masked for every query
    kept = logits_block(q, k, padded)
    assert kept is not None
    torch.testing.assert_close(kept, by_flag[..., 1:].reshape(-1))


def test_the_block_is_bounded_by_thinning_rows_then_queries() -> None:
    q, k = torch.randn(8, 4, 16, 2), torch.randn(8, 4, 16, 2)
    block = logits_block(q, k, max_logits=16 * 16 * 5)
    assert block is not None
    # 32 rows of 256 scores, room for 5 rows: the batch is thinned to 1 of its 8 (4 heads
    # each), the heads are kept.
    assert block.shape == (1, 4, 16, 16)
    torch.testing.assert_close(block, (q[:1] @ k[:1].transpose(-1, -2)) / math.sqrt(2))
    one_row = logits_block(q, k, max_logits=64)
    assert one_row is not None
    assert one_row.shape == (1, 1, 4, 16)  # one row, every 4th query
    torch.testing.assert_close(
        one_row, (q[:1, :1, ::4] @ k[:1, :1].transpose(-1, -2)) / math.sqrt(2)
    )


def test_grouped_query_attention_repeats_the_key_heads() -> None:
    q, k = torch.randn(1, 4, 3, 2), torch.randn(1, 2, 3, 2)
    block = logits_block(q, k, enable_gqa=True)
    assert block is not None
    expanded = k.repeat_interleave(2, dim=1)
    torch.testing.assert_close(block, q @ expanded.transpose(-1, -2) / math.sqrt(2))


@pytest.mark.parametrize(("causal", "scale"), [(True, None), (False, 3.0)])
def test_the_logits_rms_is_the_float64_rms_of_the_block_and_training_is_unchanged(
    tmp_path: Path, causal: bool, scale: float | None
) -> None:
    def factory() -> Net:
        torch.manual_seed(3)
        return Net(causal=causal, scale=scale)

    data = make_batches(3)
    probe = factory()
    expected: list[float] = []
    probe.attention.register_forward_pre_hook(
        lambda module, args: expected.append(_expected_rms(module, args[0], causal=causal))
    )
    fit(probe, data)
    report, _ = observe_against_twin(factory, ["attention"], data, tmp_path)
    row = series(report)[LOGITS]
    assert row["observations"] == 3
    assert row["first"]["value"] == pytest.approx(expected[0], rel=1e-5)
    assert row["latest"]["value"] == pytest.approx(expected[-1], rel=1e-5)


def test_torch_keeps_its_own_function_outside_sampled_forwards(tmp_path: Path) -> None:
    original = F.scaled_dot_product_attention
    model = _net()
    attach(model, tmp_path, sampling=2)
    seen = []

    def probe(module: nn.Module, args: object, output: object) -> None:
        seen.append(F.scaled_dot_product_attention is original)

    handle = model.attention.register_forward_hook(probe)
    for x, y in make_batches(4):
        F.mse_loss(model(x), y).backward()
        assert F.scaled_dot_product_attention is original
    handle.remove()
    report = finish(model, tmp_path)
    assert seen == [False, True, False, True]  # the wrapper only in sampled forwards
    assert F.scaled_dot_product_attention is original
    assert series(report)[LOGITS]["observations"] == 2
    scripted = torch.jit.script(Attention())  # torch's function, as TorchScript knows it
    assert scripted(torch.randn(2, 8)).shape == (2, 8)


def test_a_call_by_a_module_that_is_not_observed_is_counted_not_measured(tmp_path: Path) -> None:
    model = _net()
    attach(model, tmp_path, exclude=["attention"])
    for x, y in make_batches(3):
        F.mse_loss(model(x), y).backward()
    report = finish(model, tmp_path)
    assert not [k for k in series(report) if ATTENTION_LOGITS_PATH in k[3]]
    # Sample 0 is before the parents of modules that never ran are adopted.
    assert report["coverage"]["tensors_skipped"][_attention.NOT_OBSERVED] == 2


def test_an_error_while_measuring_is_counted_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("broken logits")

    monkeypatch.setattr(_attention, "logits_block", broken)
    report, _ = observe_against_twin(_net, [], make_batches(3), tmp_path)
    entries = [e for e in report["errors"] if e["stage"] == "attention_logits"]
    assert entries and entries[0]["count"] == 3
    assert "broken logits" in entries[0]["message"]


@pytest.mark.parametrize("causal", [True, False])
def test_a_compiled_model_measures_the_logits_inside_its_graph(
    tmp_path: Path, causal: bool
) -> None:
    """Compiled whole with ``fullgraph=True`` (no graph break): training as without the
    observer, torch's function back after every sampled forward, and every series, the
    attention logits' among them, equal to those of the same model observed eagerly;
    every traced call is measured."""
    original = F.scaled_dot_product_attention

    def factory() -> Net:
        torch.manual_seed(3)
        return Net(causal=causal)

    model, twin, eager = factory(), factory(), factory()
    attach(eager, tmp_path / "eager", sampling=2)
    for x, y in make_batches(4):
        F.mse_loss(eager(x), y).backward()
    finish(eager, tmp_path / "eager")
    attach(model, tmp_path / "compiled", sampling=2)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled_twin = torch.compile(twin, backend="aot_eager", fullgraph=True)
    for x, y in make_batches(4):
        losses = []
        for m in (compiled, compiled_twin):
            loss = F.mse_loss(m(x), y)
            loss.backward()
            losses.append(loss.item())
        assert losses[0] == losses[1]
        assert F.scaled_dot_product_attention is original
    report = finish(model, tmp_path / "compiled")
    assert series(report)[LOGITS]["observations"] == 2
    assert report["coverage"]["compiled_capture"]["attention_calls_not_measured"] == 0
    assert report["errors"] == []
    eager_series = written_series(tmp_path / "eager")
    assert {key[3] for key in eager_series if key[0] == "attention"} == {
        "output",
        ATTENTION_LOGITS_PATH,
    }
    assert_same_telemetry(eager_series, written_series(tmp_path / "compiled"))


def test_a_wrong_attention_scale_heads_the_report_as_a_step_of_the_logits(tmp_path: Path) -> None:
    # The scale goes from 1/sqrt(1) to 8 at step 40: the logits step 8x, the attention
    # output (a weighted mean of the values) moves far less.
    model = _net()
    expected: list[float] = []
    model.attention.register_forward_pre_hook(
        lambda module, args: expected.append(_expected_rms(module, args[0], causal=True))
    )
    attach(model, tmp_path)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, (x, y) in enumerate(make_batches(60)):
        if step == 40:
            model.attention.scale = 8.0
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    report = finish(model, tmp_path)
    first = next(f for f in report["findings"] if f["notable"])
    assert (first["module"], first["tensor_path"]) == ("attention", ATTENTION_LOGITS_PATH)
    assert first["category"] in ("activation_scale_drift", "regime_change")
    assert first["change_sample"] == 40
    assert f"(call 0, `{ATTENTION_LOGITS_PATH}`, activation.rms)" in report["summary"]["headline"]
    event = next(e for e in report["events"] if e["id"] == first["event"])
    values = {p[0]: p[2] for p in event["history"]["points"]}
    assert values[39] == pytest.approx(expected[39], rel=1e-5)
    assert values[40] == pytest.approx(expected[40], rel=1e-5)  # with the scale of 8
    assert "scale passed to scaled_dot_product_attention" in event["next_experiment"]
    markdown = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert f"activation.rms, `{ATTENTION_LOGITS_PATH}`, sample 40" in markdown


def test_attention_logits_false_leaves_torch_untouched(tmp_path: Path) -> None:
    original = F.scaled_dot_product_attention
    model = _net()
    attach(model, tmp_path, attention_logits=False)
    seen = []
    model.attention.register_forward_hook(
        lambda module, args, output: seen.append(F.scaled_dot_product_attention is original)
    )
    for x, y in make_batches(3):
        F.mse_loss(model(x), y).backward()
    report = finish(model, tmp_path)
    assert seen == [True, True, True]
    assert not [k for k in series(report) if ATTENTION_LOGITS_PATH in k[3]]
    assert report["config"]["attention_logits"] is False


def test_no_block_is_larger_than_the_bound() -> None:
    def count(batch: int, heads: int, length: int, keys: int, causal: bool) -> int:
        q = torch.empty(batch, heads, length, 8, device="meta")
        k = torch.empty(batch, heads, keys, 8, device="meta")
        block = logits_block(q, k, is_causal=causal)
        assert block is not None
        return block.numel()

    assert count(2, 8, 4096, 4096, True) <= _attention.MAX_LOGITS
    assert count(1, 8, 1, 100_000, False) <= _attention.MAX_LOGITS  # one query, long cache
    assert count(1, 1, 183, 5000, False) <= _attention.MAX_LOGITS
    assert count(16, 4, 32, 32, True) == 16 * 4 * 16 * 17  # small enough: whole


def test_masks_of_the_most_negative_float_mask_out_and_nan_scores_stay() -> None:
    q = torch.ones(1, 2, 4, 4)
    q[:, 1] = float("nan")
    keep = torch.ones(4, 4, dtype=torch.bool).tril()
    keep[3, 0] = False
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        mask = torch.zeros(4, 4, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
        block = logits_block(q, q, mask)
        assert block is not None
        # Queries 2 and 3 against keys 0..2: 3 + 2 kept scores in each head.
        assert block.numel() == 2 * 5
        assert torch.isnan(block).sum() == 5  # the diverged head's scores are kept
        assert block[torch.isfinite(block)].tolist() == [2.0] * 5


def test_a_mask_with_more_batch_dimensions_than_the_query_broadcasts() -> None:
    q = torch.randn(8, 6, 2)
    block = logits_block(q, q, torch.zeros(1, 1, 6, 6))
    assert block is not None
    # (1, 8) rows; queries 3..5 against keys 0..3 (a mask, as many queries as keys)
    expected = (q @ q.transpose(-1, -2) / math.sqrt(2))[:, 3:, :4]
    torch.testing.assert_close(block, expected.reshape(-1))


def test_an_interrupted_sampled_forward_gives_torch_its_function_back(tmp_path: Path) -> None:
    original = F.scaled_dot_product_attention

    class Interrupted(Net):
        interrupt = True

        def forward(self, x: Tensor) -> Tensor:
            out = super().forward(x)
            if self.interrupt:
                raise KeyboardInterrupt  # skips even the always-called post-hook
            return out

    model = Interrupted()
    attach(model, tmp_path)
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(2, 8))
    # Scripting works even now, before any other forward: TorchScript knows the wrapper.
    assert torch.jit.script(Attention())(torch.randn(2, 8)).shape == (2, 8)
    model.interrupt = False
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 8))  # the next root forward (an evaluation) closes it
    assert F.scaled_dot_product_attention is original
    remove_observer(model)


class ContainerAttention(nn.Module):
    """Attention whose children all run (as Llama's): observed only as the caller."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        q = self.q(x).view(x.shape[0], 4, 2, 1).transpose(1, 2)
        k = self.k(x).view(x.shape[0], 4, 2, 1).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, k).transpose(1, 2).reshape(x.shape[0], 8)


def test_a_module_that_calls_attention_is_observed_from_the_second_sample(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), ContainerAttention(), nn.Linear(8, 1))
    teacher = [ContainerAttention()]  # another model's attention, called inside the forward

    class Student(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = model

        def forward(self, x: Tensor) -> Tensor:
            with torch.no_grad():
                teacher[0](x)
            return self.body(x)

    student = Student()
    attach(student, tmp_path)
    for x, y in make_batches(4):
        F.mse_loss(student(x), y).backward()
    report = finish(student, tmp_path)
    assert report["coverage"]["attention_modules_observed"] == ["body.1"]
    assert series(report)[act("body.1", path=ATTENTION_LOGITS_PATH)]["observations"] == 3
    assert series(report)[act("body.1")]["observations"] == 3  # its output too
    # The teacher's calls are counted from the second sample on (3 samples).
    assert report["coverage"]["tensors_skipped"][_attention.NOT_OBSERVED] == 3
