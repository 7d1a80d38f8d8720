"""The spec of the causal depthwise short convolution in the time-first layout: torch's ``conv1d``.

    y_t = b + sum_{j=0}^{k-1} w_j x_{t-(k-1)+j}      (x_s = 0 for s < 0),     out = SiLU(y) (optional)

``x (B, T, C)``, ``weight (C, k)``, ``bias (C)`` or None; the channels-first copies ``conv1d`` needs are
made here (a reference, not a fast path).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          activation: bool = True) -> torch.Tensor:
    T, k = x.shape[1], weight.shape[1]
    if T == 0:  # conv1d refuses an empty length: the empty output, still joined to every input for autograd
        y = x * weight[:, -1] if bias is None else x * weight[:, -1] + bias
        return F.silu(y) if activation else y
    y = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=k - 1, groups=x.shape[2])[..., :T]
    y = y.transpose(1, 2)
    return F.silu(y) if activation else y
