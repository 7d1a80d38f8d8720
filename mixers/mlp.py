"""State mixers (position-wise blocks after each sequence mixer).

- ``swiglu``: ``W_2 (silu(W_1 x) * W_3 x)`` (Shazeer 2020), hidden width ~8/3 d.
- ``koopman_mlp``: the Spectral Koopman MLP of Echo (arXiv 2605.06997, section 3.3): LayerNorm -> lift to
  d_k (~2.67 d, rounded up to a multiple of 64) -> SiLU -> for each pair of lifted coordinates a 2x2
  rotation-scale by a learnable complex eigenvalue ``rho e^{i theta}`` with ``rho = min(|lambda|, 1)``
  -> readout. Two matrices instead of SwiGLU's three.
- ``none``: no state mixer (the block is the sequence mixer alone).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.backend import triton_pieces_for
from kernels.swiglu import swiglu, swiglu_reference

from .base import StateMixer, register_state_mixer
from .layers import no_weight_decay
from .options import opt


def _round_up(x: float, multiple: int) -> int:
    return int(math.ceil(x / multiple) * multiple)


@register_state_mixer
class SwiGLU(StateMixer):
    name = "swiglu"
    description = "SwiGLU MLP, hidden ~ mult * d_model"
    input_to_linear = True

    @dataclass
    class Options:
        mult: float = opt(8 / 3, "hidden width as a multiple of d_model", above=0.0)
        multiple_of: int = opt(16, "round the hidden width up to a multiple of this", at_least=1)

    def __init__(self, d_model, options):
        super().__init__(d_model, options)
        hidden = _round_up(options.mult * d_model, options.multiple_of)
        self.w_in = nn.Linear(d_model, 2 * hidden, bias=False)
        self.w_out = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        """On the GPU plan the gate is one Triton kernel each way (:func:`kernels.swiglu.swiglu`), where the
        formula launches two forward and four backward and keeps ``SiLU(a)`` for the backward."""
        h = self.w_in(x)
        if triton_pieces_for(h):
            return self.w_out(swiglu(h, backend="triton"))
        return self.w_out(swiglu_reference(h))


@register_state_mixer
class KoopmanMLP(StateMixer):
    name = "koopman_mlp"
    description = ("Spectral Koopman MLP (Echo): lift, SiLU, per-pair complex eigenvalue rotation-scale "
                   "(|lambda|<=1), readout")

    @dataclass
    class Options:
        mult: float = opt(2.67, "lifted width d_k as a multiple of d_model", above=0.0)
        multiple_of: int = opt(64, "round d_k up to a multiple of this (then up to even)", at_least=1)
        layer_norm: bool = opt(True, "apply the MLP's own LayerNorm before the lift")

    def __init__(self, d_model, options):
        super().__init__(d_model, options)
        d_k = _round_up(options.mult * d_model, options.multiple_of)
        d_k += d_k % 2
        self.norm = nn.LayerNorm(d_model) if options.layer_norm else nn.Identity()
        self.lift = nn.Linear(d_model, d_k, bias=True)
        self.readout = nn.Linear(d_k, d_model, bias=False)
        pairs = d_k // 2
        # eigenvalues start near the unit circle with spread frequencies
        self.log_modulus = nn.Parameter(torch.full((pairs,), -0.05))
        self.theta = nn.Parameter(torch.linspace(0, math.pi, pairs))
        if options.layer_norm:
            no_weight_decay(self.norm, "weight", "bias")
        no_weight_decay(self.lift, "bias")
        # the eigenvalues rho e^{i theta}: decay would pull |lambda| to 1 and every frequency to 0
        no_weight_decay(self, "log_modulus", "theta")

    def forward(self, x):
        h = F.silu(self.lift(self.norm(x)))
        re, im = h[..., 0::2], h[..., 1::2]
        rho = torch.exp(self.log_modulus).clamp(max=1.0)
        c, s = rho * torch.cos(self.theta), rho * torch.sin(self.theta)
        out = torch.stack([c * re - s * im, s * re + c * im], dim=-1).flatten(-2)
        return self.readout(out)


@register_state_mixer
class NoStateMixer(StateMixer):
    name = "none"
    description = "no state mixer: blocks are sequence mixers only"
    is_identity = True

    @dataclass
    class Options:
        pass

    def forward(self, x):
        return torch.zeros_like(x)
