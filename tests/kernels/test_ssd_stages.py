"""The Triton SSD stages one by one against their references (kernels/ssd/stages.py), so that a wrong result
names its stage; and the references themselves, composed, against the token recurrence and its autograd.

Each stage gets the same inputs as its reference (the states and state gradients it reads are the
reference's), so an error in one stage cannot hide or appear in another. On a CPU the kernels run through
the interpreter (tests/conftest.py) at tiny sizes, in fp32 (tight) and fp16 (operands rounded to 16 bits,
as on tensor cores); the gpu-marked test runs every stage at real size in bf16. The references see the inputs
rounded to the kernels' dtype, so what is measured is the kernels' own rounding: over 6 seeds of both shapes,
fp32 within 3.4e-7 relative (tolerance 2e-6), fp16 within 4.2e-4 (tolerance 5e-3); ``dA``, a signed sum over
every token, against the size of its terms (fp32 8.8e-8, fp16 1.5e-5).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.ssd import ssd_reference
from kernels.ssd import stages as ref
from tests.kernels.harness import DEVICE, needs_triton, rel_err


def _inputs(b, T, H, P, N, dtype=torch.float64, device=DEVICE, shared_bc=False):
    x = torch.randn(b, T, H, P, dtype=dtype, device=device)
    dt = F.softplus(torch.randn(b, T, H, dtype=dtype, device=device) - 1.0)
    A = -(torch.rand(H, dtype=dtype, device=device) * 2 + 0.5)
    if shared_bc:  # Mamba-2's one group, expanded over the heads (a head stride of 0)
        B, C = (torch.randn(b, T, 1, N, dtype=dtype, device=device).expand(b, T, H, N) for _ in range(2))
    else:
        B, C = (torch.randn(b, T, H, N, dtype=dtype, device=device) for _ in range(2))
    return x, dt, A, B, C


def test_references_compose_to_the_recurrence_and_its_gradients():
    b, T, H, P, N, L = 2, 37, 3, 5, 4, 8
    x, dt, A, B, C = _inputs(b, T, H, P, N)
    h0, skip = torch.randn(b, H, N, P, dtype=torch.float64), torch.randn(H, dtype=torch.float64)
    dy, dfinal = torch.randn_like(x), torch.randn(b, H, N, P, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (x, dt, A, B, C, h0, skip)]
    y_ref, final_ref = ssd_reference(*leaves[:5], initial_state=leaves[5])
    y_ref = y_ref + leaves[6][:, None] * leaves[0]       # Mamba-2's skip D x, by hand
    grads_ref = torch.autograd.grad((y_ref * dy).sum() + (final_ref * dfinal).sum(), leaves)

    S, alast = ref.chunk_states(x, dt, A, B, L)
    hstart, final = ref.pass_states(S, alast, h0)
    y = ref.chunk_outputs(x, dt, A, B, C, hstart, L, skip)
    assert rel_err(y, y_ref) < 1e-12 and rel_err(final, final_ref) < 1e-12
    gend, dinit = ref.pass_state_grads(ref.chunk_state_grads(C, dy, dt, A, L), alast, dfinal)
    *grads, dskip = ref.chunk_grads(x, dt, A, B, C, dy, hstart, gend, L, skip)
    for name, g, g_ref in zip(("dx", "ddt", "dA", "dB", "dC", "dinit", "dskip"), (*grads, dinit, dskip), grads_ref):
        assert rel_err(g, g_ref) < 1e-10, name
    assert ref.chunk_grads(x, dt, A, B, C, dy, hstart, gend, L)[5] is None     # no skip, no gradient of it


def _stage_cases(b, T, H, P, N, L, dtype, shared_bc=False, device=DEVICE):
    """fp64 inputs with their rounding to ``dtype`` (what the kernels take), the references' states and state
    gradients from the rounded inputs, and the upstream gradients."""
    x, dt, A, B, C = (t.to(dtype).double() for t in _inputs(b, T, H, P, N, device=device, shared_bc=shared_bc))
    h0, dfinal = (torch.randn(b, H, N, P, dtype=torch.float64, device=device) for _ in range(2))
    dy = torch.randn_like(x).to(dtype).double()
    S, alast = ref.chunk_states(x, dt, A, B, L)
    hstart, final = ref.pass_states(S, alast, h0)
    D = ref.chunk_state_grads(C, dy, dt, A, L)
    gend, dinit = ref.pass_state_grads(D, alast, dfinal)
    # the chunk kernels read the states in the input dtype (16-bit: operands): hand them the rounded ones
    hstart, gend = hstart.to(dtype).double(), gend.to(dtype).double()
    skip = torch.randn(H, dtype=torch.float64, device=device).float().double()   # the kernels take it in fp32
    return dict(x=x, dt=dt, A=A, B=B, C=C, h0=h0, dfinal=dfinal, dy=dy, S=S, alast=alast, hstart=hstart,
                final=final, D=D, gend=gend, dinit=dinit, skip=skip)


def _run_stages(c, L, dtype):
    """Every Triton stage on the case's inputs (cast as the launcher casts them), results as fp64."""
    from kernels.ssd import triton as tri
    lo = lambda t: t.to(dtype)  # noqa: E731
    x, dt, B, C, dy = (lo(c[k]) for k in ("x", "dt", "B", "C", "dy"))
    if c["B"].stride(2) == 0:   # keep the expanded group as the launcher does (read in place)
        B, C = (lo(c[k][:, :, :1]).expand_as(c[k]) for k in ("B", "C"))
    A32 = c["A"].float()
    out = {}
    out["S"], out["alast"] = tri.chunk_states(x, dt, A32, B, L)
    out["hstart"], out["final"] = tri.pass_states(c["S"].float(), c["alast"].float(), c["h0"].float(), dtype)
    out["y"] = tri.chunk_outputs(x, dt, A32, B, C, lo(c["hstart"]), L, c["skip"].float())
    out["D"] = tri.chunk_state_grads(C, dy, dt, A32, L)
    out["gend"], out["dinit"] = tri.pass_state_grads(c["D"].float(), c["alast"].float(), c["dfinal"].float(), dtype)
    out["dx"], out["ddt"], out["dA"], out["dB"], out["dC"], out["dskip"] = tri.chunk_grads(
        x, dt, A32, B, C, dy, lo(c["hstart"]), lo(c["gend"]), L, c["skip"].float())
    return {k: v.double() for k, v in out.items()}


def _expected(c, L):
    y = ref.chunk_outputs(c["x"], c["dt"], c["A"], c["B"], c["C"], c["hstart"], L, c["skip"])
    grads = ref.chunk_grads(c["x"], c["dt"], c["A"], c["B"], c["C"], c["dy"], c["hstart"], c["gend"], L, c["skip"])
    return dict(c, y=y, **dict(zip(("dx", "ddt", "dA", "dB", "dC", "dskip"), grads)))


STAGES = ("S", "alast", "hstart", "final", "y", "D", "gend", "dinit", "dx", "ddt", "dA", "dB", "dC", "dskip")


def _check(out, want, tol, dA_scale):
    # dA and the skip's dD are signed sums over every token: each is bounded by the size of its terms (see
    # tests/kernels/test_ssd.py), sum |dt_t dA_t| <= |ddt| |dt| and sum |dy x| <= |dy| |x|
    sums = {"dA": dA_scale, "dskip": (want["dy"].norm() * want["x"].norm()).item()}
    for name in STAGES:
        if name in sums:
            err = (out[name] - want[name]).abs().max().item()
            assert err <= tol * sums[name], f"{name}: abs error {err:.2e} > {tol:.0e} * {sums[name]:.2e}"
        else:
            assert rel_err(out[name], want[name]) < tol, f"{name}: rel err {rel_err(out[name], want[name]):.2e}"


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float16, 5e-3)])
@pytest.mark.parametrize("shape", [
    (2, 37, 3, 40, 8, 16, False),     # fp32 runs 3 column blocks of 16; T not a multiple of the chunk
    (1, 20, 2, 24, 20, 16, True),     # odd d_state, one group of B and C shared by the heads
])
def test_every_triton_stage_matches_its_reference(dtype, tol, shape):
    b, T, H, P, N, L, shared = shape
    c = _stage_cases(b, T, H, P, N, L, dtype, shared_bc=shared)
    want = _expected(c, L)
    _check(_run_stages(c, L, dtype), want, tol, (want["ddt"].norm() * c["dt"].norm()).item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("P,N", [(64, 64), (128, 128)])
def test_gpu_every_stage_bf16_real_size(P, N):
    b, T, H, L = 2, 4096, 8, 64
    c = _stage_cases(b, T, H, P, N, L, torch.bfloat16, shared_bc=True)
    want = _expected(c, L)
    _check(_run_stages(c, L, torch.bfloat16), want, 2e-2, (want["ddt"].norm() * c["dt"].norm()).item())
