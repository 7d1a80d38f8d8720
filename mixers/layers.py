"""Building blocks shared by several mixers: RMSNorm, gated RMSNorm, causal short convolution with a
decode state, and the Mamba-2 log-decay gate.

Log-decay gate (the Mamba-2 parameterisation; Dao & Gu, arXiv 2405.21060): ``g_t = -exp(A_log) * softplus(W_a x_t + dt_bias)``, ``A ~ U(1, 16)``,
``dt_bias = softplus^{-1}(dt)``, ``dt ~ logU(1e-3, 1e-1)`` floored at 1e-4.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.common import at_least_fp32, compute_dtype  # noqa: F401  (re-exported for the mixers)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = at_least_fp32(x)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(xf.dtype)).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """``RMSNorm(x) * silu(z)``, normalising over the last dimension (per head when reshaped)."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x) * F.silu(at_least_fp32(z)).to(x.dtype)


def _depthwise_valid(xp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``out_t = bias + sum_j weight[:, j] * xp_{t + j}`` per channel, ``xp (B, T + k - 1, C)`` contiguous ->
    ``(B, T, C)``. ``xp`` viewed as ``(B, C, 1, T + k - 1)`` is already channels-last, so the depthwise
    ``conv2d`` runs on it in place (no transposes to a channels-first copy) and returns the same layout."""
    C = xp.shape[-1]
    out = F.conv2d(xp.transpose(1, 2).unsqueeze(2), weight[:, None, None, :], bias, groups=C)
    return out.squeeze(2).transpose(1, 2)


class _CausalDepthwiseConv(torch.autograd.Function):
    """``y_t = act(bias + sum_j w_j * x_{t + j - (k - 1)})`` per channel (``x`` zero before the start) on
    ``(B, T, C)`` inputs, with a hand-written backward.

    Forward and the input gradient are depthwise convolutions in the time-major (channels-last) layout;
    the weight gradient is ``k`` shifted products. Backward with ``dy = dL/d(pre-activation)``:
    ``dx_s = sum_j w_j dy_{s + (k - 1) - j}`` (the flipped kernel over ``dy`` padded at the end),
    ``dw_j = sum_t dy_t * x_{t + j - (k - 1)}``, ``dbias = sum_t dy_t``. (``conv1d``'s own backward on a
    CPU is several times slower than these, and its channels-first layout needs transposed copies.)
    """

    @staticmethod
    def forward(ctx, x, weight, bias, act: bool):
        k = weight.shape[1]
        xp = F.pad(x, (0, 0, k - 1, 0))                                 # (B, T + k - 1, C), contiguous
        y = _depthwise_valid(xp, weight, bias)
        ctx.save_for_backward(xp, weight, y)
        ctx.act = act
        return F.silu(y) if act else y

    @staticmethod
    def backward(ctx, g):
        xp, weight, y = ctx.saved_tensors
        T, k = y.shape[1], weight.shape[1]
        dy = torch.ops.aten.silu_backward(g, y) if ctx.act else g
        dy = dy.contiguous()
        dx = _depthwise_valid(F.pad(dy, (0, 0, 0, k - 1)), weight.flip(-1), None)
        dyf = dy.flatten(0, 1)
        dw = torch.stack([(xp[:, j:j + T].flatten(0, 1) * dyf).sum(0) for j in range(k)], dim=1)
        return dx, dw, dyf.sum(0), None


class ShortConv(nn.Module):
    """Causal depthwise 1-D convolution over time (kernel ``k``), then SiLU (optional).

    Decode state: the last ``k - 1`` inputs, shape ``(batch, channels, k - 1)``.
    """

    def __init__(self, channels: int, kernel_size: int = 4, activation: bool = True):
        super().__init__()
        self.channels, self.kernel_size, self.activation = channels, kernel_size, activation
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, padding=kernel_size - 1, bias=True)

    def _act(self, y: torch.Tensor) -> torch.Tensor:
        return F.silu(y) if self.activation else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 3 or x.shape[-1] != self.channels:
            raise ValueError(f"ShortConv: input must be (batch, time, {self.channels}), got {tuple(x.shape)}")
        w = self.conv.weight.squeeze(1).to(x.dtype)                      # (C, k)
        return _CausalDepthwiseConv.apply(x, w, self.conv.bias.to(x.dtype), self.activation)

    def init_state(self, batch_size: int, device=None, dtype=None) -> torch.Tensor:
        return torch.zeros(batch_size, self.channels, self.kernel_size - 1, device=device, dtype=dtype)

    def final_state(self, x: torch.Tensor) -> torch.Tensor:
        """The decode state after consuming ``x`` (B, T, C) from a zero state."""
        k1 = self.kernel_size - 1
        xt = x.transpose(1, 2)
        if xt.shape[-1] < k1:
            xt = F.pad(xt, (k1 - xt.shape[-1], 0))
        return xt[..., -k1:] if k1 > 0 else xt[..., :0]

    def step(self, x_t: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.cat([state, x_t.unsqueeze(-1)], dim=-1)  # (B, C, k)
        y = (window * self.conv.weight.squeeze(1)).sum(-1) + self.conv.bias
        return self._act(y), window[..., 1:]


class DecayGate(nn.Module):
    """Mamba-2 style per-head log decay ``g_t <= 0`` (returns ``g`` and the step size ``dt``)."""

    def __init__(self, d_model: int, n_heads: int, a_range=(1.0, 16.0), dt_range=(1e-3, 1e-1), dt_floor=1e-4):
        super().__init__()
        self.proj = nn.Linear(d_model, n_heads, bias=False)
        A = torch.empty(n_heads).uniform_(*a_range)
        self.A_log = nn.Parameter(torch.log(A))
        dt = torch.exp(torch.rand(n_heads) * (math.log(dt_range[1]) - math.log(dt_range[0])) + math.log(dt_range[0]))
        dt = dt.clamp(min=dt_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^{-1}(dt)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raw = at_least_fp32(self.proj(x))
        dt = F.softplus(raw + self.dt_bias.to(raw.dtype))
        g = -torch.exp(self.A_log.to(raw.dtype)) * dt
        return g, dt
