"""Events: one change written once, pass-throughs as one series, a dense history, the
cross-section in index.md, advice that fits the shape and the module, stopped modules."""

from __future__ import annotations

import copy
import gc
import itertools
import json
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import nn

from tests.harness import event_of, read_report
from torchinstruments import TrackConfig, inject_observer, remove_observer
from torchinstruments.events import module_kind


class Gate(nn.Module):
    """Runs ``inner`` until ``skip`` is set, then passes its input through."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.skip else self.inner(x)


def stepped_run(
    directory: Path, *, sampling: int = 1, steps: int = 90, drop: bool = False
) -> dict[str, Any]:
    """Linear, Linear, Identity, Tanh, Linear; the second Linear's weight x4 at step 60.
    The Identity returns the second Linear's tensor, the root the last Linear's. With
    ``drop`` the model is not removed but dropped in a reference cycle and collected."""
    torch.manual_seed(0)
    faulty = nn.Linear(16, 16)
    model = nn.Sequential(nn.Linear(8, 16), faulty, nn.Identity(), nn.Tanh(), nn.Linear(16, 1))
    inject_observer(
        model,
        output_dir=directory,
        sampling=sampling,
        track_config=TrackConfig(history_points=8),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        if step == 60:
            with torch.no_grad():
                faulty.weight.mul_(4.0)
        optimizer.zero_grad()
        model(torch.randn(32, 8, generator=generator)).pow(2).mean().backward()
        optimizer.step()
    if drop:
        model.myself = [model]  # type: ignore[assignment]
        del model, faulty, optimizer
        gc.collect()
    else:
        remove_observer(model)
    return read_report(directory)


@pytest.fixture(scope="module")
def stepped(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    directory = tmp_path_factory.mktemp("stepped")
    return stepped_run(directory, sampling=2, steps=180), directory


def test_one_step_is_one_event_that_its_findings_refer_to(
    stepped: tuple[dict[str, Any], Path],
) -> None:
    report, _ = stepped
    notable = [f for f in report["findings"] if f["notable"]]
    activation = [f for f in notable if f["signal"] == "activation"]
    assert {f["category"] for f in activation} >= {"activation_scale_drift", "regime_change"}
    assert {f["event"] for f in activation} == {"E1"}
    (event,) = [e for e in report["events"] if e["id"] == "E1"]
    assert (event["module"], event["shape"], event["module_kind"]) == ("1", "step", "Linear")
    assert event["onset"] == {"sample": 30, "forward": 60, "after_forward": 58}  # sampling=2
    assert {f["category"] for f in event["findings"]} >= {
        "activation_scale_drift",
        "regime_change",
    }
    assert event["change"]["ratio"] == pytest.approx(4.0, rel=0.15)
    # Written once: findings carry no texts, histories or evidence of their own.
    for finding in report["findings"]:
        assert not {"interpretation", "next_experiment", "history"} & set(finding)
    ids = [e["id"] for e in report["events"]]
    assert ids == [f"E{n}" for n in range(1, len(ids) + 1)]
    referred = {f["event"] for f in notable}
    assert referred == set(ids)
    # Every event has its echoes, an empty list when nothing echoed.
    assert all(isinstance(e["echoes"], list) for e in report["events"])


def test_a_pass_through_is_one_series_named_by_all(stepped: tuple[dict[str, Any], Path]) -> None:
    report, _ = stepped
    event = event_of(report, next(f for f in report["findings"] if f["event"] == "E1"))
    assert event["also_named"] == ["2"]  # the Identity returns module 1's tensor
    notable = [f for f in report["findings"] if f["notable"]]
    assert "2" not in {f["module"] for f in notable}  # one tensor, named once
    rows = [f for f in report["findings"] if not f["notable"]]
    for row in rows:  # compact rows name each series, and the others of its tensor
        if row["module"] == "2":
            assert row["also_named"] == ["1"]
        if row["module"] == "<root>":
            assert row["also_named"] == ["4"]
    echoes = {e["module"] for e in event["echoes"]}
    assert "2" not in echoes and "<root>" not in echoes
    assert [r["module"] for r in event["cross_section"]["rows"]] == ["0", "1", "3", "4"]
    assert [r["offset"] for r in event["cross_section"]["rows"]] == [-1, 0, 1, 2]


def test_history_is_dense_around_the_change_and_carries_the_forward(
    stepped: tuple[dict[str, Any], Path],
) -> None:
    report, _ = stepped
    event = report["events"][0]
    history = event["history"]
    assert history["columns"] == ["sample", "forward", "value"]
    samples = [p[0] for p in history["points"]]
    # Every observed sample from three before to three after the change's first sample,
    # though the tracker keeps only 8 history points (a stride of 16 samples by now).
    assert set(range(27, 34)) <= set(samples)
    assert samples == sorted(samples) and samples[0] == 0 and samples[-1] == 89
    assert all(forward == 2 * sample for sample, forward, _ in history["points"])
    before = next(p for p in history["points"] if p[0] == 29)[2]
    after = next(p for p in history["points"] if p[0] == 30)[2]
    assert after / before == pytest.approx(4.0, rel=0.15)


def test_index_md_shows_the_event_with_its_cross_section(
    stepped: tuple[dict[str, Any], Path],
) -> None:
    report, directory = stepped
    index = (directory / "index.md").read_text(encoding="utf-8")
    assert "### E1: step at `1` (call 0), a Linear, activation.rms, sample 30" in index
    assert "| offset | module | call | before | after | ratio | in spreads |" in index
    assert "| 0 | `1` | 0 |" in index
    assert "Around the onset, sample (forward): value: 27 (forward 54)" in index
    assert json.dumps(report["events"][0]["interpretation"])[1:40] in json.dumps(index)


def test_advice_fits_a_step_at_a_linear(stepped: tuple[dict[str, Any], Path]) -> None:
    report, _ = stepped
    event = report["events"][0]
    text, experiment = event["interpretation"], event["next_experiment"]
    assert "moved 3.5" in text and "above its" in text and "trend at sample 30" in text
    assert "The value itself rose from" in text
    assert "weight" in experiment and "normalization" not in experiment
    assert "learning rate" not in experiment


class ScaledBeforeIdentity(nn.Module):
    """Linear, then ``scale`` applied in this module's own forward, then an Identity
    (as timm's ``ls2`` after a block's MLP): the scale is seen first at the Identity."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.ident = nn.Linear(16, 16), nn.Identity()
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ident(self.fc(x) * self.scale)


def test_advice_for_a_step_first_seen_at_an_identity(tmp_path: Path) -> None:
    """A step that begins between a Linear and the Identity after it, in code no
    observed module covers: the advice says the Identity passes its input on and asks
    to observe its parent (it gave dropout advice: "check its probability"), and the
    heading reads "an Identity"."""
    torch.manual_seed(0)
    middle = ScaledBeforeIdentity()
    model = nn.Sequential(nn.Linear(8, 16), middle, nn.Tanh(), nn.Linear(16, 1))
    inject_observer(model, output_dir=tmp_path, sampling=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    for step in range(180):
        middle.scale = 8.0 if step >= 60 else 1.0
        optimizer.zero_grad()
        model(torch.randn(32, 8, generator=generator)).pow(2).mean().backward()
        optimizer.step()
    remove_observer(model)
    report = read_report(tmp_path)
    event = report["events"][0]
    described = (event["module"], event["module_kind"], event["shape"])
    assert described == ("1.ident", "Identity", "step")
    experiment = event["next_experiment"]
    assert experiment.startswith(
        "1.ident is an Identity, which returns its input unchanged: the change happened "
        "between the module before it (1.fc) and here"
    )
    assert "Observe 1.ident's parent too" in experiment and "probability" not in experiment
    index = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert "### E1: step at `1.ident` (call 0), an Identity, activation.rms" in index


def test_module_kinds() -> None:
    assert [module_kind(k) for k in ("Linear", "Conv2d", "LayerNorm", "BatchNorm1d")] == [
        "weighted",
        "weighted",
        "normalization",
        "normalization",
    ]
    assert [module_kind(k) for k in ("ReLU", "Dropout", "Sequential", None)] == [
        "nonlinearity",
        "pass_through",
        "block",
        "block",
    ]


def gated_run(directory: Path, model: nn.Module, gate: Gate) -> dict[str, Any]:
    """Train ``model`` 90 steps observed at every forward, ``gate`` skipping its module
    from step 60 on; return the report."""
    inject_observer(model, output_dir=directory, sampling=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    for step in range(90):
        gate.skip = step >= 60
        optimizer.zero_grad()
        (model(torch.randn(32, 8, generator=generator) * 5).pow(2).mean() * 1e-2).backward()
        optimizer.step()
    remove_observer(model)
    return read_report(directory)


def test_a_module_that_stops_being_called_is_named_and_explains_the_step(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    gate = Gate(nn.LayerNorm(16))
    model = nn.Sequential(nn.Linear(8, 16), gate, nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    report = gated_run(tmp_path, model, gate)
    assert report["coverage"]["modules_stopped"] == [
        {"module": "1.inner", "call_index": 0, "last_sample": 59, "last_forward": 59}
    ]
    headline = report["summary"]["headline"]
    assert "1 module(s) stopped being called: `1.inner` (call 0) last ran at sample 59" in headline
    index = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert "Stopped being called: `1.inner` after sample 59 (forward 59)." in index
    event = next(e for e in report["events"] if e["signal"] == "activation")
    assert event["onset"]["sample"] == 60
    assert "1.inner (call 0) stopped being called after sample 59" in event["interpretation"]
    assert event["next_experiment"].startswith("Check why 1.inner no longer runs")


def test_a_module_that_stops_being_called_explains_a_gradient_step_too(tmp_path: Path) -> None:
    # A ReLU bypassed from step 60: the gradient reaching the Linear before it stops
    # being zero where the ReLU had cut it, and the advice names the ReLU, not the
    # modules after the Linear.
    torch.manual_seed(0)
    gate = Gate(nn.ReLU())
    model = nn.Sequential(nn.Linear(8, 16), gate, nn.Linear(16, 1))
    report = gated_run(tmp_path, model, gate)
    (event,) = report["events"]
    assert (event["signal"], event["module"], event["onset"]["sample"]) == ("grad_output", "0", 60)
    assert "1.inner (call 0) stopped being called after sample 59" in event["interpretation"]
    assert event["next_experiment"].startswith("Check why 1.inner no longer runs")


def test_a_weight_that_compounds_is_a_bend_with_advice_for_a_slow_cause(tmp_path: Path) -> None:
    """The second Linear's weight grows 4% a step from step 60 on: its output leaves a
    settled course for a steep one (no step between two samples). The event is a bend,
    told as a break of trend, and its next experiment asks for the weight and update
    norms from the bend on, not for one checkpoint pair around a step."""
    torch.manual_seed(0)
    growing = nn.Linear(16, 16)
    model = nn.Sequential(nn.Linear(8, 16), growing, nn.Tanh(), nn.Linear(16, 1))
    inject_observer(model, output_dir=tmp_path, sampling=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    for step in range(120):
        if step >= 60:
            with torch.no_grad():
                growing.weight.mul_(1.04)
        optimizer.zero_grad()
        model(torch.randn(32, 8, generator=generator)).pow(2).mean().backward()
        optimizer.step()
    remove_observer(model)
    event = read_report(tmp_path)["events"][0]
    assert (event["module"], event["shape"]) == ("1", "bend")
    assert event["interpretation"].startswith("1 (call 0, output) activation.rms began to rise")
    assert "bends instead of stepping" in event["next_experiment"]
    assert "weights: log their norm" in event["next_experiment"]


def test_echoes_carry_their_values_around_their_onset(
    stepped: tuple[dict[str, Any], Path],
) -> None:
    report, _ = stepped
    event = report["events"][0]
    assert event["echoes"], event
    for echo in event["echoes"]:
        history = echo["history"]
        samples = [p[0] for p in history["points"]]
        assert history["metric"] == ("rms" if echo["signal"] == "activation" else "rms_to_root")
        assert samples == sorted(samples) and len(samples) >= 2
        assert all(abs(s - echo["onset_sample"]) <= 3 for s in samples)


def test_the_onset_brackets_the_change_between_two_samples(
    stepped: tuple[dict[str, Any], Path],
) -> None:
    report, directory = stepped
    onset = report["events"][0]["onset"]
    # sampling=2: sample 30 is training forward 60, the sample before it forward 58.
    assert onset == {"sample": 30, "forward": 60, "after_forward": 58}
    index = (directory / "index.md").read_text(encoding="utf-8")
    assert "sample 30, training forward 60 (after forward 58, the sample before)" in index


def test_the_cross_section_row_of_the_module_states_the_event_numbers(tmp_path: Path) -> None:
    """60 samples after the step, its sample is no longer among the latest values the
    trackers keep: the module's own row still states the event's numbers (its
    neighbours' rows compare the kept points around the onset)."""
    report = stepped_run(tmp_path, sampling=1, steps=120)
    event = report["events"][0]
    (own,) = [row for row in event["cross_section"]["rows"] if row["offset"] == 0]
    change = event["change"]
    assert own["measured"] == "against_trend"
    assert (own["before"], own["after"]) == (change["trend_forecast"], change["value"])
    assert own["ratio"] == pytest.approx(change["ratio"], rel=1e-5)
    assert own["in_spreads"] == pytest.approx(change["in_residual_spreads"], rel=1e-5)


def test_a_module_whose_output_turned_non_finite_has_not_stopped(tmp_path: Path) -> None:
    """A NaN input at step 40 poisons the weights through the optimizer step: from then
    on every output is entirely non-finite. The modules keep running (their rms is
    undefined, their nonfinite_fraction is 1), so none is listed as stopped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inject_observer(model, output_dir=tmp_path, sampling=1)
    for step in range(90):
        x = torch.randn(32, 8)
        if step == 40:
            x[0, 0] = float("nan")
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    remove_observer(model)
    report = read_report(tmp_path)
    assert report["coverage"]["modules_stopped"] == []
    assert any(e["shape"] == "non_finite" for e in report["events"])


def test_index_names_an_echo_s_call_when_it_is_not_the_first(
    stepped: tuple[dict[str, Any], Path],
) -> None:
    from torchinstruments.report import render_markdown

    report = copy.deepcopy(stepped[0])
    event = report["events"][0]
    event["echoes"] = [
        {**event["echoes"][0], "module": "block.relu", "call_index": 1},
        {**event["echoes"][0], "module": "block.fc", "call_index": 0},
    ]
    index = render_markdown(report)
    assert (
        "Echoes (moved with it, at its sample, in its signal and tensor path unless others "
        "are given; not listed separately): "
    ) in index
    assert "`block.relu (call 1)`, `block.fc`." in index
    # An echo whose change began at another sample, or in another signal, says which.
    event["echoes"][1]["onset_sample"] = event["onset"]["sample"] + 1
    event["echoes"][0]["signal"] = "grad_output"
    index = render_markdown(report)
    later = event["onset"]["sample"] + 1
    assert f"`block.relu (call 1)` (grad_output), `block.fc` (from sample {later})." in index
    # An echo in another tensor path (attention logits of the module) names it.
    event["echoes"][1]["tensor_path"] = "attention_logits"
    index = render_markdown(report)
    assert f"`block.fc` (`attention_logits`, from sample {later})." in index
    # A change on a young reference says why it may be listed after later ones.
    line = "- Young reference: the change came while its series had fewer than"
    event["young_reference"] = True
    assert line in render_markdown(report)
    event["young_reference"] = False
    assert line not in render_markdown(report)


def test_a_cross_section_of_differences_is_headed_so(
    stepped: tuple[dict[str, Any], Path],
) -> None:
    """Fractions and kurtosis are compared by difference: the column says so."""
    from torchinstruments.report import render_markdown

    report = copy.deepcopy(stepped[0])
    rows = report["events"][0]["cross_section"]["rows"]
    for row in rows:
        row["difference"] = row.pop("ratio")
    index = render_markdown(report)
    header = "| offset | module | call | before | after | {} | in spreads |"
    assert header.format("difference") in index
    others = [e for e in report["events"][1:] if (e.get("cross_section") or {}).get("rows")]
    assert index.count(header.format("ratio")) == len(others)


def test_the_headline_counts_stopped_modules_once_whatever_their_calls() -> None:
    from torchinstruments.report import _stopped_text

    one_module_two_calls = [
        {"module": "a", "call_index": 0, "last_sample": 5, "last_forward": 50},
        {"module": "a", "call_index": 1, "last_sample": 5, "last_forward": 50},
    ]
    assert _stopped_text(one_module_two_calls) == (
        " 1 module(s) (2 calls) stopped being called: `a` (call 0) last ran at sample 5, "
        "training forward 50 and 1 more call(s)."
    )
    two_modules = [one_module_two_calls[0], {**one_module_two_calls[1], "module": "b"}]
    assert _stopped_text(two_modules) == (
        " 2 module(s) stopped being called: `a` (call 0) last ran at sample 5, "
        "training forward 50 and 1 more call(s)."
    )
    assert _stopped_text([]) == ""
    assert _stopped_text(two_modules, ["a"]).endswith(
        "and 1 more call(s). `a` was replaced in the model by another module object, which "
        "is not observed: check what took its place and when."
    )


def test_the_input_that_moved_too_is_checked_first() -> None:
    from torchinstruments._event_texts import _input_experiment

    row = {"offset": -1, "module": "h.2.ln_2", "ratio": 1.5, "in_spreads": 23.35}
    assert _input_experiment(row, "h.2.mlp.c_fc", "rms", "sample 34") == (
        "Its input moved at the same samples (h.2.ln_2: 1.5x, 23.35 residual spreads): "
        "check h.2.ln_2 first (removed, bypassed, re-initialized, rescaled or switched "
        "between train and eval at sample 34), then h.2.mlp.c_fc itself; restore one at "
        "a time and check whether h.2.mlp.c_fc's rms returns to its trend."
    )
    # A move below 3 residual spreads, or an unknown input, leaves the module's own advice.
    assert _input_experiment({**row, "in_spreads": -2.9}, "c_fc", "rms", "sample 34") is None
    assert _input_experiment(None, "c_fc", "rms", "sample 34") is None


def test_echoes_before_the_lead_are_counted_apart_and_the_largest_named() -> None:
    from types import SimpleNamespace

    from torchinstruments._event_texts import _echoes_text

    def candidate(
        module: str, position: int, step_z: float, signal: str = "activation", onset: int = 30
    ) -> Any:
        series = SimpleNamespace(module=module, call_index=0, signal=signal)
        return SimpleNamespace(
            series=series,
            position=position,
            change=SimpleNamespace(step_z=step_z),
            echoes=[],
            onset=onset,
        )

    lead = candidate("c_fc", 5, 51.7)
    lead.echoes = [candidate("ln_2", 4, -23.35), candidate("attn", 2, 4.0)]
    lead.echoes += [candidate("act", 6, 30.0), candidate("c_proj", 7, 9.0)]
    event = cast(Any, SimpleNamespace(facets=[SimpleNamespace(candidate=lead)]))
    assert _echoes_text(event, lead) == (
        " 2 module(s) after it in propagation order moved at the same samples. 2 module(s) "
        "before it in propagation order moved at the same samples too (the largest step: "
        "ln_2, 23.35 residual spreads); the change may begin there."
    )
    # Output gradients propagate backwards: a larger forward position is before.
    gradient = candidate("c_fc", 5, 8.0, "grad_output")
    gradient.echoes = [candidate("c_proj", 7, 5.0, "grad_output")]
    event = cast(Any, SimpleNamespace(facets=[SimpleNamespace(candidate=gradient)]))
    assert _echoes_text(event, gradient) == (
        " 1 module(s) before it in propagation order moved at the same samples too (the "
        "largest step: c_proj, 5 residual spreads); the change may begin there."
    )
    # Upstream modules that moved only at a later sample did not begin it: the updates
    # after the change carried it back (a Linear before a weight scaled between samples).
    head = candidate("head", 9, 20.5)
    head.echoes = [candidate("fc1", 5, 26.5, onset=31), candidate("act", 6, 25.1, onset=31)]
    head.echoes += [candidate("extra", 10, 21.8), candidate("out", 11, 19.8, onset=32)]
    event = cast(Any, SimpleNamespace(facets=[SimpleNamespace(candidate=head)]))
    assert _echoes_text(event, head) == (
        " 2 module(s) after it in propagation order moved at the same sample or up to 2 "
        "later. 2 module(s) before it in propagation order moved only from sample 31 on "
        "(the largest step: fc1, 26.5 residual spreads), after this change: the updates "
        "that followed it carried it back."
    )


def test_a_gradient_step_whose_later_modules_held_is_at_the_module_itself() -> None:
    from torchinstruments._event_texts import _gradient_experiment

    held = [
        {"offset": -1, "module": "attn", "in_spreads": 9.0},
        {"offset": 0, "module": "ln_2", "in_spreads": 40.0},
        {"offset": 1, "module": "c_fc", "in_spreads": 1.2},
        {"offset": 2, "module": "act", "in_spreads": -2.5},
    ]
    # The gradient reaching ln_2 passes c_fc's weights: a c_fc weight scaled there moves
    # ln_2's output gradient while c_fc's own holds (a fresh user's ReLU MLP, a Linear
    # x10: the gradient event named only the ReLU before it).
    assert _gradient_experiment(held, "ln_2", "sample 34") == (
        "The gradient reaching ln_2 changed at sample 34 while those of the modules after "
        "it in forward order held (c_fc, act within 3 residual spreads): the change is "
        "between them, at ln_2 itself, whose output now takes another path back (its "
        "forward bypassed or replaced, its output changed in place, detached or "
        "rerouted), or in the weights of c_fc, which the gradient passes from c_fc's "
        "output to ln_2's (scaled or replaced; an event at c_fc at the same sample says "
        "so). Check c_fc's weights and ln_2's forward at sample 34."
    )
    moved = [*held[:3], {**held[3], "in_spreads": 3.0}]
    assert _gradient_experiment(moved, "ln_2", "sample 34").startswith(
        "The gradient reaching ln_2 changed at sample 34 while the loss gradient did not "
        "account for it: something after ln_2 in forward order changed its backward."
    )
    # The last observed module in forward order: its gradient comes from the loss.
    last = [{"offset": -1, "module": "attn", "in_spreads": 0.6}, held[1]]
    assert _gradient_experiment(last, "ln_2", "sample 34").startswith(
        "The gradient reaching ln_2 changed at sample 34, and no observed module runs after "
        "ln_2 in forward order: its gradient comes from the loss. Check the loss around "
        "sample 34"
    )
    assert _gradient_experiment(None, "ln_2", "sample 34").startswith(
        "The gradient reaching ln_2 changed at sample 34 while the loss gradient did not"
    )


def test_an_event_is_led_by_its_most_upstream_facet() -> None:
    from types import SimpleNamespace

    from torchinstruments._event_groups import Event, _lead_from_upstream

    def facet(
        category: str,
        module: str,
        position: int,
        onset: int,
        signal: str,
        kind: str = "step",
        departed: dict[int, float] | None = None,
    ) -> Any:
        """``departed``: the series' departure from its trend (in spreads) by sample."""
        series = SimpleNamespace(module=module, call_index=0, signal=signal)
        departures = departed or {}

        def departure_at(sample: int) -> Any:
            z = departures.get(sample)
            return None if z is None else SimpleNamespace(z=z)

        candidate = SimpleNamespace(
            series=series,
            position=position,
            onset=onset,
            model_wide=None,
            change=SimpleNamespace(kind=kind),
            judged=SimpleNamespace(departure_at=departure_at),
        )
        return SimpleNamespace(category=category, candidate=candidate)

    kurtosis = facet("heavy_tail_growth", "c_fc", 5, 34, "activation")
    scale = facet("activation_scale_drift", "ln_2", 4, 34, "activation")
    later = facet("regime_change", "attn", 2, 40, "activation")  # 6 samples later
    gradient = facet("gradient_scale_change", "head", 9, 34, "grad_output")
    event = Event(number=1, facets=[kurtosis, scale, later, gradient])
    _lead_from_upstream(event)
    assert [f.candidate.series.module for f in event.facets] == ["ln_2", "c_fc", "attn", "head"]
    # Output gradients: backward order, the largest forward position first.
    first = facet("gradient_scale_change", "fc1", 1, 34, "grad_output")
    event = Event(
        number=1, facets=[first, facet("relative_volatility", "fc2", 3, 33, "grad_output")]
    )
    _lead_from_upstream(event)
    assert [f.candidate.series.module for f in event.facets] == ["fc2", "fc1"]

    def lead(*facets: Any) -> list[str]:
        event = Event(number=1, facets=list(facets))
        _lead_from_upstream(event)
        return [f.candidate.series.module for f in event.facets]

    # A head weight scaled at sample 32: the head steps there; AdamW then bends the
    # course of an upstream activation from sample 33 on. The step leads.
    step = facet("regime_change", "head", 9, 32, "activation")
    bend = facet("activation_scale_drift", "act", 7, 33, "activation", kind="trend")
    assert lead(step, bend) == ["head", "act"]
    assert lead(bend, step) == ["head", "act"]
    # A bend whose corner comes before the step leads it when upstream.
    early_bend = facet("activation_scale_drift", "act", 7, 31, "activation", kind="trend")
    assert lead(step, early_bend) == ["act", "head"]
    # Steps: one sample of slack (a small step may alarm one sample after its echo)
    # where the later step's series had already departed at the earlier sample.
    upstream = facet("heavy_tail_growth", "fc1", 5, 33, "activation", departed={32: -3.5})
    assert lead(step, upstream) == ["fc1", "head"]
    unknown = facet("heavy_tail_growth", "fc1", 5, 33, "activation")  # that value not kept
    assert lead(step, unknown) == ["fc1", "head"]
    # A Linear before a weight scaled between samples steps one sample later, through
    # the larger gradients its update received; at the sample of the fault it held.
    held = facet("regime_change", "fc1", 5, 33, "activation", departed={32: 0.13})
    assert lead(step, held) == ["head", "fc1"]
    two_later = facet("heavy_tail_growth", "fc1", 5, 34, "activation")
    assert lead(step, two_later) == ["head", "fc1"]
    # The earliest step leads however little its value had departed at its own onset
    # (a sustained shift is found over windows: its first value may sit in the noise).
    shift = facet("activation_scale_drift", "head", 9, 32, "activation", departed={32: 0.4})
    assert lead(shift, held) == ["head", "fc1"]
    assert lead(held, shift) == ["head", "fc1"]
    # Only breaks of trend: the most upstream, as before.
    late_bend = facet("heavy_tail_growth", "fc1", 5, 35, "activation", kind="trend")
    assert lead(bend, late_bend) == ["fc1", "act"]


def test_a_scaled_linear_before_a_saturating_tanh_gets_the_weight_advice(tmp_path: Path) -> None:
    """A Linear's weight x10 in a Tanh MLP: its output steps 10x, and the Tanh after it
    saturates, so the Linear's output gradient gains exact zeros (zero_fraction_growth
    of grad_output, a facet of the same event). The advice said "Units at 4 stopped
    firing" and pointed at its input, which the same text says did not move: zeros of
    an output gradient are not units that stopped firing. The Linear's advice is back."""
    from sklearn.datasets import load_digits

    features, targets = load_digits(return_X_y=True)
    x = torch.tensor(features, dtype=torch.float32) / 16
    y = torch.tensor(targets)
    torch.manual_seed(0)
    widths = [64, 96, 96, 96, 64]
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(64, 10))
    inject_observer(model, output_dir=tmp_path, sampling=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    for step in range(600):
        if step == 400:
            with torch.no_grad():
                cast(nn.Linear, model[4]).weight.mul_(10)
        batch = torch.randint(0, len(x), (64,), generator=generator)
        loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    remove_observer(model)
    event = read_report(tmp_path)["events"][0]
    assert (event["module"], event["shape"], event["onset"]["forward"]) == ("4", "step", 400)
    assert "zero_fraction_growth" in {f["category"] for f in event["findings"]}
    assert event["next_experiment"].startswith(
        "4 is a Linear: compare its weight norm just before and just after sample 100"
    )


def test_a_model_collected_while_observed_keeps_its_module_kinds(
    tmp_path: Path, stepped: tuple[dict[str, Any], Path]
) -> None:
    """The final report of a model collected while observed named no module kinds (they
    were read from the live modules): every event lost "a Linear" and its Linear
    advice. They are kept from when the modules were observed."""
    dropped = stepped_run(tmp_path, sampling=2, steps=180, drop=True)
    removed = stepped[0]
    assert dropped["run"]["final"] is True
    assert [e["module_kind"] for e in dropped["events"]] == [
        e["module_kind"] for e in removed["events"]
    ]
    assert dropped["events"][0]["module_kind"] == "Linear"
    assert dropped["events"][0]["next_experiment"] == removed["events"][0]["next_experiment"]
