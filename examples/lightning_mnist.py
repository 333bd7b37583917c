"""Train a small CNN on MNIST with PyTorch Lightning, observed by torchinstruments.

    uv run examples/lightning_mnist.py                      # downloads MNIST into data/ if missing
    uv run examples/lightning_mnist.py --no-download --max-steps 200
    tensorboard --logdir lightning_logs                     # task metrics and telemetry together

The data is loaded with ``torchvision.datasets.MNIST`` exactly as in any MNIST example
(``--data-dir`` holds ``MNIST/raw/*-ubyte``; ``--download`` fetches it when missing). One
``TensorBoardLogger`` receives both the task metrics (``train_loss``, ``train_acc``,
``val_loss``, ``val_acc`` from ``self.log``) and our telemetry
(``torchinstruments/<module>/<signal>/rms``), so both sit in one TensorBoard run.

Where the observer goes: the shipped
:class:`torchinstruments.integrations.lightning.TorchInstrumentsCallback`, a Lightning
``Callback``. It injects the observer in ``on_fit_start`` (the model is on its device and
the logger's ``SummaryWriter`` exists, so the telemetry goes to the same TensorBoard run),
gives ``trainer.global_step`` to the sinks before every batch (so the telemetry sits at
the steps of ``train_loss``), and removes the observer in ``on_fit_end`` (or
``on_exception``), before the Trainer's teardown finalizes the logger: the final
``report.json`` is written before ``fit`` returns, and a later ``trainer.test`` or a
checkpoint sees the unmodified module. See ``docs/lightning.md``.

The observer is attached to the ``LightningModule`` itself (the root). ``training_step``
calls ``self(x)``, which runs through ``nn.Module.__call__`` and so through the root's
hooks: every training forward is a sample. Validation forwards run in ``eval()`` mode
under ``no_grad`` and are not mixed into the training series. ``sampling=1`` samples every
training forward, for a dense curve on this short run; drop it on long runs to use the
default schedule.

Options: ``--data-dir`` (default ``data``), ``--output-dir`` (report, default ``stats``),
``--log-dir`` (TensorBoard, default ``lightning_logs``), ``--max-steps``,
``--download/--no-download`` (default: download if missing), ``--seed``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from torchinstruments.integrations.lightning import TorchInstrumentsCallback

#: MNIST's pixel mean and standard deviation (the usual normalisation).
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


class MNISTClassifier(pl.LightningModule):
    """Two conv blocks and a two-layer head; logs loss and accuracy."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = lr
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 14x14
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 7x7
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * 7 * 7, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def _loss_and_accuracy(
        self, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = batch
        logits = self(images)  # through __call__: the observer's root hooks see it
        loss = F.cross_entropy(logits, labels)
        accuracy = (logits.argmax(dim=1) == labels).float().mean()
        return loss, accuracy

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        loss, accuracy = self._loss_and_accuracy(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        self.log("train_acc", accuracy, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss, accuracy = self._loss_and_accuracy(batch)
        self.log("val_loss", loss, on_step=False, on_epoch=True)
        self.log("val_acc", accuracy, on_step=False, on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def mnist_loaders(
    data_dir: Path, *, download: bool, batch_size: int = 64
) -> tuple[DataLoader[Any], DataLoader[Any]]:
    """The training split (shuffled) and the test split (for validation)."""
    transform = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))]
    )
    train = datasets.MNIST(data_dir, train=True, download=download, transform=transform)
    test = datasets.MNIST(data_dir, train=False, download=download, transform=transform)
    return (
        DataLoader(train, batch_size=batch_size, shuffle=True),
        DataLoader(test, batch_size=256),
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a small CNN on MNIST with Lightning.")
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--output-dir", type=Path, default=Path("stats"))
    parser.add_argument("--log-dir", type=Path, default=Path("lightning_logs"))
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument(
        "--download",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="download MNIST into --data-dir when it is missing (default: yes)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.max_steps < 1:
        parser.error(f"--max-steps must be at least 1, got {args.max_steps}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    pl.seed_everything(args.seed, workers=True, verbose=False)
    try:
        train_loader, val_loader = mnist_loaders(args.data_dir, download=args.download)
    except RuntimeError as error:  # torchvision: "Dataset not found ..."
        print(f"MNIST not found under {args.data_dir}/MNIST/raw: {error}", file=sys.stderr)
        return 2
    # Tiny CPU loaders: worker processes would cost more than they save.
    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    logger = TensorBoardLogger(save_dir=args.log_dir, name="mnist")
    observe = TorchInstrumentsCallback(args.output_dir, sampling=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.max_steps,
        # Validate at the end of every epoch, or once at --max-steps within the first.
        val_check_interval=min(args.max_steps, len(train_loader)),
        limit_val_batches=20,
        log_every_n_steps=5,
        logger=logger,
        callbacks=[observe],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(MNISTClassifier(), train_dataloaders=train_loader, val_dataloaders=val_loader)

    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    print(
        f"{trainer.global_step} steps: "
        + ", ".join(f"{name} {value:.4f}" for name, value in sorted(metrics.items()))
    )
    print(f"Report: {args.output_dir / 'report.json'} (for people: {args.output_dir / 'index.md'})")
    print(f"TensorBoard logs: {logger.log_dir} (view with: tensorboard --logdir {args.log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
