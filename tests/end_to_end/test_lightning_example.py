"""The Lightning example trains on a generated MNIST-format data set and puts the task
metrics and our telemetry into one TensorBoard run.

The data set is written as the four uncompressed IDX files that
``torchvision.datasets.MNIST`` reads from ``<root>/MNIST/raw/``, so the example's real
loading code runs unchanged (with ``--no-download``: nothing is fetched).
"""

from __future__ import annotations

import math
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("torchvision")
pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.harness import REPO, read_report

ROOT = REPO
EXAMPLE = ROOT / "examples" / "lightning_mnist.py"
TRAIN_IMAGES, TEST_IMAGES = 768, 256
MAX_STEPS = 48  # 4 epochs of 12 batches of 64
TASK_TAGS = {"train_loss", "train_acc", "val_loss", "val_acc"}
#: Qualified names of the example model's observed modules (the root and the leaves).
MODEL_MODULES = {
    "<root>",
    *(f"features.{i}" for i in range(6)),
    *(f"classifier.{i}" for i in range(4)),
}


def digit_like_images(count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """28x28 uint8 images: a bright blob whose place on a 4x3 grid is the label, jittered
    by up to 2 pixels, over faint noise: learnable in a few dozen steps."""
    labels = torch.randint(0, 10, (count,), generator=generator)
    rows = 5.0 + 6.0 * (labels // 3).float() + torch.randint(-2, 3, (count,), generator=generator)
    cols = 6.0 + 8.0 * (labels % 3).float() + torch.randint(-2, 3, (count,), generator=generator)
    grid = torch.arange(28, dtype=torch.float32)
    distance = (grid.view(1, 28, 1) - rows.view(-1, 1, 1)) ** 2 + (
        grid.view(1, 1, 28) - cols.view(-1, 1, 1)
    ) ** 2
    blob = torch.exp(-distance / (2 * 2.0**2))
    noise = 0.15 * torch.rand(count, 28, 28, generator=generator)
    pixels = (255 * (blob + noise).clamp(0, 1)).round().to(torch.uint8)
    return pixels, labels.to(torch.uint8)


def write_idx(path: Path, data: torch.Tensor) -> None:
    """IDX ("SN3 Pascal Vincent") format: magic 0x0000080N (unsigned bytes, N dimensions),
    big-endian dimension sizes, then the bytes."""
    header = struct.pack(">I", 0x0800 | data.dim()) + struct.pack(f">{data.dim()}I", *data.shape)
    path.write_bytes(header + data.contiguous().numpy().tobytes())


def write_mnist(root: Path, seed: int = 0) -> Path:
    """``root/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``, as torchvision expects."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    for split, count in (("train", TRAIN_IMAGES), ("t10k", TEST_IMAGES)):
        images, labels = digit_like_images(count, generator)
        write_idx(raw / f"{split}-images-idx3-ubyte", images)
        write_idx(raw / f"{split}-labels-idx1-ubyte", labels)
    return raw


def run_example(cwd: Path, *args: str | Path | int) -> subprocess.CompletedProcess[str]:
    # One intra-op thread: the model is tiny, and on a shared CI machine OpenMP threads
    # that wait for a busy core make every reduction many times slower.
    environment = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
        cwd=cwd,
        check=False,
    )


def test_generated_mnist_reads_back_through_torchvision(tmp_path: Path) -> None:
    datasets = pytest.importorskip("torchvision.datasets")
    write_mnist(tmp_path)
    train = datasets.MNIST(tmp_path, train=True, download=False)
    test = datasets.MNIST(tmp_path, train=False, download=False)
    assert (len(train), len(test)) == (TRAIN_IMAGES, TEST_IMAGES)
    assert train.data.shape == (TRAIN_IMAGES, 28, 28) and train.data.dtype == torch.uint8
    assert set(train.targets.tolist()) == set(range(10))


def test_lightning_example_reports_and_logs_to_tensorboard(tmp_path: Path) -> None:
    write_mnist(tmp_path / "data")
    output_dir, log_dir = tmp_path / "stats", tmp_path / "logs"
    result = run_example(
        tmp_path,
        "--data-dir", tmp_path / "data",
        "--output-dir", output_dir,
        "--log-dir", log_dir,
        "--max-steps", MAX_STEPS,
        "--no-download",
        "--seed", 0,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr

    # It says where the report and the TensorBoard logs are.
    assert f"Report: {output_dir / 'report.json'}" in result.stdout
    match = re.search(r"^TensorBoard logs: (\S+)", result.stdout, re.MULTILINE)
    assert match is not None, result.stdout
    run_dir = Path(match.group(1))
    assert run_dir.parent.parent == log_dir

    # The report covers the model's modules, with samples.
    report = read_report(output_dir)
    assert (output_dir / "index.md").is_file()
    assert report["errors"] == []
    assert report["run"]["samples_seen"] == MAX_STEPS  # sampling=1, one forward per step
    assert report["coverage"]["samples_observed"] == MAX_STEPS
    assert report["coverage"]["backward_samples_observed"] == MAX_STEPS
    assert report["coverage"]["eval_forwards_skipped"] > 0  # sanity check and validation
    assert report["findings"]
    named = {finding["module"] for finding in report["findings"]}
    assert named & (MODEL_MODULES - {"<root>"}), named
    assert named <= MODEL_MODULES | {"<model>"}, named

    # One TensorBoard run holds the task metrics and the telemetry.
    events = EventAccumulator(str(run_dir))
    events.Reload()
    scalar_tags = events.Tags()["scalars"]
    assert isinstance(scalar_tags, list)
    tags = set(scalar_tags)
    assert tags >= TASK_TAGS, tags
    telemetry = {tag for tag in tags if tag.startswith("torchinstruments/")}
    assert "torchinstruments/<root>/activation/rms" in telemetry
    assert "torchinstruments/classifier.3/grad_output/rms" in telemetry
    steps = [event.step for event in events.Scalars("torchinstruments/features.0/activation/rms")]
    assert len(steps) == MAX_STEPS
    assert all(math.isfinite(event.value) for event in events.Scalars(min(telemetry)))

    # The model trained: the loss fell and validation accuracy is far above chance.
    losses = [event.value for event in events.Scalars("train_loss")]
    assert len(losses) >= 5
    assert sum(losses[-2:]) / 2 < 0.5 * sum(losses[:2]) / 2, losses
    assert events.Scalars("val_acc")[-1].value > 0.6


def test_no_download_without_data_fails_clearly(tmp_path: Path) -> None:
    result = run_example(tmp_path, "--data-dir", tmp_path / "empty", "--no-download")
    assert result.returncode == 2
    assert "MNIST not found" in result.stderr
    assert list(tmp_path.iterdir()) == []  # nothing created, nothing fetched
