"""BD-LRU: block-diagonal linear recurrent unit with L1-normalised (softmax) gates.

Dubinin, Orvieto & Effenberger, "Improved State Mixing in Higher-order and Block Diagonal Linear
Recurrent Networks", arXiv:2602.12021. The state is ``N`` independent blocks of size ``m``; per block
``k`` and token ``t``:

    G_t^k = softmax_row( reshape_{m x (m+1)}( W_a^k x_t + b_a^k ) )      (each row's m+1 entries sum to 1)
    A_t^k = G_t^k[:, :m]   (m x m, entries > 0),    a0_t^k = G_t^k[:, m]   (m,)
    h_t^k = A_t^k h_{t-1}^k + a0_t^k * v_t^k,       v_t = W_v x_t  (m channels per block)
    y_t   = W_out vec(h_t^1, ..., h_t^N)

Each row of ``A_t`` sums to ``1 - a0_t`` (elementwise), so ``|h_t,i| <= (1 - a0_t,i) ||h_{t-1}||_inf +
a0_t,i ||v_t||_inf``: from a zero state ``||h_T||_inf <= max_t ||v_t||_inf`` (the paper's stability
proposition) and every eigenvalue of ``A_t`` lies in the disc of radius ``max_i (1 - a0_t,i)``. For
``m = 1`` this is the diagonal recurrence with a convex gate, ``h_t = (1 - a0_t) h_{t-1} + a0_t v_t``,
whose transitions are positive reals (no parity); for ``m >= 2`` a positive matrix can still have
negative or complex eigenvalues (e.g. a near-permutation), which state tracking needs.

The paper indexes a row's input gate as column 0 (``a_{i,0,t}``) and the transition as columns 1..m; here the
input gate is the last of the ``m + 1`` logits of a row: the same softmax, the logits only stored in another order.
``selective = False`` makes the logits a learned constant per block (the input-independent variant).
Initialisation: every weight (and the constant logits) N(0, 0.02), zero bias, so the transitions
start near uniform rows ``1/(m+1)``. The scan is :func:`kernels.blockscan.block_scan` (chunked
PyTorch on a CPU, Triton on CUDA), and on CUDA the gates come from :func:`kernels.blockscan.softmax_gates`
(one kernel each way); the decode state is ``N * m`` numbers per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.backend import triton_pieces_for
from kernels.blockscan import BACKENDS, block_scan, block_scan_step, softmax_gates

from .base import Mixer, State, register_mixer
from .layers import at_least_fp32, compute_dtype, no_weight_decay, one_pass, project
from .options import backend_opt, chunk_size_for, chunk_size_opt, opt


@register_mixer
class BDLRU(Mixer):
    name = "bdlru"
    input_to_linear = True     # x enters through the transition's and input projections, one matmul on the GPU plan
    description = "BD-LRU: N dense m x m blocks, softmax (L1-normalised) gates, h = A_t h + a0_t * v_t"
    state_formula = "n_blocks * block_size  (constant in T)"

    @dataclass
    class Options:
        n_blocks: int | None = opt(None, "number of blocks N (default d_model // block_size)", at_least=1)
        block_size: int = opt(4, "block size m (1 = diagonal recurrence with a convex gate)", at_least=1)
        selective: bool = opt(True, "transition logits from the input (W_a x + b) instead of a learned constant")
        init_std: float = opt(0.02, "std of the normal initialisation of every weight", above=0.0)
        chunk_size: int | None = chunk_size_opt("blockscan", "chunk length of the chunked scan (does not change the result)")
        backend: str = backend_opt(BACKENDS)

    contract_options = {"n_blocks": 4, "block_size": 3, "chunk_size": 8}

    def __init__(self, d_model: int, options: "BDLRU.Options"):
        super().__init__(d_model, options)
        o = options
        m = o.block_size
        if o.n_blocks is None and d_model < m:
            raise ValueError(f"bdlru: block_size {m} exceeds d_model {d_model}; set n_blocks explicitly or "
                             f"use a smaller block_size")
        self.m = m
        self.N = o.n_blocks if o.n_blocks is not None else d_model // m
        self.v_proj = nn.Linear(d_model, self.N * m, bias=False)
        if o.selective:
            self.a_proj = nn.Linear(d_model, self.N * m * (m + 1), bias=True)
            nn.init.zeros_(self.a_proj.bias)
            no_weight_decay(self.a_proj, "bias")
        else:
            self.a_logits = nn.Parameter(torch.empty(self.N, m, m + 1))
            # the input-independent transition is the selective variant's bias (W_a = 0), undecayed like it:
            # decay would pull every row towards the uniform average 1/(m+1), not towards a smaller function
            no_weight_decay(self, "a_logits")
        self.out_proj = nn.Linear(self.N * m, d_model, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.ndim >= 2 or p is getattr(self, "a_logits", None):
                    p.normal_(0.0, o.init_std)

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A (..., N, m, m), a0 (..., N, m))`` for inputs ``x (..., d_model)``, in fp32 (fp64 stays)."""
        m, N = self.m, self.N
        if not self.options.selective:
            probs = torch.softmax(at_least_fp32(self.a_logits.to(x.dtype)), dim=-1)
            probs = probs.expand(*x.shape[:-1], N, m, m + 1)
            return probs[..., :m], probs[..., m]
        # The softmax runs over an outer axis: the projection's rows are taken in (column j, block, row i)
        # order, so the logits come out as (..., m + 1, N * m) and the softmax over j is vectorised along
        # the N * m contiguous entries (a softmax over a trailing axis of m + 1 entries runs ~20x slower
        # on a CPU). Same parameters, same values; only the order of the output features changes.
        W = self.a_proj.weight.unflatten(0, (N, m, m + 1)).permute(2, 0, 1, 3).flatten(0, 2)
        bias = self.a_proj.bias.unflatten(0, (N, m, m + 1)).permute(2, 0, 1).flatten()
        logits = at_least_fp32(F.linear(x, W, bias)).unflatten(-1, (m + 1, N * m))
        A_cols, a0 = torch.softmax(logits, dim=-2).split([m, 1], dim=-2)
        A = A_cols.unflatten(-1, (N, m)).movedim(-3, -1)               # (..., N, m_i, m_j)
        return A, a0.squeeze(-2).unflatten(-1, (N, m))

    def _inputs(self, x):
        if self.options.selective and one_pass(x):
            # the GPU plan: both projections in one matmul (x's only reader), the softmax and a0 v in one kernel
            # each way (the formula where Triton cannot run)
            logits, v = project(x, [self.a_proj, self.v_proj])
            return softmax_gates(logits, v, self.m, backend="triton" if triton_pieces_for(x) else "torch")
        A, a0 = self.gates(x)
        v = at_least_fp32(self.v_proj(x)).unflatten(-1, (self.N, self.m))
        return A, a0 * v

    def prefill(self, x, mask=None):
        A, b = self._inputs(x)
        h, h_last = block_scan(A, b, chunk_size=chunk_size_for(b, "blockscan", self.options.chunk_size),
                               backend=self.options.backend)
        y = self.out_proj(h.flatten(-2).to(x.dtype))
        # the state in the module's compute dtype, as init_state and step hold it (fp32 in a 16-bit model: every
        # step adds to it); under autocast x may come in the autocast dtype (input_to_linear)
        return y, {"h": h_last.to(compute_dtype(self.out_proj.weight.dtype))}

    def init_state(self, batch_size, device=None, dtype=None) -> State:
        return {"h": torch.zeros(batch_size, self.N, self.m, device=device, dtype=compute_dtype(dtype))}

    def step(self, x_t, state):
        A, b = self._inputs(x_t)
        h = block_scan_step(A, b, state["h"])
        return self.out_proj(h.flatten(-2).to(x_t.dtype)), {"h": h.to(compute_dtype(self.out_proj.weight.dtype))}

    def state_size(self, seq_len: int) -> int:
        return self.N * self.m
