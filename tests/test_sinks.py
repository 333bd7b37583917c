"""Dashboard sinks: per-sample scalars to loggers and TensorBoard writers the caller owns."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

from tests.harness import ResidualNet, make_batches, read_report, read_series, train
from torchinstruments import (
    ConfigError,
    MetricLoggerSink,
    TensorBoardSink,
    TrackConfig,
    inject_observer,
    remove_observer,
)
from torchinstruments.sinks import scalar_tag


class RecordingLogger:
    """The Lightning logger interface: log_metrics(metrics, step)."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], int]] = []
        self.closed = False

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((dict(metrics), step))

    def finalize(self, status: str) -> None:
        self.closed = True


@pytest.mark.parametrize(
    ("module", "call_index", "signal", "tensor_path", "expected"),
    [
        ("fc", 0, "activation", "output", "torchinstruments/fc/activation/rms"),
        ("", 2, "grad_output", "output[1]", "torchinstruments/<root>@call2/grad_output[1]/rms"),
        ("lm", 0, "activation", "output.logits", "torchinstruments/lm/activation.logits/rms"),
        (
            "h.0.attn",
            0,
            "activation",
            "attention_logits",
            "torchinstruments/h.0.attn/activation/attention_logits/rms",
        ),
        (
            "h.0.attn",
            1,
            "activation",
            "attention_logits[1]",
            "torchinstruments/h.0.attn@call1/activation/attention_logits[1]/rms",
        ),
        ("head", 0, "activation", "output['a/b']", "torchinstruments/head/activation['a%2Fb']/rms"),
        ("head", 0, "activation", "output['5%']", "torchinstruments/head/activation['5%25']/rms"),
        ("my/net", 1, "grad_output", "output", "torchinstruments/my%2Fnet@call1/grad_output/rms"),
    ],
)
def test_scalar_tags_keep_every_tensor_path_whole(
    module: str, call_index: int, signal: str, tensor_path: str, expected: str
) -> None:
    assert scalar_tag(module, call_index, signal, tensor_path, "rms") == expected


def test_metric_logger_gets_one_call_per_sample_with_every_series(tmp_path: Path) -> None:
    logger = RecordingLogger()
    model = ResidualNet()
    inject_observer(model, output_dir=tmp_path, sampling=1, sinks=[MetricLoggerSink(logger)])
    train(model, make_batches(4))
    remove_observer(model)
    assert [step for _, step in logger.calls] == [0, 1, 2, 3]
    first = {
        f["module"]: f
        for f in read_series(tmp_path)
        if f["signal"] == "activation" and f["metric"] == "rms"
    }
    values = logger.calls[0][0]
    tag = scalar_tag("fc", 0, "activation", "output", "rms")
    assert values[tag] == pytest.approx(first["fc"]["first"]["value"], rel=1e-5)
    assert scalar_tag("", 0, "grad_output", "output", "rms") in values
    # 6 modules x (activation + output gradient), rms only.
    assert len(values) == 12
    assert not logger.closed


def test_plain_callable_logger_like_wandb_log(tmp_path: Path) -> None:
    calls: list[tuple[dict[str, float], int]] = []

    def log(values: dict[str, float], step: int | None = None) -> None:
        assert step is not None
        calls.append((values, step))

    model = ResidualNet()
    sink = MetricLoggerSink(log, metrics=("rms", "nonfinite_fraction"))
    inject_observer(model, output_dir=tmp_path, sampling=2, sinks=[sink])
    train(model, make_batches(6))
    remove_observer(model)
    # Samples are forwards 0, 2 and 4: logged at those training-forward indices.
    assert [step for _, step in calls] == [0, 2, 4]
    assert all(len(values) == 24 for values, _ in calls)


def test_tensorboard_sink_writes_events_that_tensorboard_reads_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    model = ResidualNet()
    inject_observer(
        model, output_dir=tmp_path / "stats", sampling=1, sinks=[TensorBoardSink(writer)]
    )
    train(model, make_batches(5))
    remove_observer(model)
    writer.add_scalar("task/loss", 1.0, 0)  # still the caller's, still open
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert isinstance(tags, list)
    tag = scalar_tag("head", 0, "activation", "output", "rms")
    assert tag in tags and "task/loss" in tags
    assert [event.step for event in events.Scalars(tag)] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: TensorBoardSink(object()), "writer must have add_scalar"),
        (lambda: MetricLoggerSink(3), "logger must have log_metrics"),
        (lambda: MetricLoggerSink(print, metrics=("speed",)), "metrics must be a non-empty"),
        (
            lambda: MetricLoggerSink(print, prompt=1),  # type: ignore[arg-type]
            "prompt must be a bool, got 1",
        ),
        (
            lambda: TensorBoardSink(SummaryWriter, prompt="no"),  # type: ignore[arg-type]
            "prompt must be a bool, got 'no'",
        ),
    ],
)
def test_bad_sink_arguments(factory, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        factory()


def test_a_failing_sink_is_counted_and_never_breaks_training(tmp_path: Path) -> None:
    def broken(values: dict[str, float], step: int | None = None) -> None:
        raise OSError("logger offline")

    model, twin = ResidualNet(), ResidualNet()
    twin.load_state_dict(model.state_dict())
    inject_observer(model, output_dir=tmp_path, sampling=1, sinks=[MetricLoggerSink(broken)])
    batches = make_batches(3)
    losses = train(model, batches)
    remove_observer(model)
    assert losses == train(twin, batches)
    errors = read_report(tmp_path)["errors"]
    assert errors[0]["stage"] == "sink" and errors[0]["message"] == "logger offline"
    assert torch.equal(model.head.weight, twin.head.weight)


def test_directory_sink_writes_full_details_when_asked(tmp_path: Path) -> None:
    import json

    from torchinstruments import DirectorySink

    sink = DirectorySink(tmp_path, write_full_details=True)
    model = ResidualNet()
    inject_observer(model, output_dir=tmp_path, sampling=1, sinks=[sink])
    train(model, make_batches(30))
    remove_observer(model)
    details = json.loads((tmp_path / "details.json").read_text(encoding="utf-8"))
    report = read_report(tmp_path)
    assert details["schema"] == "torchinstruments.details/1"
    assert len(details["series"]) == report["coverage"]["tensor_series"] == 12
    fc = next(s for s in details["series"] if s["module"] == "fc" and s["signal"] == "activation")
    rms = fc["metrics"]["rms"]
    assert rms["count"] == 30 and rms["warmup_complete"] is True
    assert len(rms["history"]) <= 32
    assert (tmp_path / "index.md").is_file()


def test_directory_sink_rejects_a_non_bool_details_flag(tmp_path: Path) -> None:
    from torchinstruments import DirectorySink

    with pytest.raises(ConfigError, match="write_full_details must be a bool, got 'yes'"):
        DirectorySink(tmp_path, write_full_details="yes")  # type: ignore[arg-type]


def test_plots_are_written_and_linked_from_index(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ResidualNet()

    def scale_up(step: int) -> None:
        if step == 40:
            with torch.no_grad():
                model.fc.weight.mul_(8.0)

    inject_observer(model, output_dir=tmp_path, sampling=1, plots=True)
    train(model, make_batches(80), lr=0.01, on_step=scale_up)
    remove_observer(model)
    pictures = sorted((tmp_path / "plots").glob("*.png"))
    assert pictures, "no picture written"
    assert pictures[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    index = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert f"(plots/{pictures[0].name})" in index
    assert all("plot" not in event for event in read_report(tmp_path)["events"])


def test_plots_flag_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="plots must be a bool, got 1"):
        inject_observer(ResidualNet(), output_dir=tmp_path, plots=1)  # type: ignore[arg-type]


def test_echo_lines_meet_the_event_before_the_onset() -> None:
    from torchinstruments.plots import _echo_lines, render_plot

    points = [[10, 100, 2.0], [11, 110, 2.0], [12, 120, 8.0], [13, 130, 8.0]]
    event = {
        "id": "E1",
        "shape": "step",
        "module": "fc",
        "call_index": 0,
        "signal": "activation",
        "metric": "rms",
        "onset": {"sample": 12, "forward": 120},
        "history": {"metric": "rms", "points": points},
        "echoes": [
            {
                "module": "act",
                "history": {"metric": "rms", "points": [[11, 110, 0.5], [12, 120, 1.0]]},
            },
            {"module": "other", "history": {"metric": "zero_fraction", "points": points}},
            {"module": "lonely", "history": {"metric": "rms", "points": [[12, 120, 1.0]]}},
        ],
    }
    # Log scale: the echo is multiplied by 2.0 / 0.5 to meet the event at sample 11.
    assert _echo_lines(event, points, log=True) == [("act", ([110, 120], [2.0, 4.0]))]
    # Linear scale: shifted by 2.0 - 0.5.
    assert _echo_lines(event, points, log=False) == [("act", ([110, 120], [2.0, 2.5]))]
    assert render_plot(event)[:8] == b"\x89PNG\r\n\x1a\n"


class _Stopped(BaseException):
    """Stands for a SIGKILL: nothing after it runs (not an Exception, so not caught)."""


def _numbers(directory: Path) -> tuple[int, int | None]:
    """The report number of ``report.json`` and the one ``index.md`` states."""
    run = read_report(directory)["run"]
    index = (directory / "index.md").read_text(encoding="utf-8")
    match = re.search(r"^Report (\d+) of the run started (\S+) ", index, re.MULTILINE)
    assert match is None or match.group(2) == run["started_at"]
    return run["report_number"], int(match.group(1)) if match else None


def test_report_and_index_state_one_report_number_whenever_a_write_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchinstruments.plots
    import torchinstruments.sinks

    # Where symbolic links cannot be made, each file is replaced on its own (the linked
    # layout is tested in test_sinks_generations.py).
    monkeypatch.setattr(torchinstruments.sinks, "symlinks_work", lambda directory: False)
    torch.manual_seed(0)
    model = ResidualNet()
    handle = inject_observer(
        model,
        output_dir=tmp_path,
        sampling=1,
        plots=True,
        track_config=TrackConfig(warmup_samples=4),
    )
    assert _numbers(tmp_path) == (1, 1)  # written at injection
    assert read_report(tmp_path)["coverage"]["file_write_mode"] == "replace_each"
    for step, batch in enumerate(make_batches(16)):
        if step == 8:
            with torch.no_grad():
                model.fc.weight.mul_(8.0)  # an event, and its picture
        train(model, [batch])
    handle.flush()
    # Reports 1 at injection, 2 after the warm-up, 3 at the flush.
    assert _numbers(tmp_path) == (3, 3)
    assert list((tmp_path / "plots").glob("*.png")), "no picture: the test draws nothing"

    # Stopped while drawing: the pictures come first, so both files stay at report 3.
    def stop(event: dict[str, Any]) -> bytes:
        raise _Stopped

    with monkeypatch.context() as patch:
        patch.setattr(torchinstruments.plots, "render_plot", stop)
        with pytest.raises(_Stopped):
            handle.flush()
    assert _numbers(tmp_path) == (3, 3)

    # Stopped between the two replacements (report.json first): index.md is an earlier
    # report (the last one that reached it, 3: report 4 was stopped), and says which.
    replace = os.replace
    calls: list[str] = []

    def replace_then_stop(source: str, target: os.PathLike[str] | str) -> None:
        calls.append(Path(target).name)
        if Path(target).name == "index.md":
            raise _Stopped
        replace(source, target)

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", replace_then_stop)
        with pytest.raises(_Stopped):
            handle.flush()
    assert calls[-2:] == ["report.json", "index.md"]  # after the pictures
    assert calls[:-2] and all(name.endswith(".png") for name in calls[:-2])
    assert _numbers(tmp_path) == (5, 3)
    remove_observer(model)
    assert _numbers(tmp_path) == (6, 6)
