"""References of the Triton delta-rule stages, one per stage, in the stages' own layouts (plain PyTorch).

:mod:`kernels.delta.triton` computes the chunked gated delta rule / delta product (Gated Delta Networks,
arXiv:2412.06464; DeltaProduct, arXiv:2502.10297) in six stages; each function here computes what one of
them returns from the same inputs, so a test can check a stage alone and a failure names the stage. The
notation is that of :mod:`kernels.delta.chunked`: per chunk of ``BT`` positions, ``G`` the in-chunk cumulative
log gate (``gC`` at the chunk's last row), ``A = tril_strict(beta_r e^{G_r - G_i} k_r . k_i)``:

    prep           G,  Tm = (I + A)^{-1},  U = Tm diag(beta) V,  W = Tm diag(beta e^G) K
    state_pass     h_c (entering),  D = U - W h_c,  h_{c+1} = e^{gC} h_c + K^T (e^{gC - G} D),  and the last
    output         o = scale (e^{G_p} q_p h_c + sum_{s<=p} e^{G_p - G_s} (q_p . k_s) D_s)  at the query rows p
    output_grads   d<dO, o> w.r.t. q, k, G and D (h held fixed)
    state_grads    the gradients of every chunk's exit state, of U and of the initial state
    prep_state_grads  the gradients through D = U - W h_c and the state update w.r.t. W, k and G (h_c, D held)
    prep_wy_grads  the inputs' gradients through the UT transform (U, W and G as functions of k, v, beta, g),
                   with prep_state_grads' partials of k and G added
    prep_grads     the inputs' gradients dk, dv, dbeta, dg of the whole operation (what the last two compose to;
                   the gradient stages by autograd through the forward references)

Layouts: ``q (B, L/NQ, H, K)`` (the query of position ``NQ - 1`` of every ``NQ``), ``k (B, L, H, K)``, ``v (B, L,
H, V)``, ``beta (B, L, H)``, ``g (B, L/NQ, H)`` or None (the gate of position 0 of every ``NQ``); per-position
intermediates heads-first ``(B*H, Lp, ...)`` with ``Lp = N BT`` (zero past ``L``), chunk states ``(B*H, N, K,
V)``, initial and final states ``(B, H, K, V)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["prep", "state_pass", "output", "output_grads", "state_grads", "prep_state_grads", "prep_wy_grads",
           "prep_grads"]


def _chunks(x: torch.Tensor, size: int) -> torch.Tensor:
    """``(B, T, H, ...)`` -> ``(B*H, n, size, ...)`` heads-first, zero past ``T``."""
    B, T, H = x.shape[:3]
    n = -(-T // size)
    x = F.pad(x.movedim(2, 1), [0, 0] * (x.dim() - 3) + [0, n * size - T])
    return x.reshape(B * H, n, size, *x.shape[3:])


def _gates(g, L: int, NQ: int, like: torch.Tensor) -> torch.Tensor:
    """The gate of every position ``(B, L, H)``: ``g`` at position 0 of every ``NQ``, else 0."""
    B, _, H = like.shape[:3]
    gam = like.new_zeros(B, L, H)
    if g is not None:
        gam[:, ::NQ] = g.to(like.dtype)
    return gam


def prep(k, v, beta, g, NQ: int, BT: int):
    """``(G (B*H, Lp), Tm (B*H, Lp, BT), U (B*H, Lp, V), W (B*H, Lp, K))``."""
    L = k.shape[1]
    kc, vc, bc = _chunks(k, BT), _chunks(v, BT), _chunks(beta, BT)
    G = torch.cumsum(_chunks(_gates(g, L, NQ, beta), BT), dim=-1)
    strict = torch.ones(BT, BT, dtype=torch.bool, device=k.device).tril(-1)
    A = torch.where(strict, bc[..., :, None] * torch.exp(G[..., :, None] - G[..., None, :]) * (kc @ kc.transpose(-1, -2)),
                    0.0)
    eye = torch.eye(BT, dtype=A.dtype, device=A.device)
    Tm = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    U = Tm @ (bc[..., None] * vc)
    W = Tm @ ((bc * torch.exp(G))[..., None] * kc)
    return G.flatten(1), Tm.flatten(1, 2), U.flatten(1, 2), W.flatten(1, 2)


def _state_pass(k, G, U, W, h0, BT: int):
    """:func:`state_pass` with the list of states ``[h_0, ..., h_N]`` (``h_N`` the last)."""
    B, L, H, K = k.shape
    kc, Gc = _chunks(k, BT), G.unflatten(1, (-1, BT))
    Uc, Wc = U.unflatten(1, (-1, BT)), W.unflatten(1, (-1, BT))
    S = Uc.new_zeros(B * H, K, Uc.shape[-1]) if h0 is None else h0.reshape(B * H, K, -1).to(Uc.dtype)
    states, Ds = [S], []
    for c in range(Gc.shape[1]):
        D = Uc[:, c] - Wc[:, c] @ S
        gC = Gc[:, c, -1]
        to_end = torch.exp(gC[:, None] - Gc[:, c])[..., None]
        S = torch.exp(gC)[:, None, None] * S + kc[:, c].transpose(-1, -2) @ (to_end * D)
        states.append(S)
        Ds.append(D)
    return states, torch.cat(Ds, dim=1)


def state_pass(k, G, U, W, h0, BT: int):
    """``(h (B*H, N, K, V), D (B*H, Lp, V), hT (B, H, K, V))``."""
    B, L, H, K = k.shape
    states, D = _state_pass(k, G, U, W, h0, BT)
    return torch.stack(states[:-1], dim=1), D, states[-1].reshape(B, H, K, -1)


def output(q, k, G, h, D, scale: float, NQ: int, BT: int):
    """``o (B, L/NQ, H, V)``."""
    B, L, H, K = k.shape
    BQ = BT // NQ
    qc, kc, Gc = _chunks(q, BQ), _chunks(k, BT), G.unflatten(1, (-1, BT))
    p = torch.arange(BQ, device=k.device) * NQ + NQ - 1                      # the query rows of a chunk
    Gq = Gc[..., p]
    causal = p[:, None] >= torch.arange(BT, device=k.device)[None, :]
    Mi = torch.where(causal, torch.exp(torch.where(causal, Gq[..., :, None] - Gc[..., None, :], 0.0)), 0.0)
    P = (qc @ kc.transpose(-1, -2)) * Mi
    o = scale * (torch.exp(Gq)[..., None] * (qc @ h.to(qc.dtype)) + P @ D.unflatten(1, (-1, BT)).to(qc.dtype))
    return o.flatten(1, 2)[:, :L // NQ].unflatten(0, (B, H)).movedim(1, 2)


def output_grads(q, k, G, h, D, do, scale: float, NQ: int, BT: int):
    """``(dq (like q), dk_o (B*H, Lp, K), dG_o (B*H, Lp), dDo (B*H, Lp, V))``."""
    q, k, G, D = (t.detach().requires_grad_(True) for t in (q, k, G, D))
    o = output(q, k, G, h, D, scale, NQ, BT)
    dq, dk, dG, dD = torch.autograd.grad((o * do.to(o.dtype)).sum(), (q, k, G, D))
    return dq, _chunks(dk, G.shape[1]).squeeze(1), dG, dD


def state_grads(q, k, G, U, W, h0, do, dhT, scale: float, NQ: int, BT: int):
    """``(dh (B*H, N, K, V), dU (B*H, Lp, V), dh0 (B, H, K, V))``: ``dh[c]`` is the gradient of the state
    leaving chunk ``c``, of ``<dO, o> + <dhT, hT>`` with ``q``, ``k``, ``G`` and ``W`` held fixed."""
    B, L, H, K = k.shape
    U = U.detach().requires_grad_(True)
    h0 = (torch.zeros(B, H, K, U.shape[-1], dtype=U.dtype, device=U.device) if h0 is None else h0.to(U.dtype)) \
        .detach().requires_grad_(True)
    states, D = _state_pass(k, G, U, W, h0, BT)
    o = output(q, k, G, torch.stack(states[:-1], dim=1), D, scale, NQ, BT)
    objective = (o * do.to(o.dtype)).sum()
    if dhT is not None:
        objective = objective + (states[-1].reshape(B, H, K, -1) * dhT.to(o.dtype)).sum()
    grads = torch.autograd.grad(objective, [U, h0, *states[1:]], allow_unused=True)
    dh = torch.stack([torch.zeros_like(s) if d is None else d for d, s in zip(grads[2:], states[1:])], dim=1)
    return dh, grads[0], grads[1]


def _heads_first(x: torch.Tensor, Lp: int) -> torch.Tensor:
    """``(B, L, H, D)`` -> ``(B*H, Lp, D)``, zero past ``L``."""
    return _chunks(x, Lp).squeeze(1)


def prep_state_grads(k, G, h, D, dh, dU, dk_o, dG_o, BT: int, gated: bool = True):
    """``(dW (B*H, Lp, K), dk_s (B*H, Lp, K), dG_s (B*H, Lp))``: the gradients of ``<dU, D> + sum_c <dh[c], h_{c+1}>``
    with ``D = U - W h_c`` and ``h_{c+1} = e^{gC} h_c + K^T (e^{gC - G} D)`` w.r.t. ``W``, ``k`` and ``G``, where the
    entry states ``h`` and ``D`` are held fixed (their own gradients are :func:`state_grads`'), with ``dk_o`` and
    ``dG_o`` added (``dG_o`` alone when not ``gated``: ``G`` is then zero)."""
    Lp = G.shape[1]
    k, G = k.detach().requires_grad_(True), G.detach().requires_grad_(True)
    W = torch.zeros(*G.shape, k.shape[-1], dtype=k.dtype, device=k.device, requires_grad=True)
    kc, Gc = _chunks(k, BT), G.unflatten(1, (-1, BT))
    Dc, dUc, Wc = D.unflatten(1, (-1, BT)), dU.unflatten(1, (-1, BT)), W.unflatten(1, (-1, BT))
    gC = Gc[..., -1]
    exits = torch.exp(gC)[..., None, None] * h + kc.transpose(-1, -2) @ (torch.exp(gC[..., None] - Gc)[..., None] * Dc)
    objective = (exits * dh).sum() - (dUc * (Wc @ h)).sum()
    dk, dG, dW = torch.autograd.grad(objective, (k, G, W))
    return dW, dk_o + _heads_first(dk, Lp), dG_o + dG if gated else dG_o


def prep_wy_grads(k, v, beta, g, dU, dW, dk_s, dG_s, NQ: int, BT: int):
    """``(dk, dv, dbeta, dg)`` of ``<dU, U> + <dW, W> + <dG_s, G>`` through :func:`prep`, with ``dk_s`` added to
    ``dk`` (``dg`` None without a gate)."""
    B, L, H, _ = k.shape
    leaves = [t.detach().requires_grad_(True) if t is not None else None for t in (k, v, beta, g)]
    G, _Tm, U, W = prep(*leaves, NQ, BT)
    objective = (U * dU).sum() + (W * dW).sum() + (G * dG_s).sum()
    used = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(objective, used))
    dk, dv, db, dg = (next(grads) if t is not None else None for t in leaves)
    return dk + dk_s.unflatten(0, (B, H))[:, :, :L].movedim(1, 2), dv, db, dg


def prep_grads(q, k, v, beta, g, h0, do, dhT, scale: float, NQ: int, BT: int):
    """``(dk, dv, dbeta, dg)`` of ``<dO, o> + <dhT, hT>`` through the three forward references."""
    leaves = [t.detach().requires_grad_(True) if t is not None else None for t in (k, v, beta, g)]
    kl, vl, bl, gl = leaves
    G, _Tm, U, W = prep(kl, vl, bl, gl, NQ, BT)
    h, D, hT = state_pass(kl, G, U, W, h0, BT)
    o = output(q, kl, G, h, D, scale, NQ, BT)
    objective = (o * do.to(o.dtype)).sum()
    if dhT is not None:
        objective = objective + (hT * dhT.to(o.dtype)).sum()
    used = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(objective, used))
    return tuple(next(grads) if t is not None else None for t in leaves)
