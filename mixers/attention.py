"""Causal multi-head softmax attention with rotary position embeddings (the baseline).

    o_t^h = sum_{i<=t} softmax_i(q_t^h . k_i^{g(h)} / sqrt(d)) v_i^{g(h)},    q, k rotated by RoPE (Su et al. 2021)

Here ``d = head_dim``. RoPE ("RoFormer: Enhanced Transformer with Rotary Position Embedding", arXiv 2104.09864) is
applied in the rotate-half pairing: at position ``p`` the coordinates ``i`` and ``i + d/2`` of a query or key turn together
by ``p base^(-2i/d)`` (``rope_base`` = 10000 by default). The paper pairs neighbours ``(2i, 2i + 1)``; the two differ
by a fixed permutation of the projection's q and k rows, so they span the same models, but checkpoints rotated the
other way do not load unchanged. The decode step rotates at the cache length.

With ``H = n_heads`` query heads and ``Hkv = n_kv_heads`` key/value heads, query head ``h`` reading key/value head
``g(h) = h // (H / Hkv)``. ``n_kv_heads`` unset is ``H``: ``g(h) = h``, standard multi-head attention (Vaswani et al.
2017, "Attention Is All You Need"). Fewer is grouped-query attention (GQA; Ainslie et al. 2023, "GQA: Training
Generalized Multi-Query Transformer Models from Multi-Head Checkpoints", arXiv 2305.13245), each key/value head
shared by ``H / Hkv`` query heads; ``n_kv_heads = 1`` is multi-query attention (Shazeer 2019). The projection gives
``H d`` query features then ``Hkv d`` key and ``Hkv d`` value features (``3 H d`` at the default, the layout of
checkpoints trained before the option, which load unchanged).

The decode state is the KV cache, ``2 * T * Hkv * d`` elements: the only mixer here whose state grows with the
context, ``H / Hkv`` times smaller under GQA. Kernels: torch SDPA (CPU default), our Triton flash-style
kernel, or flash-attn on CUDA (``backend``); every one takes the ``Hkv`` heads as they are (the Triton kernel
reads the shared head, no repeated copy).

Non-finite inputs: a NaN or inf at position t reaches the outputs of earlier positions too (the
fused attention kernels multiply the zero weight of a masked score by the NaN value); large finite inputs
do not (the contract suite checks 1e30).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.attention import BACKENDS, attention
from kernels.backend import triton_pieces_for
from kernels.rope import rope_reference, rotary

from .base import Mixer, State, register_mixer
from .options import backend_opt, opt


@register_mixer
class Attention(Mixer):
    name = "attention"
    description = "causal multi-head softmax attention with RoPE, optional grouped-query KV heads; KV-cache decode"
    state_formula = "2 * T * n_kv_heads * head_dim  (n_kv_heads unset = n_heads: 2 T d_model; grows with T)"

    @dataclass
    class Options:
        n_heads: int = opt(4, "number of heads", at_least=1)
        head_dim: int | None = opt(None, "per-head dimension, even (default d_model / n_heads)", at_least=2)
        rope_base: float = opt(10000.0, "RoPE base frequency", above=0.0)
        backend: str = backend_opt(BACKENDS)
        n_kv_heads: int | None = opt(None, "key/value heads, a divisor of n_heads (grouped-query attention, Ainslie "
                                           "et al. 2023: each shared by n_heads / n_kv_heads query heads; the KV cache "
                                           "shrinks by that factor); unset: n_heads", at_least=1, omit_at_default=True)

        def __post_init__(self):
            if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
                raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}: each "
                                 f"key/value head serves n_heads / n_kv_heads query heads; set n_kv_heads to a divisor "
                                 f"of n_heads (n_kv_heads={self.n_heads} or unset for multi-head attention)")

    state_grows_with_seq_len = True  # the KV cache
    input_to_linear = True           # x enters through the qkv projection only
    contract_options = {"n_heads": 2}

    def __init__(self, d_model: int, options: "Attention.Options"):
        super().__init__(d_model, options)
        H = options.n_heads
        if options.head_dim is None and d_model % H:
            raise ValueError(f"attention: d_model={d_model} is not divisible by n_heads={H}; set head_dim or change n_heads")
        self.head_dim = options.head_dim or d_model // H
        if self.head_dim % 2:
            raise ValueError(f"attention: head_dim={self.head_dim} must be even for RoPE")
        self.n_heads = H
        self.n_kv_heads = options.n_kv_heads or H
        if H % self.n_kv_heads:  # Options checks this too; an Options built around __post_init__ is still refused
            raise ValueError(f"attention: n_heads={H} is not divisible by n_kv_heads={self.n_kv_heads}; set n_kv_heads "
                             f"to a divisor of n_heads")
        # q | k | v features: H d, Hkv d, Hkv d (3 H d when n_kv_heads is unset: the layout checkpoints have)
        self.qkv = nn.Linear(d_model, (H + 2 * self.n_kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(H * self.head_dim, d_model, bias=False)

    def _qkv(self, x: torch.Tensor, start: int):
        """Queries and keys rotated to their positions ``start ..``, and values. On the GPU plan one Triton
        kernel rotates the fused projection (values copied) each way, where the formula launches about fifty
        kernels forward and backward per layer."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        heads = (H, Hkv, Hkv)
        if triton_pieces_for(x):
            qkv = rotary(self.qkv(x).view(B, T, H + 2 * Hkv, D), start, self.options.rope_base, rotated=H + Hkv,
                         backend="triton")
            return qkv.split(heads, dim=2)
        q, k, v = self.qkv(x).view(B, T, H + 2 * Hkv, D).split(heads, dim=2)
        pos = torch.arange(start, start + T, device=x.device)
        base = self.options.rope_base
        return rope_reference(q, pos, base), rope_reference(k, pos, base), v

    def prefill(self, x, mask=None):
        q, k, v = self._qkv(x, 0)
        o = attention(q, k, v, causal=True, backend=self.options.backend)
        # the cache in the module's dtype, as init_state lays it out and step extends it (step runs with autocast
        # off): under autocast the projection gives k and v in the autocast dtype, and the first step's
        # concatenation would promote the whole cache mid-decode
        dtype = self.qkv.weight.dtype
        return self.out(o.flatten(2)), {"k": k.to(dtype), "v": v.to(dtype)}

    def init_state(self, batch_size, device=None, dtype=None) -> State:
        empty = torch.zeros(batch_size, 0, self.n_kv_heads, self.head_dim, device=device, dtype=dtype)
        return {"k": empty, "v": empty.clone()}

    def step(self, x_t, state):
        q, k, v = self._qkv(x_t[:, None], state["k"].shape[1])
        k_all = torch.cat([state["k"], k], dim=1)
        v_all = torch.cat([state["v"], v], dim=1)
        backend = "torch" if self.options.backend in ("triton", "flash_attn") else self.options.backend
        o = attention(q, k_all, v_all, causal=False, backend=backend)
        return self.out(o.flatten(2))[:, 0], {"k": k_all, "v": v_all}

    def state_size(self, seq_len: int) -> int:
        return 2 * seq_len * self.n_kv_heads * self.head_dim  # the KV cache holds the n_kv_heads heads only
