"""Untrained models that still exercise every mixer: a zero-initialised output projection or scalar would
make a layer contribute nothing, so a test comparing two implementations of a model would pass vacuously."""
from __future__ import annotations

import torch


@torch.no_grad()
def wake_zero_initialised(model: torch.nn.Module) -> torch.nn.Module:
    """Give every all-zero ``nn.Linear`` weight random entries (std 0.2) and every zero scalar parameter the
    value 1, in place; returns ``model``."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.abs().sum() == 0:
            module.weight.normal_(0, 0.2)
    for p in model.parameters():
        if p.ndim == 0 and p.abs().sum() == 0:
            p.fill_(1.0)
    return model
