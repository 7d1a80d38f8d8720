"""DeltaProduct against the unrolled form of Siems et al., "DeltaProduct: Improving State-Tracking in Linear RNNs
via Householder Products", arXiv:2502.10297, written here with explicit fp64 matrices: per token

    A(x_t) = prod_{j=1..n_h} (I - beta_j k_j k_j^T)         (sub-step 1 applied first)
    B(x_t) = sum_j [prod_{l=j+1..n_h} (I - beta_l k_l k_l^T)] beta_j k_j v_j^T
    H_t = A(x_t) e^{g_t} H_{t-1} + B(x_t),    o_t = H_t^T q_t / sqrt(d_k)

for the kernel's reference and chunked backends and for the layer (its projections, short convolutions, beta
range, forget gate and output norm taken from its submodules); the paper's Proposition 1 (||A|| <= 1 for beta in
[0, 2], eigenvalue 1 - beta < 0 reachable at the default beta range); and the defaults the papers state.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernels.delta import delta_product, householder_transition
from mixers import build_mixer

F64 = torch.float64


def factors(k, beta):
    """``I - beta_j k_j k_j^T`` for every sub-step: ``k (..., n_h, K)``, ``beta (..., n_h)`` -> ``(..., n_h, K, K)``."""
    eye = torch.eye(k.shape[-1], dtype=k.dtype)
    return eye - beta[..., None, None] * torch.einsum("...i,...j->...ij", k, k)


def unrolled(q, k, v, beta, g, scale):
    """The paper's ``H_t = A(x_t) e^{g_t} H_{t-1} + B(x_t)``: ``q (B, T, H, K)``, ``k (B, T, n_h, H, K)``,
    ``v (B, T, n_h, H, V)``, ``beta (B, T, n_h, H)``, ``g (B, T, H)`` or None. Returns ``(o, H_T)``."""
    Bsz, T, n, Hh, K = k.shape
    S = torch.zeros(Bsz, Hh, K, v.shape[-1], dtype=F64)
    outs = []
    for t in range(T):
        Hj = factors(k[:, t].transpose(1, 2), beta[:, t].transpose(1, 2))       # (B, H, n_h, K, K)
        A = torch.eye(K, dtype=F64).expand(Bsz, Hh, K, K)
        Bm = torch.zeros_like(S)
        for j in range(n):
            after = torch.eye(K, dtype=F64).expand(Bsz, Hh, K, K)
            for l in range(j + 1, n):
                after = Hj[:, :, l] @ after
            kv = beta[:, t, j, :, None, None] * torch.einsum("bhi,bhj->bhij", k[:, t, j], v[:, t, j])
            Bm = Bm + after @ kv
            A = Hj[:, :, j] @ A
        decay = 1.0 if g is None else g[:, t].exp()[..., None, None]
        S = A @ (decay * S) + Bm
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]) * scale)
    return torch.stack(outs, 1), S


def unit(x):
    return x / x.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_kernel_equals_the_unrolled_householder_product(backend):
    Bsz, T, Hh, K, V = 2, int(torch.randint(3, 11, ())), 2, 4, 3
    n = int(torch.randint(1, 4, ()))
    q = torch.randn(Bsz, T, Hh, K, dtype=F64)
    k = unit(torch.randn(Bsz, T, n, Hh, K, dtype=F64))
    v = torch.randn(Bsz, T, n, Hh, V, dtype=F64)
    beta = 2 * torch.rand(Bsz, T, n, Hh, dtype=F64)
    g = -torch.rand(Bsz, T, Hh, dtype=F64)
    want_o, want_S = unrolled(q, k, v, beta, g, K ** -0.5)
    o, S = delta_product(q, k.flatten(1, 2), v.flatten(1, 2), beta.flatten(1, 2), g=g, num_householder=n,
                         chunk_size=4, backend=backend)
    torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S, want_S, rtol=1e-10, atol=1e-10)


def _randomised(name, **options):
    m = build_mixer(name, 16, {"n_heads": 2, "head_dim": 4, "chunk_size": 4, **options}).to(F64).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return m


@pytest.mark.parametrize("name, options", [("deltaproduct", {}), ("deltaproduct", {"num_householder": 3}),
                                           ("deltaproduct", {"allow_neg_eigval": False, "use_short_conv": False}),
                                           ("deltanet", {}), ("gated_deltanet", {})])
def test_layer_equals_the_unrolled_form_on_its_own_projections(name, options):
    m = _randomised(name, **options)
    o_, n, Hh, K = m.options, m.n_h, m.n_heads, m.head_dim
    Bsz, T = 2, int(torch.randint(3, 10, ()))
    x = torch.randn(Bsz, T, 16, dtype=F64)
    if o_.use_short_conv:   # causal depthwise conv then SiLU, from the layer's submodules
        q, k, v = m.q_conv(m.q_proj(x)), m.k_conv(m.k_proj(x)), m.v_conv(m.v_proj(x))
    else:
        q, k, v = F.silu(m.q_proj(x)), F.silu(m.k_proj(x)), F.silu(m.v_proj(x))
    # sub-step j has its own projection: rows j*H*K .. (j+1)*H*K of W_k, W_v (and j*H .. of W_b)
    q, k, v = unit(q.view(Bsz, T, Hh, K)), unit(k.view(Bsz, T, n, Hh, K)), v.view(Bsz, T, n, Hh, K)
    beta = (2.0 if o_.allow_neg_eigval else 1.0) * torch.sigmoid(m.b_proj(x)).view(Bsz, T, n, Hh)
    g = None
    if o_.use_forget_gate:
        g = -torch.exp(m.gate.A_log) * F.softplus(m.gate.proj(x) + m.gate.dt_bias)
    o, _ = unrolled(q, k, v, beta, g, 1 / math.sqrt(K))
    want = m.o_proj(m.norm(o, m.z_proj(x).view(Bsz, T, Hh, K)).flatten(-2))
    with torch.no_grad():
        torch.testing.assert_close(m(x), want, rtol=1e-9, atol=1e-9)


def test_proposition_1_norm_bound_and_negative_eigenvalues():
    n, K = int(torch.randint(2, 5, ())), 5   # two factors at least: their order matters
    k = unit(torch.randn(64, n, K, dtype=F64))
    beta = 2 * torch.rand(64, n, dtype=F64)
    A = householder_transition(k, beta)
    explicit = torch.eye(K, dtype=F64).expand(64, K, K)
    for j in range(n):
        explicit = factors(k[:, j], beta[:, j]) @ explicit
    torch.testing.assert_close(A, explicit, rtol=1e-12, atol=1e-12)
    assert torch.linalg.matrix_norm(A, ord=2).max() <= 1 + 1e-12
    # the layer's default betas fill (0, 2): a single factor then has eigenvalue 1 - beta < 0
    m = build_mixer("deltaproduct", 16, {"n_heads": 2, "head_dim": 4}).to(F64)
    with torch.no_grad():
        m.b_proj.weight.mul_(4)
        beta = m._beta(m.b_proj(torch.randn(256, 16, dtype=F64)))
    assert beta.min() > 0 and beta.max() < 2 and beta.max() > 1.2
    eig = torch.linalg.eigvalsh(factors(unit(torch.randn(K, dtype=F64)), beta.max()))
    torch.testing.assert_close(eig.min(), 1 - beta.max(), rtol=1e-12, atol=1e-12)


def test_defaults_the_papers_state():
    dp, dn, gdn = (build_mixer(name, 64, {"n_heads": 32, "head_dim": 2}) for name in
                   ("deltaproduct", "deltanet", "gated_deltanet"))
    assert (dp.n_h, dn.n_h, gdn.n_h) == (2, 1, 1)
    assert all(x.options.allow_neg_eigval and x.options.use_short_conv and x.options.conv_size == 4
               for x in (dp, dn, gdn))
    assert dp.gate is not None and dn.gate is None and gdn.gate is not None
    # Mamba-2 gate init: A ~ U(1, 16), dt = softplus(dt_bias) ~ logU(1e-3, 1e-1)
    A, dt = dp.gate.A_log.exp(), F.softplus(dp.gate.dt_bias)
    assert A.min() >= 1 and A.max() <= 16 and A.std() > 1
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 1e-1 * (1 + 1e-5)
    assert dt.log().std() > 0.3   # log-uniform, not a constant
