"""The kronecker_slots mixer against its equations (Xiao et al., "RAM-Net", arXiv 2602.11958), computed here
from the layer's weights alone: a depthwise causal ``F.conv1d``, the materialised Kronecker product of the factor
softmaxes and its top-K, the dense slot recurrence ``S_t = diag(1 - w_t)^gamma S_{t-1} + w_t v_t^T`` over all M
slots, the read ``sum_m r_t,m S_t[m] / (z_t[m] + eps)`` and the gated RMS norm. Each option that changes the
equations (temperature, renormalisation, straight-through weights, tied or shifted addresses, position
features) is checked in the forward, in the recurrent form and in prefill-then-decode.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernels.slots import slot_memory
from mixers import build_mixer
from tests.kernels.harness import assert_rel_close, needs_triton

D = 24
SMALL = {"n_heads": 2, "d_v": 5, "d_p": 3, "U": 2, "top_k": 3, "chunk_size": 4}


def make(**opts):
    m = build_mixer("kronecker_slots", D, {**SMALL, **opts}).double()
    with torch.no_grad():
        for p in m.parameters():  # away from the init (zero position map, unit norm weight, gamma = 1)
            p.add_(0.3 * torch.randn_like(p))
    return m


def product_distribution(logits, tau):
    """``(..., U, d_p)`` -> ``(..., d_p^U)``: slot ``m`` with base-``d_p`` digits ``i_1 .. i_U`` (first most
    significant) has probability ``prod_u softmax(l_u / tau)[i_u]``."""
    p = torch.softmax(logits / tau, dim=-1)
    out = p[..., 0, :]
    for u in range(1, p.shape[-2]):
        out = torch.einsum("...a,...b->...ab", out, p[..., u, :]).flatten(-2)
    return out


def positions(T):
    half = 8
    freq = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * freq
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


def dense_memory(w, r, v, gamma, eps):
    """Over all M slots: ``w, r (B, T, H, M)`` dense write and read weights, ``v (B, T, H, d_v)``, ``gamma (H,)``."""
    B, T, Hh, M = w.shape
    S = torch.zeros(B, Hh, M, v.shape[-1], dtype=v.dtype)
    z = torch.zeros(B, Hh, M, dtype=v.dtype)
    outs = []
    for t in range(T):
        keep = (1 - w[:, t]) ** gamma[:, None]
        S = keep[..., None] * S + w[:, t, ..., None] * v[:, t, :, None, :]
        z = keep * z + w[:, t]
        outs.append(torch.einsum("bhm,bhmd->bhd", r[:, t] / (z + eps), S))
    return torch.stack(outs, 1)


def explicit_forward(m, x):
    """The layer's output for ``x (B, T, D)`` from its parameters and the module docstring's equations."""
    o = m.options
    B, T, _ = x.shape
    Hh, dv, K = m.n_heads, m.d_v, o.top_k
    kl = x @ m.k_proj.weight.T
    ql = x @ (m.k_proj if o.tie_addresses else m.q_proj).weight.T
    if o.shift_write_address:  # the write address of token t is the projection of token t - 1
        kl = torch.cat([torch.zeros_like(kl[:, :1]), kl[:, :-1]], dim=1)
    v = x @ m.v_proj.weight.T
    if o.conv_size > 1:
        raw = torch.cat([kl, ql, v], dim=-1).transpose(1, 2)
        conv = m.conv.conv
        mixed = F.conv1d(raw, conv.weight, conv.bias, padding=o.conv_size - 1, groups=raw.shape[1])[..., :T]
        kl, ql, v = mixed.transpose(1, 2).split([kl.shape[-1], ql.shape[-1], v.shape[-1]], dim=-1)
    if o.pos_address:
        pk, pq = (positions(T) @ m.pos_proj.weight.T).chunk(2, dim=-1)
        kl, ql = kl + pk, ql + pq
    v = v.unflatten(-1, (Hh, dv))

    def address(logits):  # dense (B, T, H, M) weights, zero off the top-K slots
        dist = product_distribution(logits.unflatten(-1, (Hh, o.U, o.d_p)), o.tau)
        val, idx = (t[..., :K] for t in dist.sort(dim=-1, descending=True, stable=True))  # ties: lower slot first
        if o.renormalize:
            val = val / val.sum(-1, keepdim=True)
        if o.topk_grad == "straight_through":
            val = torch.full_like(val, 1.0 / K)
        return torch.zeros_like(dist).scatter(-1, idx, val)

    out = dense_memory(address(kl), address(ql), v, F.softplus(m.gamma_raw), o.eps)
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + m.norm.eps) * m.norm.weight
    gate = (x @ m.g_proj.weight.T).unflatten(-1, (Hh, dv))
    return (normed * F.silu(gate)).flatten(-2) @ m.out_proj.weight.T


OPTIONS = [
    {},
    {"renormalize": False, "tau": 0.5},
    {"topk_grad": "straight_through", "d_p": 2, "U": 3, "top_k": 5},
    {"tie_addresses": True, "conv_size": 2},
    {"shift_write_address": True, "conv_size": 1},
    {"shift_write_address": True, "tie_addresses": True, "pos_address": True},
    {"memory_layout": "sparse", "U": 3, "top_k": 4},
    {"backend": "reference", "tau": 2.0, "gamma_init": 0.3},
]


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
def test_forward_recurrent_and_decode_follow_the_equations(opts):
    m = make(**opts)
    x = torch.randn(2, 11, D, dtype=torch.float64)
    with torch.no_grad():
        expected = explicit_forward(m, x)
        assert_rel_close(m(x), expected, 1e-10, "forward")
        assert_rel_close(m.forward_recurrent(x)[0], expected, 1e-10, "recurrent")
        y, state = m.prefill(x[:, :4])
        ys = [y]
        for t in range(4, 11):
            y_t, state = m.step(x[:, t], state)
            ys.append(y_t[:, None])
    assert_rel_close(torch.cat(ys, 1), expected, 1e-10, "prefill then decode")


@pytest.mark.parametrize("opts", [{}, {"shift_write_address": True, "conv_size": 1}], ids=str)
def test_decoding_from_the_initial_state_follows_the_equations(opts):
    m = make(**opts)
    x = torch.randn(2, 6, D, dtype=torch.float64)
    with torch.no_grad():
        state, ys = m.init_state(2, dtype=torch.float64), []
        for t in range(6):
            y_t, state = m.step(x[:, t], state)
            ys.append(y_t)
        assert_rel_close(torch.stack(ys, 1), explicit_forward(m, x), 1e-10)


def test_gamma_starts_at_gamma_init_and_stays_positive():
    m = build_mixer("kronecker_slots", D, {**SMALL, "gamma_init": 0.37})
    assert torch.allclose(m.gamma(torch.float32), torch.full((2,), 0.37), rtol=1e-6)
    with torch.no_grad():
        m.gamma_raw.copy_(torch.tensor([-40.0, 3.0]))
    gamma = m.gamma(torch.float64)
    assert (gamma > 0).all() and math.isclose(gamma[1].item(), math.log1p(math.exp(3.0)), rel_tol=1e-12)


def test_gradients_match_the_equations():
    m = make()
    x = torch.randn(1, 9, D, dtype=torch.float64)
    up = torch.randn(1, 9, D, dtype=torch.float64)
    (m(x) * up).sum().backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    (explicit_forward(m, x) * up).sum().backward()
    for n, p in m.named_parameters():
        assert_rel_close(got[n], p.grad, 1e-9, f"gradient of {n}")


def test_active_state_counts_at_most_the_slots_there_are():
    """A step touches K written and K read rows of (S, z) per head, but never more rows than the M slots."""
    m = build_mixer("kronecker_slots", D, {**SMALL, "d_p": 2, "U": 2, "top_k": 3, "conv_size": 1})  # 2K = 6 > M = 4
    assert m.active_state_size(7) == m.n_heads * 4 * (m.d_v + 1) == m.state_size(7)
    m = build_mixer("kronecker_slots", D, {**SMALL, "conv_size": 1})  # 2K = 6 < M = 9
    assert m.active_state_size(7) == m.n_heads * 6 * (m.d_v + 1)


MEMORY_PATHS = [dict(backend="reference"), dict(backend="torch", layout="dense", chunk_size=4),
                dict(backend="torch", layout="sparse")]


def _addresses(B, T, H, M, K):
    idx = torch.rand(B, T, H, M).argsort(-1)[..., :K]  # distinct within a token
    return idx, torch.rand(B, T, H, K, dtype=torch.float64) * 0.9 + 0.05


@pytest.mark.parametrize("kw", MEMORY_PATHS, ids=str)
def test_every_memory_path_divides_by_z_plus_the_given_eps(kw):
    B, T, H, M, K = 2, 9, 2, 6, 2
    (wi, ww), (ri, rw) = _addresses(B, T, H, M, K), _addresses(B, T, H, M, K)
    v = torch.randn(B, T, H, 3, dtype=torch.float64)
    gamma = torch.rand(H, dtype=torch.float64) + 0.3
    eps = 0.7  # comparable with z: a path that ignores it is far off
    o, _ = slot_memory(wi, ww, ri, rw, v, gamma, M, eps=eps, **kw)
    dense = lambda idx, val: torch.zeros(B, T, H, M, dtype=val.dtype).scatter(-1, idx, val)  # noqa: E731
    assert_rel_close(o, dense_memory(dense(wi, ww), dense(ri, rw), v, gamma, eps), 1e-12)


@pytest.mark.parametrize("kw", MEMORY_PATHS, ids=str)
def test_a_full_write_replaces_the_slot_with_finite_gradients(kw):
    """w = 1 (one slot, renormalised weight): the slot forgets everything and holds v_t, so reading it returns
    v_t / (1 + eps) (up to the (1e-6)^gamma the slot keeps: the log decay log(1 - w) is taken at w = 1 - 1e-6, so
    that every gradient stays finite)."""
    B, T, H, M = 1, 6, 2, 4
    idx = torch.randint(0, M, (B, T, H, 1))
    w = torch.ones(B, T, H, 1, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, T, H, 3, dtype=torch.float64, requires_grad=True)
    gamma = (torch.rand(H, dtype=torch.float64) + 2.0).requires_grad_()  # what the slot keeps: below 1e-12
    o, _ = slot_memory(idx, w, idx, torch.ones_like(w), v, gamma, M, **kw)
    assert_rel_close(o, v / (1 + 1e-6), 1e-9)
    (o * torch.randn_like(o)).sum().backward()
    for name, t in (("w", w), ("v", v), ("gamma", gamma)):
        assert torch.isfinite(t.grad).all(), f"gradient of {name}"


def test_more_addresses_than_slots_are_refused():
    idx = torch.zeros(1, 3, 1, 4, dtype=torch.long)
    w = torch.full((1, 3, 1, 4), 0.25)
    with pytest.raises(ValueError, match="K=4 exceeds num_slots=3"):
        slot_memory(idx, w, idx, w, torch.randn(1, 3, 1, 2), torch.ones(1), 3)


@pytest.mark.parametrize("which", ["write_idx", "read_idx"])
@pytest.mark.parametrize("kw", [*MEMORY_PATHS, pytest.param(dict(backend="triton"), marks=needs_triton)], ids=str)
def test_a_slot_number_outside_the_memory_is_refused_by_name(kw, which):
    M, K, T = 6, 2, int(torch.randint(1, 5, ()))
    idx = torch.rand(1, T, 1, M).argsort(-1)[..., :K].contiguous()
    w = torch.rand(1, T, 1, K)
    t, j = int(torch.randint(0, T, ())), int(torch.randint(0, K, ()))
    for bad in (M, M + int(torch.randint(1, 100, ())), -1):
        wrong = idx.clone()
        wrong[0, t, 0, j] = bad
        args = (wrong, idx) if which == "write_idx" else (idx, wrong)
        with pytest.raises(ValueError, match=rf"{which} holds slot {bad}, outside 0\.\.{M - 1} \(num_slots={M}\)"):
            slot_memory(args[0], w, args[1], w, torch.randn(1, T, 1, 3), torch.ones(1), M, **kw)
