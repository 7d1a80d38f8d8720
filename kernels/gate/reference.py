"""The spec of the Mamba-2 log-decay gate: ``g = -exp(A_log) softplus(raw + dt_bias)`` per head, and of its step
size ``dt = min(softplus(raw + dt_bias), dt_max)`` alone, in at least fp32 (Dao & Gu, "Transformers are SSMs",
arXiv 2405.21060); and of the beta gate of the GLA and GKA layers, ``(k beta, v beta)`` with ``beta =
sigmoid(raw)`` per head (Gated KalmaNet, arXiv 2511.21016: the gate scales the keys and values, so the
statistics carry ``beta^2``); and of the delta rule's step size ``beta = scale sigmoid(raw)`` (``scale`` 2 lets
the transitions ``I - beta k k^T`` have negative eigenvalues)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import compute_dtype


def log_decay_reference(raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """``raw (..., H)`` (the gate projection), ``A_log (H)``, ``dt_bias (H)`` -> ``g (..., H)`` <= 0."""
    cd = compute_dtype(raw.dtype)
    return -torch.exp(A_log.to(cd)) * F.softplus(raw.to(cd) + dt_bias.to(cd))


def step_size_reference(raw: torch.Tensor, dt_bias: torch.Tensor, dt_max: float | None = None) -> torch.Tensor:
    """``raw (..., H)``, ``dt_bias (H)`` -> ``dt = softplus(raw + dt_bias) (..., H)``, capped at ``dt_max``
    where given (its gradient zero above the cap)."""
    cd = compute_dtype(raw.dtype)
    dt = F.softplus(raw.to(cd) + dt_bias.to(cd))
    return dt if dt_max is None else dt.clamp(max=dt_max)


def beta_scale_reference(k: torch.Tensor, v: torch.Tensor, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k (..., H, d_k)``, ``v (..., H, d_v)``, ``raw (..., H)`` -> ``(k beta, v beta)``, ``beta = sigmoid(raw)``
    per head (the mixers' formula, in the inputs' dtypes)."""
    beta = torch.sigmoid(raw).unsqueeze(-1)
    return k * beta, v * beta


def scaled_sigmoid_reference(raw: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``raw (..., H)`` -> ``scale sigmoid(raw)`` in at least fp32."""
    return scale * torch.sigmoid(raw.to(compute_dtype(raw.dtype)))
