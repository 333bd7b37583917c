"""Real-model fault benchmark: upstream models, real training loops, default settings.

Known faults (a normalisation bypassed or its weight zeroed, a weight rescaled, attention
scaling wrong, dropout raised, an activation swapped, NaN from an op or a weight, a
gradient-only change, a learning rate, momentum or weight decay gone wrong) are injected
at a known module and step into models from upstream packages with random init:
transformers' GPT-2 (a plain loop and ``transformers.Trainer``), torchvision's ResNet
(plain loop) and timm's Vision Transformer (accelerate), on synthetic data made locally.
Each run is observed with the library's *default* settings and its ``report.json`` is
scored with :mod:`benchmarks.faults.score` (hit@1, hit@3, MRR, notable findings of the
controls) plus the notable findings dated before the fault (``early``). A probe with
plain torch hooks checks every declared origin without the library; ``--compare`` also
runs ``torchinstruments.compare_runs`` against each family's same-seed control. See
``benchmarks/real_faults/README.md``.

    python -m benchmarks.real_faults --threads 2      # everything (about 15 min, 2 cores)
    python -m benchmarks.real_faults --quick          # CI smoke: one fault + control per loop
    python -m benchmarks.real_faults --only gpt2_fc_x8_h2 --keep-reports /tmp/real
"""
