"""Mixer layers against their documented equations and initialisations at what the other equation tests leave at
a default: a layer that reads an option and ignores it, gets a gate wrong where only that option shows it, starts
from another law than its docstring names, or drops an fp32 cast in a 16-bit model, fails here. References are
written out here in fp64 from the layer's own weights (or reuse the explicit loops of the neighbouring tests).

- Gated KalmaNet ("Gated KalmaNet", arXiv 2511.21016) and GLA, with a ``head_dim`` apart from
  ``d_model / n_heads`` and short convolutions of other widths: the alpha-connection gate ``q~ = q + alpha (x - q)`` with
  ``alpha = sigmoid(W_alpha x + b)`` (and ``q~ = x`` with the connection off), the ridge
  ``lambda_t = ridge_a ||H_t||_F + ridge_eps`` and the solver the options name, in ``forward``, ``prefill`` and
  the decode ``step``; the core is the explicit ``torch.linalg.solve`` loop of ``test_gka_properties``.
- The Mamba-2 log-decay gate (Dao & Gu, arXiv 2405.21060) that mamba2, gla, gka, the delta rules and jordan
  share: ``A ~ U(1, 16)``, ``dt ~ logU(1e-3, 1e-1)`` through ``dt_bias = softplus^{-1}(dt)``.
- SKA's degree-2 key lift (Echo, arXiv 2605.06997) squares bf16 projections in fp32.
- kronecker_slots (RAM-Net, arXiv 2602.11958): the read divides by ``z + eps`` with the options' ``eps``.
- swiglu: the hidden width follows ``mult``.
- ``input_to_linear`` (mixers.base): under autocast an input rounded to the autocast dtype first gives the same
  output and decode state (jordan rounds its input itself where it projects in fp32 under fp16 autocast).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mixers import MIXERS, build_mixer, build_state_mixer
from mixers.key_lift import key_lift
from mixers.layers import DecayGate

from .contract import D_MODEL, make
from .test_gka_properties import explicit_loop
from .test_kronecker_slots_properties import explicit_forward as slots_reference
from .test_kronecker_slots_properties import make as slots_layer

F64 = torch.float64


def randomised(name, d_model, **options):
    """The layer in fp64 with every parameter moved off its init (unit gains, zero biases hide terms)."""
    m = build_mixer(name, d_model, options).to(F64).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return m


def decode(m, x):
    """``m.step`` over every token of ``x`` from ``m.init_state``: ``(B, T, D)``."""
    state, ys = m.init_state(x.shape[0], dtype=x.dtype), []
    for t in range(x.shape[1]):
        y, state = m.step(x[:, t], state)
        ys.append(y)
    return torch.stack(ys, dim=1)


def assert_layer_follows(m, reference, x, tol=1e-9):
    """``forward``, ``prefill`` and the decode ``step`` of ``m`` all equal ``reference(m, x)``."""
    with torch.no_grad():
        want = reference(m, x)
        for how, got in (("forward", m(x)), ("prefill", m.prefill(x)[0]), ("step", decode(m, x))):
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda s: f"{how}: {s}")


# --- Gated KalmaNet and GLA ------------------------------------------------------------------------------------

def short_conv_silu(conv, x, width):
    """``SiLU(b + sum_{j < width} w_j x_{t - (width - 1) + j})``: the causal depthwise convolution of the ``width``
    taps the options name, read from the layer's filter (the last ``width`` taps of a wider one)."""
    w, b = conv.conv.weight[:, 0, -width:], conv.conv.bias
    padded = torch.cat([x.new_zeros(x.shape[0], width - 1, x.shape[2]), x], dim=1)
    return F.silu(b + sum(w[:, j] * padded[:, j:j + x.shape[1]] for j in range(width)))


def gated_block_reference(m, x):
    """The block of ``mixers.gka``'s and ``mixers.gla``'s docstrings, per head of the ``head_dim`` the options name:
    conv + SiLU, L2-normalised q and k, beta on k and v, the Mamba-2 forget gate, then GLA's ``o_t = U_t q_t /
    sqrt(d)`` or GKA's ridge solve with the alpha connection, and the per-head gated RMSNorm."""
    o_opt, h = m.options, m.options.n_heads
    d = o_opt.head_dim
    B, T, _ = x.shape
    qkv = short_conv_silu(m.conv, x @ m.in_proj.weight.T, o_opt.conv_size)
    q, k, v = (qkv[..., i * h * d:(i + 1) * h * d].reshape(B, T, h, d) for i in range(3))
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    if o_opt.beta_gate:
        beta = torch.sigmoid(x @ m.beta_proj.weight.T + m.beta_proj.bias)[..., None]
        k, v = beta * k, beta * v
    g = x.new_zeros(B, T, h)
    if o_opt.forget_gate:
        g = -torch.exp(m.gate.A_log) * F.softplus(x @ m.gate.proj.weight.T + m.gate.dt_bias)
    if m.name == "gka":
        alpha = torch.sigmoid(x @ m.alpha_proj.weight.T + m.alpha_proj.bias) if o_opt.alpha_connection else None
        o, _ = explicit_loop(q, k, v, g, alpha, ridge_a=o_opt.ridge_a, ridge_eps=o_opt.ridge_eps)
    else:
        o, _ = explicit_loop(q, k, v, g, None, solve=False)
    z = (x @ m.z_proj.weight.T).reshape(B, T, h, d)
    normed = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + m.norm.eps) * m.norm.weight
    return (normed * F.silu(z)).reshape(B, T, h * d) @ m.out_proj.weight.T


@pytest.mark.parametrize("name, options, tol", [
    ("gka", {"solver": "exact", "num_iter": 2}, 1e-9),      # exact ignores the count: 2 Chebyshev steps would not
    ("gka", {"solver": "exact", "alpha_connection": False, "conv_size": 3}, 1e-9),
    ("gka", {"solver": "chebyshev", "num_iter": 120}, 1e-7),
    ("gla", {}, 1e-9),
    ("gla", {"beta_gate": False, "forget_gate": False, "conv_size": 2}, 1e-9),
], ids=str)
def test_gated_block_follows_its_equations_with_its_gates_ridge_and_head_dim(name, options, tol):
    """head_dim 6 apart from d_model / n_heads = 8; GKA's ridge away from its defaults (ridge_a 0.02, eps 1e-6);
    convolutions of 2 and 3 taps besides the default 4."""
    ridge = {"ridge_a": 0.3, "ridge_eps": 0.05} if name == "gka" else {}
    m = randomised(name, 16, n_heads=2, head_dim=6, chunk_size=4, **ridge, **options)
    assert_layer_follows(m, gated_block_reference, torch.randn(2, 9, 16, dtype=F64), tol)


# --- the Mamba-2 log-decay gate's initialisation ----------------------------------------------------------------

def test_decay_gate_starts_at_the_documented_ranges():
    """``A ~ U(1, 16)`` and ``dt_bias = softplus^{-1}(dt)``, ``dt ~ logU(1e-3, 1e-1)`` (mixers.layers, mixers.mamba2):
    the step size the gate gives at a zero input is ``dt``. Over 4096 heads the samples fill their ranges, with
    the uniform's mean and the log-uniform's median (1e-2) where those laws put them (many standard errors apart
    from the nearest wrong law)."""
    gate = DecayGate(4, 4096)
    A = torch.exp(gate.A_log.detach().double())
    dt = gate.from_projection(torch.zeros(4096, dtype=F64))[1].detach()
    assert 1.0 <= A.min() and A.max() <= 16.0 and A.max() > 15.5 and abs(A.mean().item() - 8.5) < 0.5
    assert 1e-3 * (1 - 1e-5) <= dt.min() and dt.max() <= 1e-1 * (1 + 1e-5)
    assert dt.min() < 1.2e-3 and dt.max() > 0.08 and abs(math.log10(dt.median().item()) + 2) < 0.15


# --- SKA's key lift in a 16-bit model -------------------------------------------------------------------------

@pytest.mark.parametrize("lift", ["cg_invariant", "cg"])
def test_ska_lifts_16_bit_projections_in_fp32(lift):
    """The degree-2 lift squares the projections in the kernels' compute precision (fp32 for a bf16 layer): the
    last lifted key a prefill leaves in the decode state (``kprev``) is the lift of the layer's bf16 projection
    computed exactly (fp64) up to fp32 rounding, not up to bf16's."""
    m = build_mixer("ska", 16, {"n_heads": 2, "rank": 4, "key_lift": lift}).to(torch.bfloat16).eval()
    x = torch.randn(3, 5, 16).to(torch.bfloat16)
    with torch.no_grad():
        _, state = m.prefill(x)
        u = m.k_proj(x[:, -1]).double().unflatten(-1, (2, 4))
    want = key_lift(u, lift)
    assert state["kprev"].dtype == torch.float32
    torch.testing.assert_close(state["kprev"].double(), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


# --- kronecker_slots: the slot normaliser's eps ---------------------------------------------------------------

@pytest.mark.parametrize("opts", [{}, {"memory_layout": "sparse", "U": 3, "top_k": 4}], ids=str)
def test_kronecker_slots_reads_divide_by_z_plus_the_options_eps(opts):
    """``o_t = sum_m r_t,m S_t[m] / (z_t[m] + eps)`` with the ``eps`` the options name (large here, so that it
    moves every read), in ``forward``, ``prefill`` and the decode ``step``."""
    m = slots_layer(eps=0.5, **opts)
    assert_layer_follows(m, slots_reference, torch.randn(2, 9, m.d_model, dtype=F64))


# --- swiglu: the hidden width follows mult ------------------------------------------------------------------------

def test_swiglu_hidden_width_follows_mult():
    """``hidden = ceil(mult d / multiple_of) multiple_of``; mult is drawn far enough from the default 8/3 (and d
    large enough) that a width taken from the default would differ."""
    d, multiple_of = int(torch.randint(24, 49, ())), int(torch.randint(1, 5, ()))
    mult = float(torch.rand(()) + 0.5)
    sm = build_state_mixer("swiglu", d, {"mult": mult, "multiple_of": multiple_of})
    hidden = math.ceil(mult * d / multiple_of) * multiple_of
    assert (sm.w_in.out_features, sm.w_out.in_features) == (2 * hidden, hidden), (d, mult, multiple_of)


# --- input_to_linear: the input rounded to the autocast dtype first changes nothing --------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", [n for n in MIXERS.names() if MIXERS.get(n).input_to_linear])
def test_an_input_to_linear_mixer_gives_the_same_under_autocast_for_a_pre_rounded_input(name, dtype):
    """A mixer declaring ``input_to_linear`` reads its input through linear layers only, which autocast rounds to
    its dtype: the block's pre-norm may hand the input over already rounded (``RMSNorm(to_linear=True)``), and the
    output and the decode state must be the same bits as from the fp32 input."""
    m = make(name)
    x = torch.randn(2, 9, D_MODEL)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        (y, state), (y16, state16) = m.prefill(x), m.prefill(x.to(dtype))
    assert torch.equal(y, y16), f"{name}: output moved by {(y.float() - y16.float()).abs().max().item():.2e}"
    for key in state:
        assert torch.equal(state[key], state16[key]), f"{name}: decode state {key!r} differs"
