"""Loss-scale capture for ``torch.amp.GradScaler``.

Output gradients computed from ``scaler.scale(loss).backward()`` carry the loss scale.
While at least one observer is attached, ``torch.amp.GradScaler.scale`` is wrapped (the
class attribute, restored when the last observer detaches) so that each observer learns
the scale tensor in force for the backward of its latest sampled forward. The wrapper
calls the original first and returns its result unchanged; it keeps a device copy of the
scale (no host synchronisation) and never raises.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .observer import Observer

__all__ = ["install", "uninstall"]

_LOCK = threading.Lock()
_OBSERVERS: weakref.WeakSet[Observer] = weakref.WeakSet()
_ORIGINAL: Callable[..., Any] | None = None


def _scaler_class() -> type | None:
    amp = getattr(torch, "amp", None)
    return getattr(amp, "GradScaler", None) if amp is not None else None


def _scale_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def scale(self: Any, outputs: Any) -> Any:
        result = original(self, outputs)
        try:
            tensor = getattr(self, "_scale", None)
            if getattr(self, "_enabled", False) and isinstance(tensor, torch.Tensor):
                for observer in list(_OBSERVERS):
                    observer.note_loss_scale(tensor)
        except Exception:  # never break training
            pass
        return result

    scale.__wrapped__ = original  # type: ignore[attr-defined]
    scale.__doc__ = original.__doc__
    scale._torchinstruments = True  # type: ignore[attr-defined]
    return scale


def install(observer: Observer) -> None:
    """Start telling ``observer`` about loss scales (wraps ``GradScaler.scale`` once)."""
    global _ORIGINAL
    cls = _scaler_class()
    if cls is None:
        return
    with _LOCK:
        if _ORIGINAL is None:
            _ORIGINAL = cls.scale
            cls.scale = _scale_wrapper(_ORIGINAL)  # type: ignore[method-assign]
        _OBSERVERS.add(observer)


def uninstall(observer: Observer) -> None:
    """Stop telling ``observer``; restore ``GradScaler.scale`` after the last one."""
    global _ORIGINAL
    cls = _scaler_class()
    with _LOCK:
        _OBSERVERS.discard(observer)
        if not _OBSERVERS and _ORIGINAL is not None and cls is not None:
            if getattr(cls.scale, "_torchinstruments", False):
                cls.scale = _ORIGINAL  # type: ignore[method-assign]
            _ORIGINAL = None
