"""Fault-localisation benchmark: does the report name the module where a fault starts?

Known faults (a weight scaled up, a ReLU killed by its bias, NaN in one output, a
residual branch scaled down, a normalization removed, one channel growing, the inputs
rescaled, the learning rate raised, a backward-only gradient change) are injected at a
known module and step into three small model families (a residual MLP with LayerNorm, a
CNN with BatchNorm, a transformer encoder), next to one clean control per family. Each
run is observed with ``sampling=1`` and its ``report.json`` is scored: hit@1, hit@3 and
reciprocal rank of the origin among the notable findings of the expected categories, and
the notable and non-finite findings of the controls. See :mod:`.score` for the exact
definitions and :mod:`.scenarios` for the ground truth.

    python -m benchmarks.faults              # every scenario, 300 steps (a few minutes)
    python -m benchmarks.faults --quick      # CI smoke: fewer scenarios and steps
    python -m benchmarks.faults --only mlp_nan_b5 --keep-reports /tmp/faults
"""
