"""Dashboard sinks keep every telemetry point at the caller's steps, read back from the
files a real ``wandb`` (offline) and a real ``SummaryWriter`` write.

The training loop logs its own loss at its optimizer step, as a user does; the telemetry
must land beside it: at the training-forward index of each sample by default, at the
caller's step after ``ObserverHandle.set_step``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import ResidualNet, make_batches
from torchinstruments import (
    ConfigError,
    DefaultSampling,
    MetricLoggerSink,
    TensorBoardSink,
    inject_observer,
    remove_observer,
)
from torchinstruments.sinks import scalar_tag

#: Training forwards of the runs below: the default schedule's first 6 + 6 + 6 samples
#: (intervals 1, 2 and 4) and then interval 8.
FORWARDS = 48
EXPECTED_SAMPLE_FORWARDS = [i for i in range(FORWARDS) if DefaultSampling().should_sample(i)]


class Recorder:
    """A Lightning-style logger keeping every ``log_metrics`` call: the ground truth of
    what the observer handed to its sinks."""

    def __init__(self) -> None:
        self.points: dict[tuple[int, str], float] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for tag, value in metrics.items():
            assert (step, tag) not in self.points
            self.points[(step, tag)] = value


def run_loop(
    model: nn.Module,
    log_loss: Callable[[float, int], None],
    *,
    forwards_per_step: int = 1,
    set_step: Callable[[int], None] | None = None,
) -> None:
    """SGD on seeded batches; the loss is logged at the optimizer step after it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = make_batches(FORWARDS)
    for step in range(FORWARDS // forwards_per_step):
        if set_step is not None:
            set_step(step)
        optimizer.zero_grad()
        total = 0.0
        for x, y in batches[step * forwards_per_step : (step + 1) * forwards_per_step]:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            total += loss.item()
        optimizer.step()
        log_loss(total, step)


def wandb_history(run_dir: Path) -> list[tuple[int, dict[str, Any]]]:
    """``(step, row)`` of every history record in an offline run's ``.wandb`` file, and
    ``(-1, {})`` for its exit record.

    The file is a LevelDB-format log (a 7-byte ``:W&B`` header, then 32 KiB blocks of
    records with a 7-byte header: checksum, little-endian length, type 1 full / 2 first
    / 3 middle / 4 last) of protobuf ``Record`` messages, read with wandb's own
    message classes.
    """
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"

    def payloads() -> Iterator[bytes]:
        position, block, parts = 7, 32768, []
        while position + 7 <= len(data):
            left = block - position % block
            if left < 7:  # block trailer: zero padding
                position += left
                continue
            length = int.from_bytes(data[position + 4 : position + 6], "little")
            kind = data[position + 6]
            payload = data[position + 7 : position + 7 + length]
            position += 7 + length
            if kind == 1:
                yield payload
            elif kind == 2:
                parts = [payload]
            elif kind == 3:
                parts.append(payload)
            elif kind == 4:
                yield b"".join([*parts, payload])

    rows = []
    for payload in payloads():
        record = wandb_internal_pb2.Record()  # type: ignore[missing-attribute]
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "exit":
            rows.append((-1, {}))  # the run's last record
        elif record.WhichOneof("record_type") == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            rows.append((record.history.step.num, row))
    return rows


def finished_wandb_history(run_dir: Path, timeout_s: float = 60.0) -> list[tuple[int, dict]]:
    """:func:`wandb_history` once the file holds its exit record: wandb's service
    process may still be writing the last records when ``run.finish()`` returns."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = wandb_history(run_dir)
        if (rows and rows[-1][0] == -1) or time.monotonic() > deadline:
            return [row for row in rows if row[0] != -1]
        time.sleep(0.2)


def test_wandb_offline_keeps_every_point_at_the_training_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(
        project="torchinstruments-test",
        dir=str(tmp_path),
        settings=wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True),
    )
    recorder = Recorder()
    torch.manual_seed(0)
    model = ResidualNet()
    inject_observer(
        model,
        output_dir=tmp_path / "stats",
        sinks=[MetricLoggerSink(wandb.log), MetricLoggerSink(recorder, prompt=False)],
    )
    run_loop(model, lambda loss, step: wandb.log({"train/loss": loss}, step=step))
    remove_observer(model)
    run.finish()

    history = finished_wandb_history(Path(run.dir).parent)
    logged = {(step, tag): value for step, row in history for tag, value in row.items()}
    assert [step for step, _ in history] == list(range(FORWARDS))
    assert all((step, "train/loss") in logged for step in range(FORWARDS))
    assert sorted({step for step, _ in recorder.points}) == EXPECTED_SAMPLE_FORWARDS
    assert len(recorder.points) == len(EXPECTED_SAMPLE_FORWARDS) * 12  # 6 modules x 2 signals
    missing = {key: v for key, v in recorder.points.items() if logged.get(key) != v}
    assert missing == {}


def test_tensorboard_keeps_every_point_beside_the_callers_curve(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    recorder = Recorder()
    torch.manual_seed(0)
    model = ResidualNet()
    inject_observer(
        model,
        output_dir=tmp_path / "stats",
        sinks=[TensorBoardSink(writer), MetricLoggerSink(recorder, prompt=False)],
    )
    run_loop(model, lambda loss, step: writer.add_scalar("train/loss", loss, step))
    remove_observer(model)
    writer.close()

    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    assert isinstance(tags, list)
    logged = {(event.step, tag): event.value for tag in tags for event in events.Scalars(tag)}
    assert [e.step for e in events.Scalars("train/loss")] == list(range(FORWARDS))
    assert sorted({step for step, _ in recorder.points}) == EXPECTED_SAMPLE_FORWARDS
    assert len(logged) == FORWARDS + len(recorder.points)
    # Event files store float32.
    assert all(
        logged.get(key) == pytest.approx(value, rel=1e-6) for key, value in recorder.points.items()
    )
    tag = scalar_tag("fc", 0, "activation", "output", "rms")
    assert [e.step for e in events.Scalars(tag)] == EXPECTED_SAMPLE_FORWARDS


def test_set_step_puts_the_points_at_the_callers_step(tmp_path: Path) -> None:
    """Two forwards per optimizer step: each sample is logged at the step it fed."""
    recorder = Recorder()
    torch.manual_seed(0)
    model = ResidualNet()
    handle = inject_observer(
        model, output_dir=tmp_path, sampling=2, sinks=[MetricLoggerSink(recorder)]
    )
    run_loop(model, lambda loss, step: None, forwards_per_step=2, set_step=handle.set_step)
    remove_observer(model)
    # sampling=2 samples forwards 0, 2, 4, ...: the first forward of every step.
    assert sorted({step for step, _ in recorder.points}) == list(range(FORWARDS // 2))
    assert len(recorder.points) == FORWARDS // 2 * 12


@pytest.mark.parametrize("step", [-1, 1.5, True, "3", 2**63, 2**70])
def test_set_step_rejects_what_is_not_a_step(tmp_path: Path, step: object) -> None:
    handle = inject_observer(ResidualNet(), output_dir=tmp_path)
    with pytest.raises(
        ConfigError, match=r"set_step: step must be an int >= 0 and below 2\*\*63, got "
    ):
        handle.set_step(step)  # type: ignore[arg-type]
    handle.remove()
