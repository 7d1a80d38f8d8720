"""Mamba-2 against Dao & Gu, "Transformers are SSMs: Generalized Models and Efficient Algorithms Through Structured
State Space Duality", arXiv:2405.21060, and the defaults of mamba-ssm's ``Mamba2`` module, written here in fp64 from
the layer's weights: the input projection read in mamba-ssm's order ``[z, x, B, C, dt]`` (the step size's rows kept
in their own linear layer here), the depthwise causal convolution over ``x, B, C`` (``F.conv1d`` padded by
``d_conv - 1`` and truncated) then SiLU, one group (``B`` and ``C`` shared by all heads),
``dt = min(softplus(dt_raw + dt_bias), DT_MAX)``, ``A = -exp(A_log)``, the SSD quadratic (dual) form
``y_t = sum_{s<=t} exp(sum_{s<r<=t} dt_r A) (C_t . B_s) dt_s x_s + D x_t`` (the masked segment-sum matrix of
mamba-ssm's ``ssd_minimal_discrete``, a computation apart from the recurrence and from the chunked scan), the output
``W_out RMSNorm(y * silu(z))`` (mamba-ssm's default ``norm_before_gate=False``, one norm group over the inner width;
this zoo's default, as its tables were trained, is ``W_out (RMSNorm(y) * silu(z))``: both orders are checked),
and the initialisation: ``A ~ U(1, 16)``, ``softplus(dt_bias) ~ logU(1e-3, 1e-1)``, ``D = 1``, no projection biases.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mixers import build_mixer
from mixers.mamba2 import DT_MAX

F64 = torch.float64


def _randomised(d_model, **options):
    m = build_mixer("mamba2", d_model, {"chunk_size": 4, **options}).to(F64).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))   # unit gains and skips at init would hide a misplaced term
    return m


def paper_parts(m, u):
    """``(y (B, T, d_inner), z (B, T, d_inner))``: the SSD output with its skip, and the gate branch."""
    o = m.options
    Bsz, T, _ = u.shape
    inner, N, P = m.d_inner, o.d_state, o.headdim
    H = inner // P
    # mamba-ssm's single projection: rows z | x | B | C | dt
    w = torch.cat([m.in_proj.weight, m.gate.proj.weight])
    zxbcdt = u @ w.T
    z, xBC, dt_raw = zxbcdt.split([inner, inner + 2 * N, H], dim=-1)
    conv = m.conv.conv
    xBC = F.silu(F.conv1d(xBC.transpose(1, 2), conv.weight, conv.bias, padding=o.d_conv - 1,
                          groups=xBC.shape[-1])[..., :T].transpose(1, 2))
    x, Bm, Cm = xBC.split([inner, N, N], dim=-1)
    x = x.unflatten(-1, (H, P))
    dt = F.softplus(dt_raw + m.gate.dt_bias).clamp(max=DT_MAX)               # (B, T, H)
    A = -torch.exp(m.gate.A_log)
    cs = (dt * A).cumsum(1)                                                   # (B, T, H)
    seg = cs[:, :, None, :] - cs[:, None, :, :]                               # [t, s] = sum_{s<r<=t} dt_r A
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, :, :, None]
    L = seg.masked_fill(~causal, float("-inf")).exp()                         # (B, T, T, H)
    CB = Cm @ Bm.transpose(1, 2)                                              # (B, T, T), one group
    y = torch.einsum("btsh,bts,bsh,bshp->bthp", L, CB, dt, x) + m.D[:, None] * x
    return y.flatten(-2), z


def rms(v, weight, eps):
    return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight


def _case(d_model, expand, d_state, headdim, d_conv, scale):
    m = _randomised(d_model, expand=expand, d_state=d_state, headdim=headdim, d_conv=d_conv)
    u = scale * torch.randn(2, int(torch.randint(5, 14, ())), d_model, dtype=F64)
    return m, u


CASES = [(8, 2, 4, 4, 4, 1.0), (12, 1, 3, 6, 2, 1.0), (8, 3, 5, 8, 3, 1.0),
         (8, 2, 4, 4, 4, 3e4)]   # the last drives some steps past the cap DT_MAX


@pytest.mark.parametrize("d_model, expand, d_state, headdim, d_conv, scale", CASES)
def test_ssd_output_and_gate_branch_follow_the_projection_conv_and_dual_form(d_model, expand, d_state, headdim,
                                                                             d_conv, scale):
    """What reaches the output norm: ``y`` from the quadratic form with the skip, ``z`` from the projection."""
    m, u = _case(d_model, expand, d_state, headdim, d_conv, scale)
    seen = []
    handle = m.norm.register_forward_hook(lambda mod, args, out: seen.append(args))
    with torch.no_grad():
        m(u)
        y, z = paper_parts(m, u)
    handle.remove()
    got_y, got_z = seen[0]
    torch.testing.assert_close(got_z, z, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_y, y, rtol=1e-9, atol=1e-9 * max(1.0, y.abs().max().item()))


@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("d_model, expand, d_state, headdim, d_conv, scale", CASES[:2])
def test_output_is_the_projected_norm_and_gate_of_the_ssd_output_in_either_order(d_model, expand, d_state, headdim,
                                                                                d_conv, scale, norm_before_gate):
    """``norm_before_gate=False``: the paper's and mamba-ssm's ``W_out RMSNorm(y * silu(z))``; the default (this
    zoo's tables): ``W_out (RMSNorm(y) * silu(z))``."""
    m = _randomised(d_model, expand=expand, d_state=d_state, headdim=headdim, d_conv=d_conv,
                    norm_before_gate=norm_before_gate)
    u = scale * torch.randn(2, int(torch.randint(5, 14, ())), d_model, dtype=F64)
    with torch.no_grad():
        y, z = paper_parts(m, u)
        gated = rms(y, m.norm.weight, m.norm.eps) * F.silu(z) if norm_before_gate else \
            rms(y * F.silu(z), m.norm.weight, m.norm.eps)
        torch.testing.assert_close(m(u), gated @ m.out_proj.weight.T, rtol=1e-9, atol=1e-9)
        state = m.init_state(2, dtype=F64)   # the recurrent form takes the same order
        steps = []
        for t in range(u.shape[1]):
            out, state = m.step(u[:, t], state)
            steps.append(out)
        torch.testing.assert_close(torch.stack(steps, 1), m(u), rtol=1e-9, atol=1e-9)


def test_initialisation_has_the_stated_ranges_and_shapes():
    """``A = exp(A_log)`` in [1, 16] spread uniformly, ``softplus(dt_bias)`` in [1e-3, 1e-1] spread uniformly in
    log, ``D = 1``; bounds and half-range counts over 4096 heads (a count off by 0.1 of its expected half is
    more than 12 standard deviations away, and a linear-uniform dt or a log-uniform A is that far off)."""
    layers = [build_mixer("mamba2", 512, {"expand": 2, "headdim": 1, "d_state": 2}) for _ in range(4)]
    A = torch.cat([m.gate.A_log.detach().exp() for m in layers]).double()
    dt = torch.cat([F.softplus(m.gate.dt_bias.detach().double()) for m in layers])
    assert A.numel() == dt.numel() == 4096
    assert A.min() >= 1 - 1e-5 and A.max() <= 16 * (1 + 1e-5)
    assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 1e-1 * (1 + 1e-4)
    assert abs((A < 8.5).double().mean().item() - 0.5) < 0.1
    assert abs((dt < 1e-2).double().mean().item() - 0.5) < 0.1   # 1e-2: the geometric midpoint
    assert dt.min() < 1.5e-3 and dt.max() > 0.07 and A.min() < 1.5 and A.max() > 15.5
    for m in layers:
        assert torch.equal(m.D.detach(), torch.ones(m.n_heads))
        assert m.in_proj.bias is None and m.gate.proj.bias is None and m.out_proj.bias is None
        assert m.conv.conv.bias is not None and m.conv.activation
        assert m.in_proj.out_features == 2 * m.d_inner + 2 * m.options.d_state
        assert m.gate.proj.out_features == m.n_heads == m.d_inner // m.options.headdim


def test_step_size_is_softplus_of_projection_plus_bias_capped_at_dt_max():
    m = _randomised(8, expand=2, d_state=4, headdim=4)
    raw = torch.randn(3, 7, m.n_heads, dtype=F64) * torch.tensor([1.0, 1e2, 1e4], dtype=F64)[:, None, None]
    with torch.no_grad():
        got = m.gate.step_size(raw, DT_MAX, F64)
    s = raw + m.gate.dt_bias
    softplus = torch.where(s > 30, s, torch.log1p(torch.exp(s.clamp(max=30))))   # log(1 + e^s) = s + O(e^-30)
    want = torch.minimum(softplus, torch.tensor(DT_MAX, dtype=F64))
    torch.testing.assert_close(got, want, rtol=1e-8, atol=0)
    assert (got == DT_MAX).any() and (got < 1).any()
    assert math.isclose(DT_MAX, 1e3)
