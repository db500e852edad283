"""The failures of a training run that are not about its params or its data.

Bad params (`llm.config.ConfigError`), bad data (`llm.fileio.DataError`) and bad model
directories (`llm.artifacts.ArtifactError`) each have their class beside the code that finds
them. These are raised from several places, and every stage reports them the same way:

- `NonFiniteError`: a NaN or Inf where training cannot go on: a non-finite loss or gradient
  norm under `nonfinite_policy: raise` (or the skip budget spent), from the training loop
  (llm/loop.py); or, in debug mode (llm/model.py `enable_debug`), the first sub-module whose
  output holds one.
- `QualityGateError`: a stage trained to the end but its output is not fit to hand on (reward
  model accuracy below `reward.min_accuracy`, KL above `*.max_kl`, no informative GRPO group for
  too long). The message says which gate, the numbers and what to change; no model is written.
- `CheckpointError`: a checkpoint that cannot be trusted (llm/checkpoint.py): a bad manifest,
  a hash that does not match, a non-finite tensor.

Stages turn both into a one-line message and exit status 1 (llm/stage.py).
"""
from __future__ import annotations


class NonFiniteError(FloatingPointError):
    """A NaN or Inf that stops training; the message names the step or the module."""


class QualityGateError(RuntimeError):
    """A stage's output would be unusable downstream; the message names the gate and the numbers."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted; the message names the directory and the reason."""
