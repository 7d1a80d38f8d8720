"""The Triton delta-rule stages one by one against their references (kernels/delta/stages.py), so that a wrong
result names its stage; and the references themselves, composed, against the chunked PyTorch path and its
autograd (fp64).

Each stage gets the same inputs as its reference (what it reads from the other stages is the references'),
for the gated delta rule (one sub-step per token) and the delta product's layout (2 sub-steps: the queries
and gates on every second position). On a CPU the kernels run through the interpreter (tests/conftest.py)
at tiny sizes in fp32 and fp16; the gpu-marked test runs every stage at real size in bf16. The references
see the inputs, and the 16-bit intermediates a stage reads, rounded as the kernels see them, so what is
measured is the kernels' own rounding. Over 3 seeds of the three cases: fp32 within 3.8e-7 relative
(tolerance 5e-6), fp16 within 6.5e-4 (tolerance 5e-3; bf16 has 3 fewer bits: tolerance 3e-2).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.delta import stages as ref
from kernels.delta.chunked import chunk_gated_delta_rule_torch
from tests.kernels.harness import DEVICE, needs_triton, rel_err


def _inputs(B, L, H, K, V, NQ, gate=True, dtype=torch.float64, device=DEVICE):
    q = torch.randn(B, L // NQ, H, K, dtype=dtype, device=device)
    k = F.normalize(torch.randn(B, L, H, K, dtype=dtype, device=device), dim=-1)
    v = torch.randn(B, L, H, V, dtype=dtype, device=device)
    beta = 2 * torch.rand(B, L, H, dtype=dtype, device=device)
    g = F.logsigmoid(torch.randn(B, L // NQ, H, dtype=dtype, device=device) + 2) if gate else None
    h0, dhT = (torch.randn(B, H, K, V, dtype=dtype, device=device) for _ in range(2))
    do = torch.randn(B, L // NQ, H, V, dtype=dtype, device=device)
    return q, k, v, beta, g, h0, do, dhT


@pytest.mark.parametrize("NQ", [1, 2])
def test_references_compose_to_the_chunked_path_and_its_gradients(NQ):
    B, L, H, K, V, BT, scale = 2, 38, 2, 8, 6, 16, 0.7
    q, k, v, beta, g, h0, do, dhT = _inputs(B, L, H, K, V, NQ, device="cpu")
    q_all = torch.zeros(B, L, H, K, dtype=q.dtype)
    q_all[:, NQ - 1::NQ] = q * scale
    g_all = torch.zeros(B, L, H, dtype=q.dtype)
    g_all[:, ::NQ] = g
    leaves = [t.clone().requires_grad_(True) for t in (q_all, k, v, beta, g_all, h0)]
    o_want, hT_want = chunk_gated_delta_rule_torch(*leaves[:5], initial_state=leaves[5], chunk_size=BT,
                                                   query_stride=NQ)
    d_want = torch.autograd.grad((o_want * do).sum() + (hT_want * dhT).sum(), leaves)

    G, Tm, U, W = ref.prep(k, v, beta, g, NQ, BT)
    h, D, hT = ref.state_pass(k, G, U, W, h0, BT)
    o = ref.output(q, k, G, h, D, scale, NQ, BT)
    assert rel_err(o, o_want) < 1e-12 and rel_err(hT, hT_want) < 1e-12
    dq, dk_o, dG_o, _dDo = ref.output_grads(q, k, G, h, D, do, scale, NQ, BT)
    assert rel_err(dq, d_want[0][:, NQ - 1::NQ] * scale) < 1e-11
    dh, dU, dh0 = ref.state_grads(q, k, G, U, W, h0, do, dhT, scale, NQ, BT)
    assert rel_err(dh0, d_want[5]) < 1e-11
    whole = ref.prep_grads(q, k, v, beta, g, h0, do, dhT, scale, NQ, BT)
    dW, dk_s, dG_s = ref.prep_state_grads(k, G, h, D, dh, dU, dk_o, dG_o, BT)
    split = ref.prep_wy_grads(k, v, beta, g, dU, dW, dk_s, dG_s, NQ, BT)
    for name, got, two, want in zip(("dk", "dv", "dbeta", "dg"), whole, split,
                                    (d_want[1], d_want[2], d_want[3], d_want[4][:, ::NQ])):
        assert rel_err(got, want) < 1e-11 and rel_err(two, want) < 1e-11, name


def _check_stages(B, L, H, K, V, NQ, BT, dtype, tol, gate=True, device=DEVICE):
    from kernels.delta import triton as tri
    scale = 0.5
    ins = _inputs(B, L, H, K, V, NQ, gate=gate, device=device)
    q, k, v, beta, g, h0, do, dhT = (t.to(dtype).double() if t is not None else None for t in ins)
    lo = lambda t: t.to(dtype) if t is not None else None  # noqa: E731
    f32 = lambda t: t.float() if t is not None else None  # noqa: E731
    r = lambda t: t.to(dtype).double()  # noqa: E731  (a 16-bit intermediate as the next kernel reads it)
    errors = {}

    G, Tm, U, W = ref.prep(k, v, beta, g, NQ, BT)
    got = tri.prep(lo(k), lo(v), f32(beta), f32(g), NQ, BT)
    errors.update(zip(("G", "Tm", "U", "W"), (rel_err(a, b) for a, b in zip(got, (G, Tm, U, W)))))

    h, D, hT = ref.state_pass(k, G, r(U), r(W), h0, BT)
    got = tri.state_pass(lo(k), f32(G), lo(U), lo(W), f32(h0), BT)
    errors.update(zip(("h", "D", "hT"), (rel_err(a, b) for a, b in zip(got, (h, D, hT)))))

    o = ref.output(q, k, G, r(h), r(D), scale, NQ, BT)
    errors["o"] = rel_err(tri.output(lo(q), lo(k), f32(G), lo(h), lo(D), scale, NQ, BT), o)

    dq, dk_o, dG_o, dDo = ref.output_grads(q, k, G, r(h), r(D), do, scale, NQ, BT)
    got = tri.output_grads(lo(q), lo(k), f32(G), lo(h), lo(D), lo(do), scale, NQ, BT)
    errors.update(zip(("dq", "dk_o", "dG_o", "dDo"), (rel_err(a, b) for a, b in zip(got, (dq, dk_o, dG_o, dDo)))))

    dh, dU, dh0 = ref.state_grads(q, k, G, r(U), r(W), h0, do, dhT, scale, NQ, BT)
    got = tri.state_grads(lo(q), lo(k), f32(G), lo(W), lo(do), f32(dDo), f32(dhT), scale, NQ, BT)
    errors.update(zip(("dh", "dU", "dh0"), (rel_err(a, b) for a, b in zip(got, (dh, dU, dh0)))))

    dW, dk_s, dG_s = ref.prep_state_grads(k, G, r(h), r(D), r(dh), r(dU), dk_o, dG_o, BT, gate)
    got = tri.prep_state_grads(lo(k), f32(G), lo(h), lo(D), lo(dh), lo(dU), f32(dk_o), f32(dG_o), BT, gate)
    errors.update(zip(("dW", "dk_s", "dG_s"), (rel_err(a, b) for a, b in zip(got, (dW, dk_s, dG_s)))))

    want = ref.prep_wy_grads(k, v, beta, g, r(dU), r(dW), dk_s, dG_s, NQ, BT)
    got = tri.prep_wy_grads(lo(k), lo(v), f32(beta), f32(g), f32(G), lo(Tm), lo(dU), lo(dW), f32(dk_s), f32(dG_s),
                            NQ, BT)
    errors.update((name, rel_err(a, b)) for name, a, b in zip(("dk", "dv", "dbeta", "dg"), got, want)
                  if b is not None)

    # the two stages composed, each from the other's output, against the whole operation's gradients
    whole = ref.prep_grads(q, k, v, beta, g, h0, do, dhT, scale, NQ, BT)
    dW_t, dk_t, dG_t = tri.prep_state_grads(lo(k), f32(G), lo(h), lo(D), lo(dh), lo(dU), f32(dk_o), f32(dG_o), BT,
                                            gate)
    got = tri.prep_wy_grads(lo(k), lo(v), f32(beta), f32(g), f32(G), lo(Tm), lo(dU), dW_t, dk_t, dG_t, NQ, BT)
    errors.update((f"{name} (composed)", rel_err(a, b)) for name, a, b in zip(("dk", "dv", "dbeta", "dg"), got, whole)
                  if b is not None)
    bad = {name: f"{e:.2e}" for name, e in errors.items() if not e < tol}
    assert not bad, f"stages off their references (tolerance {tol:.0e}): {bad}"


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-6), (torch.float16, 5e-3)])
@pytest.mark.parametrize("NQ,gate,L", [(1, True, 37), (2, True, 36), (1, False, 20)])
def test_every_triton_stage_matches_its_reference(NQ, gate, L, dtype, tol):
    _check_stages(B=2, L=L, H=2, K=16, V=32, NQ=NQ, BT=16 if NQ == 1 else 32, dtype=dtype, tol=tol, gate=gate)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("NQ", [1, 2])
def test_gpu_every_stage_bf16_real_size(NQ):
    _check_stages(B=1, L=4096, H=4, K=128, V=128, NQ=NQ, BT=64, dtype=torch.bfloat16, tol=3e-2)
