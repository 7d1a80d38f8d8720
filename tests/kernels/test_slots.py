"""Slot memory kernels: the dense chunked, sparse and Triton paths against the fp64 token loop (outputs,
final state and gradients of the weights, values, gamma and the initial state); the token loop against
an independent dense-formula loop (diag(1 - w)^gamma on all M slots); sparse == dense at K = M; the
power-decay closed form; the Kronecker top-K against the materialised product. The Triton kernels in both
layouts (chunk-parallel up to ``CHUNKED_MAX_SLOTS`` slots, the sparse scan in ``d_v`` tiles above) over
several chunks and tiles, in fp16 against fp64, and for a number of launches that does not grow with ``T``.
gamma's gradient is a sum of one term per write that can cancel, so its tolerance is weighed by how much the
terms cancel on the draw (``shared`` in tests/kernels/harness.py, with gamma given per write to the dense
formula).

On a CPU the Triton kernels run through the interpreter (tests/conftest.py): tiny shapes.
"""
from __future__ import annotations

import pytest
import torch

from kernels.slots import (
    kronecker_dense,
    kronecker_topk,
    slot_memory,
    slot_memory_chunked,
    slot_memory_reference,
    slot_memory_sparse,
    slot_step,
)
from kernels.slots import triton as slots_triton
from tests.kernels.harness import DEVICE, assert_rel_close, compare_backends, needs_triton
from tests.mixers.launches import count_launches


def _distinct(B, T, H, M, K, device=DEVICE):
    return torch.rand(B, T, H, M, device=device).argsort(-1)[..., :K].contiguous()


def _inputs(B, T, H, M, K, dv, init=False, dtype=torch.float32, device=DEVICE):
    wi, ri = _distinct(B, T, H, M, K, device), _distinct(B, T, H, M, K, device)
    ww = torch.rand(B, T, H, K, dtype=dtype, device=device) * 0.98 + 0.01
    rw = torch.rand(B, T, H, K, dtype=dtype, device=device)
    v = torch.randn(B, T, H, dv, dtype=dtype, device=device)
    gamma = torch.rand(H, dtype=dtype, device=device) * 1.5 + 0.25
    out = [wi, ww, ri, rw, v, gamma]
    if init:
        out += [torch.randn(B, H, M, dv, dtype=dtype, device=device),
                torch.rand(B, H, M, dtype=dtype, device=device) + 0.1]
    return out


def _call(fn, M, **kw):
    def run(wi, ww, ri, rw, v, gamma, S0=None, z0=None):
        o, (S, z) = fn(wi, ww, ri, rw, v, gamma, M, initial_state=None if S0 is None else (S0, z0), **kw)
        return o, S, z
    return run


def _reference(M):
    """The token loop, for the comparisons; with gamma given per token and slot (``(B, T, M, H)``, as the
    harness's ``shared`` check expands it) the dense formula, which is the same function and takes one exponent
    per write. gamma's gradient sums one term per write, and the terms can cancel: its relative error has no
    fixed bound, so the slot tests scale gamma's gradient tolerance by how much they cancel on the draw
    (``||sum |terms||| / ||sum terms||``; without it a Triton draw missed 1e-5 by 3.5e-5, with the fp32 token
    loop itself 2.5e-5 off and the terms cancelling 700-fold)."""
    loop = _call(slot_memory_reference, M)

    def run(wi, ww, ri, rw, v, gamma, S0=None, z0=None):
        if gamma.ndim == 1:
            return loop(wi, ww, ri, rw, v, gamma, S0, z0)
        return _dense_formula(wi, ww, ri, rw, v, gamma, M, S0, z0)
    return run


def _gamma_per_write(B, T, H, M):
    """``shared`` for :func:`tests.kernels.harness.compare_backends`: gamma (input 5) per token and slot."""
    return {5: (B, T, M, H)}


BACKENDS = {
    "dense": dict(backend="torch", layout="dense", chunk_size=4),
    "sparse": dict(backend="torch", layout="sparse"),
}


@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_torch_paths_match_reference(name, init):
    M = 16
    ins = _inputs(2, 13, 3, M, 3, 5, init=init)
    compare_backends(_call(slot_memory, M, **BACKENDS[name]), _reference(M), ins, tol=1e-5, grad_tol=1e-5,
                     shared=_gamma_per_write(2, 13, 3, M))


@pytest.mark.parametrize("backend", [
    pytest.param({"backend": "torch", "layout": "dense", "chunk_size": 32}, id="torch"),
    pytest.param({"backend": "triton", "chunk_size": 16}, id="triton", marks=needs_triton),
])
def test_chunked_with_strong_decays_and_ragged_length(backend):
    """The chunked paths (PyTorch at its default chunk length, the chunk-parallel Triton kernels at chunks of
    16) with M = 64 and T not a multiple of the chunk; read slots that are written several times inside a
    chunk with weights 0.6-0.95 and gamma up to 2 (cumulative log decays of tens within a chunk): outputs,
    final state and gradients against the fp64 loop (the gradient of gamma, a cancelling sum over every
    token, is the least accurate: ~1e-6). Then full overwrites (K = 1, w = 1, clamped log decay -13.8 gamma
    per write, hundreds per chunk): the forward stays finite and exact."""
    M, T, K = 64, 45, 4
    ins = _inputs(1, T, 2, M, K, 6, init=True)
    ins[0] = torch.randint(0, 8, (1, T, 2, 1)) * 8 + torch.arange(K).view(1, 1, 1, K)  # 8 groups of K slots
    ins[2] = ins[0].flip(1)
    ins[1] = torch.rand(1, T, 2, K) * 0.35 + 0.6
    ins[5] = torch.rand(2) * 1.5 + 0.5
    chunked = _call(slot_memory, M, **backend)
    compare_backends(chunked, _reference(M), ins, tol=1e-5, grad_tol=1e-4, shared=_gamma_per_write(1, T, 2, M))
    ins[0], ins[2] = ins[0][..., :1], ins[2][..., :1]
    ins[1], ins[3] = torch.ones(1, T, 2, 1), ins[3][..., :1]
    # on some draws the fp32 loop itself lands up to 4.8e-6 from fp64 (19 of 400 draws above 3e-6), and the chunked
    # path's error equals the loop's own to two digits on every draw looked at: the tolerance is at least 4x what
    # rounding costs the fp32 loop on this draw
    compare_backends(chunked, _call(slot_memory_reference, M), ins, tol=1e-5, grad=False, rounding_factor=4)


@needs_triton
@pytest.mark.parametrize("init", [False, True])
def test_triton_matches_reference(init):
    M = 16
    ins = _inputs(2, 7, 2, M, 3, 5, init=init)
    compare_backends(_call(slot_memory, M, backend="triton"), _reference(M), ins, tol=1e-5, grad_tol=1e-5,
                     shared=_gamma_per_write(2, 7, 2, M))


TRITON_CASES = [  # (B, T, H, M, K, d_v, chunk_size, initial state)
    (2, 37, 2, 16, 3, 5, 16, True),     # chunked: 3 chunks, the last one partial
    (1, 50, 2, 24, 4, 20, 16, False),   # d_v not a power of two
    (1, 33, 1, 64, 4, 70, 16, True),    # d_v in three tiles of 32
    (1, 21, 1, 130, 3, 9, 16, True),    # the state kernels in three tiles of 64 slots
    (1, 90, 2, 16, 3, 20, 64, True),    # chunks of 64 (the read kernels' tiles the whole chunk)
    (1, 70, 1, 130, 4, 9, 64, False),   # ... the read backward's reads of the start state in three slot tiles
    (1, 19, 2, 300, 3, 40, 16, True),   # sparse (M > CHUNKED_MAX_SLOTS): d_v in two tiles, each with its own z
    (1, 13, 1, 300, 2, 70, 16, False),  # ... three tiles
]


@needs_triton
@pytest.mark.parametrize("B,T,H,M,K,dv,chunk,init", TRITON_CASES)
def test_triton_layouts_match_reference(B, T, H, M, K, dv, chunk, init):
    """Against the fp64 token loop; each tolerance is at least 4x the fp32 token loop's own error on the draw:
    a read of slots whose normaliser is small amplifies rounding (seed 748330817, sparse layout: the fp32
    token loop itself is 1.6e-5 off in the read weights' gradient, the kernels 2.6e-5). Over 100 draws per
    case the kernels' errors stayed below 0.10 of the fixed 1e-5."""
    ins = _inputs(B, T, H, M, K, dv, init=init)
    compare_backends(_call(slot_memory, M, backend="triton", chunk_size=chunk), _reference(M), ins,
                     tol=1e-5, grad_tol=1e-5, rounding_factor=4, shared=_gamma_per_write(B, T, H, M))


@needs_triton
@pytest.mark.parametrize("B,T,H,M,K,dv,chunk,init", [c for c in TRITON_CASES if c[6] == 64])
def test_triton_read_row_tiles_match_reference(monkeypatch, B, T, H, M, K, dv, chunk, init):
    """The read kernels taking a chunk's reading tokens in row tiles narrower than the chunk (``READ_ROWS`` 16:
    four tiles of a 64-token chunk, each adding its share of the sums over reading tokens) compute what the
    whole-chunk tile does: against the fp64 token loop as above."""
    monkeypatch.setattr(slots_triton, "READ_ROWS", 16)
    ins = _inputs(B, T, H, M, K, dv, init=init)
    compare_backends(_call(slot_memory, M, backend="triton", chunk_size=chunk), _reference(M), ins,
                     tol=1e-5, grad_tol=1e-5, rounding_factor=4, shared=_gamma_per_write(B, T, H, M))


@needs_triton
def test_triton_reads_strided_inputs_as_their_copies():
    """The chunked kernels read the write and read halves of one joint address tensor and a column slice of a
    wider value tensor in place: outputs, final state and gradients (of the joint weights, the wide values and
    gamma) equal, bit for bit, those of the same call on contiguous copies."""
    B, T, H, M, K, dv = 2, 21, 2, 16, 3, 5
    wi, ww, ri, rw, v, gamma = _inputs(B, T, H, M, K, dv)
    idx, wr = torch.stack([wi, ri], 2), torch.stack([ww, rw], 2)  # (B, T, 2, H, K)
    wide = torch.cat([torch.randn(B, T, 3), v.flatten(-2)], -1)
    up = torch.randn(B, T, H, dv), torch.randn(B, H, M, dv), torch.randn(B, H, M)
    results = []
    for strided in (True, False):
        wr_, wide_, g_ = (x.clone().requires_grad_() for x in (wr, wide, gamma))
        (i, j), (w, r) = idx.unbind(2), wr_.unbind(2)
        vv = wide_[..., 3:].unflatten(-1, (H, dv))
        if not strided:
            i, j, w, r, vv = (x.contiguous() for x in (i, j, w, r, vv))
        o, (S, z) = slot_memory(i, w, j, r, vv, g_, M, backend="triton", chunk_size=16)
        sum((a * u).sum() for a, u in zip((o, S, z), up)).backward()
        results.append((o, S, z, wr_.grad, wide_.grad, g_.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


# fp16 under the interpreter against fp64 on the same rounded inputs; u = 2^-11. The output is rounded to fp16
# once (tolerance 2u, as for the block scans); the chunked products round their coefficient tile (P, F) to fp16
# (u each, averaged over the sum) and the gradients start from an fp16-rounded upstream gradient: 4u.
FP16_U = 2.0 ** -11


@needs_triton
@pytest.mark.parametrize("M,chunk", [(16, 16), (16, 64), (300, 16)])
def test_triton_fp16_matches_fp64(M, chunk):
    """The normalisers' gradients pass through ``r / (z + eps)``, whose conditioning varies from draw to draw (a
    rare draw, none of seeds 0-299, put the initial normaliser's at 4.05 u against 4 u): each tolerance is
    also at least 4x what fp16 rounding costs the reference itself on the draw."""
    ins = [x.half() if x.is_floating_point() else x for x in _inputs(1, 37, 2, M, 3, 20, init=True)]
    compare_backends(_call(slot_memory, M, backend="triton", chunk_size=chunk), _reference(M), ins,
                     tol=2 * FP16_U, grad_tol=4 * FP16_U, rounding_factor=4, shared=_gamma_per_write(1, 37, 2, M))


def fwd_bwd_launches(run, T):
    """Launches by name (:func:`tests.mixers.launches.count_launches`: ATen operations and Triton kernels) of
    ``run(T)`` and a backward through the sum of its outputs, on meta tensors with the kernels counted, not run."""
    def go():
        sum(o.float().sum() for o in run(T)).backward()
    return count_launches(go, execute=False)[1]


def triton_launches(by_name):
    return {k: v for k, v in by_name.items() if k.startswith("triton:")}


CHUNKED_LAUNCHES = {"triton:slots._slots_state": 1, "triton:slots._slots_carry": 2, "triton:slots._slots_read": 1,
                    "triton:slots._slots_read_bwd": 1, "triton:slots._slots_state_bwd": 1}
SPARSE_LAUNCHES = {"triton:slots._slots_fwd": 2, "triton:slots._slots_bwd": 1}


@needs_triton
@pytest.mark.parametrize("M,expected", [(64, CHUNKED_LAUNCHES), (1024, SPARSE_LAUNCHES)])
def test_launches_per_forward_backward_do_not_grow_with_T(M, expected):
    """Chunked: state, carry and read kernels forward, their three backward kernels. Sparse: the scan forward,
    replay and reverse scan backward. The same operations and kernels at T and 4T (meta tensors; nothing runs),
    with gamma's gradient requested."""
    from kernels.slots.triton import slot_memory_triton

    def run(T, B=2, H=2, K=4, dv=32):
        idx = torch.zeros(B, T, H, K, dtype=torch.int64, device="meta")
        ww, rw, v = (torch.empty(shape, device="meta").requires_grad_() for shape in ((B, T, H, K),) * 2 + ((B, T, H, dv),))
        o, (S, z) = slot_memory_triton(idx, ww, idx, rw, v, torch.ones(H, device="meta", requires_grad=True), M,
                                       chunk_size=32)
        return o, S, z

    short, long = fwd_bwd_launches(run, 1024), fwd_bwd_launches(run, 4096)
    assert short == long, (short, long)
    assert triton_launches(short) == expected, short


@needs_triton
def test_strided_inputs_are_read_in_place():
    """As a layer passes them, the write and read addresses are the two halves of one joint tensor and the values
    a column slice of the projections, and the address logits a column slice too: the chunked memory's forward
    is its three kernels and the addressing's its one kernel, with no copy (meta tensors; nothing runs)."""
    from kernels.slots.triton import kronecker_topk_triton, slot_memory_triton
    B, T, H, K, dv, U, dp = 2, 256, 2, 4, 32, 3, 4
    a = H * U * dp
    mixed = torch.empty(B, T, 2 * a + H * dv, device="meta", requires_grad=True)
    idx = torch.empty(B, T, 2, H, K, dtype=torch.int64, device="meta")
    wr = torch.empty(B, T, 2, H, K, device="meta", requires_grad=True)
    gamma = torch.empty(H, device="meta", requires_grad=True)

    def memory():
        (wi, ri), (w, r) = idx.unbind(2), wr.unbind(2)
        slot_memory_triton(wi, w, ri, r, mixed[..., 2 * a:].unflatten(-1, (H, dv)), gamma, 64, chunk_size=32)

    def address():
        kronecker_topk_triton(mixed[..., :2 * a].unflatten(-1, (2, H, U, dp)), K, 1.0, True)

    assert count_launches(memory, execute=False) == (3, {k: 1 for k in ("triton:slots._slots_state",
                                                                        "triton:slots._slots_carry",
                                                                        "triton:slots._slots_read")})
    assert count_launches(address, execute=False) == (1, {"triton:slots._topk_fwd": 1})


def _dense_formula(wi, ww, ri, rw, v, gamma, M, S0=None, z0=None, eps=1e-6):
    """The spec written densely, independent of slot_step: every slot decays by (1 - w_m)^gamma. ``gamma`` is
    ``(H,)``, or ``(B, T, M, H)``: one exponent per token and slot (a slot not written has w = 0, so its
    exponent does nothing), the form in which each term of gamma's gradient stands alone."""
    B, T, H, dv = v.shape
    w = torch.zeros(B, T, H, M, dtype=v.dtype, device=v.device).scatter(-1, wi, ww)
    r = torch.zeros(B, T, H, M, dtype=v.dtype, device=v.device).scatter(-1, ri, rw)
    S = v.new_zeros(B, H, M, dv) if S0 is None else S0
    z = v.new_zeros(B, H, M) if z0 is None else z0
    outs = []
    for t in range(T):
        keep = (1 - w[:, t]) ** (gamma[:, None] if gamma.ndim == 1 else gamma[:, t].transpose(-1, -2))
        S = keep[..., None] * S + w[:, t, :, :, None] * v[:, t, :, None, :]
        z = keep * z + w[:, t]
        outs.append(torch.einsum("bhm,bhmd->bhd", r[:, t] / (z + eps), S))
    return torch.stack(outs, 1), S, z


def test_reference_is_the_dense_formula():
    """The token loop equals the dense formula, from a zero and from a given state; and the dense formula with
    gamma given per token and slot (the form the gradient tolerance of gamma is weighed in) is the same
    function, with the same gradient of gamma once summed back to one exponent per head."""
    M, B, T, H = 16, 2, 11, 2
    wi, ww, ri, rw, v, gamma, S0, z0 = _inputs(B, T, H, M, 4, 3, init=True, dtype=torch.float64)
    for initial in ((None, None), (S0, z0)):
        o, (S, z) = slot_memory_reference(wi, ww, ri, rw, v, gamma, M,
                                          initial_state=None if initial[0] is None else initial)
        for g in (gamma, gamma.expand(B, T, M, H)):
            for a, b in zip((o, S, z), _dense_formula(wi, ww, ri, rw, v, g, M, *initial)):
                assert_rel_close(b, a, 1e-12)
    up = torch.randn(B, T, H, 3, dtype=torch.float64)
    g_head = gamma.clone().requires_grad_()
    g_write = gamma.detach().expand(B, T, M, H).clone().requires_grad_()
    (_reference(M)(wi, ww, ri, rw, v, g_head, S0, z0)[0] * up).sum().backward()
    (_reference(M)(wi, ww, ri, rw, v, g_write, S0, z0)[0] * up).sum().backward()
    assert_rel_close(g_write.grad.sum((0, 1, 2)), g_head.grad, 1e-12)


def test_sparse_equals_dense_when_every_slot_is_written():
    M = 8
    wi, ww, ri, rw, v, gamma = _inputs(2, 9, 2, M, M, 4, dtype=torch.float64)
    o_s, (S_s, z_s) = slot_memory_sparse(wi, ww, ri, rw, v, gamma, M)
    o_d, (S_d, z_d) = slot_memory_chunked(wi, ww, ri, rw, v, gamma, M, chunk_size=4)
    for a, b in ((o_s, o_d), (S_s, S_d), (z_s, z_d)):
        assert_rel_close(a, b, 1e-12)


@pytest.mark.parametrize("layout", ["dense", "sparse", "reference"])
def test_constant_write_weight_closed_form(layout):
    """One slot written every step with the same weight w: the read is the power-decay average
    sum_i w d^(t-i) v_i / (sum_i w d^(t-i) + eps), d = (1 - w)^gamma; at gamma = 1 the bias-corrected
    exponential moving average."""
    T, dv, eps = 23, 3, 1e-6
    w0 = float(torch.rand(()) * 0.9 + 0.05)
    for gamma0 in (1.0, float(torch.rand(()) * 2 + 0.2)):
        idx = torch.zeros(1, T, 1, 1, dtype=torch.long)
        ww = torch.full((1, T, 1, 1), w0, dtype=torch.float64)
        rw = torch.ones(1, T, 1, 1, dtype=torch.float64)
        v = torch.randn(1, T, 1, dv, dtype=torch.float64)
        gamma = torch.tensor([gamma0], dtype=torch.float64)
        kw = {"backend": "reference"} if layout == "reference" else {"backend": "torch", "layout": layout}
        o, _ = slot_memory(idx, ww, idx, rw, v, gamma, 4, eps=eps, **kw)
        d = (1 - w0) ** gamma0
        t = torch.arange(T, dtype=torch.float64)
        coef = w0 * d ** (t[:, None] - t[None, :]) * (t[None, :] <= t[:, None])  # (t, i)
        expect = (coef @ v[0, :, 0]) / (coef.sum(1, keepdim=True) + eps)
        assert_rel_close(o[0, :, 0], expect, 1e-12)
        if gamma0 == 1.0:
            ema, outs = torch.zeros(dv, dtype=torch.float64), []
            for i in range(T):
                ema = (1 - w0) * ema + w0 * v[0, i, 0]
                z = 1 - (1 - w0) ** (i + 1)  # the EMA's bias correction is the slot normaliser z_t
                outs.append(ema / (z + eps))
            assert_rel_close(o[0, :, 0], torch.stack(outs), 1e-12)


def test_step_touches_only_the_written_rows():
    M, K = 32, 3
    wi, ww, ri, rw, v, gamma = _inputs(2, 1, 2, M, K, 4)
    S, z = torch.randn(2, 2, M, 4), torch.rand(2, 2, M)
    args = (wi[:, 0], ww[:, 0], ri[:, 0], rw[:, 0], v[:, 0], gamma)
    o, (S2, z2) = slot_step(*args, (S, z))
    written = torch.zeros(2, 2, M, dtype=torch.bool).scatter(-1, wi[:, 0], True)
    assert torch.equal(S2[~written], S[~written]) and torch.equal(z2[~written], z[~written])
    assert not torch.equal(S2[written], S[written])
    S_in, z_in = S.clone(), z.clone()
    o3, (S3, z3) = slot_step(*args, (S_in, z_in), inplace=True)
    assert S3 is S_in and z3 is z_in
    assert torch.equal(o3, o) and torch.equal(S3, S2) and torch.equal(z3, z2)


@pytest.mark.parametrize("U,dp,K", [(1, 7, 3), (2, 4, 5), (3, 4, 9), (3, 5, 2), (4, 3, 20)])
def test_kronecker_topk_equals_topk_of_materialised_product(U, dp, K):
    logits = torch.randn(3, 6, U, dp, dtype=torch.float64) * 2
    tau = float(torch.rand(()) + 0.3)
    idx, w = kronecker_topk(logits, K, tau)
    dense = kronecker_dense(logits, tau)
    assert dense.shape[-1] == dp ** U
    val, ref_idx = dense.topk(K, dim=-1)
    assert torch.equal(idx, ref_idx), "selected slots differ from the top-K of the materialised product"
    assert_rel_close(w, val, 1e-12)
    # and the weights are the product entries at those indices, with the same gradient
    lg = logits.clone().requires_grad_()
    ld = logits.clone().requires_grad_()
    up = torch.randn_like(w)
    (kronecker_topk(lg, K, tau)[1] * up).sum().backward()
    (torch.gather(kronecker_dense(ld, tau), -1, ref_idx) * up).sum().backward()
    assert_rel_close(lg.grad, ld.grad, 1e-12)


def test_bad_inputs_raise():
    M = 8
    wi, ww, ri, rw, v, gamma = _inputs(1, 3, 2, M, 2, 4)
    with pytest.raises(ValueError, match="gamma"):
        slot_memory(wi, ww, ri, rw, v, gamma[:1], M)
    with pytest.raises(ValueError, match="layout"):
        slot_memory(wi, ww, ri, rw, v, gamma, M, layout="diagonal")
    with pytest.raises(TypeError, match="int64"):
        slot_memory(wi.int(), ww, ri, rw, v, gamma, M)
    with pytest.raises(ValueError, match="write_w"):
        slot_memory(wi, ww[:, :2], ri, rw, v, gamma, M)
    with pytest.raises(ValueError, match="read_idx on another device"):
        slot_memory(wi, ww, ri.to("meta"), rw, v, gamma, M)
    with pytest.raises(ValueError, match="k=9"):
        kronecker_topk(torch.randn(2, 2), 9)


@needs_triton
def test_triton_rejects_fp64():
    wi, ww, ri, rw, v, gamma = _inputs(1, 3, 1, 8, 2, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match="fp64"):
        slot_memory(wi, ww, ri, rw, v, gamma, 8, backend="triton")


@pytest.mark.gpu
def test_triton_at_size_on_cuda():
    M = 4096
    ins = _inputs(2, 512, 4, M, 8, 64, init=True, device="cuda")
    compare_backends(_call(slot_memory, M, backend="triton"), _call(slot_memory, M, backend="torch", layout="sparse"),
                     ins, tol=1e-5, grad_tol=1e-4)


@pytest.mark.gpu
def test_triton_bf16_at_layer_size_matches_fp64():
    """On a GPU: the chunk-parallel kernels at one layer's size (8 heads of d_v 128, M 64, K 4, T 4096) in bf16,
    against the dense torch path in fp64 on the same rounded inputs (itself checked against the token loop
    above). Tolerances as for fp16 with u = 2^-8."""
    M, u = 64, 2.0 ** -8
    ins = [x.bfloat16() if x.is_floating_point() else x for x in _inputs(1, 4096, 8, M, 4, 128, init=True, device="cuda")]
    compare_backends(_call(slot_memory, M, backend="triton", chunk_size=32),
                     _call(slot_memory, M, backend="torch", layout="dense", chunk_size=32), ins, tol=2 * u, grad_tol=4 * u)
