"""The optimizer and the learning-rate schedule of every training stage.

- `param_groups(model, weight_decay)`: AdamW groups. Matrices of Linear layers decay;
  norms, biases and embeddings (token and learned position tables, and so a tied LM
  head) do not. A parameter shared by two modules (tied embeddings) is listed once.
- `build_optimizer(model, cfg, device)`: `torch.optim.AdamW` over those groups with
  betas (beta1, beta2) from the config.
- `lr_at(step, ...)`: linear warmup then cosine decay to `min_lr`, a pure function of
  the optimizer step, so a resumed run needs nothing but the step to know its LR.
- `set_trainable(model, patterns, key)`: freeze every parameter whose name no glob in
  `patterns` matches (DPO's `dpo.trainable`); the optimizer then leaves the frozen ones out.

PPO/GRPO reuse these with their own section's numbers (`lr_at(step, lr=..., min_lr=...,
warmup_steps=..., max_steps=cfg.steps)`).
"""
from __future__ import annotations

import fnmatch
import math
import re
from typing import Sequence

import torch
from torch import nn

from llm.config import TrainConfig

# Modules whose parameters never take weight decay: shrinking a norm's gain or an
# embedding row towards zero is not regularisation, it changes the scale of the trunk.
_NO_DECAY_MODULES: tuple[type[nn.Module], ...] = (nn.Embedding, nn.LayerNorm, nn.GroupNorm,
                                                  nn.BatchNorm1d, nn.RMSNorm)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: `decay` (weight matrices) and `no_decay` (norms, biases, embeddings).

    A parameter is in `no_decay` if it is owned by an embedding or norm module (also a
    custom norm class whose name ends in "Norm"), if its name ends in "bias", or if it
    has fewer than 2 dimensions. Frozen parameters (requires_grad=False) are left out.
    """
    no_decay_ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, _NO_DECAY_MODULES) or type(module).__name__.endswith("Norm"):
            no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
    decay, no_decay, seen = [], [], set()
    decay_names, no_decay_names = [], []
    for name, p in model.named_parameters():  # shared parameters appear once
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in no_decay_ids or name.endswith("bias") or p.ndim < 2:
            no_decay.append(p)
            no_decay_names.append(name)
        else:
            decay.append(p)
            decay_names.append(name)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay", "param_names": decay_names},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay", "param_names": no_decay_names}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device | str = "cpu",
                    ) -> torch.optim.AdamW:
    """AdamW over `param_groups(model, cfg.weight_decay)`, lr set per step by `lr_at`.

    The fused kernel (one pass over each tensor for all of AdamW's updates) on CUDA and on
    the CPU; elsewhere torch's default. On the CPU it is several times faster than the default
    foreach kernel (docs/log.md, 2026-12-01) and gives the same weights up to float
    rounding. It is elementwise, so deterministic, which exact resume relies on.
    """
    fused = torch.device(device).type in ("cuda", "cpu")
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=fused or None)


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based).

    Steps 0 .. warmup_steps-1 ramp linearly to `lr` (step 0 gets lr/warmup_steps, never
    0, so the first step learns something); then cosine from `lr` at step warmup_steps
    to `min_lr` at step max_steps; beyond max_steps it stays at `min_lr`.
    """
    if step < 0:
        raise ValueError(f"lr_at: step must be >= 0, got {step}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max_steps - warmup_steps
    if decay_steps <= 0:
        return lr
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def lr_for(step: int, cfg: TrainConfig) -> float:
    """`lr_at` with the numbers of a TrainConfig section."""
    return lr_at(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def set_trainable(model: nn.Module, patterns: Sequence[str], key: str = "trainable") -> list[str]:
    """Freeze every parameter whose name matches none of `patterns` (fnmatch globs over
    `model.named_parameters()` names: "*" = all, "norm_f.weight", "blocks.3.*"); return
    the names left trainable. A glob that matches no parameter is a ValueError naming `key`
    and the parameter names, so a typo never silently trains nothing.
    """
    params = dict(model.named_parameters())
    matched = {pat: [n for n in params if fnmatch.fnmatchcase(n, pat)] for pat in patterns}
    unmatched = [pat for pat, names in matched.items() if not names]
    if unmatched:
        # one entry per kind: blocks.0.attn.qkv.weight, blocks.1.attn.qkv.weight, ... -> blocks.*.attn.qkv.weight
        kinds = list(dict.fromkeys(re.sub(r"^blocks\.\d+\.", "blocks.*.", n) for n in params))
        raise ValueError(f"{key}: {unmatched} match no parameter of the model; its parameters are"
                         f" {', '.join(kinds)}")
    keep = {n for names in matched.values() for n in names}
    for name, p in params.items():
        p.requires_grad_(name in keep)
    return [n for n in params if n in keep]
