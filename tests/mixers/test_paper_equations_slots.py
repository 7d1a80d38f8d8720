"""The Kronecker slot memory against Xiao et al., "RAM-Net: Expressive Linear Attention with Selectively Addressable
Memory", arXiv:2602.11958, written here in fp64 with every slot materialised: the address is the top-K of
``softmax(k^(1)/tau) (x) ... (x) softmax(k^(U)/tau)`` over the ``M = d_p^U`` digit tuples enumerated one by one
(renormalised to sum 1 when asked), and the power-decay moving average runs on dense length-M vectors,
``S_t = diag(1 - w_t)^gamma S_{t-1} + w_t v_t^T``, ``z_t = diag(1 - w_t)^gamma z_{t-1} + w_t``,
``o_t = sum_m r_t,m S_t[m] / (z_t[m] + eps)`` (unwritten slots have ``w = 0`` and so keep their value). Checked
for the address decoder, every memory path of the kernel, and the layer on its own projections and convolution;
plus the default ``gamma = 1`` (a plain EMA per written slot).
"""
from __future__ import annotations

import itertools

import pytest
import torch

from kernels.slots import kronecker_topk, slot_memory
from mixers import build_mixer

F64 = torch.float64


def paper_address(logits, k, tau, renormalize):
    """``logits (U, d_p)`` of one head -> ``{slot: weight}`` of the top-K of the materialised product."""
    U, dp = logits.shape
    p = torch.softmax(logits / tau, dim=-1)
    probs = {}
    for digits in itertools.product(range(dp), repeat=U):
        slot = sum(i * dp ** (U - 1 - u) for u, i in enumerate(digits))
        probs[slot] = torch.prod(torch.stack([p[u, i] for u, i in enumerate(digits)]))
    top = sorted(probs, key=lambda s: -probs[s])[:k]
    total = sum(probs[s] for s in top) if renormalize else 1.0
    return {s: probs[s] / total for s in top}


def dense(addr, M):
    out = torch.zeros(M, dtype=F64)
    for s, w in addr.items():
        out[s] = w
    return out


def pdma(wd, rd, v, gamma, eps):
    """Dense PDMA of one head: ``wd, rd (T, M)``, ``v (T, d_v)`` -> ``o (T, d_v)``."""
    M = wd.shape[1]
    S, z, outs = torch.zeros(M, v.shape[1], dtype=F64), torch.zeros(M, dtype=F64), []
    for t in range(v.shape[0]):
        keep = (1 - wd[t]) ** gamma
        S = keep[:, None] * S + wd[t][:, None] * v[t][None, :]
        z = keep * z + wd[t]
        outs.append((rd[t][:, None] * S / (z[:, None] + eps)).sum(0))
    return torch.stack(outs)


@pytest.mark.parametrize("renormalize", [True, False])
def test_top_k_of_the_materialised_kronecker_product(renormalize):
    U, dp = int(torch.randint(2, 4, ())), int(torch.randint(2, 5, ()))
    k = int(torch.randint(1, min(6, dp ** U - 1) + 1, ()))   # fewer than M: the renormalisation shows
    tau = float(torch.empty(()).uniform_(0.3, 2.0))
    logits = 2 * torch.randn(3, U, dp, dtype=F64)
    idx, w = kronecker_topk(logits, k, tau, renormalize=renormalize, backend="torch")
    for row in range(3):
        want = paper_address(logits[row], k, tau, renormalize)
        got = dict(zip(idx[row].tolist(), w[row]))
        assert set(got) == set(want)
        for s in want:
            torch.testing.assert_close(got[s], want[s], rtol=1e-12, atol=1e-12)


PATHS = [{"backend": "reference"}, {"backend": "torch", "layout": "dense"}, {"backend": "torch", "layout": "sparse"}]


def _check_memory_paths(kw, repeated_reads):
    Bsz, T, H, M, K, dv = 2, int(torch.randint(6, 12, ())), 2, 9, 3, 4
    wi = torch.rand(Bsz, T, H, M).argsort(-1)[..., :K]
    if repeated_reads:   # a slot read twice in one token is read with both weights
        ri = torch.randint(0, M - 1, (Bsz, T, H, K))
        ri[..., 1] = ri[..., 0]
    else:                # distinct, as the address decoder returns them
        ri = torch.rand(Bsz, T, H, M).argsort(-1)[..., :K]
    w, r = torch.rand(Bsz, T, H, K, dtype=F64), torch.rand(Bsz, T, H, K, dtype=F64)
    v = torch.randn(Bsz, T, H, dv, dtype=F64)
    gamma, eps = torch.rand(H, dtype=F64) * 2 + 0.1, float(torch.empty(()).uniform_(1e-3, 0.5))
    o, _ = slot_memory(wi, w, ri, r, v, gamma, M, eps=eps, chunk_size=4, **kw)   # several chunks
    for b, h in itertools.product(range(Bsz), range(H)):
        wd = torch.zeros(T, M, dtype=F64).scatter_(1, wi[b, :, h], w[b, :, h])
        rd = torch.zeros(T, M, dtype=F64).scatter_add_(1, ri[b, :, h], r[b, :, h])
        torch.testing.assert_close(o[b, :, h], pdma(wd, rd, v[b, :, h], gamma[h], eps), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kw", PATHS)
def test_memory_paths_equal_the_dense_power_decay_average(kw):
    _check_memory_paths(kw, repeated_reads=False)


@pytest.mark.parametrize("kw", PATHS)
def test_a_slot_read_twice_is_read_with_both_weights_across_chunks(kw):
    _check_memory_paths(kw, repeated_reads=True)


def _randomised(**options):
    m = build_mixer("kronecker_slots", 12, {"n_heads": 2, "d_v": 3, "d_p": 3, "U": 2, "top_k": 3, "chunk_size": 4,
                                            **options}).to(F64)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return m


@pytest.mark.parametrize("options", [{}, {"renormalize": False, "tau": 0.6},
                                     {"tie_addresses": True, "conv_size": 1, "memory_layout": "sparse"}])
def test_layer_equals_the_papers_address_and_memory(options):
    layer = _randomised(**options)
    o_ = layer.options
    H, dv, U, dp = layer.n_heads, layer.d_v, o_.U, o_.d_p
    Bsz, T = 2, int(torch.randint(2, 9, ()))
    x = torch.randn(Bsz, T, 12, dtype=F64)
    kl, v = layer.k_proj(x), layer.v_proj(x)
    ql = kl if o_.tie_addresses else layer.q_proj(x)
    raw = torch.cat([kl, ql, v], -1)
    mixed = layer.conv(raw) if layer.conv is not None else raw      # causal depthwise conv, no activation
    a = layer.addr_dim
    kl, ql, v = mixed[..., :a], mixed[..., a:2 * a], mixed[..., 2 * a:].unflatten(-1, (H, dv))
    gamma = torch.nn.functional.softplus(layer.gamma_raw)
    o = torch.zeros(Bsz, T, H, dv, dtype=F64)
    for b, h in itertools.product(range(Bsz), range(H)):
        wd, rd = (torch.stack([dense(paper_address(lg[b, t].unflatten(-1, (H, U, dp))[h], o_.top_k, o_.tau,
                                                   o_.renormalize), dp ** U) for t in range(T)])
                  for lg in (kl, ql))
        o[b, :, h] = pdma(wd, rd, v[b, :, h], gamma[h], o_.eps)
    want = layer.out_proj(layer.norm(o, layer.g_proj(x).unflatten(-1, (H, dv))).flatten(-2))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), want, rtol=1e-9, atol=1e-9)


def test_default_gamma_is_one_a_plain_ema_of_the_written_slot():
    layer = build_mixer("kronecker_slots", 12, {"n_heads": 2, "d_p": 3, "U": 2, "top_k": 2})
    assert layer.options.tau == 1.0 and layer.options.renormalize
    torch.testing.assert_close(layer.gamma(torch.float32), torch.ones(2))
    # gamma = 1: a slot written with weight w each step holds the w-EMA, normalised by z
    M, T = 4, 6
    w = torch.full((1, T, 1, 1), 0.3, dtype=F64)
    v = torch.randn(1, T, 1, 2, dtype=F64)
    idx = torch.zeros(1, T, 1, 1, dtype=torch.int64)
    o, _ = slot_memory(idx, w, idx, torch.ones_like(w), v, torch.ones(1, dtype=F64), M, eps=1e-12)
    ema, z = torch.zeros(2, dtype=F64), 0.0
    for t in range(T):
        ema, z = 0.7 * ema + 0.3 * v[0, t, 0], 0.7 * z + 0.3
        torch.testing.assert_close(o[0, t, 0], ema / z, rtol=1e-9, atol=1e-12)
