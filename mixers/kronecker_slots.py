"""Kronecker slot memory: a sparse, content-addressed memory of M = d_p^U slots per head, written and read
through top-K Kronecker-product addresses, with a power-decay moving average per slot.

Xiao et al., "RAM-Net: Expressive Linear Attention with Selectively Addressable Memory", arXiv 2602.11958. Per
head, with ``x`` the block input:

    [l^w, l^r, v] = conv_4([W_k x, W_q x, W_v x])   (causal depthwise, no activation; W_q = W_k when tied)
    l^w_t, l^r_t: each U factors of d_p logits per head          [+ P pos(t), optional]
    (W_t, w_t) = top-K of softmax(l^w_t,1 / tau) (x) ... (x) softmax(l^w_t,U / tau)    (write address)
    (R_t, r_t) = the same from l^r_t                                                (read address)
    w_t <- w_t / sum_j w_t,j ;  r_t <- r_t / sum_j r_t,j                            (renormalize)
    S_t = diag(1 - w_t)^gamma S_{t-1} + w_t v_t^T,   z_t = diag(1 - w_t)^gamma z_{t-1} + w_t
    o_t = sum_m r_t,m S_t[m] / (z_t[m] + eps)          (the read at t sees the write of t)
    y_t = W_o [GatedRMSNorm(o_t) * silu(W_g x_t)]      (norm per head)

``gamma = softplus(gamma_raw)`` per head (positive, init 1): it sets how fast a slot forgets relative to
how strongly it is written; slots that are not written do not decay, so a token touches 2K slot rows
(K written, K read) whatever M is. The memory kernels are :func:`kernels.slots.slot_memory`; the address
decoder is :func:`kernels.slots.kronecker_topk` (never materialises the M-vector).

Choices the paper leaves open, each an option (default, and why):
- ``renormalize`` (True): divide the K selected weights by their sum, for writes and reads. The raw
  product probabilities shrink like 1/M at a flat softmax, which would make the write strength (and so
  the EMA rate) depend on M; renormalised, a write has total weight 1 spread over K slots at every M,
  which is what a capacity comparison across M at fixed K needs.
- ``tau`` (1.0): softmax temperature of every factor.
- ``topk_grad`` ("soft"): gradients flow through the selected product probabilities (the selection
  itself is piecewise constant). "straight_through": the forward uses hard uniform weights 1/K on the
  selected slots, the backward the gradient of the soft weights.
- ``pos_address`` (False): adds a linear map (zero-initialised) of sinusoidal features of the position
  to the write and read logits, so the model can learn time-dependent addresses; off by default because
  recall wants content-only addresses (a key written at one time is queried at another) and because it
  ties the address to absolute positions (length generalisation).
- read-after-write (fixed, not an option): the read at ``t`` sees the write of ``t``, as in linear
  attention's ``o_t = S_t q_t``, so T = 1 returns what was written rather than zeros.
- ``conv_size`` (4): a causal short convolution over the address logits and values (as in the gla and
  deltanet mixers of this zoo), so a write can be addressed by the previous token (the key of a
  key-value pair) while storing the current one; 1 turns it off.
- ``shift_write_address`` (False): the write address is computed from the previous token (its
  projection ``W_k x_{t-1}``) while the value is the current token's, a fixed shift on the keys like
  the shift SSM of H3 (Fu et al., "Hungry Hungry Hippos", arXiv 2212.14052). Off by default (the
  paper's addresses are content of the current token); with ``tie_addresses`` and ``conv_size = 1`` the
  value of a key-then-value pair is stored exactly where a later occurrence of the key reads, from the
  first step of training, so recall does not have to wait for sparse top-K gradients to align two
  independently initialised address maps. In ``tables/slots_capacity`` (MQAR, 16 pairs, 500 steps)
  the default addressing stays at chance at M = 1024 while the shifted, tied one reaches 1.0.
- ``tie_addresses`` (False): reads use their own projection; True reads with the write projection
  (each keeps its own short-convolution filter, so a write can be addressed by the previous token and
  a read by the current one, and the two agree when those tokens are equal).

Decode state per sequence: ``S (H, M, d_v)``, ``z (H, M)``, the convolution buffer (+ a position
counter with ``pos_address``), constant in T; a step reads/writes only ``min(2 K, M) (d_v + 1)`` memory elements
per head plus the convolution buffer (``active_state_size``). Without autograd, ``step`` writes those
rows into the state tensors it is given (no copy of the ``M x d_v`` memory per token).

Non-finite inputs: a NaN or inf at position t reaches the earlier outputs of its chunk in the dense
layout (NaN times the zero of the chunk's causal mask); large finite inputs do not (the contract suite
checks 1e30).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.common import at_least_fp32, compute_dtype, full_precision
from kernels.slots import BACKENDS, LAYOUTS, kronecker_topk, slot_memory, slot_step

from .base import Mixer, State, register_mixer
from .layers import GatedRMSNorm, ShortConv, keep_autocast_dtype, no_weight_decay, one_pass, project
from .options import backend_opt, chunk_size_for, chunk_size_opt, opt

_POS_FEATURES = 16
#: the spellings of ``backend`` from before ``memory_layout`` was its own option, still accepted (the
#: committed CPU benchmark of the slot memory names them): ``backend=dense`` is ``backend=torch`` with
#: ``memory_layout=dense``
_LAYOUT_BACKENDS = ("dense", "sparse")


def _positions(start, T, device, dtype):
    """Sinusoidal features of positions ``start .. start + T - 1``: ``(..., T, _POS_FEATURES)``."""
    half = _POS_FEATURES // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half, device=device, dtype=dtype) / half)
    pos = start.unsqueeze(-1) + torch.arange(T, device=device, dtype=dtype)  # (B, T)
    ang = pos.unsqueeze(-1) * freq
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


@register_mixer
class KroneckerSlots(Mixer):
    name = "kronecker_slots"
    description = "Kronecker-addressed sparse slot memory (RAM-Net): top-K of M = d_p^U slots, power-decay EMA"
    state_formula = ("n_heads d_p^U (d_v + 1) + (conv_size - 1)(2 U d_p + d_v) n_heads "
                     "[+ n_heads U d_p with shift_write_address] [+ 1 with pos_address]  "
                     "(constant in T; per token min(2 top_k, M) (d_v + 1) per head + conv touched)")

    @dataclass
    class Options:
        n_heads: int = opt(2, "number of heads (each has its own memory)", at_least=1)
        d_v: int | None = opt(None, "value dimension per head (None: d_model // n_heads)", at_least=1)
        d_p: int = opt(4, "logits per address factor (a softmax over one logit is constant); M = d_p^U slots",
                       at_least=2)
        U: int = opt(3, "number of address factors; M = d_p^U slots", at_least=1)
        top_k: int = opt(4, "slots written and read per token per head (K)", at_least=1)
        tau: float = opt(1.0, "softmax temperature of every address factor", above=0.0)
        renormalize: bool = opt(True, "divide the K selected weights by their sum (write strength independent of M)")
        topk_grad: str = opt("soft", "soft: gradient through the selected probabilities; straight_through: hard "
                             "1/K weights forward, soft gradient backward", choices=("soft", "straight_through"))
        pos_address: bool = opt(False, "add a learned (zero-init) map of sinusoidal position features to the "
                                "address logits")
        gamma_init: float = opt(1.0, "initial decay power gamma (learnable, positive)", above=0.0)
        eps: float = opt(1e-6, "added to the slot normaliser z before dividing", above=0.0)
        conv_size: int = opt(4, "causal short-convolution width on the address logits and values (1: none)",
                             at_least=1)
        tie_addresses: bool = opt(False, "read addresses use the write-address projection (one projection)")
        shift_write_address: bool = opt(False, "the write address comes from the previous token's projection "
                                        "(key-then-value pairs: store v_t under the address of x_{t-1})")
        chunk_size: int | None = chunk_size_opt("slots", "chunk length of the dense chunked path")
        backend: str = backend_opt(BACKENDS + _LAYOUT_BACKENDS,
                                   "memory kernel: torch (in the memory_layout), triton (sparse scan kernels), "
                                   "reference (token loop), auto (triton on CUDA, else torch); dense / sparse: "
                                   "torch in that layout (older spelling)")
        memory_layout: str = opt("auto", "layout of the torch memory kernel: dense (chunked, O(T (C K + M) d_v)), "
                                 "sparse (scan over K rows, O(T K d_v)), auto (dense for M <= 512, else sparse)",
                                 choices=LAYOUTS, omit_at_default=True)

        def __post_init__(self):
            if self.top_k > self.d_p ** self.U:
                raise ValueError(f"top_k={self.top_k} exceeds the number of slots d_p^U = {self.d_p ** self.U}; "
                                 f"lower top_k or raise d_p / U")
            if self.memory_layout != "auto" and self.backend in ("reference", "triton"):
                raise ValueError(f"memory_layout={self.memory_layout!r} chooses between the torch backend's paths; "
                                 f"backend={self.backend!r} has one layout: use backend='torch' or "
                                 f"memory_layout='auto'")
            if self.backend in _LAYOUT_BACKENDS and self.memory_layout not in ("auto", self.backend):
                raise ValueError(f"backend={self.backend!r} is backend='torch' with memory_layout={self.backend!r}, "
                                 f"which contradicts memory_layout={self.memory_layout!r}: set backend='torch'")

    contract_options = {"n_heads": 2, "d_v": 8, "d_p": 4, "U": 2, "top_k": 3, "chunk_size": 8}

    def __init__(self, d_model: int, options):
        super().__init__(d_model, options)
        o = options
        self.n_heads = o.n_heads
        self.d_v = o.d_v if o.d_v is not None else d_model // o.n_heads
        if self.d_v <= 0:
            raise ValueError(f"{self.name}: d_model={d_model} // n_heads={o.n_heads} is 0; set d_v explicitly")
        self.num_slots = o.d_p ** o.U
        h, dv, a = self.n_heads, self.d_v, o.n_heads * o.U * o.d_p
        self.addr_dim = a
        self.k_proj = nn.Linear(d_model, a, bias=False)
        if not o.tie_addresses:
            self.q_proj = nn.Linear(d_model, a, bias=False)
        self.v_proj = nn.Linear(d_model, h * dv, bias=False)
        self.conv_dim = 2 * a + h * dv
        self.conv = ShortConv(self.conv_dim, o.conv_size, activation=False) if o.conv_size > 1 else None
        self.g_proj = nn.Linear(d_model, h * dv, bias=False)
        if o.pos_address:
            self.pos_proj = nn.Linear(_POS_FEATURES, 2 * a, bias=False)
            nn.init.zeros_(self.pos_proj.weight)
        self.gamma_raw = nn.Parameter(torch.full((h,), math.log(math.expm1(o.gamma_init))))
        no_weight_decay(self, "gamma_raw")  # the forgetting power of the slot EMA (a decay rate)
        self.norm = GatedRMSNorm(dv)
        self.out_proj = nn.Linear(h * dv, d_model, bias=False)

    # --- pieces ----------------------------------------------------------------------------------
    def gamma(self, dtype):
        return F.softplus(self.gamma_raw.to(compute_dtype(dtype)))

    def _address(self, logits, pairs: int = 0):
        """``(idx, w)`` of address logits ``(..., H U d_p)``; ``pairs = 2``: logits ``(..., 2 H U d_p)`` holding the
        write and the read logits side by side, addressed in one call, ``(..., 2, H, K)`` out."""
        o = self.options
        shape = (self.n_heads, o.U, o.d_p) if not pairs else (pairs, self.n_heads, o.U, o.d_p)
        b = o.backend
        return kronecker_topk(logits.unflatten(-1, shape), o.top_k, o.tau, renormalize=o.renormalize,
                              straight_through=o.topk_grad == "straight_through",
                              backend=b if b in ("auto", "triton") else "torch")

    def _addresses(self, mixed, kl, ql, x):
        """``(wi, w, ri, r)``. On the GPU plan the write and read logits, adjacent columns of the convolved
        projections, are addressed in one call (one kernel each way), and the four results are views."""
        if one_pass(x) and not self.options.pos_address:
            (wi, ri), (w, r) = (t.unbind(-3) for t in self._address(mixed[..., :2 * self.addr_dim], pairs=2))
            return wi, w, ri, r
        return (*self._address(kl), *self._address(ql))

    @full_precision
    def _logits(self, proj, x):
        """Address logits in at least fp32 even under autocast: top-K is a discrete choice, and bf16 logits
        (8 mantissa bits) tie and flip selections that fp32 keeps apart."""
        x = at_least_fp32(x)
        return F.linear(x, proj.weight.to(x.dtype), None if proj.bias is None else proj.bias.to(x.dtype))

    @full_precision
    def _logit_pair(self, x):
        """``(k logits, q logits)`` as :meth:`_logits`, from one matmul (the GPU plan's, untied addresses)."""
        x = at_least_fp32(x)
        return F.linear(x, torch.cat([self.k_proj.weight, self.q_proj.weight]).to(x.dtype)).chunk(2, dim=-1)

    def _value_and_gate(self, x):
        """``(v, output gate)`` projections: one matmul on the GPU plan (the two bf16 matmuls under autocast
        would each cast ``x`` and add their input gradients)."""
        return project(x, [self.v_proj, self.g_proj])

    def _raw(self, x, v, k_prev=None):
        """The projections that go through the short convolution: [k logits, q logits (untied), v]."""
        if one_pass(x) and not self.options.tie_addresses:
            k, q = self._logit_pair(x)
        else:
            k = self._logits(self.k_proj, x)
            q = k if self.options.tie_addresses else self._logits(self.q_proj, x)
        if self.options.shift_write_address:
            k = torch.cat([torch.zeros_like(k[:, :1]), k[:, :-1]], dim=1) if k_prev is None else k_prev
        return torch.cat([k, q, v.to(k.dtype)], dim=-1)

    def _split(self, mixed, x, start):
        """``(k logits, q logits, v (..., H, d_v))`` from the convolved projections."""
        a = self.addr_dim
        kl = mixed[..., :a]
        ql = mixed[..., a:2 * a]
        v = mixed[..., -self.n_heads * self.d_v:].unflatten(-1, (self.n_heads, self.d_v))
        if self.options.pos_address:
            squeeze = x.ndim == 2
            feats = _positions(start, 1 if squeeze else x.shape[1], x.device, compute_dtype(x.dtype))
            pk, pq = F.linear(feats, self.pos_proj.weight.to(feats.dtype)).to(x.dtype).chunk(2, dim=-1)
            if squeeze:
                pk, pq = pk[:, 0], pq[:, 0]
            kl, ql = kl + pk, ql + pq
        return kl, ql, v

    def _finish(self, o, x, gate):
        gate = gate.unflatten(-1, (self.n_heads, self.d_v))
        return self.out_proj(self.norm(keep_autocast_dtype(o, x), gate).flatten(-2))

    def _kernel_args(self):
        b = self.options.backend
        if b in _LAYOUT_BACKENDS:
            return {"backend": "torch", "layout": b}
        return {"backend": b, "layout": self.options.memory_layout}

    # --- the Mixer contract ------------------------------------------------------------------------
    def prefill(self, x, mask=None):
        B, T, _ = x.shape
        start = torch.zeros(B, device=x.device, dtype=compute_dtype(x.dtype)) if self.options.pos_address else None
        v, gate = self._value_and_gate(x)
        raw = self._raw(x, v)
        mixed = self.conv(raw) if self.conv is not None else raw
        kl, ql, v = self._split(mixed, x, start)
        k_last = self._logits(self.k_proj, x[:, -1]) if self.options.shift_write_address else None
        wi, w, ri, r = self._addresses(mixed, kl, ql, x)
        o, (S, z) = slot_memory(wi, w, ri, r, v, self.gamma(x.dtype), self.num_slots, eps=self.options.eps,
                                chunk_size=chunk_size_for(v, "slots", self.options.chunk_size), **self._kernel_args())
        state = {"S": S, "z": z}
        if self.conv is not None:
            state["conv"] = self.conv.final_state(raw)
        if self.options.pos_address:
            state["pos"] = (start + T).unsqueeze(-1)
        if self.options.shift_write_address:
            state["k_prev"] = k_last
        return self._finish(o, x, gate), state

    def init_state(self, batch_size, device=None, dtype=None) -> State:
        cd = compute_dtype(dtype or torch.float32)
        state = {"S": torch.zeros(batch_size, self.n_heads, self.num_slots, self.d_v, device=device, dtype=cd),
                 "z": torch.zeros(batch_size, self.n_heads, self.num_slots, device=device, dtype=cd)}
        if self.conv is not None:
            state["conv"] = self.conv.init_state(batch_size, device, cd)   # the logits are at least fp32
        if self.options.pos_address:
            state["pos"] = torch.zeros(batch_size, 1, device=device, dtype=cd)
        if self.options.shift_write_address:
            state["k_prev"] = torch.zeros(batch_size, self.addr_dim, device=device, dtype=cd)
        return state

    def step(self, x_t, state):
        start = state["pos"][:, 0] if self.options.pos_address else None
        v, gate = self._value_and_gate(x_t)
        raw = self._raw(x_t, v, state["k_prev"] if self.options.shift_write_address else None)
        new = {}
        if self.options.shift_write_address:
            new["k_prev"] = self._logits(self.k_proj, x_t)
        if self.conv is not None:
            raw, new["conv"] = self.conv.step(raw, state["conv"])
        kl, ql, v = self._split(raw, x_t, start)
        wi, w = self._address(kl)
        ri, r = self._address(ql)
        # without autograd the K written rows are updated in the given state tensors (O(K d_v) per token;
        # a copy would move the whole M x d_v memory every step)
        o, (S, z) = slot_step(wi, w, ri, r, v, self.gamma(x_t.dtype), (state["S"], state["z"]), self.options.eps,
                              inplace=not torch.is_grad_enabled())
        new.update(S=S, z=z)
        if self.options.pos_address:
            new["pos"] = state["pos"] + 1
        return self._finish(o, x_t, gate), new

    def _conv_state_size(self):
        # the short-convolution buffer, plus the previous token's address logits with shift_write_address
        return self.conv_dim * (self.options.conv_size - 1) + (self.addr_dim if self.options.shift_write_address else 0)

    def state_size(self, seq_len: int) -> int:
        return (self.n_heads * self.num_slots * (self.d_v + 1) + self._conv_state_size()
                + (1 if self.options.pos_address else 0))

    def active_state_size(self, seq_len: int) -> int:
        # K written and K read rows of (S, z) per head (at most the M rows there are), plus the whole (small)
        # convolution buffer
        rows = min(2 * self.options.top_k, self.num_slots)
        return (self.n_heads * rows * (self.d_v + 1) + self._conv_state_size()
                + (1 if self.options.pos_address else 0))
