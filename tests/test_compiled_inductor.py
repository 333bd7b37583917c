"""``torch.compile`` with inductor, which compiles C++ kernels on the CPU: minutes per
model on a 2-core machine, so skipped unless asked for::

    TORCHINSTRUMENTS_INDUCTOR_TESTS=1 uv run pytest tests/test_compiled_inductor.py -q

The same checks run with the ``aot_eager`` backend in ``tests/test_compiled.py``.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import cast

import pytest
import torch
from torch import Tensor, nn

from tests.harness import read_report
from tests.harness.scenarios import (
    assert_identical_training,
    assert_same_telemetry,
    example_batches,
    example_model,
    fit_classifier,
    written_series,
)
from torchinstruments import inject_observer, remove_observer
from torchinstruments.series import ATTENTION_LOGITS_PATH

pytestmark = pytest.mark.skipif(
    os.environ.get("TORCHINSTRUMENTS_INDUCTOR_TESTS") != "1",
    reason="inductor compiles slowly; set TORCHINSTRUMENTS_INDUCTOR_TESTS=1 to run",
)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_example_model_under_inductor(tmp_path: Path, fullgraph: bool) -> None:
    """Inductor: training bit-identical to the compiled model without the observer, and
    all 28 series equal to the eager path's within 1e-5."""
    base = example_model()
    eager, observed, twin = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    data = example_batches(6)
    inject_observer(eager, output_dir=tmp_path / "eager", sampling=1)
    fit_classifier(eager, data)
    remove_observer(eager)
    inject_observer(observed, output_dir=tmp_path / "compiled", sampling=1)
    compiled = torch.compile(observed, backend="inductor", fullgraph=fullgraph)
    losses = fit_classifier(cast(nn.Module, compiled), data)
    remove_observer(observed)
    plain = torch.compile(twin, backend="inductor", fullgraph=fullgraph)
    twin_losses = fit_classifier(cast(nn.Module, plain), data)
    assert_identical_training(observed, twin, losses, twin_losses)
    assert_same_telemetry(written_series(tmp_path / "eager"), written_series(tmp_path / "compiled"))


def gpt2_fit(model: nn.Module, batches: list[Tensor]) -> list[Tensor]:
    """Next-token cross-entropy on the logits (the loss outside the compiled model)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for ids in batches:
        optimizer.zero_grad()
        logits = model(input_ids=ids).logits
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
    return losses


def test_gpt2_under_inductor_fullgraph(tmp_path: Path) -> None:
    """A two-block GPT-2 from a config (dropout off: compiled code draws its random
    numbers differently from eager code), ``fullgraph=True``: bit-identical losses,
    parameters equal to float32 rounding, every series of the eager path, the attention
    logits among them (``transformers`` passes a causal mask under ``torch.compile`` and
    ``is_causal=True`` eagerly: the same scores are measured), and its scale metrics on
    the same batches."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    base = transformers.GPT2LMHeadModel(config)
    eager, observed, twin = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, 16), generator=generator) for _ in range(4)]
    inject_observer(eager, output_dir=tmp_path / "eager", sampling=1)
    gpt2_fit(eager, batches)
    remove_observer(eager)
    inject_observer(observed, output_dir=tmp_path / "compiled", sampling=1)
    losses = gpt2_fit(
        cast(nn.Module, torch.compile(observed, backend="inductor", fullgraph=True)), batches
    )
    remove_observer(observed)
    twin_losses = gpt2_fit(
        cast(nn.Module, torch.compile(twin, backend="inductor", fullgraph=True)), batches
    )
    # Under inductor the observed graph fuses differently: the losses stay bit-identical,
    # the tied embedding's gradient (the sum of its two uses) may be rounded otherwise.
    assert all(torch.equal(a, b) for a, b in zip(losses, twin_losses, strict=True))
    mine, theirs = observed.state_dict(), twin.state_dict()
    for name in mine:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-7)
    eager_series = written_series(tmp_path / "eager")
    compiled_series = written_series(tmp_path / "compiled")
    # The attention modules, observed because they call scaled_dot_product_attention,
    # get their hooks after the first sample: its graph measures no logits (two calls
    # counted), the next one does.
    logits = {key for key in eager_series if key[3] == ATTENTION_LOGITS_PATH}
    assert {key[0] for key in logits} == {"transformer.h.0.attn", "transformer.h.1.attn"}
    # A dropout of p=0 returns its input itself: that output is not tapped in graphs (a
    # copy would no longer be the input), so its output gradient is eager-only.
    same_tensor = {
        key
        for key in eager_series
        if key[2] == "grad_output"
        and key[0] != "<root>"
        and isinstance(observed.get_submodule(key[0]), nn.Dropout)
    }
    assert {key[0] for key in same_tensor} == {
        "transformer.drop",
        "transformer.h.0.attn.resid_dropout",
        "transformer.h.0.mlp.dropout",
        "transformer.h.1.attn.resid_dropout",
        "transformer.h.1.mlp.dropout",
    }
    assert sorted(compiled_series) == sorted(set(eager_series) - same_tensor)
    coverage = read_report(tmp_path / "compiled")["coverage"]["compiled_capture"]
    assert coverage["gradients_not_captured"] >= len({key[0] for key in same_tensor})
    assert coverage["attention_calls_not_measured"] == 2
    # Inductor's kernels compute GPT-2's values (its gradients above all) in another
    # order than eager kernels: scale metrics agree to float32 rounding, while counts of
    # exact zeros (and the kurtosis of near-zero gradients) may not.
    scale = {
        k: v
        for k, v in eager_series.items()
        if k[4] in ("rms", "mean_abs", "max_abs") and k not in same_tensor
    }
    adopted = {"transformer.h.0.attn", "transformer.h.1.attn"}
    assert all(scale[k][0][0] == 1 for k in scale if k[0] in adopted)  # from the second
    assert_same_telemetry(scale, {k: compiled_series[k] for k in scale}, rel=1e-3)
