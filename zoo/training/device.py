"""Device, precision and autocast of the training side, in one place: which device a recipe's
``train.device`` names, which precision ``train.precision`` means there, and the autocast region it runs
under. Training, evaluation, ``zoo eval``, ``zoo generate`` and the preflight checks all choose through these
functions.

Precision ``auto`` keeps fp32 on a CPU (bf16/fp16 matmuls are far slower there) and takes bf16 autocast on
CUDA; ``fp32`` runs without autocast; ``bf16`` and ``fp16`` autocast to that dtype (fp16 training adds a
gradient scaler, :class:`zoo.training.state.TrainState`).
"""
from __future__ import annotations

import torch

from ..errors import UserError


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else the CPU; a named device is checked to exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device=cuda but no CUDA device is available; use train.device=cpu (or auto)")
    return torch.device(name)


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` -> ``bf16`` on CUDA, ``fp32`` elsewhere."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def autocast(device: torch.device, precision: str = "auto"):
    """The autocast region of ``precision`` on ``device`` (disabled for fp32)."""
    precision = resolve_precision(precision, device)
    if precision == "fp32":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
