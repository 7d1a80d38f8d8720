"""Gated linear attention (GLA, scalar per-head decay) — the ``r = 0`` baseline of Gated KalmaNet.

    q, k, v = SiLU(short_conv_4(W_qkv x))          per head, d_k = d_v = head_dim
    q, k <- q / ||q||, k / ||k||
    beta_t = sigmoid(W_b x_t + b);  k_t, v_t <- beta_t k_t, beta_t v_t      (beta_gate)
    g_t = -exp(A_log) softplus(W_a x_t + dt_bias)                          (forget_gate; else g = 0)
    U_t = e^{g_t} U_{t-1} + v_t k_t^T,   o_t = U_t q_t / sqrt(d_k)
    y = W_o [GatedRMSNorm(o_t) * silu(W_g x_t)]    (norm per head)

Yang et al. 2024, "Gated Linear Attention Transformers with Hardware-Efficient Training" (scalar-gate
variant as in fla's simple GLA), with the projections, gates and normalisation of the Gated KalmaNet
block ("Gated KalmaNet: A Fading Memory Layer Through Test-Time Ridge Regression", arXiv 2511.21016, Fig. 4) so
that GKA with ``num_iter = 0`` is this mixer with the same weights
(GKA adds one alpha-gate projection). The core is :func:`kernels.gla.gla`.

Where it departs from the paper's layer (and flash-linear-attention's ``GatedLinearAttention``): the paper's forget
gate is per key channel, ``log alpha_t = logsigmoid(W_2 W_1 x_t + b) / 16`` with ``W_2 W_1`` of rank 16; here it is
one Mamba-2 log decay per head, initialised as Mamba-2's (A ~ U(1, 16), softplus(dt_bias) log-uniform in
[1e-3, 1e-1]), the forgetting gate of the Gated KalmaNet block. The short convolution, the L2-normalised q and k
and the beta gate are Gated KalmaNet's block too (the paper's layer has none of them by default). As in the paper,
keys and values have the same number of heads and the output is normalised per head and then gated
(``Swish(x W_r) * Norm(o)``); the readout is scaled by ``1 / sqrt(d_k)`` (flash-linear-attention's default).

Non-finite inputs: a NaN or inf at position t reaches the earlier outputs of its chunk (NaN times the
zero of the chunk's causal mask); large finite inputs do not (the contract suite checks 1e30).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.backend import triton_pieces_for
from kernels.gate import beta_scale
from kernels.gla import BACKENDS, gla, gla_step, triton_chunk_size_problem

from .base import Mixer, State, register_mixer
from .l2norm import l2_normalize
from .layers import DecayGate, GatedRMSNorm, ShortConv, compute_dtype, no_weight_decay, one_pass, project, split_in_place
from .options import backend_opt, chunk_size_for, chunk_size_opt, opt


class GatedRegressionBlock(Mixer):
    """Shared projections / gates / output norm of the GLA and GKA mixers (not registered).

    Subclasses implement ``_core(q, k, v, g, alpha, initial_state) -> (o, core_state)`` over whole
    sequences and ``_core_step(q_t, k_t, v_t, g_t, alpha_t, core_state) -> (o_t, core_state)``,
    ``_core_init(batch, device, dtype) -> core_state`` (a dict) and ``_core_state_size()``.
    """

    #: subclasses with an alpha-connection gate (GKA) set this; the shared block then builds alpha_proj
    has_alpha = False
    input_to_linear = True     # x enters through the fused projection only

    def __init__(self, d_model: int, options):
        super().__init__(d_model, options)
        o = options
        self.n_heads = o.n_heads
        self.head_dim = o.head_dim if o.head_dim is not None else d_model // o.n_heads
        if self.head_dim <= 0:
            raise ValueError(f"{self.name}: d_model={d_model} // n_heads={o.n_heads} is 0; set head_dim explicitly")
        h, d = self.n_heads, self.head_dim
        self.qkv_dim = 3 * h * d
        self.in_proj = nn.Linear(d_model, self.qkv_dim, bias=False)
        self.conv = ShortConv(self.qkv_dim, o.conv_size)
        if o.beta_gate:
            self.beta_proj = nn.Linear(d_model, h, bias=True)
            no_weight_decay(self.beta_proj, "bias")
        if o.forget_gate:
            self.gate = DecayGate(d_model, h)
        if self.has_alpha and o.alpha_connection:
            self.alpha_proj = nn.Linear(d_model, h, bias=True)
            no_weight_decay(self.alpha_proj, "bias")
        self.z_proj = nn.Linear(d_model, h * d, bias=False)
        self.norm = GatedRMSNorm(d)
        self.out_proj = nn.Linear(h * d, d_model, bias=False)

    # --- shared pieces ---------------------------------------------------------------------------
    def _reads_alpha(self) -> bool:
        """Whether the core reads the alpha gate now. A gate the core does not read is not projected: on the GPU
        plan its weight would otherwise be a slice of the fused matmul and get a zero gradient (which AdamW decays)
        where the CPU plan's separate projections leave it without one."""
        return self.has_alpha and self.options.alpha_connection

    def _projections(self, x):
        """The input projections of ``x`` (``(..., D)``, any leading dims) by name: ``qkv`` (before the conv),
        ``beta``, ``gate`` where the options have them, ``alpha`` where the core reads it (:meth:`_reads_alpha`),
        and ``z`` (one matmul on the GPU plan)."""
        o = self.options
        named = {"qkv": self.in_proj}
        if o.beta_gate:
            named["beta"] = self.beta_proj
        if o.forget_gate:
            named["gate"] = self.gate.proj
        if self._reads_alpha():
            named["alpha"] = self.alpha_proj
        named["z"] = self.z_proj
        return dict(zip(named, project(x, list(named.values()))))

    def _heads(self, qkv, p):
        """``qkv`` after the conv, ``p`` the :meth:`_projections` of the block input."""
        h, d = self.n_heads, self.head_dim
        if one_pass(qkv):   # q and k normalised together: one launch each way
            # cut where the backward finds the gradients in place: the norm writes dqk, the core or the beta gate
            # dq, dk, dv
            qk, v = split_in_place(qkv, [2 * h * d, h * d])
            q, k = split_in_place(l2_normalize(qk.unflatten(-1, (2 * h, d))).flatten(-2), [h * d, h * d])
            q, k, v = q.unflatten(-1, (h, d)), k.unflatten(-1, (h, d)), v.unflatten(-1, (h, d))
        else:
            q, k, v = qkv.unflatten(-1, (3, h, d)).unbind(-3)
            q = l2_normalize(q)                                           # = F.normalize(q, dim=-1)
            k = l2_normalize(k)
        if self.options.beta_gate:   # on the GPU plan one launch each way for the sigmoid and both products
            k, v = beta_scale(k, v, p["beta"], backend="triton" if triton_pieces_for(k) else "reference")
        if self.options.forget_gate:
            g = self.gate.log_decay(p["gate"])
        else:
            g = torch.zeros(*qkv.shape[:-1], h, dtype=torch.float32, device=qkv.device)
        alpha = torch.sigmoid(p["alpha"]) if "alpha" in p else None
        return q, k, v, g.to(q.dtype), alpha

    def _finish(self, o, p):
        z = p["z"].unflatten(-1, (self.n_heads, self.head_dim))
        return self.out_proj(self.norm(o, z).flatten(-2))

    def _forward(self, x):
        p = self._projections(x)
        q, k, v, g, alpha = self._heads(self.conv(p["qkv"]), p)
        o, core_state = self._core(q, k, v, g, alpha, None)
        # the convolution buffer in the model's dtype, as init_state and step lay it out (under autocast the
        # projections come in the autocast dtype)
        conv_state = self.conv.final_state(p["qkv"]).to(self.conv.conv.weight.dtype)
        return self._finish(o, p), {"conv": conv_state, **core_state}

    # --- the Mixer contract ------------------------------------------------------------------------
    def prefill(self, x, mask=None):
        return self._forward(x)

    def init_state(self, batch_size, device=None, dtype=None) -> State:
        return {"conv": self.conv.init_state(batch_size, device, dtype), **self._core_init(batch_size, device, dtype)}

    def step(self, x_t, state):
        p = self._projections(x_t)
        qkv, conv_state = self.conv.step(p["qkv"], state["conv"])
        q, k, v, g, alpha = self._heads(qkv, p)
        o, core_state = self._core_step(q, k, v, g, alpha, state)
        return self._finish(o, p), {"conv": conv_state, **core_state}

    def state_size(self, seq_len: int) -> int:
        return self._core_state_size() + self.qkv_dim * (self.options.conv_size - 1)

    @staticmethod
    def _state_dtype(dtype):
        return compute_dtype(dtype or torch.float32)


@register_mixer
class GLA(GatedRegressionBlock):
    name = "gla"
    description = "gated linear attention (scalar decay), the r=0 baseline of Gated KalmaNet"
    state_formula = "n_heads * (head_dim^2 + 3 head_dim (conv_size - 1))  (constant in T)"

    @dataclass
    class Options:
        n_heads: int = opt(4, "number of heads", at_least=1)
        head_dim: int | None = opt(None, "key/value dimension per head (None: d_model // n_heads)", at_least=1)
        beta_gate: bool = opt(True, "sigmoid gate beta_t scaling k_t and v_t")
        forget_gate: bool = opt(True, "Mamba-2 style log-decay gate g_t (off: no forgetting, g = 0)")
        conv_size: int = opt(4, "causal short-convolution width on q, k, v", at_least=1)
        chunk_size: int | None = chunk_size_opt("gla", "chunk length of the chunked form")
        backend: str = backend_opt(BACKENDS, "kernel backend (triton: the chunk stages it shares with GKA, chunk "
                                             "sizes powers of two >= 16; fla: flash-linear-attention's "
                                             "chunk_simple_gla, CUDA only, auto's choice on CUDA where installed)")

        def __post_init__(self):
            # the rule kernels.gla applies at the first forward, checked where a recipe names the two options
            why = self.backend == "triton" and self.chunk_size is not None and triton_chunk_size_problem(
                self.chunk_size)
            if why:
                raise ValueError(f"backend='triton' {why}; use chunk_size=16, 32 or 64, or backend='torch'")

    contract_options = {"n_heads": 2, "head_dim": 8, "chunk_size": 8}

    def _core(self, q, k, v, g, alpha, initial_state):
        o, U = gla(q, k, v, g, chunk_size=chunk_size_for(q, "gla", self.options.chunk_size), backend=self.options.backend)
        return o, {"U": U.to(self._state_dtype(q.dtype))}

    def _core_init(self, batch_size, device, dtype):
        d = self.head_dim
        return {"U": torch.zeros(batch_size, self.n_heads, d, d, device=device, dtype=self._state_dtype(dtype))}

    def _core_step(self, q, k, v, g, alpha, state):
        o, U = gla_step(q, k, v, g, state["U"])
        return o, {"U": U}

    def _core_state_size(self):
        return self.n_heads * self.head_dim * self.head_dim
