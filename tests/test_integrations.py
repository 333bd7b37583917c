"""The shipped callbacks run inside the real trainers, on tiny models with random
initial weights and local data: the report covers the model, and the dashboard scalars
sit at the trainer's own logging steps; ``transformers.Trainer`` also with
``torch_compile=True``, training as without the callback. ``accelerate`` is tested in both orders
(prepare then inject, inject then prepare), with and without bf16 autocast.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import REPO, read_report, read_series
from torchinstruments import MetricLoggerSink, inject_observer, remove_observer
from torchinstruments.sinks import scalar_tag


class Recorder:
    """A logger keeping every ``(step, tag)`` the sink handed over."""

    def __init__(self) -> None:
        self.points: dict[tuple[int, str], float] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for tag, value in metrics.items():
            self.points[(step, tag)] = value

    def steps(self) -> list[int]:
        return sorted({step for step, _ in self.points})


# --------------------------------------------------------------------------- Lightning


def test_lightning_callback_observes_fit_and_logs_at_the_trainers_steps(tmp_path: Path) -> None:
    pytest.importorskip("lightning.pytorch")
    pytest.importorskip("tensorboard")
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.data import DataLoader, TensorDataset

    from torchinstruments.integrations.lightning import TorchInstrumentsCallback

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.log("train_loss", loss, on_step=True, on_epoch=False)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(96, 8), torch.randn(96, 1))
    recorder = Recorder()
    callback = TorchInstrumentsCallback(tmp_path / "stats", sampling=1, sinks=[])
    logger = TensorBoardLogger(save_dir=str(tmp_path / "logs"), name="run")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=12,
        accumulate_grad_batches=2,  # 24 forwards, 12 optimizer steps
        log_every_n_steps=1,
        logger=[logger, _RecordingLightningLogger(recorder)],
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(Regressor(), DataLoader(data, batch_size=4))
    assert callback.handle is None

    report = read_report(tmp_path / "stats")
    assert report["errors"] == []
    assert report["run"]["samples_seen"] == 24
    assert report["coverage"]["backward_samples_observed"] == 24
    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    events.Reload()
    loss_steps = sorted({event.step for event in events.Scalars("train_loss")})
    tag = scalar_tag("body.0", 0, "activation", "output", "rms")
    telemetry_steps = [event.step for event in events.Scalars(tag)]
    # Two forwards per optimizer step, both at the step Lightning logs their loss at.
    assert loss_steps == list(range(12))
    assert telemetry_steps == sorted([*range(12), *range(12)])
    assert recorder.steps() == list(range(12))


class _RecordingLightningLogger:
    """Built on first use: a Lightning ``Logger`` writing into a :class:`Recorder`."""

    def __new__(cls, recorder: Recorder) -> Any:
        from lightning.pytorch.loggers import Logger

        class RecordingLogger(Logger):
            @property
            def name(self) -> str:
                return "recording"

            @property
            def version(self) -> int:
                return 0

            def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
                pass

            def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
                if step is not None:
                    recorder.log_metrics(
                        {k: v for k, v in metrics.items() if k.startswith("torchinstruments/")},
                        step,
                    )

        return RecordingLogger()


def test_callback_arguments_are_checked_when_the_callback_is_made() -> None:
    """A callback made with an output_dir that is no path, Lightning's metrics given
    as one str, or a sampling, selection or report_config that inject_observer refuses,
    fails at once with an error naming the callback and the argument (it raised a bare
    TypeError, or at fit start a ConfigError that named an internal sink and the str's
    characters, or inject_observer)."""
    pytest.importorskip("lightning.pytorch")
    pytest.importorskip("transformers")
    from torchinstruments.errors import ConfigError
    from torchinstruments.integrations.lightning import TorchInstrumentsCallback as Lightning
    from torchinstruments.integrations.transformers import TorchInstrumentsCallback as Hf

    for callback in (Lightning, Hf):
        with pytest.raises(ConfigError) as error:
            callback(None)  # type: ignore[arg-type]
        assert str(error.value).startswith(
            "TorchInstrumentsCallback: output_dir must be a non-empty path"
        ), error.value
        assert str(error.value).endswith("got None")
    with pytest.raises(ConfigError) as error:
        Lightning("stats", metrics="rms")
    assert str(error.value) == (
        "TorchInstrumentsCallback: metrics must be a sequence of metric names, as ('rms',), "
        "got the str 'rms'"
    )
    # What inject_observer would refuse at fit start is refused now, in its words.
    refused: list[tuple[dict[str, Any], str]] = [
        ({"sampling": 0}, "sampling must be None, an int >= 1 (at most 2**62) or a "),
        ({"include": 5}, "include must be a glob pattern string or a sequence of them"),
        ({"exclude": [3]}, "exclude must be a glob pattern string or a sequence of them"),
        ({"report_config": {"max_bytes": 10}}, "report_config must be a ReportConfig or None"),
        ({"sinks": 5}, "sinks must be an iterable of sinks, got 5"),
        ({"sinks": [object()]}, "each sink needs a write(report) method, got <object"),
    ]
    with pytest.raises(ConfigError) as error:
        Lightning("stats", metrics=("rms", "nope"))
    assert str(error.value).startswith("TorchInstrumentsCallback: metrics must be a non-empty")
    for callback in (Lightning, Hf):
        for kwargs, message in refused:
            with pytest.raises(ConfigError) as error:
                callback("stats", **kwargs)
            assert str(error.value).startswith(f"TorchInstrumentsCallback: {message}"), error.value


def test_lightning_example_uses_the_shipped_callback() -> None:
    source = (REPO / "examples" / "lightning_mnist.py").read_text()
    assert "from torchinstruments.integrations.lightning import TorchInstrumentsCallback" in source
    assert "class TorchInstrumentsCallback" not in source


# ------------------------------------------------------------------------ Transformers


def tiny_gpt2() -> nn.Module:
    """A two-block GPT-2 from a config: random initial weights, nothing downloaded."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, use_cache=False
    )
    return transformers.GPT2LMHeadModel(config)


def training_arguments(directory: Path, **options: Any) -> Any:
    """``TrainingArguments`` of the tiny runs, with ``options`` added: 4 optimizer steps
    of 4 rows on the CPU, the loss logged at each, nothing saved or reported."""
    transformers = pytest.importorskip("transformers")
    return transformers.TrainingArguments(
        output_dir=str(directory / "trainer"),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **options,
    )


def token_rows(count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        ids = torch.randint(0, 64, (16,), generator=generator)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_transformers_callback_observes_training(
    tmp_path: Path, gradient_checkpointing: bool
) -> None:
    transformers = pytest.importorskip("transformers")
    from torchinstruments.integrations.transformers import TorchInstrumentsCallback

    model = tiny_gpt2()
    recorder = Recorder()
    callback = TorchInstrumentsCallback(
        tmp_path / "stats", sampling=1, sinks=[MetricLoggerSink(recorder, prompt=False)]
    )
    import dataclasses

    # The field's name since transformers 5 (the old one still works, with a warning).
    fields = {field.name for field in dataclasses.fields(transformers.TrainingArguments)}
    name = (
        "activation_checkpointing"
        if "activation_checkpointing" in fields
        else "gradient_checkpointing"
    )
    args = training_arguments(
        tmp_path,
        gradient_accumulation_steps=2,  # 8 forwards
        **{name: gradient_checkpointing},
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=token_rows(32), callbacks=[callback]
    )
    trainer.train()
    assert callback.handle is None

    report = read_report(tmp_path / "stats")
    assert report["errors"] == []
    assert report["run"]["samples_seen"] == 8  # recomputed forwards are no samples
    assert report["coverage"]["backward_samples_observed"] == 8
    modules = {f["module"] for f in report["findings"]}
    assert all(not module.startswith("module.") for module in modules)
    assert modules & {"transformer.h.0.mlp.c_fc", "transformer.h.1.attn.c_proj", "lm_head"}
    # The telemetry sits at the steps Trainer logs its loss at: 1, 2, 3, 4.
    loss_steps = [entry["step"] for entry in trainer.state.log_history if "loss" in entry]
    assert loss_steps == list(range(1, 5))
    assert recorder.steps() == loss_steps
    tag = scalar_tag("lm_head", 0, "activation", "output", "rms")
    assert all((step, tag) in recorder.points for step in loss_steps)


def test_transformers_trainer_with_torch_compile_trains_as_without_the_callback(
    tmp_path: Path,
) -> None:
    """``TrainingArguments(torch_compile=True)``: Trainer compiles the model itself
    (``aot_eager`` here, to keep the test short); with the callback the statistics are
    computed inside the compiled graphs and every logged loss and every parameter after
    training equal those of the same run without it."""
    transformers = pytest.importorskip("transformers")
    from torchinstruments.integrations.transformers import TorchInstrumentsCallback

    def train(callbacks: list[Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
        model = tiny_gpt2()
        args = training_arguments(tmp_path, torch_compile=True, torch_compile_backend="aot_eager")
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=token_rows(16), callbacks=callbacks
        )
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return losses, model.state_dict()

    losses, parameters = train([TorchInstrumentsCallback(tmp_path / "stats", sampling=2)])
    plain_losses, plain_parameters = train([])
    assert len(losses) == 4 and losses == plain_losses
    assert all(torch.equal(value, plain_parameters[name]) for name, value in parameters.items())
    report = read_report(tmp_path / "stats")
    assert report["errors"] == []
    assert report["coverage"]["compiled_capture"]["mode"] == "in_graph"
    assert report["coverage"]["backward_samples_observed"] == 2
    assert {"transformer.h.0.mlp.c_fc", "lm_head"} <= {
        row["module"] for row in read_series(tmp_path / "stats")
    }


# -------------------------------------------------------------------------- accelerate


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
@pytest.mark.parametrize("order", ["prepare_then_inject", "inject_then_prepare"])
def test_accelerate_in_both_orders(tmp_path: Path, order: str, mixed_precision: str) -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision=mixed_precision)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if order == "inject_then_prepare":
        inject_observer(model, output_dir=tmp_path, sampling=1)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    if order == "prepare_then_inject":
        inject_observer(prepared, output_dir=tmp_path, sampling=1)
    losses = []
    for row in token_rows(5):
        batch = {key: value.unsqueeze(0).repeat(2, 1) for key, value in row.items()}
        optimizer.zero_grad()
        loss = prepared(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    remove_observer(prepared if order == "prepare_then_inject" else model)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()

    report = read_report(tmp_path)
    assert report["errors"] == []
    assert report["run"]["samples_seen"] == 5
    assert report["coverage"]["backward_samples_observed"] == 5
    modules = {f["module"] for f in report["findings"]}
    assert modules and all(not name.startswith(("module.", "_orig_mod.")) for name in modules)
    assert all(torch.isfinite(torch.tensor(losses)))
