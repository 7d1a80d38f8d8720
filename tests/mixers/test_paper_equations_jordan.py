"""The defective-Jordan SSM against Dadwal, "The Illusion of State: Sharp Memory-Decay Bounds in Linear State Space
Models" (OpenReview 8Kg8lL3L58), written here in fp64 with explicit matrices: blocks ``A_t = lam_t I + c N`` with
``N`` the ones on the superdiagonal (so ``h_{i,t} = lam h_{i,t-1} + c h_{i+1,t-1}``, the paper's appendix E),
``h_t = A_t h_{t-1} + B x_t``, ``y_t = C h_t``, the optional per-step LayerNorm of the state; the closed form
``J^k = sum_j binom(k, j) lam^{k-j} c^j N^j`` of a constant block against the scan's impulse response; the
appendix G.2 HiPPO-LegS block ``I + (1 - rho) H / ||H||`` built entry by entry; and the paper's defaults
(``rho = 0.9``, a defective ``c = 1`` block).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernels.blockscan import jordan_scan
from mixers import build_mixer

F64 = torch.float64


def nilpotent(m):
    Nm = torch.zeros(m, m, dtype=F64)
    for i in range(m - 1):
        Nm[i, i + 1] = 1.0
    return Nm


def paper_loop(layer, x):
    """``y_t`` from explicit ``A_t`` matrices, block by block."""
    o, m, Nb = layer.options, layer.m, layer.N
    Bsz, T, _ = x.shape
    if o.decay == "selective":
        lam = torch.exp(-layer.gate.A_log.exp() * F.softplus(x @ layer.gate.proj.weight.T + layer.gate.dt_bias))
    else:
        lam = torch.full((Bsz, T, Nb), o.rho, dtype=F64)
    u = (x @ layer.in_proj.weight.T).unflatten(-1, (Nb, m))
    h = torch.zeros(Bsz, Nb, m, dtype=F64)
    ys = []
    for t in range(T):
        rows = []
        for b in range(Bsz):
            blocks = []
            for n in range(Nb):
                A = (layer.transition[n] if o.init == "hippo"
                     else lam[b, t, n] * torch.eye(m, dtype=F64) + layer.coupling[n] * nilpotent(m))
                hn = A @ h[b, n] + u[b, t, n]
                if o.state_norm == "step":
                    hn = (hn - hn.mean()) / torch.sqrt(hn.var(unbiased=False) + o.norm_eps)
                    hn = hn * layer.norm_weight[n] + layer.norm_bias[n]
                blocks.append(hn)
            rows.append(torch.stack(blocks))
        h = torch.stack(rows)
        read = h
        if o.state_norm == "readout":
            read = (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, unbiased=False, keepdim=True) + o.norm_eps)
            read = read * layer.norm_weight + layer.norm_bias
        ys.append(read.flatten(-2) @ layer.out_proj.weight.T)
    return torch.stack(ys, 1), lam


MODES = [{"decay": "fixed", "init": "defective"}, {"decay": "selective", "init": "defective"},
         {"decay": "selective", "init": "diagonal", "learn_transition": False},
         {"decay": "fixed", "init": "defective", "state_norm": "step"},
         {"decay": "selective", "init": "defective", "state_norm": "readout"},
         {"decay": "fixed", "init": "hippo"}]


@pytest.mark.parametrize("mode", MODES, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_layer_and_reference_scan_equal_the_papers_recurrence(mode):
    m = int(torch.randint(2, 5, ()))
    layer = build_mixer("jordan", 8, {"block_size": m, "n_blocks": 2, "chunk_size": 4, **mode}).to(F64)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name not in ("coupling", "transition"):
                p.add_(0.3 * torch.randn_like(p))
        if "coupling" in dict(layer.named_parameters()):
            layer.coupling.copy_(torch.rand(2, dtype=F64) * 2)   # a learned c away from 0 and 1
    x = torch.randn(2, int(torch.randint(3, 11, ())), 8, dtype=F64)
    want, lam = paper_loop(layer, x)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), want, rtol=1e-9, atol=1e-9)
        if mode["init"] != "hippo" and "state_norm" not in mode:
            h, _ = jordan_scan(lam, layer.coupling, (x @ layer.in_proj.weight.T).unflatten(-1, (2, m)),
                               backend="reference")
            torch.testing.assert_close(h.flatten(-2) @ layer.out_proj.weight.T, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_constant_block_powers_follow_the_binomial_closed_form(backend):
    m, T = int(torch.randint(2, 6, ())), int(torch.randint(5, 30, ()))
    lam, c = float(torch.empty(()).uniform_(0.5, 0.99)), float(torch.empty(()).uniform_(0.2, 2.0))
    # impulse e_i at t = 0 in block i: h_k = J^k e_i, so the blocks' states after k steps are J^k's columns
    b = torch.zeros(1, T, m, m, dtype=F64)
    b[0, 0] = torch.eye(m, dtype=F64)
    h, _ = jordan_scan(torch.full((1, T, m), lam, dtype=F64), c, b, chunk_size=4, backend=backend)
    Nm = nilpotent(m)
    for k in range(T):
        closed = sum(math.comb(k, j) * lam ** (k - j) * c ** j * torch.linalg.matrix_power(Nm, j)
                     for j in range(min(k, m - 1) + 1))
        J = lam * torch.eye(m, dtype=F64) + c * Nm
        torch.testing.assert_close(closed, torch.linalg.matrix_power(J, k), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(h[0, k].T, closed, rtol=1e-10, atol=1e-12)


def test_hippo_block_is_the_appendix_legs_matrix():
    m, rho = int(torch.randint(2, 7, ())), float(torch.empty(()).uniform_(0.5, 0.99))
    layer = build_mixer("jordan", 8, {"block_size": m, "n_blocks": 2, "decay": "fixed", "init": "hippo",
                                      "rho": rho}).to(F64)
    H = torch.zeros(m, m, dtype=F64)
    for i in range(m):
        for j in range(m):
            H[i, j] = math.sqrt((2 * i + 1) * (2 * j + 1)) if i > j else (i + 1 if i == j else 0.0)
    H = -H
    H = H / torch.linalg.svdvals(H)[0]
    want = torch.eye(m, dtype=F64) + H * (1 - rho)
    torch.testing.assert_close(layer.transition, want.expand(2, m, m), rtol=1e-6, atol=1e-6)   # stored in fp32


def test_defaults_are_the_papers_setting():
    layer = build_mixer("jordan", 16, {})
    o = layer.options
    assert o.rho == 0.9 and o.init == "defective" and o.state_norm == "none" and o.block_size == 4
    torch.testing.assert_close(layer.coupling, torch.ones(layer.N))
    lam = layer.decay(torch.randn(3, 5, 16))
    assert (lam > 0).all() and (lam < 1).all()
