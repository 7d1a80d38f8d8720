"""The optimizer and its schedule: AdamW with declared weight decay, linear warm-up then cosine decay.

Weight decay is declared where a parameter is created, not guessed from names or shapes: a parameter
declared with :func:`mixers.layers.no_weight_decay` (norm gains and biases, biases, recurrence
parameters such as decay rates and transition logits, the embedding) or marked
``p._no_weight_decay = True`` is never decayed, every other parameter gets ``train.weight_decay``.
"""
from __future__ import annotations

import math

import torch

from mixers.layers import split_weight_decay

from ..config import Recipe


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decayed, undecayed = split_weight_decay(model)
    return [{"params": list(decayed.values()), "weight_decay": weight_decay},
            {"params": list(undecayed.values()), "weight_decay": 0.0}]


def lr_at(step: int, recipe: Recipe) -> float:
    """The learning rate at ``step`` as a fraction of ``train.lr``: ``(step + 1) / warmup_steps`` during the warm-up
    (its last step reaches the peak, which the first step of the decay keeps), then a cosine from 1 down to
    ``min_lr_ratio`` at step ``steps``, one past the last update (which runs slightly above the floor)."""
    t = recipe.train
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def fused_update(model: torch.nn.Module) -> bool:
    """Whether AdamW updates ``model`` in its fused kernels: where every parameter is a floating CUDA tensor.

    On a GPU the default (``foreach``) update launches a dozen multi-tensor kernels per step and the fused one
    one or two, which a small model's step feels. CPU runs keep the default update, whose rounding every CPU
    table was recorded with."""
    params = list(model.parameters())
    return bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)


def make_optimizer(model: torch.nn.Module, recipe: Recipe):
    """``(optimizer, scheduler)`` for ``model`` under ``recipe.train``."""
    t = recipe.train
    fused = {"fused": True} if fused_update(model) else {}
    optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=tuple(t.betas), **fused)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, recipe))
