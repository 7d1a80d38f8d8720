"""Chunked (WY / UT-transform) gated delta product in pure PyTorch: the ``torch`` backend of the ``delta`` family,
which ``auto`` runs on a CPU (on CUDA ``auto`` runs flash-linear-attention where it takes the inputs, else
:mod:`kernels.delta.triton`).

DeltaProduct as a delta rule on a longer sequence: the ``n_h`` sub-steps of every token are laid
out one after another (a sequence of ``L = n_h * T`` steps, token-major, the layout of ``k``, ``v``,
``beta`` already), the log forget gate ``g_t`` sits on sub-step 0 (zero on the others), the query
sits on the last sub-step (zero on the others) and the output is read at every ``n_h``-th position.

Gated delta rule on positions ``s`` (log gate ``gamma_s <= 0``):
``S_s = exp(gamma_s) (I - beta_s k_s k_s^T) S_{s-1} + beta_s k_s v_s^T``, ``o_s = S_s^T q_s``.

Within a chunk of ``C`` positions with entry state ``S0`` and in-chunk cumulative log gate
``G_r = sum_{i <= r} gamma_i`` the state is ``S_r = e^{G_r} S0 + sum_{i <= r} e^{G_r - G_i} k_i d_i^T``
where the "residual" rows ``d_i = beta_i (v_i - e^{gamma_i} S_{i-1}^T k_i)`` solve a unit lower
triangular system (the UT transform):

    (I + A) D = diag(beta) V - diag(beta e^G) K S0,   A_ri = beta_r e^{G_r - G_i} k_r.k_i  (i < r)
    =>  D = U - W S0,   U = (I + A)^{-1} diag(beta) V,   W = (I + A)^{-1} diag(beta e^G) K

and then

    O      = diag(e^G) Q S0 + ((Q K^T) * M) D,        M_ri = e^{G_r - G_i} for i <= r, else 0
    S_next = e^{G_C} S0 + (diag(e^{G_C - G}) K)^T D.

The segment sums ``G_r - G_i`` (and ``G_C - G_i``) add the steps of their own segment
(:func:`kernels.common.segment_log_decays`), never the difference of the cumulative sums: that lost a weak
decay after a strong one in the chunk and left the gradient of a saturated gate as rounding noise.

Everything is computed in fp32 at least (fp64 stays fp64) and differentiated by autograd. A sequence
longer than :data:`kernels.common.SEGMENT` positions runs in segments of whole chunks with the state
carried (:func:`kernels.common.in_segments`), so no intermediate grows with the length.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import (
    as_state,
    at_least_fp32,
    causal_mask,
    compute_dtype,
    in_segments,
    pad_time,
    segment_length,
    segment_log_decays,
)
from .reference import flatten_substeps


def interleave_inputs(q, g, num_householder: int, L: int):
    """Queries on the last sub-step and the gate on sub-step 0 of each token, zero elsewhere.

    ``q``: ``(B, T, H, K)`` -> ``(B, T*n_h, H, K)``; ``g``: ``(B, T, H)`` -> ``(B, T*n_h, H)`` (or None).
    """
    B, T, H, K = q.shape
    n = num_householder
    if n == 1:
        return q, g
    q_new = F.pad(q.unsqueeze(2), (0, 0, 0, 0, n - 1, 0))       # (B, T, n, H, K), q at index n-1
    q_new = q_new.reshape(B, L, H, K)
    if g is not None:
        g = F.pad(g.unsqueeze(2), (0, 0, 0, n - 1)).reshape(B, L, H)  # g at index 0
    return q_new, g


class _ChunkRecurrence(torch.autograd.Function):
    """The sequential part of the chunked delta rule, chunk by chunk:

        D_c = U_c - W_c S_c,   S_{c+1} = gC_c S_c + Kd_c^T D_c

    Inputs ``U (N, BH, C, V)``, ``W, Kd (N, BH, C, K)``, ``gC (N, BH)``, ``S0 (BH, K, V)``, chunk axis
    first so one chunk is a contiguous block. Returns ``D (N, BH, C, V)``, the chunk-start states
    ``(N, BH, K, V)`` and the final state. The loop runs outside autograd and the backward is the same
    loop reversed: autograd through per-chunk slices would allocate a full-size gradient for every
    slice (quadratic in the sequence length). The backward loop carries only ``dS`` (three small ops per
    chunk); the gradients of ``W``, ``Kd`` and ``gC``, which need ``dS_{c+1}`` but feed nothing back
    into the loop, are then batched over all chunks.
    """

    @staticmethod
    def forward(ctx, U, W, Kd, gC, S0):
        N = U.shape[0]
        D = U.clone()                                           # one copy, then D_c -= W_c S_c in place
        states = U.new_empty(N + 1, *S0.shape)                 # states[c] = S_c, states[N] = final
        states[0] = S0
        # per-chunk views taken once (unbind): indexing inside the loop costs more than the small matmuls
        Dc, Wc, St = D.unbind(0), W.unbind(0), states.unbind(0)
        KdTc = Kd.transpose(-1, -2).unbind(0)
        gCc = gC[:, :, None, None].unbind(0)
        for c in range(N):
            Dc[c].baddbmm_(Wc[c], St[c], alpha=-1.0)
            torch.mul(St[c], gCc[c], out=St[c + 1])
            St[c + 1].baddbmm_(KdTc[c], Dc[c])
        ctx.save_for_backward(W, Kd, gC, states, D)
        return D, states[:N], states[N].clone()

    @staticmethod
    def backward(ctx, dD, d_starts, d_final):
        W, Kd, gC, states, D = ctx.saved_tensors
        N = W.shape[0]
        dS = torch.empty_like(states)                          # dS[c + 1] = dLoss / dS_{c+1} (total)
        if d_final is None:
            dS[N].zero_()
        else:
            dS[N].copy_(d_final)
        # dLoss / dD_c in total: dD_c (contiguous copy) + Kd_c dS_{c+1}, accumulated in the loop
        dU = torch.zeros_like(D) if dD is None else dD.clone(memory_format=torch.contiguous_format)
        dUc, dSc, Kdc = dU.unbind(0), dS.unbind(0), Kd.unbind(0)
        WTc = W.transpose(-1, -2).unbind(0)
        gCc = gC[:, :, None, None].unbind(0)
        starts_c = None if d_starts is None else d_starts.unbind(0)
        for c in range(N - 1, -1, -1):
            g = dSc[c + 1]
            dUc[c].baddbmm_(Kdc[c], g)
            if starts_c is not None:
                torch.addcmul(starts_c[c], g, gCc[c], out=dSc[c])
            else:
                torch.mul(g, gCc[c], out=dSc[c])
            dSc[c].baddbmm_(WTc[c], dUc[c], alpha=-1.0)
        S, dSn = states[:N], dS[1:]                                        # S_c and dLoss / dS_{c+1}
        dKd = D @ dSn.transpose(-1, -2)
        dW = torch.matmul(dU, S.transpose(-1, -2)).neg_()                 # in place: no second full-size tensor
        dgC = (dSn * S).sum((-1, -2))
        return dU, dW, dKd, dgC, dS[0].clone()


class _UnitLowerSolve(torch.autograd.Function):
    """``(U, W) = L^{-1} [B1 | B2]`` with ``L = I + tril(A, -1)`` (unit lower triangular; the diagonal and the
    upper part of ``A`` are ignored), for two right-hand sides at once.

    ``torch.linalg.solve_triangular`` run twice with autograd copies each right-hand side into a fresh
    output, and its backward solves, transposes and masks once per side. Here both sides share one
    in-place solve forward and one backward: ``dB = L^{-T} [dU | dW]``, ``dA = -tril(dB [U | W]^T, -1)``.
    """

    @staticmethod
    def forward(ctx, A, B1, B2):
        V1 = B1.shape[-1]
        X = torch.cat([B1, B2], dim=-1)
        torch.linalg.solve_triangular(A, X, upper=False, unitriangular=True, out=X)
        ctx.save_for_backward(A, X)
        ctx.V1 = V1
        return X[..., :V1], X[..., V1:]

    @staticmethod
    def backward(ctx, dU, dW):
        A, X = ctx.saved_tensors
        V1 = ctx.V1
        dX = torch.cat([torch.zeros_like(X[..., :V1]) if dU is None else dU,
                        torch.zeros_like(X[..., V1:]) if dW is None else dW], dim=-1)
        torch.linalg.solve_triangular(A.mT, dX, upper=True, unitriangular=True, out=dX)
        dA = torch.matmul(dX, X.mT).tril_(-1).neg_()
        return dA, dX[..., :V1], dX[..., V1:]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: the gradient of the time-first
    output arrives as a permuted view, and CPU batched matmuls on such operands copy matrix by matrix."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        return dx.contiguous()


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    gamma: torch.Tensor | None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    query_stride: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule above on ``(B, L, H, D)`` inputs (``q`` already scaled).

    Returns ``o`` ``(B, L, H, V)`` and the final state ``(B, H, K, V)``, both in the compute dtype.
    Everything but the chunk-to-chunk recurrence is batched over all chunks. ``query_stride = s > 1``
    (with ``chunk_size`` a multiple of ``s``): only the outputs at positions ``s-1, 2s-1, ...`` are
    computed and returned, ``(B, L / s, H, V)`` (the delta product's queries sit there; the other
    rows of ``q`` are zero).

    Layout inside: chunk axis first, ``(N, B, H, C, D)`` (contiguous), so the batched products need no
    copies of strided operands and one chunk of every tensor the recurrence reads is a contiguous block.
    """
    L = k.shape[1]
    C = int(chunk_size)
    if C <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if query_stride > 1 and (C % query_stride or L % query_stride):
        raise ValueError(f"query_stride {query_stride} must divide chunk_size {C} and the length {L}")
    dt = compute_dtype(q, k, v, beta, gamma, initial_state)
    S0 = None if initial_state is None else initial_state.to(dt)

    def segment(q, k, v, beta, gamma, S):
        return _delta_rule_segment(q, k, v, beta, gamma, S, C, query_stride, dt)

    # segments are whole chunks, so the query stride (a divisor of C) starts every segment afresh
    return in_segments(segment, (q, k, v, beta, gamma), S0, segment_length(C))


def _delta_rule_segment(q, k, v, beta, gamma, initial_state, C, query_stride, dt):
    """:func:`chunk_gated_delta_rule_torch` on one segment (or the whole sequence), in the compute dtype ``dt``."""
    B, L, H, K = k.shape
    V = v.shape[-1]
    q, k, v, beta = (pad_time(x.to(dt), C) for x in (q, k, v, beta))
    N = q.shape[1] // C

    def chunks_first(x):  # (B, N*C, H, *rest) -> (N, B, H, C, *rest), contiguous
        x = x.reshape(B, N, C, H, *x.shape[3:]).movedim(3, 2).movedim(0, 1)
        return x.contiguous()

    k_, v_ = chunks_first(k), chunks_first(v)                             # (N, B, H, C, D)
    b_ = chunks_first(beta)                                               # (N, B, H, C)
    if gamma is not None:
        gamma = chunks_first(pad_time(gamma.to(dt), C))
        G, seg = gamma.cumsum(-1), segment_log_decays(gamma)              # seg[r, i] = G_r - G_i, i <= r
        M = seg.exp()
        eG = G.exp()
    else:
        G = None
        M = causal_mask(C, k.device).to(dt)
        eG = None
    # I + A with A_ri = beta_r M_ri k_r.k_i (i < r): the solve reads only the strictly lower triangle
    # (unitriangular), so the diagonal and upper part of beta * M * KK need not be masked or replaced
    bk = b_.unsqueeze(-1) * k_                                            # beta folded into the product:
    A = (bk @ k_.transpose(-1, -2)) * M                                   # one C x C pass less each way
    U, W = _UnitLowerSolve.apply(A, b_.unsqueeze(-1) * v_, bk if eG is None else eG.unsqueeze(-1) * bk)
    if query_stride > 1:
        rows = slice(query_stride - 1, None, query_stride)
        q_ = chunks_first(q)[..., rows, :].contiguous()
        M_q = M[..., rows, :]
        eG_q = None if eG is None else eG[..., rows]
    else:
        q_, M_q, eG_q = chunks_first(q), M, eG
    QKm = (q_ @ k_.transpose(-1, -2)) * M_q                               # masked by M (zero above)
    if G is None:
        Qg, Kd, gC = q_, k_, torch.ones(N, B, H, dtype=dt, device=k.device)
    else:
        Qg = eG_q.unsqueeze(-1) * q_
        Kd = seg[..., -1, :].exp().unsqueeze(-1) * k_                     # e^{G_C - G_i} k_i
        gC = eG[..., -1]                                                  # (N, B, H)

    def flat(x):  # (N, B, H, ...) -> (N, B*H, ...)
        return x.reshape(N, B * H, *x.shape[3:])

    S0 = q.new_zeros(B * H, K, V) if initial_state is None else initial_state.to(dt).reshape(B * H, K, V)
    D, starts, S = _ChunkRecurrence.apply(flat(U), flat(W), flat(Kd), flat(gC), S0)
    D = D.view(N, B, H, C, V)
    starts = starts.view(N, B, H, K, V)
    o = _ContiguousGrad.apply(Qg @ starts + QKm @ D)                      # (N, B, H, C / s, V)
    o = o.movedim(0, 1).movedim(2, 3).reshape(B, -1, H, V)                # time first
    return o[:, :L // query_stride], S.view(B, H, K, V)


def delta_product_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    num_householder: int = 1,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta product (layout of :mod:`kernels.delta.reference`) via the chunked delta rule."""
    n = num_householder
    if n > 1 and chunk_size % n == 0:
        # only every n-th position carries a query: compute the outputs there alone
        def rule(*args):
            return chunk_gated_delta_rule_torch(*args, query_stride=n)
        return delta_product_via_rule(rule, q, k, v, beta, g, n, scale, initial_state, chunk_size, strided=True)
    return delta_product_via_rule(chunk_gated_delta_rule_torch, q, k, v, beta, g, n, scale, initial_state,
                                  chunk_size)


def delta_product_via_rule(rule, q, k, v, beta, g, num_householder, scale, initial_state, chunk_size,
                           strided: bool = False):
    """Interleave the ``n_h`` sub-steps into one sequence ``n_h * T`` long (gate on sub-step 0, query on the
    last), run the chunked gated delta ``rule`` over it, and read every ``n_h``-th output (``strided``: the
    rule returns those outputs only)."""
    B, T, H, K = q.shape
    n = num_householder
    k = flatten_substeps(k, n, T, "k")
    v = flatten_substeps(v, n, T, "v")
    beta = flatten_substeps(beta, n, T, "beta")
    scale = K ** -0.5 if scale is None else scale
    q_up = at_least_fp32(q)
    qi, gi = interleave_inputs(q_up * scale, g, n, T * n)
    o, S = rule(qi, k, v, beta, gi, initial_state, chunk_size)
    o = o[:, n - 1::n] if n > 1 and not strided else o
    return o.to(q.dtype), as_state(S, q)
