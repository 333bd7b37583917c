"""Opt-in histograms with fixed edges: mergeable by adding counts.

A :class:`HistogramSpec` (built with :func:`histogram`) fixes ``bins`` equal-width bins
over ``value_range``, plus three extra counts: underflow (below the range), overflow
(above it) and non-finite. Because the edges never change, histograms of different
samples, runs or ranks merge by adding counts (:meth:`Histogram.merge`), exactly.

Counts are computed on the tensor's device (``torch.histc`` plus three comparisons) and
reach the host with the other statistics, in batches.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ._validate import require_float, require_int
from .errors import ConfigError

__all__ = ["Histogram", "HistogramSpec", "histogram", "histogram_counts"]

#: Most bins of one histogram. Each observed tensor's counts are a float64 row of
#: ``bins + 3`` held until the next flush (up to 4,096 rows) and kept per series; at
#: 4,096 bins that is 32 KiB per row, 128 MiB for a full batch of pending rows.
MAX_BINS = 4_096


@dataclass(frozen=True, slots=True, kw_only=True)
class HistogramSpec:
    """Which tensors get a histogram, and its fixed edges.

    Args:
        bins: equal-width bins over ``value_range``, 1 to ``MAX_BINS`` (4,096). Default 64.
        value_range: ``(low, high)`` in the tensor's units, low < high. Default (-8, 8).
        every_n_samples: take a histogram every n-th sample of a series, 1 to 2**31.
            Default 10.
        signals: ``"activation"`` and/or ``"grad_output"``. Default activations only.
        include: glob patterns of module names; None for every observed module.

    Raises:
        ConfigError: a field is out of range or of the wrong type.
    """

    bins: int = 64
    value_range: tuple[float, float] = (-8.0, 8.0)
    every_n_samples: int = 10
    signals: tuple[str, ...] = ("activation",)
    include: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        require_int("histogram", "bins", self.bins, minimum=1, maximum=MAX_BINS)
        require_int(
            "histogram", "every_n_samples", self.every_n_samples, minimum=1, maximum=1 << 31
        )
        if not isinstance(self.value_range, tuple | list) or len(self.value_range) != 2:
            raise ConfigError(
                f"histogram.value_range must be a (low, high) pair, got {self.value_range!r}"
            )
        low = require_float("histogram", "value_range[0]", self.value_range[0])
        high = require_float("histogram", "value_range[1]", self.value_range[1])
        if not low < high:
            raise ConfigError(
                f"histogram.value_range must have low < high, got {self.value_range!r}"
            )
        object.__setattr__(self, "value_range", (low, high))
        signals = tuple(self.signals)
        if not signals or any(s not in ("activation", "grad_output") for s in signals):
            raise ConfigError(
                "histogram.signals must be a non-empty selection of ('activation', "
                f"'grad_output'), got {self.signals!r}"
            )
        object.__setattr__(self, "signals", signals)
        if self.include is not None:
            patterns = (self.include,) if isinstance(self.include, str) else tuple(self.include)
            if not all(isinstance(p, str) for p in patterns):
                raise ConfigError(
                    f"histogram.include must be glob pattern strings, got {self.include!r}"
                )
            object.__setattr__(self, "include", patterns)

    @property
    def edges(self) -> list[float]:
        """The ``bins + 1`` bin edges."""
        low, high = self.value_range
        width = (high - low) / self.bins
        return [low + i * width for i in range(self.bins)] + [high]

    def applies_to(self, module: str, signal: str) -> bool:
        """True if a series of this module name and signal gets this histogram."""
        if signal not in self.signals:
            return False
        return self.include is None or any(fnmatch.fnmatchcase(module, p) for p in self.include)


def histogram(
    bins: int = 64,
    value_range: tuple[float, float] = (-8.0, 8.0),
    every_n_samples: int = 10,
    *,
    signals: Sequence[str] = ("activation",),
    include: str | Sequence[str] | None = None,
) -> HistogramSpec:
    """Ask for fixed-edge histograms: ``inject_observer(model, histograms=[histogram()])``.

    See :class:`HistogramSpec` for the arguments. Histograms never go into
    ``report.json`` beyond a bounded summary; ``details.json`` and TensorBoard get them.

    Example:
        >>> histogram(bins=4, value_range=(-1.0, 1.0)).edges
        [-1.0, -0.5, 0.0, 0.5, 1.0]
    """
    include_patterns = (include,) if isinstance(include, str) else include
    return HistogramSpec(
        bins=bins,
        value_range=value_range,
        every_n_samples=every_n_samples,
        signals=tuple(signals),
        include=tuple(include_patterns) if include_patterns is not None else None,
    )


@torch.no_grad()
def histogram_counts(x: Tensor, spec: HistogramSpec) -> Tensor:
    """Counts of one tensor, on its device, as float64 of shape ``(bins + 3,)``.

    Layout: ``bins`` in-range counts (the last bin includes ``high``), then underflow
    (< low), overflow (> high), non-finite. Complex tensors are counted by magnitude.
    """
    x = x.detach()
    if x.is_complex():
        x = x.abs()
    low, high = spec.value_range
    finite = torch.isfinite(x)
    values = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device)).float()
    in_range = torch.histc(values, bins=spec.bins, min=low, max=high)
    nonfinite = (~finite).sum()
    # Masked (non-finite) positions hold 0: correct the bin or the side they fell on.
    zero_bin = torch.zeros(spec.bins, dtype=in_range.dtype, device=x.device)
    if low <= 0.0 <= high:
        index = min(int((0.0 - low) / (high - low) * spec.bins), spec.bins - 1)
        zero_bin[index] = 1.0
    in_range = in_range - zero_bin * nonfinite
    under = (values < low).sum() - (nonfinite if low > 0.0 else 0)
    over = (values > high).sum() - (nonfinite if high < 0.0 else 0)
    tail = torch.stack([under, over, nonfinite]).to(in_range.dtype)
    return torch.cat([in_range, tail]).to(torch.float64)


class Histogram:
    """Counts accumulated over samples for one series.

    Attributes:
        spec: the fixed edges.
        counts: ``bins + 3`` floats (in-range bins, underflow, overflow, non-finite).
        samples: how many samples were added.
    """

    __slots__ = ("counts", "first_sample", "latest_sample", "samples", "spec")

    def __init__(self, spec: HistogramSpec) -> None:
        self.spec = spec
        self.counts = [0.0] * (spec.bins + 3)
        self.samples = 0
        self.first_sample: int | None = None
        self.latest_sample: int | None = None

    def add(self, sample: int, counts: Sequence[float]) -> None:
        """Add one sample's counts (a row of :func:`histogram_counts`)."""
        if len(counts) != len(self.counts):
            raise ValueError(
                f"Histogram.add: expected {len(self.counts)} counts, got {len(counts)}"
            )
        self.counts = [a + b for a, b in zip(self.counts, counts, strict=True)]
        self.samples += 1
        if self.first_sample is None:
            self.first_sample = sample
        self.latest_sample = sample

    def merge(self, other: Histogram) -> None:
        """Add another histogram with the same edges (another run, rank or series).

        Raises:
            ValueError: the edges differ.
        """
        if other.spec.bins != self.spec.bins or other.spec.value_range != self.spec.value_range:
            raise ValueError(
                "Histogram.merge: edges differ "
                f"({self.spec.bins} bins over {self.spec.value_range} vs "
                f"{other.spec.bins} bins over {other.spec.value_range})"
            )
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.samples += other.samples

    @property
    def total(self) -> float:
        """All elements counted, non-finite included."""
        return sum(self.counts)

    def summary(self) -> dict[str, object]:
        """A few numbers for the bounded report: totals and out-of-range fractions."""
        total = self.total or 1.0
        bins = self.spec.bins
        return {
            "samples": self.samples,
            "first_sample": self.first_sample,
            "latest_sample": self.latest_sample,
            "elements": self.total,
            "underflow_fraction": self.counts[bins] / total,
            "overflow_fraction": self.counts[bins + 1] / total,
            "nonfinite_fraction": self.counts[bins + 2] / total,
        }
