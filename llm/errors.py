"""The failures of a training run that are not about its params or its data.

Bad params (`llm.config.ConfigError`), bad data (`llm.fileio.DataError`) and bad model
directories (`llm.nn.artifacts.ArtifactError`) each have their class beside the code that finds
them. These are raised from several places, and every stage reports them the same way:

- `NonFiniteError`: a NaN or Inf where training cannot go on: a non-finite loss or gradient
  norm under `nonfinite_policy: raise` (or the skip budget spent), from the training loop
  (llm/train/loop.py); or, in debug mode (llm/nn/model.py `enable_debug`), the first sub-module whose
  output holds one.
- `QualityGateError`: a stage trained to the end but its output is not fit to hand on (reward
  model accuracy below `reward.min_accuracy`, KL above `*.max_kl`), or a run that learns nothing
  (no informative GRPO group for `grpo.max_zero_std_steps` steps). Every gate fails with one
  message shape: which gate, measured vs limit, the params key to change, what to do; no model
  is written (the end of a stage checks its gates first: llm/train/finish.py).
- `CheckpointError`: a checkpoint that cannot be trusted (llm/train/checkpoint.py): a bad manifest,
  a hash that does not match, a non-finite tensor.
- `DiskFullError`: the disk or the user's quota filled up while an output was written. The
  atomic writes of llm/fileio.py raise it naming the output (what it replaced is left as it
  was); a write elsewhere that fills the disk is named by llm/stage.py from the error's file
  name or the stage's outputs. Libraries report a full disk in their own words (safetensors:
  "... No space left on device (os error 28)", not an OSError), so `is_disk_full` reads that
  message as well as the errno.

Stages turn each into a one-line message and exit status 1 (llm/stage.py). A message that lists
problems lists the first MAX_LISTED and counts the rest (`capped`).
"""
from __future__ import annotations

import errno

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# how Rust's std::io::Error ends its message (safetensors is written in Rust)
_RUST_DISK_FULL = tuple(f"(os error {n})" for n in DISK_FULL_ERRNOS)


MAX_LISTED = 20  # problems a message lists; a file of 50,000 bad keys must not print 50,000 lines


def capped(problems: list[str], most: int = MAX_LISTED) -> list[str]:
    """The first `most` of `problems`, and a last line counting the rest ("... and 49980 more"),
    for every message that lists problems: the first ones say what is wrong, the count how much."""
    if len(problems) <= most:
        return list(problems)
    return [*problems[:most], f"... and {len(problems) - most} more"]


class NonFiniteError(FloatingPointError):
    """A NaN or Inf that stops training; the message names the step or the module."""


class QualityGateError(RuntimeError):
    """A stage's output would be unusable downstream. Every gate's message has one shape:

        <stage>: quality gate failed: <gate> <measured> is <above|below|at> <key>=<limit> (<detail>).
        <advice>; <consequence>

    e.g. "ppo: quality gate failed: final KL to the reference 0.31 is above ppo.max_kl=0.2 (...)".
    The fields stay on the exception for a caller that wants them."""

    def __init__(self, stage: str, gate: str, measured: float, relation: str, key: str, limit: float, *,
                 detail: str = "", advice: str = "", consequence: str = "no model was written"):
        self.stage, self.gate, self.measured, self.key, self.limit = stage, gate, measured, key, limit
        why = f" ({detail})" if detail else ""
        super().__init__(f"{stage}: quality gate failed: {gate} {measured:.4g} is {relation} {key}={limit}{why}."
                         f" {advice}; {consequence}")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted; the message names the directory and the reason."""


class DiskFullError(OSError):
    """No space (or quota) left while writing an output; the message names the path and says to free space."""

    def __init__(self, path: object, what: str = "while writing it") -> None:
        super().__init__(f"{path}: no space left on the device {what}; free space on that disk (or raise the"
                         f" quota) and run it again (an output that was there before is left as it was)")
        self.errno = errno.ENOSPC


def is_disk_full(e: BaseException) -> bool:
    """Whether `e` reports a full disk or quota: an OSError with that errno, or a library's
    error that ends with Rust's form of that errno (safetensors, whose errors are not OSError)."""
    if isinstance(e, OSError):
        return e.errno in DISK_FULL_ERRNOS
    return type(e).__name__ == "SafetensorError" and str(e).rstrip().endswith(_RUST_DISK_FULL)
