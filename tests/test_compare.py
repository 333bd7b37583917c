"""compare_runs and ``torchinstruments compare``: first divergence, noise, guards, bounds."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.harness import REPO, ResidualNet, load_example, make_batches, train
from torchinstruments import (
    ConfigError,
    EveryNSampling,
    ReportReadError,
    compare_runs,
    inject_observer,
    remove_observer,
)
from torchinstruments.__main__ import main as cli_main
from torchinstruments._compare_align import _Schedule
from torchinstruments._compare_events import _profile_at_first_difference
from torchinstruments._compare_values import _Event
from torchinstruments._series_file import parse_recorded
from torchinstruments.compare import (
    COMPARISON_SCHEMA,
    noise_floor,
    render_comparison_markdown,
    sustained_departure,
)
from torchinstruments.report import dumps_report
from torchinstruments.sampling import DefaultSampling, SampleForwards

DOCS_EXCERPTS = REPO / "docs" / "excerpts.py"


def read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example("basic_training.py", "basic_training_example")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, example: ModuleType) -> dict[str, Path]:
    """The main example: baseline (seed 0), drop-norm candidate (seed 0), seed 1."""
    root = tmp_path_factory.mktemp("runs")
    arguments = {
        "baseline": ["--seed", "0"],
        "drop_norm": ["--seed", "0", "--modification", "drop-norm"],
        "seed1": ["--seed", "1"],
    }
    out = {}
    for name, extra in arguments.items():
        out[name] = root / name
        assert example.main([*extra, "--steps", "300", "--output-dir", str(out[name])]) == 0
    return out


def small_run(directory: Path, sampling: int | None, steps: int = 80) -> Path:
    torch.manual_seed(0)
    model = ResidualNet()
    inject_observer(model, output_dir=directory, sampling=sampling)
    train(model, make_batches(steps))
    remove_observer(model)
    return directory


# ---------------------------------------------------------------------- the example
def test_dropped_norm_is_the_first_divergence(runs: dict[str, Path], tmp_path: Path) -> None:
    path = compare_runs(runs["baseline"], runs["drop_norm"], tmp_path)
    comparison = read(path)
    assert comparison["schema"] == COMPARISON_SCHEMA
    assert comparison["strength"] == "full" and comparison["mismatches"] == []
    first = comparison["summary"]["first_divergence"]
    # The modification skips blocks.2.norm from training forward 150: the first sample
    # after it (sample 28, forward 154 of the default schedule) is the first where the
    # candidate no longer calls the norm, exactly; blocks.2.fc1's activation, which now
    # receives the un-normalised stream, departs there or at a later compared history
    # point, never before.
    assert first["module"] == "blocks.2.norm"
    assert first["kind"] == "stopped" and first["side"] == "candidate"
    assert first["signal"] == "activation"
    assert (first["sample"], first["forward"]) == (28, 154)
    assert first["last_observed"]["sample"] == 27
    assert "blocks.2.norm" in first["next_experiment"]
    events = comparison["first_divergences"]
    assert events[0] == first
    assert all(e["module"].startswith("blocks.2.") for e in events)
    fc1 = next(e for e in events if e["module"] == "blocks.2.fc1" and e["kind"] == "value")
    assert fc1["signal"] == "activation" and fc1["metric"] == "rms"
    assert fc1["sample"] >= 28 and fc1["last_agreeing"]["sample"] < 28
    assert fc1["candidate"] > 2 * fc1["baseline"]
    leader = comparison["categories"]["activation_scale"]["entries"][0]
    assert leader["module"].startswith("blocks.2.") and leader["notable"]
    # Gradients that diverge notably are those of the modified block (blocks.2.fc1's
    # output gradient moves 10% at the first difference, 1% being the noise there).
    gradients = comparison["categories"]["gradient_scale"]["entries"]
    assert all(e["module"].startswith("blocks.2.") for e in gradients if e["notable"])
    assert comparison["summary"]["headline"].startswith("First divergence at sample 28")
    markdown = (tmp_path / "comparison.md").read_text(encoding="utf-8")
    assert markdown.startswith("# torchinstruments comparison")
    assert "`blocks.2.norm`" in markdown and "Next experiment:" in markdown


def test_different_seeds_give_no_notable_divergence(runs: dict[str, Path], tmp_path: Path) -> None:
    comparison = read(compare_runs(runs["baseline"], runs["seed1"], tmp_path))
    assert comparison["strength"] == "full" and comparison["mismatches"] == []
    assert comparison["summary"]["notable_divergences"] == 0
    assert comparison["summary"]["first_divergence"] is None
    assert comparison["first_divergences"] == []
    assert comparison["summary"]["headline"].startswith("No notable divergence")
    for section in comparison["categories"].values():
        assert section["notable"] == 0
    # The seeds do differ: the comparison ranks them, below the threshold.
    entries = comparison["categories"]["activation_scale"]["entries"]
    assert entries and 0 < entries[0]["sustained_departure"] < comparison["rule"]["threshold"]


def test_run_compared_with_itself(runs: dict[str, Path], tmp_path: Path) -> None:
    comparison = read(compare_runs(runs["baseline"], runs["baseline"], tmp_path))
    assert comparison["mismatches"] == [] and comparison["strength"] == "full"
    assert comparison["summary"]["notable_divergences"] == 0
    assert comparison["first_divergences"] == []
    assert comparison["only_in_baseline"] == [] and comparison["only_in_candidate"] == []
    for section in comparison["categories"].values():
        assert section["entries"] == [] and section["series_compared"] > 0
    assert comparison["notes"] == ["Baseline and candidate are the same directory."]


def test_byte_bound_counts_what_was_cut(runs: dict[str, Path], tmp_path: Path) -> None:
    path = compare_runs(runs["baseline"], runs["drop_norm"], tmp_path, max_bytes=8_000)
    data = path.read_bytes()
    assert len(data) <= 8_000
    comparison = json.loads(data)
    assert dumps_report(comparison) == data
    coverage = comparison["coverage"]
    assert "max_bytes" in coverage["limits_hit"]
    assert sum(v["by_bytes"] for v in coverage["omitted"].values()) > 0
    # The first divergence is kept first.
    assert comparison["first_divergences"][0]["module"] == "blocks.2.norm"
    assert comparison["summary"]["first_divergence"]["module"] == "blocks.2.norm"
    render_comparison_markdown(comparison)
    with pytest.raises(ConfigError, match="max_bytes"):
        compare_runs(runs["baseline"], runs["drop_norm"], tmp_path, max_bytes=100)


def test_cli_prints_where_it_wrote(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert cli_main(["compare", str(runs["baseline"]), str(runs["drop_norm"]), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out / 'comparison.json'}" in printed
    assert f"wrote {out / 'comparison.md'}" in printed
    assert "blocks.2.norm" in printed and "next experiment:" in printed
    assert (out / "comparison.json").is_file()


DOCS = REPO / "docs" / "command-line.md"


def test_show_of_the_drop_norm_example_is_the_one_in_the_docs(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/command-line.md quotes ``show`` of the drop-norm example (seed 0, 300 steps)."""
    text = DOCS.read_text(encoding="utf-8")
    start = text.index("$ python -m torchinstruments show stats\n") + len(
        "$ python -m torchinstruments show stats\n"
    )
    documented = text[start : text.index("```", start)].splitlines()
    assert cli_main(["show", str(runs["drop_norm"])]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[0] == f"torchinstruments report: {runs['drop_norm'] / 'report.json'}"
    assert shown[1].startswith("single process; generated ")
    # the path and the time differ; every other line must be as documented
    assert shown[2:] == documented[2:], "\n".join(["docs/command-line.md should show:", *shown])


# ---------------------------------------------------------------------- guards
def test_sampling_mismatch_is_flagged_and_compared_on_common_forwards(tmp_path: Path) -> None:
    every = small_run(tmp_path / "every", 1)
    default = small_run(tmp_path / "default", None)
    comparison = read(compare_runs(default, every, tmp_path / "out"))
    assert comparison["strength"] == "weak"
    kinds = [m["kind"] for m in comparison["mismatches"]]
    assert "sampling" in kinds
    assert comparison["alignment"]["axis"] == "forward"
    assert comparison["summary"]["headline"].startswith("Weak comparison (mismatched: sampling)")
    # Same seed, same batches: at the forwards both sampled, the values are identical.
    assert comparison["first_divergences"] == []
    assert comparison["categories"]["activation_scale"]["series_compared"] > 0
    markdown = (tmp_path / "out" / "comparison.md").read_text(encoding="utf-8")
    assert "## Mismatches: a weak comparison" in markdown


def test_module_set_mismatch_compares_common_modules(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ResidualNet()
    inject_observer(model, output_dir=tmp_path / "part", sampling=1, include=["inp", "fc"])
    train(model, make_batches(30))
    remove_observer(model)
    full = small_run(tmp_path / "full", 1, steps=30)
    comparison = read(compare_runs(full, tmp_path / "part", tmp_path / "out"))
    assert comparison["strength"] == "weak"
    assert {"modules", "configuration"} <= {m["kind"] for m in comparison["mismatches"]}
    assert comparison["only_in_baseline"]
    assert all(e["explained_by"] for e in comparison["only_in_baseline"])
    assert comparison["first_divergences"] == []


def test_missing_and_corrupt_files_name_the_path(tmp_path: Path) -> None:
    run = small_run(tmp_path / "run", 1, steps=10)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ReportReadError, match=str(empty / "series.json")):
        compare_runs(run, empty, tmp_path / "out")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "series.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ReportReadError, match="expected JSON"):
        compare_runs(corrupt, run, tmp_path / "out")
    (corrupt / "series.json").write_text(json.dumps({"schema": "other/1"}), encoding="utf-8")
    with pytest.raises(ReportReadError, match="expected schema"):
        compare_runs(run, corrupt, tmp_path / "out")
    summary = read(run / "series.json")
    summary["series"][0]["points"] = [[3, 1.0], [2, 1.0]]
    (corrupt / "series.json").write_text(json.dumps(summary), encoding="utf-8")
    with pytest.raises(ReportReadError, match=r"series\[0\]"):
        compare_runs(run, corrupt, tmp_path / "out")
    assert cli_main(["compare", str(run), str(empty)]) == 1


# ---------------------------------------------------------------------- pieces
def test_sustained_departure_needs_two_points_of_one_sign() -> None:
    assert sustained_departure([0.0, 9.0, 0.0]) == 0.0
    assert sustained_departure([6.0, -7.0]) == 0.0
    assert sustained_departure([0.0, 6.0, 7.0, 1.0]) == 6.0
    assert sustained_departure([-8.0, -5.0]) == 5.0
    assert noise_floor("rms", log_scale=True) == 0.1


def test_forced_samples_are_aligned_by_recorded_training_forwards(tmp_path: Path) -> None:
    """A one-off NaN at forward 35 (unsampled, and a forward the root sentinel checks;
    the step skipped, as a GradScaler would) forces samples in the candidate (6 of them
    extra: 36 to 43, where the schedule takes 36 and 40); a later 8x input change from
    forward 120 on must be placed by training forward, with the candidate's own sample
    index, not the baseline's."""

    def run(directory: Path, faulty: bool) -> Path:
        torch.manual_seed(0)
        model = ResidualNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        inject_observer(model, output_dir=directory)
        for step, (x, y) in enumerate(make_batches(200)):
            if faulty and step == 35:
                x = torch.full_like(x, float("nan"))
            if faulty and step >= 120:
                x = x * 8.0
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if torch.isfinite(loss):
                optimizer.step()
        remove_observer(model)
        return directory

    baseline, candidate = run(tmp_path / "a", False), run(tmp_path / "b", True)
    comparison = read(compare_runs(baseline, candidate, tmp_path / "out"))
    summary = read(candidate / "series.json")["sample_forwards"]
    assert summary["complete"] is True
    recorded = SampleForwards(summary["runs"])
    assert comparison["alignment"]["axis"] == "forward"
    first = comparison["summary"]["first_divergence"]
    assert (first["kind"], first["module"], first["metric"]) == ("value", "inp", "rms")
    # At the first training forward both runs kept in their bounded histories from 120 on
    # (here 144; 120 to 136 were thinned out of one of them), and named in each run's own
    # sample indices: the forced samples shifted the candidate's by 6.
    assert 120 <= first["forward"] <= 160
    assert first["candidate_sample"] == recorded.sample(first["forward"])
    assert first["candidate_sample"] == first["sample"] + 6
    assert first["last_agreeing"]["forward"] < 120


class _EveryK:
    """A custom policy that describes itself the same whatever its interval."""

    def __init__(self, interval: int) -> None:
        self.interval = interval

    def should_sample(self, forward_index: int) -> bool:
        return forward_index % self.interval == 0

    def describe(self) -> dict[str, object]:
        return {"policy": "custom (test)"}


def test_same_described_policy_with_different_sample_forwards_aligns_by_forward(
    tmp_path: Path,
) -> None:
    def run(directory: Path, interval: int) -> Path:
        torch.manual_seed(0)
        model = ResidualNet()
        inject_observer(model, output_dir=directory, sampling=_EveryK(interval))
        train(model, make_batches(60))
        remove_observer(model)
        return directory

    comparison = read(
        compare_runs(run(tmp_path / "a", 2), run(tmp_path / "b", 3), tmp_path / "out")
    )
    assert comparison["alignment"]["axis"] == "forward"
    assert comparison["alignment"]["series_common"] > 0
    kinds = {m["kind"]: m["weakens"] for m in comparison["mismatches"]}
    assert kinds == {"sample_forwards_differ": False}


def test_recorded_sample_forwards_round_trip_and_reject_bad_input() -> None:
    forwards = [0, 1, 2, 4, 6, 7, 8, 9, 12, 16, 100]
    mapping = SampleForwards()
    for forward in forwards:  # as the observer records its samples
        mapping.append(forward)
    runs = mapping.runs
    bounded = SampleForwards(max_runs=2)
    for forward in forwards:
        bounded.append(forward)
    assert not bounded.complete and bounded.runs == runs[:2] and bounded.samples == 5
    assert runs == [[0, 0, 1, 3], [3, 4, 2, 2], [5, 7, 1, 3], [8, 12, 4, 2], [10, 100, 0, 1]]
    recorded = parse_recorded({"runs": runs, "complete": True})
    assert recorded is not None
    assert [recorded.forward(k) for k in range(len(forwards))] == forwards
    assert [recorded.sample(f) for f in forwards] == list(range(len(forwards)))
    assert recorded.sample(3) is None and recorded.sample(101) is None
    assert recorded.forward(len(forwards)) is None and recorded.forward(-1) is None
    for bad in (
        {"runs": runs, "complete": False},
        {"runs": [[1, 0, 1, 2]], "complete": True},  # does not start at sample 0
        {"runs": [[0, 5, 1, 2], [2, 5, 1, 1]], "complete": True},  # forwards not increasing
        {"runs": [[0, 0, 0, 2]], "complete": True},  # a zero step
        {"runs": [[0, 0, 1]], "complete": True},
        {"runs": "x", "complete": True},
        None,
    ):
        assert parse_recorded(bad) is None, bad


@pytest.mark.parametrize("policy", [DefaultSampling(), DefaultSampling(samples_per_stage=3)])
def test_schedule_maps_samples_to_forwards(policy: DefaultSampling) -> None:
    schedule = _Schedule(policy.describe())
    sampled = [f for f in range(3_000) if policy.should_sample(f)]
    assert [schedule.forward(k) for k in range(len(sampled))] == sampled
    assert all(schedule.sample(f) == k for k, f in enumerate(sampled))
    assert schedule.sample(sampled[-1] - 1) is None or policy.should_sample(sampled[-1] - 1)
    assert schedule.expected_samples(3_000) == len(sampled)
    every = _Schedule(EveryNSampling(3).describe())
    assert [every.forward(k) for k in range(4)] == [0, 3, 6, 9]
    assert every.expected_samples(10) == 4 and every.sample(4) is None


def test_first_non_finite_sample_is_exact_and_extra_samples_are_flagged(tmp_path: Path) -> None:
    def run(directory: Path, poison: bool) -> Path:
        torch.manual_seed(0)
        model = ResidualNet()
        batches = make_batches(80)
        if poison:  # a NaN input at training forward 42 (sample 18 of the default schedule)
            batches[42] = (torch.full_like(batches[42][0], float("nan")), batches[42][1])
        inject_observer(model, output_dir=directory)
        train(model, batches)
        remove_observer(model)
        return directory

    comparison = read(
        compare_runs(run(tmp_path / "a", False), run(tmp_path / "b", True), tmp_path / "out")
    )
    first = comparison["summary"]["first_divergence"]
    assert first["kind"] == "non_finite" and first["side"] == "candidate"
    assert (first["module"], first["signal"]) == ("inp", "activation")
    assert (first["sample"], first["forward"]) == (18, 42)
    # The sentinel forced extra samples after the NaN: sample indices stop matching, but
    # both runs recorded each sample's training forward, so the runs are aligned by those.
    extra = [m for m in comparison["mismatches"] if m["kind"] == "extra_samples"]
    assert len(extra) == 1 and not extra[0]["weakens"]
    assert "compared at the training forwards both sampled" in extra[0]["detail"]
    assert comparison["strength"] == "full"
    assert comparison["categories"]["non_finite"]["notable"] > 0


# ---------------------------------------------------------------------- same-seed pairs
class _GradScale(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        tensor, factor = args
        ctx.factor = factor
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, *gradients: Any) -> Any:
        return gradients[0] * ctx.factor, None


def _same_seed_run(
    directory: Path, fault: str | None, steps: int = 120, at: int = 60, sampling: int = 2
) -> Path:
    """ResidualNet trained with SGD, observed every ``sampling``-th forward; from step ``at`` the
    candidate's ``fault`` applies: ``"fc_x1.5"`` scales ``fc.weight`` by 1.5 once,
    ``"weights_x0.5"`` halves every parameter once (a run-level change: a mis-scaled
    weight-decay step, a reload of the wrong checkpoint), ``"fc_grad_x20"`` scales the
    gradient that reaches ``fc``'s output by 20 from then on (a backward-only bug)."""
    torch.manual_seed(0)
    model = ResidualNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    inject_observer(model, output_dir=directory, sampling=sampling)
    for step, (x, y) in enumerate(make_batches(steps)):
        if step == at and fault == "fc_grad_x20":
            model.fc.register_forward_hook(
                lambda module, inputs, output: _GradScale.apply(output, 20.0)
            )
        if step == at and fault == "fc_x1.5":
            with torch.no_grad():
                model.fc.weight.mul_(1.5)
        if step == at and fault == "weights_x0.5":
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.mul_(0.5)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    remove_observer(model)
    return directory


def test_a_modest_step_after_an_identical_prefix_is_the_first_divergence(tmp_path: Path) -> None:
    # Runs identical up to their first difference have no run-to-run noise before it, so
    # a 1.5x weight there is judged against a tenth of the floor (1%), not the 10% floor
    # (against which it is 4 units, below the threshold of 5).
    base = _same_seed_run(tmp_path / "base", None)
    cand = _same_seed_run(tmp_path / "cand", "fc_x1.5")
    comparison = read(compare_runs(base, cand, tmp_path / "out"))
    first = comparison["summary"]["first_divergence"]
    assert (first["module"], first["kind"], first["metric"]) == ("fc", "value", "rms")
    assert first["sample"] == 30  # forward 60, the first sampled forward with the fault
    assert first["last_agreeing"]["sample"] == 29  # the sample before it (every one kept)
    entry = next(
        e for e in comparison["categories"]["activation_scale"]["entries"] if e["module"] == "fc"
    )
    at_first = entry["noise"]["at_first_difference"]
    assert (at_first["sigma"], at_first["basis"]) == (0.01, "floor")
    assert entry["noise"]["sigma"] == 0.1  # the floor, elsewhere
    assert at_first["points"] == 2


def test_a_backward_only_fault_after_an_identical_prefix_is_led_by_the_gradient(
    tmp_path: Path,
) -> None:
    # Every 8th forward observed; from step 57 the gradient reaching fc's output is
    # scaled by 20 (a backward-only bug). At sample 8 (forward 64) every activation has
    # moved through seven optimizer steps (which alone would read as model-wide), while
    # the output gradients of fc and the modules before it moved 10x more: fc's
    # gradient, where their profile in backward order jumps, leads.
    base = _same_seed_run(tmp_path / "base", None, sampling=8)
    cand = _same_seed_run(tmp_path / "cand", "fc_grad_x20", at=57, sampling=8)
    comparison = read(compare_runs(base, cand, tmp_path / "out"))
    first = comparison["summary"]["first_divergence"]
    assert (first["module"], first["signal"], first["sample"]) == ("fc", "grad_output", 8)
    activations = [e for e in comparison["first_divergences"] if e["signal"] == "activation"]
    assert {e["module"] for e in activations if e["sample"] == 8} >= {"inp", "fc"}


def _departure(position: int, module: str, departure: float) -> _Event:
    return _Event(
        38, "value", "candidate", module, 0, "activation", "output", "rms", position,
        {"departure": departure, "sample": 38},
    )  # fmt: skip


def test_the_origin_at_a_first_difference_is_where_the_profile_along_depth_jumps() -> None:
    # The profile of a GELU swapped for the identity in block 2 of a ViT, 56 optimizer
    # steps after the fault: the blocks before it moved by 8 to 12.5 units through the
    # weights the optimizer changed, its input (fc1) fell, its output rose 43 units, and
    # its echoes after it kept about as much. 12.5 is more than a quarter of 43, so the
    # first departure to reach a share of the largest would name block 1; the origin is
    # where the departure multiplies (43 / 16.3 = 2.6x; block 1's 7.6 against the
    # threshold 5 is 1.5x).
    profile = [
        _departure(30, "blocks.1.attn.norm", 7.6),
        _departure(41, "blocks.1.mlp.fc2", 12.5),
        _departure(57, "blocks.2.mlp.fc1", -16.3),
        _departure(58, "blocks.2.mlp.act", 43.0),
        _departure(61, "blocks.2.mlp.fc2", 22.7),
        _departure(81, "blocks.3.mlp.fc2", 8.3),
    ]
    ordered, model_wide = _profile_at_first_difference(
        list(profile), 38, 40, "patch_embed.proj", threshold=5.0
    )
    assert model_wide is None
    assert [e.module for e in ordered] == [
        "blocks.2.mlp.act",
        "blocks.1.attn.norm",
        "blocks.1.mlp.fc2",
        "blocks.2.mlp.fc1",
        "blocks.2.mlp.fc2",
        "blocks.3.mlp.fc2",
    ]
    # A first departure far beyond the threshold stays the origin against a larger echo
    # that only doubles it (a query weight x8: qkv 205 units, its attention logits 417).
    ordered, _ = _profile_at_first_difference(
        [_departure(2, "blocks.0.attn.qkv", 205.0), _departure(9, "blocks.0.attn", 417.0)],
        38, 40, "patch_embed.proj", threshold=5.0,
    )  # fmt: skip
    assert ordered[0].module == "blocks.0.attn.qkv"


def _gradient(position: int, module: str, departure: float) -> _Event:
    return _Event(
        37, "value", "candidate", module, 0, "grad_output", "output", "rms_to_root", position,
        {"departure": departure, "sample": 37},
    )  # fmt: skip


def test_gradients_that_depart_from_the_loss_end_on_are_a_model_wide_divergence() -> None:
    # A ResNet-18 whose SGD momentum went from 0.9 to 0.995 11 steps before the sample
    # (rms_to_root departures in backward order, none of the activations): the gradient
    # nearest the loss departs, and the departures grow backwards without a jump.
    profile = [
        _gradient(34, "avgpool", 5.4),
        _gradient(32, "layer4.0.downsample.1", 13.8),
        _gradient(28, "layer4.0.relu", 20.8),
        _gradient(22, "layer3.0.bn2", 32.6),
        _gradient(14, "layer2.0.bn2", 48.7),
        _gradient(1, "bn1", 52.7),
    ]
    ordered, model_wide = _profile_at_first_difference(
        list(profile), 37, 32, "conv1", 5.0, (10, "avgpool")
    )
    assert model_wide is not None
    assert (model_wide["module"], model_wide["signal"]) == ("<model>", "grad_output")
    assert model_wide["first_in_backward_order"]["module"] == "avgpool"
    assert (model_wide["modules_departing"], model_wide["modules_compared"]) == (6, 10)
    assert model_wide["share_of_modules"] == 0.6
    # A gradient fault at layer3.0.bn2: the gradients nearer the loss did not depart.
    cut = [e for e in profile if e.position <= 22]
    ordered, model_wide = _profile_at_first_difference(
        list(cut), 37, 32, "conv1", 5.0, (10, "avgpool")
    )
    assert model_wide is None
    assert ordered[0].module == "layer3.0.bn2"
    # A gradient fault one module back from the loss end, seven optimizer steps before
    # the sample (the fc_grad_x20 run of the test above): the loss end moved 35 units,
    # fc 252 (7.2x): a jump, not compounding.
    jump = [_gradient(3, "act", -35.0), _gradient(2, "fc", 252.1), _gradient(1, "norm", 260.1)]
    _, model_wide = _profile_at_first_difference(list(jump), 37, 5, "inp", 5.0, (5, "act"))
    assert model_wide is None
    # The loss end departing, but fewer than half of the modules: not model-wide.
    _, model_wide = _profile_at_first_difference(
        list(profile[:4]), 37, 32, "conv1", 5.0, (10, "avgpool")
    )
    assert model_wide is None


def test_a_run_level_change_after_an_identical_prefix_is_model_wide(tmp_path: Path) -> None:
    base = _same_seed_run(tmp_path / "base", None)
    cand = _same_seed_run(tmp_path / "cand", "weights_x0.5")
    comparison = read(compare_runs(base, cand, tmp_path / "out"))
    first = comparison["summary"]["first_divergence"]
    assert (first["module"], first["kind"]) == ("<model>", "model_wide")
    # Forward 60 (sample 30) is the first with every weight halved; every module departs
    # there at once, inp (the first in forward order) among them.
    assert first["sample"] == 30
    assert first["first_in_forward_order"]["module"] == "inp"
    assert first["share_of_modules"] >= 0.5
    assert first["modules_departing"] <= first["modules_compared"] == 5  # root excluded
    assert comparison["first_divergences"][0] == first
    assert comparison["summary"]["headline"].startswith(
        "First divergence at sample 30 (training forward 60): the whole model (`<model>`)"
    )


def test_docs_quote_what_the_code_produces(runs: dict[str, Path], tmp_path: Path) -> None:
    """Every number and excerpt of a report that docs/*.md quote is produced by
    docs/excerpts.py, from these same example runs (its RUNS)."""
    spec = importlib.util.spec_from_file_location("docs_excerpts", DOCS_EXCERPTS)
    assert spec is not None and spec.loader is not None
    excerpts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(excerpts)
    assert excerpts.RUNS == {
        "baseline": ["--seed", "0"],
        "drop_norm": ["--seed", "0", "--modification", "drop-norm"],
        "seed1": ["--seed", "1"],
    }  # the runs of the fixture above
    values = excerpts.excerpts(runs, tmp_path)
    assert excerpts.used() == set(values)
    diffs = excerpts.stale(values)
    assert diffs == {}, "stale docs; run `uv run python docs/excerpts.py --write`:\n" + "\n".join(
        diffs.values()
    )
