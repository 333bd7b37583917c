"""The sentinel: non-finite checks of outputs in training forwards that are not sampled.

The forward context (``_context.py``) asks for a check of the root output of one
unsampled training forward in ``ROOT_SENTINEL_INTERVAL`` (every output of every
observed module with ``full_sentinel=True``). On the CPU the answer is read at once; on
an accelerator the sum stays on the device as a :class:`~._records.SentinelSum` and is
read at the next flush (no host sync). A hit is counted here, once per forward, and the
context samples the next forwards. See ``docs/architecture.md``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ._records import SentinelSum
from .capture import iter_output_tensors
from .reduce import skip_reason
from .series import ACTIVATION

if TYPE_CHECKING:
    from ._staging import StatisticsBuffer

__all__ = ["ROOT_SENTINEL_INTERVAL", "Sentinel", "next_root_sentinel", "root_sentinel_due"]

#: Without the full sentinel, the root output of one training forward in each run of
#: this many is checked when that forward is not sampled: in run ``b`` (forwards
#: ``8b`` to ``8b + 7``) the one at offset ``(b + 7) % 8`` (forwards 7, 8, 17, 26, ...,
#: 63, then 71, 72, ...). The offset moves so that a fault recurring with any period
#: and phase still meets a check (within 64 forwards; a fixed offset never saw one
#: on every 4th forward between samples on even forwards); checks are at most 9
#: forwards apart, so a persistent fault is caught within 9 forwards of its onset.
#: One reduction of a fresh tensor costs 10 to 14 us inside a training step on the
#: CPU (dispatch and allocation, in caches that the step's own kernels have just
#: evicted; measured with ``benchmarks/overhead.py``): on every forward that was 1.6%
#: of a 0.75 ms MLP step, over half of a 1.03x budget.
ROOT_SENTINEL_INTERVAL = 8

_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


class Sentinel:
    """Checks and hits of one observer.

    Args:
        names: the observed modules' names, by index (the observer's own list).
        buffer: where sums read at the next flush go (accelerator path).
    """

    #: Most sentinel events kept for the report (all are counted).
    MAX_SENTINEL_EVENTS = 16

    def __init__(self, names: list[str], buffer: StatisticsBuffer) -> None:
        self._names = names
        self._buffer = buffer
        #: Tensors checked (``coverage.sentinel_checks``).
        self.sentinel_checks = 0
        #: Unsampled training forwards with a hit (``coverage.sentinel_nonfinite_forwards``).
        self.sentinel_nonfinite_forwards = 0
        #: The first hits: forward, module, call index, tensor path, next sample.
        self.sentinel_events: list[dict[str, object]] = []
        #: Calls per module index in the open full-sentinel forward.
        self.calls: dict[int, int] = {}
        self._last_forward = -1
        #: Whether :meth:`check_root_on_cpu` is tried (False after a tensor it could not
        #: take).
        self._root_short_path = True

    def check_root_on_cpu(self, output: Tensor) -> bool | None:
        """The root sentinel's short path: True if the plain ``torch.Tensor`` ``output``
        holds a non-finite value, False if not, None where this path cannot tell and
        :meth:`check` decides: a tensor off the CPU, or on the CPU where it takes the
        device path (as tests emulate it); a complex, float8 or nested tensor, after
        which this path is no longer tried. Call it only while no torch-function or
        dispatch mode is active (the sum would reach user code).

        One unsampled forward in 8 runs it, in a training step whose kernels have just
        evicted its code from the caches, where each tensor attribute read costs about
        1 us. So it reads one (``is_cpu``) and lets the sum refuse what it cannot take,
        where :func:`~torchinstruments.reduce.skip_reason` reads eight (what that saves:
        ``benchmarks/README.md``). An integer or boolean tensor sums to an int (nothing
        to check, not counted); an empty one sums to 0.0 (counted, found finite)."""
        if (
            not self._root_short_path
            or not output.is_cpu
            or "cpu" in self._buffer.device_path_types
        ):
            return None
        enabled = _grad_enabled()
        _set_grad_enabled(False)
        try:
            total = output.sum().item()
            if type(total) is not float:
                if type(total) is int:
                    return False
                self._root_short_path = False
                return None
            self.sentinel_checks += 1
            # A sum of finite values can overflow: confirm before counting.
            return not math.isfinite(total) and not bool(torch.isfinite(output).all())
        except Exception:
            self._root_short_path = False
            return None
        finally:
            _set_grad_enabled(enabled)

    def check_output(
        self, index: int, call: int, output: object, forward: int, next_sample: int
    ) -> list[str]:
        """Check every floating tensor of ``output`` (module ``index``, call ``call``,
        training forward ``forward``); returns the tensor paths found non-finite at once
        (CPU), in output order."""
        hits = []
        for path, leaf in iter_output_tensors(output):
            if (
                isinstance(leaf, Tensor)
                and skip_reason(leaf) is None
                and self.check(index, call, path, leaf, forward, next_sample)
            ):
                hits.append(path)
        return hits

    def check(
        self, index: int, call: int, path: str, tensor: Tensor, forward: int, next_sample: int
    ) -> bool:
        """Check one tensor; True if it is found non-finite now (CPU). On the accelerator
        path the sum goes to the buffer and the answer comes with the flush."""
        self.sentinel_checks += 1
        value = tensor
        if value.is_complex():
            # Real and imaginary parts side by side: |z| could overflow where they do not.
            value = torch.view_as_real(value.detach().resolve_conj())
        if value.is_cpu and "cpu" not in self._buffer.device_path_types:
            # A non-finite element makes the sum non-finite; one plain reduction is
            # cheaper than an isfinite mask (and a sum in the tensor's own dtype than one
            # with a dtype argument). Confirm before counting: a sum can overflow. Grad
            # mode off rather than detach(): no autograd node and no tensor made for it.
            enabled = _grad_enabled()
            _set_grad_enabled(False)
            try:
                return not math.isfinite(value.sum().item()) and not bool(
                    torch.isfinite(value).all()
                )
            finally:
                _set_grad_enabled(enabled)
        value = value.detach()
        # One launch: a non-finite element makes the float64 sum non-finite, and float64
        # cannot overflow on a sum of finite float32 values. Float64 values can, so
        # their zero products are summed instead (NaN exactly where one is non-finite).
        if value.dtype == torch.float64:
            value = value * 0.0
        bad = value.sum(dtype=torch.float64).reshape(1)
        self._buffer.append(SentinelSum((index, call, ACTIVATION, path), forward, next_sample, bad))
        return False

    def note_hit(self, forward: int, index: int, call: int, path: str, next_sample: int) -> None:
        """Count a non-finite value seen in unsampled training forward ``forward``: only
        the first (earliest in forward order) of each forward counts."""
        if forward == self._last_forward:
            return
        self._last_forward = forward
        self.sentinel_nonfinite_forwards += 1
        if len(self.sentinel_events) < self.MAX_SENTINEL_EVENTS:
            self.sentinel_events.append(
                {
                    "forward_index": forward,
                    "module": self._names[index],
                    "call_index": call,
                    "tensor_path": path,
                    "next_sample": next_sample,
                }
            )


def root_sentinel_due(forward: int, interval: int) -> bool:
    """True if the root sentinel checks training forward ``forward`` (0-based): one per
    run of ``interval`` forwards, at an offset that moves by one each run (see
    :data:`ROOT_SENTINEL_INTERVAL`)."""
    return (forward - forward // interval) % interval == interval - 1


def next_root_sentinel(start: int, interval: int) -> int:
    """The first forward from ``start`` on that :func:`root_sentinel_due` picks: in run
    ``b`` (forwards ``b * interval`` on) the one at offset ``(b + interval - 1) % interval``,
    in the run of ``start`` or in the next one."""
    run = start // interval
    forward = run * interval + (run + interval - 1) % interval
    if forward < start:
        run += 1
        forward = run * interval + (run + interval - 1) % interval
    return forward
