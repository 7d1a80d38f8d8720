"""BD-LRU against Dubinin, Orvieto & Effenberger, "Improved State Mixing in Higher-order and Block Diagonal Linear
Recurrent Networks", arXiv:2602.12021, written here in fp64 from the layer's weights: per block ``k`` the
``m x (m+1)`` logits ``W_a^k x_t + b_a^k`` (rows of ``W_a`` in block, row, column order) go through a softmax over
each row's ``m + 1`` entries (the L1-normalised gates), ``A_t^k`` is the first ``m`` columns and ``a0_t^k`` the
last, ``h_t^k = A_t^k h_{t-1}^k + a0_t^k * v_t^k`` with ``v = W_v x`` and ``y = W_out vec(h)``; the associative
operator ``(A2, b2) o (A1, b1) = (A2 A1, A2 b1 + b2)`` of the parallel scan; the stability proposition
(``|lambda(A_t)| <= max_i (1 - a0_t,i)``, ``||h_T||_inf <= max_t ||v_t||_inf``); and the N(0, 0.02), zero-bias init.
"""
from __future__ import annotations

import pytest
import torch

from kernels.blockscan import block_scan
from mixers import build_mixer

F64 = torch.float64


def _randomised(**options):
    m = build_mixer("bdlru", 12, {"chunk_size": 4, **options}).to(F64)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p))   # zero bias and tiny weights would hide the selectivity
    return m


def paper_gates(layer, x):
    """``(A (B, T, N, m, m), a0 (B, T, N, m))`` with every row ``exp(l_ij) / sum_{l=0}^{m} exp(l_il)``."""
    N, m = layer.N, layer.m
    if layer.options.selective:
        logits = (x @ layer.a_proj.weight.T + layer.a_proj.bias).unflatten(-1, (N, m, m + 1))
    else:
        logits = layer.a_logits.expand(*x.shape[:-1], N, m, m + 1)
    e = logits.exp()
    G = e / e.sum(-1, keepdim=True)
    return G[..., :m], G[..., m]


def paper_loop(layer, x):
    A, a0 = paper_gates(layer, x)
    v = (x @ layer.v_proj.weight.T).unflatten(-1, (layer.N, layer.m))
    h = torch.zeros(x.shape[0], layer.N, layer.m, dtype=F64)
    hs = []
    for t in range(x.shape[1]):
        h = torch.stack([torch.stack([A[b, t, n] @ h[b, n] + a0[b, t, n] * v[b, t, n] for n in range(layer.N)])
                         for b in range(x.shape[0])])
        hs.append(h)
    hs = torch.stack(hs, 1)
    return hs, hs.flatten(-2) @ layer.out_proj.weight.T


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("selective", [True, False])
def test_layer_and_reference_scan_equal_the_papers_recurrence(m, selective):
    layer = _randomised(block_size=m, n_blocks=2, selective=selective)
    x = torch.randn(2, int(torch.randint(3, 11, ())), 12, dtype=F64)
    hs, want = paper_loop(layer, x)
    with torch.no_grad():
        A, a0 = layer.gates(x)
        wantA, wanta0 = paper_gates(layer, x)
        torch.testing.assert_close(A, wantA, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(a0, wanta0, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(layer(x), want, rtol=1e-10, atol=1e-10)
        v = (x @ layer.v_proj.weight.T).unflatten(-1, (layer.N, m))
        h, _ = block_scan(wantA, wanta0 * v, backend="reference")
    torch.testing.assert_close(h, hs, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_scan_equals_the_associative_operator_folded_as_a_tree(backend):
    Bsz, T, N, m = 1, int(torch.randint(2, 13, ())), 2, 3
    A, b = torch.randn(Bsz, T, N, m, m, dtype=F64) / 2, torch.randn(Bsz, T, N, m, dtype=F64)
    h0 = torch.randn(Bsz, N, m, dtype=F64)
    pairs = [(A[0, t], b[0, t]) for t in range(T)]
    while len(pairs) > 1:   # (A2, b2) o (A1, b1) = (A2 A1, A2 b1 + b2), combined pairwise (another association)
        nxt = [(a2 @ a1, (a2 @ b1[..., None])[..., 0] + b2) for (a1, b1), (a2, b2) in zip(pairs[::2], pairs[1::2])]
        pairs = nxt + ([pairs[-1]] if len(pairs) % 2 else [])
    A_all, b_all = pairs[0]
    _, h_last = block_scan(A, b, initial_state=h0, chunk_size=4, backend=backend)
    torch.testing.assert_close(h_last[0], (A_all @ h0[0, ..., None])[..., 0] + b_all, rtol=1e-10, atol=1e-10)


def test_stability_proposition_on_the_layers_gates():
    layer = _randomised(block_size=4, n_blocks=3)
    x = 3 * torch.randn(4, 16, 12, dtype=F64)
    with torch.no_grad():
        A, a0 = layer.gates(x)
    torch.testing.assert_close(A.sum(-1), 1 - a0, rtol=1e-12, atol=1e-12)
    radius = torch.linalg.eigvals(A).abs().amax(-1)
    assert (radius <= (1 - a0).amax(-1) + 1e-12).all()
    hs, _ = paper_loop(layer, x)
    v = (x @ layer.v_proj.weight.T).unflatten(-1, (layer.N, layer.m))
    assert hs.abs().amax((1, 2, 3)).le(v.abs().amax((1, 2, 3)) + 1e-12).all()


@pytest.mark.parametrize("selective", [True, False])
def test_init_is_normal_002_with_zero_bias(selective):
    layer = build_mixer("bdlru", 256, {"block_size": 4, "selective": selective})
    weights = [layer.v_proj.weight, layer.out_proj.weight]
    weights.append(layer.a_proj.weight if selective else layer.a_logits)
    for w in weights:
        assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002
    if selective:
        assert torch.equal(layer.a_proj.bias, torch.zeros_like(layer.a_proj.bias))
