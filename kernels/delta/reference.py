"""Reference (token-by-token) gated delta product: the readable spec of the ``delta`` family.

Per head, with state ``S`` of shape ``(d_k, d_v)``, for every token ``t``:

    S <- exp(g_t) * S                                   (optional forget gate, once per token)
    for j = 1..n_h:                                     (n_h generalized Householder steps)
        S <- (I - beta_{t,j} k_{t,j} k_{t,j}^T) S + beta_{t,j} k_{t,j} v_{t,j}^T
    o_t = S^T q_t * scale                               (read after the last sub-step)

``n_h = 1`` is (Gated) DeltaNet. With ``||k|| = 1`` and ``beta in [0, 2]`` every factor
``I - beta k k^T`` has eigenvalues ``1`` (multiplicity ``d_k - 1``) and ``1 - beta in [-1, 1]``
(Siems et al., "DeltaProduct", arXiv:2502.10297).

Layout (the same as flash-linear-attention's ``naive_recurrent_gated_delta_product``):

- ``q``: ``(B, T, H, K)``; ``g``: ``(B, T, H)`` or ``None`` (log forget gate, ``g <= 0``);
- ``k``: ``(B, T * n_h, H, K)``, ``v``: ``(B, T * n_h, H, V)``, ``beta``: ``(B, T * n_h, H)``, sub-step
  ``j`` of token ``t`` at index ``t * n_h + j`` (token-major interleave). The 5-d layout
  ``(B, T, n_h, H, ...)`` is also accepted and is the same memory viewed differently;
- ``initial_state``: ``(B, H, K, V)`` or ``None``; returns ``(o (B, T, H, V), final_state (B, H, K, V))``.

Computation runs in the promoted dtype of the inputs and at least fp32 (so fp64 inputs stay fp64);
the output is returned in ``q``'s dtype and the final state in :func:`kernels.common.state_dtype` of it, as on
every backend (fp32 for fp32 and 16-bit ``q``, whatever the dtype of the initial state).
:func:`delta_product_step` is one token; the reference loop is built from it.
"""
from __future__ import annotations

import torch

from ..common import as_state, compute_dtype


def flatten_substeps(x: torch.Tensor, num_householder: int, T: int, what: str) -> torch.Tensor:
    """Accept ``(B, T, n_h, H, ...)`` or ``(B, T*n_h, H, ...)`` and return the flat interleaved layout."""
    flat_dim = 3 if what == "beta" else 4
    if x.dim() == flat_dim + 1 and x.shape[1] == T and x.shape[2] == num_householder:
        return x.reshape(x.shape[0], T * num_householder, *x.shape[3:])
    if x.dim() != flat_dim or x.shape[1] != T * num_householder:
        raise ValueError(
            f"delta_product: {what} must have shape (B, T*n_h, H{'' if what == 'beta' else ', D'}) with "
            f"T*n_h = {T * num_householder}, or (B, T, n_h, H{'' if what == 'beta' else ', D'}); got {tuple(x.shape)}"
        )
    return x


def delta_product_step(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    beta_t: torch.Tensor,
    g_t: torch.Tensor | None,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence: ``q_t`` ``(B, H, K)``, ``k_t`` ``(B, n_h, H, K)``, ``v_t``
    ``(B, n_h, H, V)``, ``beta_t`` ``(B, n_h, H)``, ``g_t`` ``(B, H)`` or None, ``state`` ``(B, H, K, V)``.

    Returns ``(o_t (B, H, V) in q_t's dtype, new state in the compute dtype)``.
    """
    K = q_t.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    dt = compute_dtype(q_t, k_t, v_t, beta_t, g_t, state)
    S = state.to(dt)
    if g_t is not None:
        S = S * g_t.to(dt).exp()[..., None, None]
    for j in range(k_t.shape[1]):
        kj, vj, bj = k_t[:, j].to(dt), v_t[:, j].to(dt), beta_t[:, j].to(dt)
        # (I - b k k^T) S + b k v^T  =  S + b k (v - S^T k)^T
        resid = vj - torch.einsum("bhkv,bhk->bhv", S, kj)
        S = S + bj[..., None, None] * kj[..., :, None] * resid[..., None, :]
    o = torch.einsum("bhkv,bhk->bhv", S, q_t.to(dt)) * scale
    return o.to(q_t.dtype), S


def delta_product_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    num_householder: int = 1,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence above, one token at a time with :func:`delta_product_step` (differentiable)."""
    B, T, H, K = q.shape
    n = num_householder
    k, v, beta = (flatten_substeps(x, n, T, what) for x, what in ((k, "k"), (v, "v"), (beta, "beta")))
    V = v.shape[-1]
    dt = compute_dtype(q, k, v, beta, g, initial_state)
    k, v, beta = (x.reshape(B, T, n, *x.shape[2:]) for x in (k, v, beta))   # (B, T, n_h, H, ...)
    S = q.new_zeros(B, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)
    outs = []
    for t in range(T):
        o_t, S = delta_product_step(q[:, t], k[:, t], v[:, t], beta[:, t], None if g is None else g[:, t], S,
                                    scale)
        outs.append(o_t)
    o = torch.stack(outs, dim=1) if T > 0 else q.new_zeros(B, 0, H, V)
    return o, as_state(S, q)


def householder_transition(k: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The explicit state-transition matrix ``prod_j (I - beta_j k_j k_j^T)`` of one token.

    ``k``: ``(..., n_h, K)``, ``beta``: ``(..., n_h)``; returns ``(..., K, K)`` = ``A_{n_h} ... A_1``
    (sub-step 1 is applied first). Used by tests of the eigenvalue claims.
    """
    K = k.shape[-1]
    eye = torch.eye(K, dtype=k.dtype, device=k.device)
    A = eye.expand(*k.shape[:-2], K, K).clone()
    for j in range(k.shape[-2]):
        kj = k[..., j, :]
        Hj = eye - beta[..., j, None, None] * kj[..., :, None] * kj[..., None, :]
        A = Hj @ A
    return A
