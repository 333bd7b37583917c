"""Sampling policies: which root forwards are observed.

A policy sees the 0-based index of each training root forward (eval and no-grad forwards
are not counted) and answers whether it is sampled. The decision is made once per root
forward; every hook of an unsampled forward returns after one attribute check.

Policies are deterministic functions of the forward index, so a baseline run and a
candidate run that make the same calls sample the same forwards.
"""

from __future__ import annotations

import bisect
import time
from typing import Protocol, runtime_checkable

from ._validate import require_float, require_int, shown
from .errors import ConfigError

__all__ = [
    "DefaultSampling",
    "EveryNSampling",
    "SampleForwards",
    "SamplingPolicy",
    "TimeBudgetSampling",
    "policy_from_description",
    "resolve_sampling",
]


@runtime_checkable
class SamplingPolicy(Protocol):
    """Decides which training root forwards are sampled.

    Implementations must be deterministic in ``forward_index`` and cheap: the call happens
    once per training root forward.
    """

    def should_sample(self, forward_index: int) -> bool:
        """Return True if the root forward with this 0-based index is sampled."""
        ...

    # Optional, not part of the runtime check: a policy that is a function of the index
    # alone may also define ``next_sampled(forward_index) -> int``, the first sampled
    # forward at or after ``forward_index``, in the class that defines ``should_sample``
    # (and agreeing with it). The observer then does not ask about the forwards in
    # between (see ``Observer.enter_root``), which saves a call per unsampled forward.

    def describe(self) -> dict[str, object]:
        """Return a JSON-safe description of the effective schedule, for the report."""
        ...


class EveryNSampling:
    """Samples every ``n``-th training root forward, starting with the first.

    Args:
        n: interval in root forwards; ``n=1`` samples every forward.

    Raises:
        ConfigError: ``n`` is not an int >= 1.

    Example:
        >>> [i for i in range(7) if EveryNSampling(3).should_sample(i)]
        [0, 3, 6]
    """

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = require_int("EveryNSampling", "n", n, minimum=1, maximum=1 << 62)

    def should_sample(self, forward_index: int) -> bool:
        return forward_index % self.n == 0

    def next_sampled(self, forward_index: int) -> int:
        """The first sampled forward at or after ``forward_index`` (>= 0)."""
        return forward_index + (-forward_index) % self.n

    def describe(self) -> dict[str, object]:
        return {"policy": "every_n", "interval_forwards": self.n}

    @classmethod
    def from_description(cls, description: object) -> EveryNSampling | None:
        """The policy whose :meth:`describe` gave ``description``, or None when no
        ``EveryNSampling`` describes itself so.

        Example:
            >>> EveryNSampling.from_description({"policy": "every_n", "interval_forwards": 3})
            EveryNSampling(3)
        """
        if not isinstance(description, dict) or description.get("policy") != "every_n":
            return None
        n = description.get("interval_forwards")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1 << 62:
            return None
        return cls(n)

    def forward_of(self, sample: int) -> int:
        """The training forward of sample ``sample`` (0-based, >= 0)."""
        return sample * self.n

    def sample_at(self, forward_index: int) -> int | None:
        """The sample taken at ``forward_index`` (>= 0), or None if it is not sampled."""
        return forward_index // self.n if forward_index % self.n == 0 else None

    def samples_in(self, forwards: int) -> int:
        """Samples taken in the first ``forwards`` training forwards (>= 0)."""
        return -(-forwards // self.n)

    def __repr__(self) -> str:
        return f"EveryNSampling({self.n})"


class DefaultSampling:
    """Dense at the start, sparser later: the default deterministic schedule.

    The run is cut into stages of ``samples_per_stage`` samples each. Stage 0 samples every
    forward, stage 1 every 2nd, stage 2 every 4th, and so on, doubling until
    ``max_interval_forwards``, which then holds for the rest of the run. With the defaults
    (6 samples per stage, interval at most 256) a run samples its first 6 forwards, then
    every 2nd, every 4th and every 8th, so the 24-sample warm-up completes at forward 82;
    34 samples fall in a 300-step run, 44 in the first 1,000, 48 in the first 1,530, and
    after forward 1,530 one forward in 256 is sampled; a fault halfway through a 200-step
    run has 6 samples after it. The defaults were chosen with ``benchmarks/overhead.py``:
    on the CPU a sample of a small model costs about one plain training step (its code
    and trackers are out of cache by the next one), so the number of samples in the
    first 1,000 forwards sets what the start of a run costs. With 16 per stage (96
    samples in 1,000 forwards) the whole of a 1,000-step run cost 1.14x to 1.17x on the
    MLP and the example's model; with 8 (56 samples), 1.09x to 1.12x; with 6, 1.08x to
    1.09x (same process, interleaved). The last doubling (128 to 256) halves the
    steady-state cost of samples on such small models: at one in 128 that alone was
    about 1.5% of a 0.8 ms step.

    Args:
        samples_per_stage: samples taken at each interval before it doubles. Default 6.
        max_interval_forwards: largest interval, in root forwards. Default 256.

    Raises:
        ConfigError: an argument is not an int >= 1.

    Example:
        >>> policy = DefaultSampling(samples_per_stage=2, max_interval_forwards=4)
        >>> [i for i in range(16) if policy.should_sample(i)]
        [0, 1, 2, 4, 6, 10, 14]
    """

    __slots__ = ("_stage_starts", "max_interval_forwards", "samples_per_stage")

    def __init__(self, *, samples_per_stage: int = 6, max_interval_forwards: int = 256) -> None:
        self.samples_per_stage = require_int(
            "DefaultSampling", "samples_per_stage", samples_per_stage, minimum=1
        )
        self.max_interval_forwards = require_int(
            "DefaultSampling", "max_interval_forwards", max_interval_forwards, minimum=1
        )
        # (first forward of the stage, interval) for each stage until the interval caps.
        starts: list[tuple[int, int]] = []
        start, interval = 0, 1
        while True:
            starts.append((start, interval))
            if interval >= self.max_interval_forwards:
                break
            start += self.samples_per_stage * interval
            interval = min(interval * 2, self.max_interval_forwards)
        self._stage_starts = tuple(starts)

    def _stage_at(self, forward_index: int) -> tuple[int, int]:
        """(first forward, interval) of the stage holding ``forward_index``."""
        stage = self._stage_starts[-1]
        if forward_index >= stage[0]:  # the steady state: one test
            return stage
        stage = self._stage_starts[0]
        for candidate in self._stage_starts:
            if forward_index < candidate[0]:
                break
            stage = candidate
        return stage

    def interval_at(self, forward_index: int) -> int:
        """Return the sampling interval, in forwards, in force at ``forward_index``."""
        return self._stage_at(forward_index)[1]

    def should_sample(self, forward_index: int) -> bool:
        stage_start, interval = self._stage_at(forward_index)
        return (forward_index - stage_start) % interval == 0

    def next_sampled(self, forward_index: int) -> int:
        """The first sampled forward at or after ``forward_index`` (>= 0).

        Every stage's first forward is sampled and lies on the previous stage's grid, so
        the next point of the grid of the stage holding ``forward_index`` is the answer.
        """
        stage_start, interval = self._stage_at(forward_index)
        return forward_index + (stage_start - forward_index) % interval

    def describe(self) -> dict[str, object]:
        return {
            "policy": "default",
            "samples_per_stage": self.samples_per_stage,
            "max_interval_forwards": self.max_interval_forwards,
            "stages": [
                {"from_forward": start, "interval_forwards": interval}
                for start, interval in self._stage_starts
            ],
        }

    @classmethod
    def from_description(cls, description: object) -> DefaultSampling | None:
        """The policy whose :meth:`describe` gave ``description``, or None when no
        ``DefaultSampling`` describes itself so (its stages included).

        Example:
            >>> DefaultSampling.from_description(DefaultSampling().describe())
            DefaultSampling(samples_per_stage=6, max_interval_forwards=256)
        """
        if not isinstance(description, dict) or description.get("policy") != "default":
            return None
        per_stage = description.get("samples_per_stage")
        largest = description.get("max_interval_forwards")
        if not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (per_stage, largest)
        ):
            return None
        assert isinstance(per_stage, int) and isinstance(largest, int)
        # The stages grow with log2(largest): a number a JSON file can hold has at most
        # 63 of them, checked before they are built.
        stages = description.get("stages")
        if not isinstance(stages, list) or not 1 <= len(stages) <= 64:
            return None
        policy = cls(samples_per_stage=per_stage, max_interval_forwards=largest)
        return policy if policy.describe()["stages"] == stages else None

    def forward_of(self, sample: int) -> int:
        """The training forward of sample ``sample`` (0-based, >= 0)."""
        stage = min(sample // self.samples_per_stage, len(self._stage_starts) - 1)
        start, interval = self._stage_starts[stage]
        return start + (sample - stage * self.samples_per_stage) * interval

    def sample_at(self, forward_index: int) -> int | None:
        """The sample taken at ``forward_index`` (>= 0), or None if it is not sampled."""
        stage = 0
        for index, (start, _) in enumerate(self._stage_starts):
            if forward_index >= start:
                stage = index
        start, interval = self._stage_starts[stage]
        if (forward_index - start) % interval:
            return None
        return stage * self.samples_per_stage + (forward_index - start) // interval

    def samples_in(self, forwards: int) -> int:
        """Samples taken in the first ``forwards`` training forwards (>= 0)."""
        total = 0
        last = len(self._stage_starts) - 1
        for index, (start, interval) in enumerate(self._stage_starts):
            if forwards <= start:
                break
            count = -(-(forwards - start) // interval)
            total += count if index == last else min(count, self.samples_per_stage)
        return total

    def __repr__(self) -> str:
        return (
            f"DefaultSampling(samples_per_stage={self.samples_per_stage}, "
            f"max_interval_forwards={self.max_interval_forwards})"
        )


class TimeBudgetSampling:
    """Samples while the measured telemetry cost stays under a fraction of wall time.

    Opt-in and, unlike the other policies, not deterministic: the decision depends on
    measured times. The observer reports the seconds it spends in hooks, flushes and
    report writes through :meth:`note_cost`; a forward is sampled when the cost so far is
    at most ``max_fraction`` of the wall time since the first forward, and always when
    ``max_interval_forwards`` forwards passed without a sample. The first
    ``dense_forwards`` forwards are all sampled so that warm-up completes.

    Args:
        max_fraction: largest share of wall time spent on telemetry, in (0, 1].
            Default 0.02 (2%).
        dense_forwards: forwards sampled unconditionally at the start. Default 32.
        max_interval_forwards: most forwards between two samples. Default 1,000.

    Raises:
        ConfigError: an argument is out of range.
    """

    __slots__ = (
        "_cost_s",
        "_last_sampled",
        "_started",
        "dense_forwards",
        "max_fraction",
        "max_interval_forwards",
    )

    def __init__(
        self,
        max_fraction: float = 0.02,
        *,
        dense_forwards: int = 32,
        max_interval_forwards: int = 1_000,
    ) -> None:
        self.max_fraction = require_float(
            "TimeBudgetSampling",
            "max_fraction",
            max_fraction,
            minimum=0.0,
            maximum=1.0,
            exclusive_minimum=True,
        )
        self.dense_forwards = require_int(
            "TimeBudgetSampling", "dense_forwards", dense_forwards, minimum=0
        )
        self.max_interval_forwards = require_int(
            "TimeBudgetSampling", "max_interval_forwards", max_interval_forwards, minimum=1
        )
        self._cost_s = 0.0
        self._started: float | None = None
        self._last_sampled = -1

    def note_cost(self, seconds: float) -> None:
        """Add telemetry time, in seconds (called by the observer)."""
        self._cost_s += seconds

    @property
    def cost_s(self) -> float:
        """Telemetry seconds noted so far."""
        return self._cost_s

    def should_sample(self, forward_index: int) -> bool:
        now = time.perf_counter()
        if self._started is None:
            self._started = now
        sampled = (
            forward_index < self.dense_forwards
            or forward_index - self._last_sampled >= self.max_interval_forwards
            or self._cost_s <= self.max_fraction * (now - self._started)
        )
        if sampled:
            self._last_sampled = forward_index
        return sampled

    def describe(self) -> dict[str, object]:
        return {
            "policy": "time_budget",
            "max_fraction": self.max_fraction,
            "dense_forwards": self.dense_forwards,
            "max_interval_forwards": self.max_interval_forwards,
            "telemetry_seconds": round(self._cost_s, 6),
        }

    @classmethod
    def from_description(cls, description: object) -> TimeBudgetSampling | None:
        """A policy with the settings of ``description`` (its measured cost starts at
        zero), or None when no ``TimeBudgetSampling`` describes itself so. Only its
        dense start maps samples to forwards (:meth:`forward_of`)."""
        if not isinstance(description, dict) or description.get("policy") != "time_budget":
            return None
        try:
            return cls(
                description.get("max_fraction"),  # type: ignore[arg-type]
                dense_forwards=description.get("dense_forwards"),  # type: ignore[arg-type]
                max_interval_forwards=description.get("max_interval_forwards"),  # type: ignore[arg-type]
            )
        except ConfigError:
            return None

    def forward_of(self, sample: int) -> int | None:
        """The training forward of sample ``sample`` within the dense start, else None
        (later samples depend on measured times)."""
        return sample if sample < self.dense_forwards else None

    def sample_at(self, forward_index: int) -> int | None:
        """The sample taken at ``forward_index`` within the dense start, else None."""
        return forward_index if forward_index < self.dense_forwards else None

    def samples_in(self, forwards: int) -> None:
        """Unknown: samples after the dense start depend on measured times."""
        del forwards

    def __repr__(self) -> str:
        return f"TimeBudgetSampling(max_fraction={self.max_fraction})"


_DESCRIBED = {
    "every_n": EveryNSampling,
    "default": DefaultSampling,
    "time_budget": TimeBudgetSampling,
}


def policy_from_description(
    description: object,
) -> EveryNSampling | DefaultSampling | TimeBudgetSampling | None:
    """Rebuild a built-in policy from its :meth:`describe` output (as a report or
    ``series.json`` stores it under ``config.sampling``).

    Each policy checks the description itself (``from_description``); the rebuilt one
    maps samples to training forwards with ``forward_of``, ``sample_at`` and
    ``samples_in``.

    Returns:
        The policy, or None for a custom policy, a malformed description or one that
        no built-in policy gives.

    Example:
        >>> policy_from_description(EveryNSampling(4).describe()).forward_of(3)
        12
    """
    if not isinstance(description, dict):
        return None
    kind = _DESCRIBED.get(description.get("policy"))  # type: ignore[arg-type]
    return kind.from_description(description) if kind is not None else None


def resolve_sampling(sampling: object) -> SamplingPolicy:
    """Turn the ``sampling`` argument of ``inject_observer`` into a policy.

    Args:
        sampling: ``None`` (the default schedule), an int ``N >= 1`` (every N-th forward),
            or an object with ``should_sample(forward_index) -> bool`` and ``describe()``.

    Raises:
        ConfigError: anything else.
    """
    if sampling is None:
        return DefaultSampling()
    if isinstance(sampling, bool):
        raise ConfigError(
            "inject_observer: sampling must be None, an int >= 1 (at most 2**62) or a "
            f"SamplingPolicy, got {sampling!r}"
        )
    if isinstance(sampling, int):
        if not 1 <= sampling <= 1 << 62:
            raise ConfigError(
                "inject_observer: sampling must be None, an int >= 1 (at most 2**62) or a "
                f"SamplingPolicy, got {shown(sampling)}"
            )
        return EveryNSampling(sampling)
    if isinstance(sampling, type):
        raise ConfigError(
            "inject_observer: sampling must be None, an int >= 1 or a SamplingPolicy "
            f"instance, got the class {sampling.__name__}; pass {sampling.__name__}()"
        )
    if isinstance(sampling, SamplingPolicy):
        return sampling
    raise ConfigError(
        "inject_observer: sampling must be None, an int >= 1 or an object with "
        f"should_sample(forward_index) and describe(), got {type(sampling).__name__} "
        f"{shown(sampling)}"
    )


class SampleForwards:
    """Which training forward (0-based) each sample was taken at, as runs of arithmetic
    progressions ``[first sample, first forward, forward step, samples]``.

    A deterministic schedule needs one run per stage; each burst of forced samples (after
    a sentinel hit) or direct-call sample adds one or two. The observer appends every
    sample; ``series.json`` stores the runs and ``compare`` reads them back.

    Args:
        runs: runs to start from, each ``(first sample, first forward, step, samples)``
            with ``samples >= 1``, following on from the previous run.
        complete: False when samples were taken past the last run.
        max_runs: most runs kept (default ``MAX_RUNS``, 1,024); past it later samples
            are not recorded and ``complete`` turns False.
    """

    #: Default bound on the number of runs (32 bytes each plus list overhead).
    MAX_RUNS = 1024

    __slots__ = ("_first_forwards", "_first_samples", "complete", "max_runs", "runs")

    def __init__(
        self,
        runs: list[list[int]] | None = None,
        *,
        complete: bool = True,
        max_runs: int = MAX_RUNS,
    ) -> None:
        self.runs: list[list[int]] = [list(run) for run in runs or []]
        self.complete = complete
        self.max_runs = max_runs
        self._first_samples = [run[0] for run in self.runs]
        self._first_forwards = [run[1] for run in self.runs]

    @property
    def samples(self) -> int:
        """Samples covered: ``0 .. samples - 1`` have a known training forward."""
        if not self.runs:
            return 0
        last = self.runs[-1]
        return last[0] + last[3]

    def append(self, forward: int) -> None:
        """Record that the next sample (index ``samples``) was taken at ``forward``."""
        if not self.complete:
            return  # a sample was dropped: a later one must not extend a run past it
        runs = self.runs
        if runs:
            last = runs[-1]
            _, first_forward, step, count = last
            if count == 1:
                last[2], last[3] = forward - first_forward, 2
                return
            if forward == first_forward + step * count:
                last[3] = count + 1
                return
        if len(runs) >= self.max_runs:
            self.complete = False
            return
        sample = self.samples
        runs.append([sample, forward, 0, 1])
        self._first_samples.append(sample)
        self._first_forwards.append(forward)

    def forward(self, sample: int | None) -> int | None:
        """The training forward of ``sample``, or None (no such sample, or not kept)."""
        if sample is None or not 0 <= sample < self.samples:
            return None
        first_sample, first_forward, step, _ = self.runs[
            bisect.bisect_right(self._first_samples, sample) - 1
        ]
        return first_forward + (sample - first_sample) * step

    def sample(self, forward: int) -> int | None:
        """The sample taken at training forward ``forward``, or None."""
        index = bisect.bisect_right(self._first_forwards, forward) - 1
        if index < 0:
            return None
        first_sample, first_forward, step, count = self.runs[index]
        offset = forward - first_forward
        if offset == 0:
            return first_sample
        if step <= 0 or offset % step or offset // step >= count:
            return None
        return first_sample + offset // step
