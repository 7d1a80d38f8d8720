"""Mamba-2: selective state-space model with a scalar decay per head (SSD), the usual backbone.

    [z, x, B, C, dt] = W_in u;   x, B, C <- SiLU(causal_conv4(x, B, C))
    h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T,    y_t = C_t^T h_t + D x_t
    out = W_out (RMSNorm(y) * silu(z))          (norm_before_gate, the default; False: W_out RMSNorm(y * silu(z)))

Dao & Gu 2024, "Transformers are SSMs: Generalized Models and Efficient Algorithms Through Structured
State Space Duality", arXiv 2405.21060. The scan is :func:`kernels.ssd.ssd` (chunked PyTorch on CPU, Triton on CUDA);
dt = softplus(W_dt u + dt_bias) (W_dt: mamba-ssm's dt rows of the input projection, here ``gate.proj``), A = -exp(A_log) with
A ~ U(1, 16) and softplus(dt_bias) initialised log-uniformly in [1e-3, 1e-1]; D = 1 per head; one group (B and C
shared by all heads); the output norm over the whole inner width, eps 1e-6. These follow mamba-ssm's ``Mamba2``
module except where stated: its defaults d_state = 128 and headdim = 64 are larger (recipes at language-model scale
name them), its norm eps is 1e-5, and its output norm (``norm_before_gate=False``, as in the paper's block) is
RMSNorm(y * silu(z)), the gate applied before the normalisation; here, by default, the norm is applied first and the
gate after, which gives a different function (RMSNorm is not invariant under the elementwise gate). Every table of
this repository was trained so; ``norm_before_gate=False`` gives the paper's and mamba-ssm's order (the same
parameters, so a checkpoint loads either way, but a model trained with one order computes something else with the
other).

dt is capped at ``DT_MAX`` = 1e3 (far above any trained value; at dt = 1e3, exp(dt A) < e^-50 for A >= 0.05): without a cap a
huge but finite input x_t gives dt_t ~ |x_t| and an input term dt_t x_t that overflows fp32, and the chunked
scan's causal mask (0 * inf) carries the NaN to the earlier positions of t's chunk. A non-finite input still
does that (NaN times the mask's zero), as in every chunked kernel here.

The SSM decode state is fp32 in a 16-bit model (fp64 in an fp64 one): every ``step`` adds to it, and rounded to
16 bits at each step (its decay too, which bf16 rounds to 1 above 0.998) a long decode drifts from ``forward``.
The short-convolution buffer holds projected inputs and stays in the model's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.ssd import BACKENDS, TRITON_MAX_DIM, ssd, ssd_step

from .base import Mixer, State, register_mixer
from .layers import (
    DecayGate,
    GatedRMSNorm,
    RMSNorm,
    ShortConv,
    at_least_fp32,
    compute_dtype,
    no_weight_decay,
    one_pass,
    project_parts,
    split_in_place,
)
from .options import backend_opt, chunk_size_for, chunk_size_opt, opt

#: upper bound of the step size dt (see the module docstring)
DT_MAX = 1e3


@register_mixer
class Mamba2(Mixer):
    name = "mamba2"
    description = "Mamba-2 selective SSM (SSD), chunked scan + recurrent step"
    state_formula = "n_heads * d_state * headdim + (expand d_model + 2 d_state) * (d_conv - 1)  (constant in T)"
    input_to_linear = True     # u enters through the fused projection only

    @dataclass
    class Options:
        d_state: int = opt(64, "state size N per head", at_least=1)
        headdim: int = opt(32, "head dimension P (expand * d_model must be divisible by it)", at_least=1)
        expand: int = opt(2, "inner width = expand * d_model", at_least=1)
        d_conv: int = opt(4, "short causal convolution width", at_least=1)
        chunk_size: int | None = chunk_size_opt("ssd", "chunk length of the chunked scan (does not change the result)")
        backend: str = backend_opt(BACKENDS, "kernel backend (mamba_ssm: mamba-ssm's mamba_chunk_scan_combined, "
                                             "CUDA only)")
        norm_before_gate: bool = opt(True, "output RMSNorm(y) * silu(z) (this zoo's tables); False: the paper's and "
                                           "mamba-ssm's RMSNorm(y * silu(z))", omit_at_default=True)

        def __post_init__(self):
            # the rule kernels.ssd applies at the first forward, checked where a recipe names the options
            if self.backend == "triton" and max(self.d_state, self.headdim) > TRITON_MAX_DIM:
                raise ValueError(f"backend='triton' needs d_state and headdim <= {TRITON_MAX_DIM} (a chunk's tiles "
                                 f"must fit a GPU block's shared memory), got d_state={self.d_state}, headdim="
                                 f"{self.headdim}; use smaller ones, or backend='auto' or 'torch'")

    contract_options = {"d_state": 8, "headdim": 16, "chunk_size": 8}

    def __init__(self, d_model: int, options: "Mamba2.Options"):
        super().__init__(d_model, options)
        o = options
        self.d_inner = o.expand * d_model
        if self.d_inner % o.headdim:
            raise ValueError(f"mamba2: expand*d_model={self.d_inner} is not divisible by headdim={o.headdim}; "
                             f"choose a headdim that divides it")
        self.n_heads = self.d_inner // o.headdim
        self.conv_dim = self.d_inner + 2 * o.d_state
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner + 2 * o.d_state, bias=False)
        self.gate = DecayGate(d_model, self.n_heads)  # the dt part of the input projection
        self.conv = ShortConv(self.conv_dim, o.d_conv)
        self.D = nn.Parameter(torch.ones(self.n_heads))
        no_weight_decay(self, "D")  # the skip gain, undecayed as in mamba-ssm (A_log, dt_bias: DecayGate)
        # the same parameter (norm.weight) either way, so checkpoints load into both
        self.norm = GatedRMSNorm(self.d_inner) if options.norm_before_gate else RMSNorm(self.d_inner)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)

    def _project(self, u):
        """``(z, xBC, raw)``, ``raw`` the step size's pre-activation: on the GPU plan one matmul for both
        projections, split once (:func:`project_parts`), on a CPU each its own."""
        return project_parts(u, [self.in_proj, self.gate.proj], [self.d_inner, self.conv_dim, self.n_heads])

    def _split(self, xBC):
        sizes = [self.d_inner, self.options.d_state, self.options.d_state]
        # on the GPU plan the SSD kernels read x in place and write its gradient into the split's slot
        x, B, C = split_in_place(xBC, sizes) if one_pass(xBC) else xBC.split(sizes, dim=-1)
        x = x.unflatten(-1, (self.n_heads, self.options.headdim))
        # one group: B and C are shared by all heads
        shape = (*B.shape[:-1], self.n_heads, self.options.d_state)
        return x, B.unsqueeze(-2).expand(shape), C.unsqueeze(-2).expand(shape)

    def _finish(self, y, z):
        if self.options.norm_before_gate:
            return self.out_proj(self.norm(y.flatten(-2), z))
        return self.out_proj(self.norm(y.flatten(-2) * F.silu(z.to(y.dtype))))

    def _forward(self, u):
        z, xBC_raw, raw = self._project(u)
        x, B, C = self._split(self.conv(xBC_raw))
        dt = self.gate.step_size(raw, DT_MAX, x.dtype)
        A = -torch.exp(at_least_fp32(self.gate.A_log))
        y, h = ssd(x, dt, A.to(x.dtype), B, C, backend=self.options.backend, D=self.D,
                   chunk_size=chunk_size_for(x, "ssd", self.options.chunk_size))
        # the decode state as init_state lays it out for the model's dtype: the convolution buffer in it (under
        # autocast xBC_raw comes in the autocast dtype), the SSM state, which every step adds to, in fp32
        dtype = self.D.dtype
        return self._finish(y, z), {"conv": self.conv.final_state(xBC_raw).to(dtype),
                                    "ssm": h.to(compute_dtype(dtype))}

    def prefill(self, x, mask=None):
        return self._forward(x)

    def init_state(self, batch_size, device=None, dtype=None) -> State:
        o = self.options
        return {"conv": self.conv.init_state(batch_size, device, dtype),
                "ssm": torch.zeros(batch_size, self.n_heads, o.d_state, o.headdim, device=device,
                                   dtype=compute_dtype(dtype))}

    def step(self, u_t, state):
        z, xBC_raw, raw = self._project(u_t)
        xBC, conv_state = self.conv.step(xBC_raw, state["conv"])
        x, B, C = self._split(xBC)
        dt = self.gate.step_size(raw, DT_MAX, x.dtype)
        A = -torch.exp(at_least_fp32(self.gate.A_log))
        # dt and A rounded to x's dtype as forward rounds them; ssd_step computes in fp32 (fp64 for fp64) and
        # returns the state in it
        y, h = ssd_step(x, dt, A.to(x.dtype), B, C, state["ssm"], D=self.D)
        return self._finish(y, z), {"conv": conv_state, "ssm": h}

    def state_size(self, seq_len: int) -> int:
        o = self.options
        return self.n_heads * o.d_state * o.headdim + self.conv_dim * (o.d_conv - 1)
