"""Callbacks that observe a model inside a training framework's own loop.

Each submodule needs its framework, installed as an extra; importing this package
imports none of them:

- :mod:`torchinstruments.integrations.lightning`: a PyTorch Lightning ``Callback``
  (``pip install "torchinstruments[lightning]"``);
- :mod:`torchinstruments.integrations.transformers`: a Hugging Face ``TrainerCallback``
  (``pip install "torchinstruments[transformers]"``).

Both inject the observer when training starts, give the trainer's step to the dashboard
sinks before every batch (:meth:`~torchinstruments.ObserverHandle.set_step`) and remove
the observer, writing the final report, when training ends.
"""

from __future__ import annotations

__all__: list[str] = []
