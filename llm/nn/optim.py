"""The optimizer and the learning-rate schedule of every training stage.

- `param_groups(model, weight_decay)`: AdamW groups. Matrices of Linear layers decay;
  norms, biases and embeddings (token and learned position tables, and so a tied LM
  head) do not. A parameter shared by two modules (tied embeddings) is listed once.
- `build_optimizer(model, cfg, device)`: `torch.optim.AdamW` over those groups with
  betas (beta1, beta2) from the config.
- `build_optimizers(model, cfg, device)`: what a training stage steps, by `cfg.optimizer`:
  `adamw`, [build_optimizer's AdamW]; `muon`, [torch.optim.Muon over the transformer blocks'
  weight matrices (`is_muon_param`), AdamW over everything else]: the split nanochat and the
  modded-nanogpt speedruns make. Muon orthogonalises each matrix's momentum (five Newton-Schulz
  iterations), an update that suits a hidden layer's matrix but not an embedding table (one row
  per token, each seen rarely), the LM head or a vector. Muon runs on one process or under DDP
  (every rank holds the whole gradient); the config refuses it with FSDP2, whose sharded
  gradients torch.optim.Muon accepts but does not orthogonalise as whole matrices.
- `lr_at(step, ...)`: linear warmup then cosine decay to `min_lr`, a pure function of
  the optimizer step, so a resumed run needs nothing but the step to know its LR.
  `set_lr(optimizers, lr)` applies it to every group; Muon's group follows the same curve
  scaled to its own peak, `muon_lr` (its `lr_ratio`, muon_lr / lr).
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

from llm.config import ConfigError, LoopConfig, TrainConfig

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


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """Whether Muon takes a parameter of `param_groups`' decay group: a 2-D weight matrix inside a
    transformer block (module path `blocks.<i>.`; attention's fused q/k/v projection is one matrix).
    Embeddings, the LM head, a reward or value head, norms' gains and biases stay with AdamW."""
    return p.ndim == 2 and _IN_BLOCK.search(name) is not None


_IN_BLOCK = re.compile(r"(^|\.)blocks\.\d+\.")


def build_optimizers(model: nn.Module, cfg: LoopConfig, device: torch.device | str = "cpu",
                     key: str = "train") -> list[torch.optim.Optimizer]:
    """The optimizers a stage steps one after the other, by `cfg.optimizer` (module docstring).

    `muon`: torch.optim.Muon at cfg.muon_lr (momentum 0.95, Nesterov, decoupled weight decay
    cfg.weight_decay times its lr, each update scaled by sqrt(max(1, rows/cols)) as in Keller
    Jordan's Muon) over the decay group's block matrices, first; then AdamW, as `build_optimizer`,
    over the rest. Muon's Newton-Schulz runs in bfloat16; on the CPU it is deterministic, so
    exact resume holds as with AdamW. `key` is the params section, for the error."""
    if cfg.optimizer == "adamw":
        return [build_optimizer(model, cfg, device)]
    muon = {"params": [], "param_names": [], "name": "muon", "lr_ratio": cfg.muon_lr / cfg.lr}
    adamw = []
    for g in param_groups(model, cfg.weight_decay):
        rest = {**g, "params": [], "param_names": []}
        for name, p in zip(g["param_names"], g["params"]):
            to = muon if g["name"] == "decay" and is_muon_param(name, p) else rest
            to["params"].append(p)
            to["param_names"].append(name)
        if rest["params"]:
            adamw.append(rest)
    if not muon["params"]:
        raise ConfigError([f"{key}.optimizer: muon, but the model has no trainable weight matrix in a transformer"
                           f" block (blocks.<i>.*) for Muon to train; set {key}.optimizer: adamw"])
    if any(hasattr(p, "device_mesh") for p in muon["params"]):  # a DTensor: FSDP2 sharded the model
        raise ConfigError([f"{key}.optimizer: muon does not run under {key}.distributed: fsdp (torch.optim.Muon"
                           f" would orthogonalise the sharded gradient, not the whole matrix); set"
                           f" {key}.distributed: ddp, or {key}.optimizer: adamw"])
    fused = torch.device(device).type in ("cuda", "cpu")
    out: list[torch.optim.Optimizer] = [torch.optim.Muon([muon], lr=cfg.muon_lr, weight_decay=cfg.weight_decay,
                                                         momentum=0.95, nesterov=True)]
    if adamw:
        out.append(torch.optim.AdamW(adamw, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=fused or None))
    return out


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


def set_lr(optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], lr: float) -> None:
    """Every group's lr: `lr`, times the group's `lr_ratio` where it has one (Muon's)."""
    for opt in [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else optimizers:
        for group in opt.param_groups:
            group["lr"] = lr * group["lr_ratio"] if "lr_ratio" in group else lr


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
