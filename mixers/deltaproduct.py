"""DeltaProduct: n_h generalized Householder steps per token (Siems et al. 2025, "DeltaProduct: Improving
State-Tracking in Linear RNNs via Householder Products", arXiv:2502.10297), and its n_h = 1 presets DeltaNet
(Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence Length", arXiv:2406.06484)
and Gated DeltaNet (Yang et al. 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule", arXiv:2412.06464).

Per head (d_k = d_v = head_dim), for token t and sub-steps j = 1..n_h, each from its own projection:

    q_t     = L2norm(SiLU(conv4(W_q x)))_t                  k_{t,j} = L2norm(SiLU(conv4(W_k^j x)))_t
    v_{t,j} = SiLU(conv4(W_v^j x))_t                        beta_{t,j} = c * sigmoid(W_b^j x_t),
                                                            c = 2 if negative eigenvalues are allowed else 1
    S <- exp(g_t) S,  g_t = -exp(A_log) softplus(W_a x_t + dt_bias)       (forget gate, optional)
    S <- (I - beta_{t,j} k_{t,j} k_{t,j}^T) S + beta_{t,j} k_{t,j} v_{t,j}^T      for j = 1..n_h
    o_t = S^T q_t / sqrt(d_k)
    y_t = W_o [ RMSNorm(o_t) * SiLU(W_z x_t) ]  (gated RMSNorm per head)

With ||k|| = 1 each factor has eigenvalues 1 and 1 - beta in (-1, 1) when beta in (0, 2), which parity
needs; the product of n_h factors is diagonal + rank n_h (rotations / permutations for n_h >= 2). Unrolled,
the paper's per-token form is S_t = A(x_t) e^{g_t} S_{t-1} + B(x_t), A = prod_j (I - beta_j k_j k_j^T) (step 1
applied first), B = sum_j [prod_{l>j} (I - beta_l k_l k_l^T)] beta_j k_j v_j^T, and ||A|| <= 1 for beta in [0, 2].
Without the short conv, SiLU is applied to the projections directly. Queries are L2-normalised too
(as in flash-linear-attention's layers). The kernel is :func:`kernels.delta.delta_product` (chunked UT
transform on the n_h*T interleaved sequence: torch on CPU, Triton on CUDA).

Registered names: ``deltaproduct`` (n_h = 2, forget gate), ``deltanet`` (n_h = 1, no gate),
``gated_deltanet`` (n_h = 1, forget gate); all share the options below.

Non-finite inputs: a NaN or inf at position t reaches the earlier outputs of its chunk (NaN times the
zero of the chunk's causal mask); large finite inputs do not (the contract suite checks 1e30).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.backend import triton_pieces_for
from kernels.delta import BACKENDS, TRITON_MAX_HEAD_DIM, delta_product, delta_product_step
from kernels.gate import scaled_sigmoid

from .base import Mixer, State, register_mixer
from .conv_time_first import short_conv_time_first
from .l2norm import l2_normalize
from .layers import DecayGate, GatedRMSNorm, ShortConv, compute_dtype, keep_autocast_dtype, one_pass, project, split_in_place
from .options import backend_opt, chunk_size_for, chunk_size_opt, opt

_STATE_FORMULA = ("n_heads * head_dim^2 + [short conv] (conv_size - 1) * n_heads * head_dim * (1 + 2 n_h)"
                  "  (constant in T)")


@register_mixer
class DeltaProduct(Mixer):
    name = "deltaproduct"
    description = "DeltaProduct: n_h Householder delta-rule steps per token, forget gate, beta in (0,2)"
    state_formula = _STATE_FORMULA
    input_to_linear = True     # x enters through the fused projection only

    @dataclass
    class Options:
        n_heads: int = opt(4, "number of heads", at_least=1)
        head_dim: int | None = opt(None, "key = value dimension per head (default d_model / n_heads)", at_least=1)
        num_householder: int = opt(2, "Householder steps n_h per token (1 = DeltaNet)", at_least=1)
        allow_neg_eigval: bool = opt(True, "beta in (0, 2) instead of (0, 1): eigenvalues of I - beta k k^T in (-1, 1)")
        use_forget_gate: bool = opt(True, "Mamba-2 style per-head log forget gate applied once per token")
        use_short_conv: bool = opt(True, "causal depthwise conv + SiLU on q, k, v (else SiLU only)")
        conv_size: int = opt(4, "short convolution width", at_least=1)
        chunk_size: int | None = chunk_size_opt("delta", "chunk length of the chunked kernel (does not change "
                                                          "the result)")
        norm_eps: float = opt(1e-5, "epsilon of the output gated RMSNorm", above=0.0)
        backend: str = backend_opt(BACKENDS, "kernel backend (fla: flash-linear-attention's chunked delta rule / "
                                             "product, CUDA only)")

    contract_options = {"n_heads": 2, "head_dim": 8, "chunk_size": 8}

    def __init__(self, d_model: int, options):
        super().__init__(d_model, options)
        o = options
        H = o.n_heads
        if o.head_dim is None and d_model % H:
            raise ValueError(f"{self.name}: d_model={d_model} is not divisible by n_heads={H}; "
                             f"set head_dim or change n_heads")
        self.n_heads, self.head_dim, self.n_h = H, o.head_dim or d_model // H, o.num_householder
        if o.backend == "triton" and self.head_dim > TRITON_MAX_HEAD_DIM:
            # the rule kernels.delta applies at the first forward, checked when the layer is built
            raise ValueError(f"{self.name}: backend='triton' needs head_dim <= {TRITON_MAX_HEAD_DIM} (a chunk's "
                             f"tiles must fit a GPU block's shared memory), got head_dim={self.head_dim}; use "
                             f"more heads, a smaller head_dim, or backend='auto' or 'torch'")
        K = V = self.head_dim
        n = self.n_h
        self.q_proj = nn.Linear(d_model, H * K, bias=False)
        self.k_proj = nn.Linear(d_model, n * H * K, bias=False)   # n_h separate key projections
        self.v_proj = nn.Linear(d_model, n * H * V, bias=False)
        self.b_proj = nn.Linear(d_model, n * H, bias=False)
        self.z_proj = nn.Linear(d_model, H * V, bias=False)       # output gate
        self.gate = DecayGate(d_model, H) if o.use_forget_gate else None
        if o.use_short_conv:
            self.q_conv = ShortConv(H * K, o.conv_size)
            self.k_conv = ShortConv(n * H * K, o.conv_size)
            self.v_conv = ShortConv(n * H * V, o.conv_size)
        self.norm = GatedRMSNorm(V, eps=o.norm_eps)
        self.o_proj = nn.Linear(H * V, d_model, bias=False)

    # --- pieces shared by the parallel and the recurrent form ---------------------------------
    def _log_gate(self, x):
        """g = -exp(A_log) softplus(W_a x + dt_bias) in (at least) fp32; (..., H)."""
        return self._log_gate_from(self.gate.proj(x))

    def _log_gate_from(self, a):
        """The log gate from the projection ``a = W_a x`` (one Triton kernel each way on the GPU plan)."""
        if one_pass(a):
            return self.gate.log_decay(a)
        dt = compute_dtype(a.dtype)
        gt = self.gate
        return -torch.exp(gt.A_log.to(dt)) * F.softplus(a.to(dt) + gt.dt_bias.to(dt))

    def _heads(self, q, k, v, b):
        """Per-head q (..., H, K), k (..., n_h, H, K), v (..., n_h, H, V), beta (..., n_h, H)."""
        H, K, n = self.n_heads, self.head_dim, self.n_h
        q = l2_normalize(q.unflatten(-1, (H, K)), eps=1e-6)               # = F.normalize(..., dim=-1)
        k = l2_normalize(k.unflatten(-1, (n, H, K)), eps=1e-6)
        v = v.unflatten(-1, (n, H, K))
        return q, k, v, self._beta(b)

    def _beta(self, b):
        scale = 2.0 if self.options.allow_neg_eigval else 1.0
        # in at least fp32; on the GPU plan one launch each way, from a 16-bit projection
        beta = scaled_sigmoid(b, scale, backend="triton" if triton_pieces_for(b) else "reference")
        return beta.unflatten(-1, (self.n_h, self.n_heads))

    def _heads_gpu(self, qkv, b):
        """:meth:`_heads` from the convolved ``q|k|v`` block on the GPU plan: q and k normalised together
        (one launch each way instead of two)."""
        H, K, n = self.n_heads, self.head_dim, self.n_h
        # cut where the backward finds the gradients in place: the norm writes dqk, the delta kernels dq, dk, dv
        qk, v = split_in_place(qkv, [(1 + n) * H * K, n * H * K])
        qk = l2_normalize(qk.unflatten(-1, ((1 + n) * H, K)), eps=1e-6)
        q, k = split_in_place(qk.flatten(-2), [H * K, n * H * K])
        return q.unflatten(-1, (H, K)), k.unflatten(-1, (n, H, K)), v.unflatten(-1, (n, H, K)), self._beta(b)

    def _finish(self, o, x):
        z = self.z_proj(x).unflatten(-1, (self.n_heads, self.head_dim))
        return self.o_proj(self.norm(keep_autocast_dtype(o, x), z).flatten(-2))

    def _forward(self, x, want_state: bool):
        # one matmul for every input projection (q, k, v, beta, forget gate, output gate) and one pass of
        # the short convolutions over the time-first q|k|v block; same function as the per-module form
        # that ``step`` uses
        # (on the GPU plan both matmuls are one: project() over all six modules)
        H, K, n = self.n_heads, self.head_dim, self.n_h
        sizes = [H * K, n * H * K, n * H * K]
        small = [self.b_proj, self.z_proj] + ([self.gate.proj] if self.gate is not None else [])
        gpu = one_pass(x)
        if gpu:
            qkv_raw, *parts = project(x, [[self.q_proj, self.k_proj, self.v_proj], *small])
        else:
            qkv_raw = F.linear(x, torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight], dim=0))
            parts = F.linear(x, torch.cat([m.weight for m in small], dim=0)).split([m.out_features for m in small], -1)
        if self.options.use_short_conv:
            qkv = short_conv_time_first([self.q_conv, self.k_conv, self.v_conv], qkv_raw)
        else:
            qkv = F.silu(qkv_raw)
        if gpu:
            q, k, v, beta = self._heads_gpu(qkv, parts[0])
        else:
            q, k, v, beta = self._heads(*qkv.split(sizes, dim=-1), parts[0])
        g = self._log_gate_from(parts[2]) if self.gate is not None else None
        # k, v as (B, T, n_h, H, D): the Triton kernels read the sub-steps in place (others flatten them)
        o, S = delta_product(q, k, v, beta.flatten(1, 2), g=g, num_householder=n,
                             chunk_size=chunk_size_for(x, "delta", self.options.chunk_size), backend=self.options.backend)
        z = parts[1].unflatten(-1, (H, K))
        y = self.o_proj(self.norm(keep_autocast_dtype(o, x), z).flatten(-2))
        if not want_state:
            return y, None
        state = {"S": S}
        if self.options.use_short_conv:
            # the buffers in the model's dtype, as init_state and step lay them out (under autocast the
            # projections come in the autocast dtype)
            convs = {"conv_q": self.q_conv, "conv_k": self.k_conv, "conv_v": self.v_conv}
            for (key, conv), raw in zip(convs.items(), qkv_raw.split(sizes, dim=-1)):
                state[key] = conv.final_state(raw).to(self.o_proj.weight.dtype)
        return y, state

    # --- the Mixer contract -----------------------------------------------------------------------
    def forward(self, x, mask=None):  # training skips the decode state (conv buffers)
        return self._forward(x, want_state=False)[0]

    def prefill(self, x, mask=None):
        return self._forward(x, want_state=True)

    def init_state(self, batch_size, device=None, dtype=None) -> State:
        dtype = dtype or torch.float32
        H, K = self.n_heads, self.head_dim
        state = {"S": torch.zeros(batch_size, H, K, K, device=device,
                                  dtype=compute_dtype(dtype))}
        if self.options.use_short_conv:
            state.update(conv_q=self.q_conv.init_state(batch_size, device, dtype),
                         conv_k=self.k_conv.init_state(batch_size, device, dtype),
                         conv_v=self.v_conv.init_state(batch_size, device, dtype))
        return state

    def step(self, x_t, state):
        qr, kr, vr = self.q_proj(x_t), self.k_proj(x_t), self.v_proj(x_t)
        new = {}
        if self.options.use_short_conv:
            q, new["conv_q"] = self.q_conv.step(qr, state["conv_q"])
            k, new["conv_k"] = self.k_conv.step(kr, state["conv_k"])
            v, new["conv_v"] = self.v_conv.step(vr, state["conv_v"])
        else:
            q, k, v = F.silu(qr), F.silu(kr), F.silu(vr)
        q, k, v, beta = self._heads(q, k, v, self.b_proj(x_t))
        g = self._log_gate(x_t) if self.gate is not None else None
        o, new["S"] = delta_product_step(q, k, v, beta, g, state["S"])
        return self._finish(o, x_t), new

    def state_size(self, seq_len: int) -> int:
        H, K, n = self.n_heads, self.head_dim, self.n_h
        size = H * K * K
        if self.options.use_short_conv:
            size += (self.options.conv_size - 1) * (H * K + n * H * K + n * H * K)
        return size


@register_mixer
class DeltaNet(DeltaProduct):
    name = "deltanet"
    description = "DeltaNet baseline: DeltaProduct with one Householder step per token, no forget gate"

    @dataclass
    class Options(DeltaProduct.Options):
        num_householder: int = opt(1, "Householder steps n_h per token (1 = DeltaNet)", at_least=1)
        use_forget_gate: bool = opt(False, "Mamba-2 style per-head log forget gate applied once per token")


@register_mixer
class GatedDeltaNet(DeltaProduct):
    name = "gated_deltanet"
    description = "Gated DeltaNet baseline: DeltaProduct with one Householder step per token and a forget gate"

    @dataclass
    class Options(DeltaProduct.Options):
        num_householder: int = opt(1, "Householder steps n_h per token (1 = DeltaNet)", at_least=1)
        use_forget_gate: bool = opt(True, "Mamba-2 style per-head log forget gate applied once per token")
