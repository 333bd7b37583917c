"""The public surface: injection, removal, errors, selection, handles."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import nn

import torchinstruments
from tests.harness import (
    MLP,
    ResidualNet,
    hook_counts,
    instance_attributes,
    make_batches,
    read_report,
    train,
)
from torchinstruments import (
    ConfigError,
    MemorySink,
    ObserverHandle,
    ObserverStateError,
    ReportConfig,
    TorchInstrumentsError,
    inject_observer,
    observer_of,
    remove_observer,
)


def test_exported_members_are_the_public_api() -> None:
    assert sorted(torchinstruments.__all__) == sorted(
        [
            "ConfigError",
            "DefaultSampling",
            "DirectorySink",
            "EveryNSampling",
            "HistogramSpec",
            "MemorySink",
            "MetricLoggerSink",
            "ObserverHandle",
            "ObserverStateError",
            "ReportConfig",
            "ReportReadError",
            "SamplingPolicy",
            "ScalarSink",
            "Sink",
            "TensorBoardSink",
            "TimeBudgetSampling",
            "TorchInstrumentsError",
            "TrackConfig",
            "__version__",
            "compare_runs",
            "histogram",
            "inject_observer",
            "merge_rank_reports",
            "observer_of",
            "remove_observer",
        ]
    )
    for name in torchinstruments.__all__:
        assert hasattr(torchinstruments, name)
    assert issubclass(ConfigError, TorchInstrumentsError) and issubclass(ConfigError, ValueError)


def test_inject_train_remove_writes_both_files(tmp_path: Path) -> None:
    model = ResidualNet()
    handle = inject_observer(model, output_dir=tmp_path, sampling=1)
    assert observer_of(model) is handle
    train(model, make_batches(5))
    remove_observer(model)
    report = read_report(tmp_path)
    assert report["schema"] == "torchinstruments.report/2"
    assert report["coverage"]["samples_observed"] == 5
    assert report["coverage"]["backward_samples_observed"] == 5
    index = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert index.startswith("# torchinstruments report")
    assert "Prompt for an LLM" in index
    assert observer_of(model) is None


def test_second_injection_raises_and_keeps_one_hook_set(tmp_path: Path) -> None:
    model = ResidualNet()
    inject_observer(model, output_dir=tmp_path / "a")
    counts = hook_counts(model)
    with pytest.raises(ObserverStateError, match="already carries an observer"):
        inject_observer(model, output_dir=tmp_path / "b")
    assert hook_counts(model) == counts
    remove_observer(model)


def test_remove_restores_hooks_and_attributes_and_second_remove_is_noop(tmp_path: Path) -> None:
    model = ResidualNet()
    before_hooks = hook_counts(model)
    before_attrs = {n: sorted(m.__dict__) for n, m in model.named_modules()}
    keys = list(model.state_dict())
    inject_observer(model, output_dir=tmp_path, capture_direct_forwards=True)
    assert "forward" in model.__dict__
    assert list(model.state_dict()) == keys
    remove_observer(model)
    remove_observer(model)
    assert hook_counts(model) == before_hooks
    assert {n: sorted(m.__dict__) for n, m in model.named_modules()} == before_attrs


def test_direct_forward_wrapper_restores_a_previous_instance_forward(tmp_path: Path) -> None:
    model = ResidualNet()
    calls = []

    def custom_forward(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return ResidualNet.forward(model, x)

    model.forward = custom_forward  # type: ignore[method-assign]
    inject_observer(model, output_dir=tmp_path, capture_direct_forwards=True, sampling=1)
    model.forward(torch.randn(2, 8)).sum().backward()
    model(torch.randn(2, 8)).sum().backward()
    remove_observer(model)
    assert model.__dict__["forward"] is custom_forward
    assert len(calls) == 2
    report = read_report(tmp_path)
    assert report["coverage"]["samples_observed"] == 2


def test_shared_output_dir_is_refused(tmp_path: Path) -> None:
    first, second = ResidualNet(), ResidualNet()
    inject_observer(first, output_dir=tmp_path)
    with pytest.raises(ObserverStateError, match="already used by another live observer"):
        inject_observer(second, output_dir=tmp_path)
    remove_observer(first)
    inject_observer(second, output_dir=tmp_path)
    remove_observer(second)


def test_a_leading_tilde_in_output_dir_is_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path / "..")
    model = MLP()
    handle = inject_observer(model, output_dir="~/stats")
    remove_observer(model)
    assert handle.output_dir == tmp_path / "stats"
    assert read_report(tmp_path / "stats")["run"]["final"] is True
    assert not (tmp_path / ".." / "~").exists()


def _train_and_drop(output_dir: Path, cycle: bool) -> ObserverHandle:
    """Observe a model inside a function that returns without removing it (the handle
    comes back; the model does not); with ``cycle`` the model is in a reference cycle,
    so only the garbage collector frees it."""
    model = MLP(features=8)
    if cycle:
        model.myself = [model]  # type: ignore[assignment]
    handle = inject_observer(model, output_dir=output_dir)
    train(model, make_batches(12))
    return handle


@pytest.mark.parametrize("cycle", [False, True], ids=["on_return", "by_the_collector"])
def test_a_model_dropped_without_removal_gets_its_final_report(tmp_path: Path, cycle: bool) -> None:
    import gc

    handle = _train_and_drop(tmp_path, cycle)
    if cycle:
        assert read_report(tmp_path)["run"]["final"] is False
        gc.collect()
    report = read_report(tmp_path)
    assert report["run"]["final"] is True
    assert report["run"]["forwards_seen"] == 12
    assert report["errors"] == []
    assert handle.removed
    handle.remove()  # nothing left to do
    again = MLP(features=8)  # the directory is free again
    inject_observer(again, output_dir=tmp_path)
    remove_observer(again)


def test_a_model_collected_while_the_registry_is_locked_never_blocks(tmp_path: Path) -> None:
    """The collector may free a model in the middle of another injection, which holds
    the registry lock: the final report is written all the same, without waiting."""
    import gc

    from torchinstruments import api

    first = tmp_path / "first"
    handle = _train_and_drop(first, cycle=True)
    with api._LOCK:
        gc.collect()
    assert read_report(first)["run"]["final"] is True
    assert handle.removed
    del handle
    # Its directory was left marked (the lock was held) by a reference that is dead now.
    inject_observer(second := MLP(features=8), output_dir=first)
    remove_observer(second)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sampling": 0}, "sampling must be None, an int >= 1"),
        ({"sampling": "often"}, "sampling must be None, an int >= 1"),
        ({"rank_policy": "some"}, "rank_policy must be one of"),
        ({"report_config": {"max_bytes": 10}}, "report_config must be a ReportConfig"),
        ({"capture_direct_forwards": 1}, "capture_direct_forwards must be a bool"),
        ({"attention_logits": "yes"}, "attention_logits must be a bool, got 'yes'"),
        ({"include": 3}, "include must be a glob pattern"),
        ({"module_types": [int]}, "module_types must be an nn.Module subclass"),
        ({"module_types": nn.Linear(1, 1)}, r"module_types must be .* got Linear\(in_features"),
        ({"output_dir": ""}, "output_dir must be a non-empty path"),
        ({"sinks": [object()]}, "each sink needs a write"),
    ],
)
def test_bad_arguments_name_argument_expected_and_given(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    arguments: dict[str, object] = {"output_dir": tmp_path, **kwargs}
    with pytest.raises(ConfigError, match=message):
        inject_observer(ResidualNet(), **arguments)  # type: ignore[arg-type]


def test_non_module_model_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"model must be a torch\.nn\.Module, got int"):
        inject_observer(3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"model must be a torch\.nn\.Module, got str"):
        remove_observer("model")  # type: ignore[arg-type]


def test_report_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"ReportConfig.max_bytes must be an int >= 4096, got 0"):
        ReportConfig(max_bytes=0)


def test_selection_by_pattern_and_type(tmp_path: Path) -> None:
    model = ResidualNet()
    inject_observer(
        model, output_dir=tmp_path, sampling=1, include=["fc"], module_types=nn.LayerNorm
    )
    train(model, make_batches(3))
    remove_observer(model)
    modules = {f["module"] for f in read_report(tmp_path)["findings"]}
    assert modules <= {"<root>", "fc", "norm"}
    assert {"fc", "norm"} <= modules


def test_exclude_removes_modules(tmp_path: Path) -> None:
    model = ResidualNet()
    inject_observer(model, output_dir=tmp_path, sampling=1, exclude="head")
    train(model, make_batches(3))
    remove_observer(model)
    report = read_report(tmp_path)
    assert "head" not in {f["module"] for f in report["findings"]}
    assert report["coverage"]["modules_selected"] == 5  # root, inp, norm, fc, act


def test_handle_flush_report_and_context_manager(tmp_path: Path) -> None:
    model = ResidualNet()
    sink = MemorySink()
    with inject_observer(model, output_dir=tmp_path, sampling=1, sinks=[sink]) as handle:
        train(model, make_batches(2))
        path = handle.flush()
        assert path == tmp_path / "report.json" and path.is_file()
        current = handle.report()
        assert current is not None and current["coverage"]["samples_observed"] == 2
    assert observer_of(model) is None
    assert handle.removed
    assert len(sink.reports) == 2  # the flush and the final report


def test_output_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    existing = tmp_path / "file"
    existing.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"output_dir must be a directory .* an existing file"):
        inject_observer(ResidualNet(), output_dir=existing)
    handle = inject_observer(ResidualNet(), output_dir=existing, write_files=False)
    handle.remove()  # nothing is written there: accepted


def test_unwritable_output_dir_warns_once_counts_and_never_stops_training(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    model = ResidualNet()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = inject_observer(model, output_dir=blocker / "stats", sampling=1)
        train(model, make_batches(3))
        handle.flush()
        handle.flush()
        report = handle.report()
        remove_observer(model)
    ours = [str(w.message) for w in caught if "could not write its report" in str(w.message)]
    assert len(ours) == 1
    # Both warnings name the directory given, not the parent that could not be made.
    directory = repr(str(blocker / "stats"))
    assert ours[0].startswith(f"torchinstruments could not write its report to {directory} (")
    # Removal says that no report of the run was written, and why.
    final = [str(w.message) for w in caught if "wrote no report" in str(w.message)]
    assert final == [
        f"torchinstruments wrote no report to {directory} in this run: every write "
        f"failed, the last with [Errno 20] Not a directory: {str(blocker / 'stats')!r}. "
        "Give inject_observer an output_dir this process can create and write."
    ]
    assert report is not None
    # report.json with index.md, and series.json, each at the first report and two flushes
    assert report["coverage"]["errors_total"] == 6
    assert sorted(e["stage"] for e in report["errors"]) == ["series_summary", "write"]


def test_a_ranking_error_still_writes_the_final_report_without_findings_and_warns_once(
    tmp_path: Path, monkeypatch
) -> None:
    import torchinstruments.report as report_module

    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("ranking failed on purpose")

    monkeypatch.setattr(report_module, "run_rules", broken)
    model = ResidualNet()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = inject_observer(model, output_dir=tmp_path, sampling=1)
        train(model, make_batches(3))
        handle.flush()
        remove_observer(model)
    ours = [str(w.message) for w in caught if "could not rank" in str(w.message)]
    assert len(ours) == 1
    assert ours[0].startswith(
        "torchinstruments could not rank this run's findings (ValueError: ranking failed "
        "on purpose at test_api.py:"
    )
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["run"]["final"], report["run"]["ended_by"]) == (True, "remove_observer")
    assert report["run"]["report_number"] == 3  # the first sample, the flush, removal
    assert report["findings"] == [] and report["events"] == []
    assert report["summary"]["headline"] == report_module.RANKING_FAILED_HEADLINE
    assert report["coverage"]["samples_observed"] == 3
    assert [(e["stage"], e["count"]) for e in report["errors"]] == [("report", 3)]
    assert report_module.RANKING_FAILED_HEADLINE in (tmp_path / "index.md").read_text()


def test_hook_errors_are_caught_counted_and_reported(tmp_path: Path, monkeypatch) -> None:
    import torchinstruments._staging as staging_module

    def broken(tensor: object, **kwargs: object) -> list[float]:
        raise RuntimeError("reduction failed on purpose")

    # Small CPU tensors are reduced in batches at flushes, larger ones inside hooks.
    monkeypatch.setattr(staging_module, "cpu_statistics_matrix_", broken)
    monkeypatch.setattr(staging_module, "cpu_statistics_subsamples", broken)
    monkeypatch.setattr(staging_module, "cpu_statistics_unchecked", broken)
    model = ResidualNet()
    twin = ResidualNet()
    twin.load_state_dict(model.state_dict())
    inject_observer(model, output_dir=tmp_path, sampling=1)
    batches = make_batches(4)
    losses = train(model, batches)
    remove_observer(model)
    assert losses == train(twin, batches)
    report = read_report(tmp_path)
    assert report["coverage"]["errors_total"] > 0
    first = report["errors"][0]
    assert first["error_type"] == "RuntimeError"
    assert first["message"] == "reduction failed on purpose"


class LeafModel(nn.Module):
    """A model without submodules: ``y = x * w``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def test_selection_that_matches_nothing_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"selects no module besides the root; module names"):
        inject_observer(ResidualNet(), output_dir=tmp_path, include="block.*")
    with pytest.raises(ConfigError) as error:
        inject_observer(ResidualNet(), output_dir=tmp_path, module_types=nn.Conv2d)
    assert str(error.value).startswith(
        "inject_observer: module_types=['Conv2d'] selects no module besides the root; "
    )
    # Only what was given is named (module_types=[] was named for an include alone).
    with pytest.raises(ConfigError) as error:
        inject_observer(ResidualNet(), output_dir=tmp_path, include=["nomatch.*"])
    assert str(error.value).startswith(
        "inject_observer: include=['nomatch.*'] selects no module besides the root; "
        "module names look like ["
    )
    # An exclude that removes every module is refused too (the root alone was observed).
    with pytest.raises(ConfigError) as error:
        inject_observer(ResidualNet(), output_dir=tmp_path, include="*", exclude="*")
    assert str(error.value).startswith(
        "inject_observer: include=['*'] and exclude=['*'] select no module besides the root"
    )
    with pytest.raises(ConfigError, match=r"^inject_observer: exclude=\['\*'\] selects no"):
        inject_observer(ResidualNet(), output_dir=tmp_path, exclude="*")
    # A model without submodules has nothing to exclude: the root is observed. (A class
    # of its own: an observed root's class is guarded on by code compiled later in the
    # process, as nn.Linear would be in every other test's models.)
    leaf = LeafModel()
    inject_observer(leaf, output_dir=tmp_path, exclude="*")
    remove_observer(leaf)


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.spare = nn.ModuleDict()  # empty: a leaf, never called
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def _selected(model: nn.Module, **options: Any) -> tuple[list[str], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = inject_observer(model, write_files=False, **options)
        observer = handle._observer
        assert observer is not None
        names = sorted(observer.names)
        remove_observer(model)
    return names, [f"{Path(w.filename).name}: {w.message}" for w in caught]


def test_selection_skips_containers_and_warns_of_patterns_it_ignores() -> None:
    names = "module names look like ['blocks', 'blocks.0', 'blocks.1', 'spare', 'head']"
    # By default: the leaves, never a container without a forward (even an empty one).
    assert _selected(_Stack()) == (["", "blocks.0", "blocks.1", "head"], [])
    # A pattern among several that matches nothing is named, with the names there are.
    assert _selected(_Stack(), include=["blocks.*", "blcks.*"]) == (
        ["", "blocks.0", "blocks.1"],
        [f"test_api.py: inject_observer: include pattern 'blcks.*' matches no module; {names}"],
    )
    assert _selected(_Stack(), exclude=["head", "haed"]) == (
        ["", "blocks.0", "blocks.1"],
        [f"test_api.py: inject_observer: exclude pattern 'haed' matches no module; {names}"],
    )
    # A ModuleList is never called: naming it says how to name what it holds.
    hint = (
        "include pattern 'blocks' matches only ModuleList container(s), which are never "
        "called and are not observed; to observe the modules they hold, include 'blocks.*'"
    )
    assert _selected(_Stack(), include=["blocks", "head"]) == (
        ["", "head"],
        [f"test_api.py: inject_observer: {hint}"],
    )
    with pytest.raises(ConfigError) as error:
        inject_observer(_Stack(), write_files=False, include="blocks")
    assert str(error.value) == (
        f"inject_observer: include=['blocks'] selects no module besides the root; {names} ({hint})"
    )
    # An exclude pattern takes everything inside what it names.
    assert _selected(_Stack(), exclude="blocks.0") == (["", "blocks.1", "head"], [])
    assert _selected(_Stack(), exclude="blocks") == (["", "head"], [])
    assert _selected(_Stack(), include="blocks.*", exclude="blocks.1") == (["", "blocks.0"], [])


def test_names_shown_and_matched_leave_out_compile_wrappers() -> None:
    model = _Stack()
    model.blocks[0] = cast(nn.Module, torch.compile(model.blocks[0], backend="eager"))
    with pytest.raises(ConfigError) as error:
        inject_observer(model, write_files=False, include="blocks.0._orig_mod")
    assert str(error.value) == (
        "inject_observer: include=['blocks.0._orig_mod'] selects no module besides the "
        "root; module names look like ['blocks', 'blocks.0', 'blocks.1', 'spare', 'head']"
    )
    assert _selected(model, include="blocks.0")[0] == ["", "blocks.0"]


def test_observer_of_finds_the_observer_through_a_compile_wrapper(tmp_path: Path) -> None:
    model = ResidualNet()
    handle = inject_observer(model, output_dir=tmp_path)
    compiled = cast(nn.Module, torch.compile(model, backend="eager"))
    assert observer_of(compiled) is handle and observer_of(model) is handle
    remove_observer(compiled)
    assert observer_of(compiled) is None and observer_of(model) is None


def test_side_calls_of_a_submodule_are_kept_out_of_root_training(tmp_path: Path) -> None:
    model = ResidualNet()
    inject_observer(model, output_dir=tmp_path, sampling=1)
    for x, y in make_batches(10):
        nn.functional.mse_loss(model(x), y).backward()
        model.fc(torch.randn(4, 16) * 100).sum().backward()  # an auxiliary side call
    remove_observer(model)
    report = read_report(tmp_path)
    coverage = report["coverage"]
    assert coverage["samples_observed"] == 10
    assert coverage["forwards_seen"] == 10
    assert coverage["calls_outside_root_skipped"] == 10
    assert report["summary"]["notable_findings"] == 0


# ------------------------------------------------------------------- invalid arguments
# (argument, given value, what the message must say is expected, how it must show the value)
BAD_ARGUMENTS: list[Any] = [
    ("sampling", -3, "an int >= 1", "-3"),
    ("sampling", True, "an int >= 1", "True"),
    ("rank_policy", "everyone", "one of", "'everyone'"),
    ("rank_policy", None, "one of", "None"),
    ("capture_direct_forwards", "yes", "a bool", "'yes'"),
    ("write_files", 0, "a bool", "0"),
    ("output_dir", None, "a non-empty path", "None"),
    ("output_dir", 42, "a non-empty path", "42"),
    ("include", 7, "glob pattern", "7"),
    ("include", ["ok", 3], "glob pattern", "['ok', 3]"),
    ("exclude", b"fc*", "glob pattern", "b'fc*'"),
    ("module_types", "Linear", "nn.Module subclass", "'Linear'"),
    ("module_types", [], "nn.Module subclass", "[]"),
    ("sinks", [object()], "write", "<object object"),
]
TYPE_NAMES_ONLY = ()  # fixed; kept so the parametrisations read the same
BAD_ARGUMENTS += [
    pytest.param("sampling", 1.5, "an int >= 1", "1.5", marks=TYPE_NAMES_ONLY),
    pytest.param("sampling", "often", "an int >= 1", "'often'", marks=TYPE_NAMES_ONLY),
    pytest.param("report_config", 5, "ReportConfig", "5", marks=TYPE_NAMES_ONLY),
    pytest.param("track_config", "fast", "TrackConfig", "'fast'", marks=TYPE_NAMES_ONLY),
    pytest.param(
        "sinks",
        None,
        "sink",
        "None",
    ),
]


@pytest.mark.parametrize(("name", "given", "expected", "shown"), BAD_ARGUMENTS)
def test_invalid_argument_names_argument_expected_and_given(
    tmp_path: Path, name: str, given: object, expected: str, shown: str
) -> None:
    model = MLP()
    hooks, attributes = hook_counts(model), instance_attributes(model)
    options: dict[str, Any] = {"output_dir": tmp_path, name: given}
    with pytest.raises(ConfigError) as caught:
        inject_observer(model, **options)
    message = str(caught.value)
    named = name if name != "sinks" else "sink"  # "each sink needs ..." names it
    assert named in message and expected in message, message
    assert shown in message, f"given value {given!r} not shown in {message!r}"
    # Nothing was attached and the directory is not taken.
    assert hook_counts(model) == hooks and instance_attributes(model) == attributes
    assert observer_of(model) is None
    inject_observer(model, output_dir=tmp_path).remove()
