"""References of the Triton SSD stages, one per stage, in the stages' own layouts (plain PyTorch, any dtype).

:mod:`kernels.ssd.triton` computes Mamba-2's SSD (Dao & Gu, "Transformers are SSMs: Generalized Models and
Efficient Algorithms Through Structured State Space Duality", arXiv:2405.21060) in six stages; each function
here computes what one of them returns, from the same inputs, so a test can check a stage alone and a failure
names the stage. With ``a_t = sum_{l<=t} dt_l A`` within a chunk of ``L`` positions (``a_L`` at its last
position, positions past the end of the sequence having ``dt = 0``), ``u_s = dt_s x_s``, ``h0_c`` the state
entering chunk ``c`` and ``G_c`` the gradient of the state leaving it:

    chunk_states       S_c = sum_s exp(a_L - a_s) B_s u_s^T,  and a_L
    pass_states        h0_0 = init,  h0_{c+1} = exp(a_L^c) h0_c + S_c  (hstart, and the final state)
    chunk_outputs      y_t = sum_{s<=t} exp(a_t - a_s) (C_t . B_s) u_s + exp(a_t) C_t^T h0_c  (+ D x_t, the skip)
    chunk_state_grads  D_c = sum_t exp(a_t) C_t dy_t^T
    pass_state_grads   G_last = dfinal,  G_{c-1} = exp(a_L^c) G_c + D_c  (gend, and the initial state's)
    chunk_grads        the gradients of  sum_c <dy_c, y_c> + <G_c, exp(a_L^c) h0_c + S_c>  w.r.t. x, dt, A, B, C
                       (and D)
                       with every h0_c and G_c held fixed (autograd through the two references above)

Layouts: ``x, dy (b, T, H, P)``, ``dt (b, T, H)``, ``A (H,)``, ``B, C (b, T, H, N)``; states and their
gradients ``(b, n, H, N, P)``; ``alast (b, H, n)``. The chunk's token loop of :mod:`kernels.ssd.reference` and
the whole-sequence chunked path of :mod:`kernels.ssd.chunked` stay the references of the whole operation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import skip

__all__ = ["chunk_states", "pass_states", "chunk_outputs", "chunk_state_grads", "pass_state_grads", "chunk_grads"]


def _chunks(t: torch.Tensor, L: int) -> torch.Tensor:
    """``(b, T, H, ...)`` -> ``(b, n, L, H, ...)``, zero past the end."""
    T = t.shape[1]
    n = -(-T // L)
    pad = [0, 0] * (t.dim() - 2) + [0, n * L - T]
    return F.pad(t, pad).unflatten(1, (n, L))


def _decays(dt, A, L):
    """``a (b, n, L, H)``: the cumulative ``dt A`` within every chunk."""
    return torch.cumsum(_chunks(dt, L) * A, dim=2)


def chunk_states(x, dt, A, B, L: int):
    """``(S (b, n, H, N, P), alast (b, H, n))``."""
    a = _decays(dt, A, L)
    w = torch.exp(a[:, :, -1:] - a) * _chunks(dt, L)                                   # exp(a_L - a_s) dt_s
    S = torch.einsum("bclh,bclhn,bclhp->bchnp", w, _chunks(B, L), _chunks(x, L))
    return S, a[:, :, -1].permute(0, 2, 1)


def pass_states(states, alast, initial_state=None):
    """``(hstart (b, n, H, N, P), final (b, H, N, P))``."""
    b, n, H, N, P = states.shape
    h = states.new_zeros(b, H, N, P) if initial_state is None else initial_state.to(states.dtype)
    starts = []
    for c in range(n):
        starts.append(h)
        h = torch.exp(alast[:, :, c])[..., None, None] * h + states[:, c]
    return torch.stack(starts, dim=1), h


def chunk_outputs(x, dt, A, B, C, hstart, L: int, D=None):
    """``y (b, T, H, P)``, with the skip ``D (H,)`` added where given."""
    T = x.shape[1]
    a = _decays(dt, A, L)                                                                # (b, n, L, H)
    seg = a.unsqueeze(3) - a.unsqueeze(2)                                                # [t, s]: a_t - a_s
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()[None, None, :, :, None]
    decay = torch.where(causal, torch.exp(torch.where(causal, seg, 0.0)), 0.0)          # (b, n, L, L, H)
    Cc, Bc, u = _chunks(C, L), _chunks(B, L), _chunks(x, L) * _chunks(dt, L).unsqueeze(-1)
    scores = torch.einsum("bcthn,bcshn->bctsh", Cc, Bc) * decay
    y = torch.einsum("bctsh,bcshp->bcthp", scores, u)
    y = y + torch.exp(a).unsqueeze(-1) * torch.einsum("bcthn,bchnp->bcthp", Cc, hstart.to(y.dtype))
    return skip(y.flatten(1, 2)[:, :T], x, D)


def chunk_state_grads(C, dy, dt, A, L: int):
    """``D (b, n, H, N, P)``."""
    a = _decays(dt, A, L)
    return torch.einsum("bclh,bclhn,bclhp->bchnp", torch.exp(a), _chunks(C, L), _chunks(dy, L))


def pass_state_grads(dstates, alast, dfinal=None):
    """``(gend (b, n, H, N, P), dinit (b, H, N, P))``."""
    b, n, H, N, P = dstates.shape
    g = dstates.new_zeros(b, H, N, P) if dfinal is None else dfinal.to(dstates.dtype)
    ends = [None] * n
    for c in reversed(range(n)):
        ends[c] = g
        g = torch.exp(alast[:, :, c])[..., None, None] * g + dstates[:, c]
    return torch.stack(ends, dim=1), g


def chunk_grads(x, dt, A, B, C, dy, hstart, gend, L: int, D=None):
    """``(dx, ddt, dA, dB, dC, dD)`` (``dD`` None without the skip), by autograd through :func:`chunk_outputs`
    and :func:`chunk_states`."""
    inputs = [t.detach().requires_grad_(True) for t in (x, dt, A, B, C) + (() if D is None else (D,))]
    xi, dti, Ai, Bi, Ci = inputs[:5]
    S, alast = chunk_states(xi, dti, Ai, Bi, L)
    leaving = torch.exp(alast).permute(0, 2, 1)[..., None, None] * hstart.to(S.dtype) + S
    y = chunk_outputs(xi, dti, Ai, Bi, Ci, hstart, L, inputs[5] if D is not None else None)
    objective = (dy.to(S.dtype) * y).sum() + (gend.to(S.dtype) * leaving).sum()
    grads = torch.autograd.grad(objective, inputs)
    return (*grads, None) if D is None else grads
