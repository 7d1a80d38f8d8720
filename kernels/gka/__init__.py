"""Gated KalmaNet (GKA; "Gated KalmaNet: A Fading Memory Layer Through Test-Time Ridge Regression", arXiv:2511.21016):
gated ridge regression solved per token by Chebyshev iteration.

    H_t = e^{g_t} H_{t-1} + k_t k_t^T,   U_t = e^{g_t} U_{t-1} + v_t k_t^T
    x_t ~= (H_t + lambda_t I)^{-1} q_t,  lambda_t = a ||H_t||_F + eps
    o_t = U_t (q_t + alpha_t (x_t - q_t)) * scale

``num_iter = 0`` skips the solve (``x = q``): exactly gated linear attention. Solvers: ``chebyshev``
(default, ``num_iter`` iterations), ``cg`` (conjugate gradients, ``num_iter`` steps), ``exact``
(``torch.linalg.solve`` on materialised ``H_t``). Gradients through the solve: ``implicit``
(default), ``reverse_chebyshev`` (the paper's Algorithm 2, exact), ``autograd`` (unrolled).

Backends: ``reference`` (token recurrence, dense solves), ``torch`` (chunked, CPU default),
``triton`` (the GPU path: the whole core in ten Triton launches forward and backward, whatever the length;
Chebyshev only, chunk sizes powers of two >= 16, fp32 and 16-bit inputs; with bf16/fp16 inputs its products
run on tensor cores, see :mod:`kernels.gka.triton`).
``gka_step`` is the one-token decode.
"""
from __future__ import annotations

import torch

from ..backend import NO_FP64, BackendUnavailable, resolve_backend
from ..common import check_chunk_size, check_layout, full_precision, no_decay
from .chebyshev import GRAD_MODES, SOLVERS, cg_iterate, chebyshev_iterate, iterative_solve
from .chunked import gka_chunked
from .reference import gka_reference, gka_step

__all__ = ["BACKENDS", "gka", "gka_chunked", "gka_reference", "gka_step", "chebyshev_iterate", "cg_iterate",
           "iterative_solve", "SOLVERS", "GRAD_MODES", "ALL_SOLVERS"]

ALL_SOLVERS = SOLVERS + ("exact",)


#: the backends this family implements (``auto`` picks among them); mixers offer these
BACKENDS = ("reference", "torch", "triton")


@full_precision
def gka(q, k, v, g, alpha=None, *, ridge_a: float = 0.02, ridge_eps: float = 1e-6, num_iter: int = 30,
        solver: str = "chebyshev", grad: str = "implicit", scale: float | None = None, chunk_size: int = 64,
        initial_state=None, backend: str = "auto"):
    """GKA core. ``q, k (B, T, H, d_k)``, ``v (B, T, H, d_v)``, ``g, alpha (B, T, H)`` (alpha may be None:
    ``q~ = x``; g may be None: no decay). Returns ``(o (B, T, H, d_v), (H_T (B, H, d_k, d_k), U_T (B, H, d_v,
    d_k)))``: ``o`` in ``q``'s dtype, ``H_T`` and ``U_T`` in :func:`kernels.common.state_dtype` of it,
    ``torch.promote_types(q.dtype, torch.float32)`` (fp32 for 16-bit inputs, on every backend), so that a state
    passed to the next call is not rounded to 16 bits; an fp32 ``initial_state`` is read as it is."""
    if solver not in ALL_SOLVERS:
        raise ValueError(f"gka: unknown solver {solver!r}; choose one of {ALL_SOLVERS}")
    if grad not in GRAD_MODES:
        raise ValueError(f"gka: unknown grad {grad!r}; choose one of {GRAD_MODES}")
    if grad == "reverse_chebyshev" and solver != "chebyshev" and num_iter > 0:
        raise ValueError("gka: grad='reverse_chebyshev' needs solver='chebyshev'")
    if num_iter < 0:
        raise ValueError(f"gka: num_iter must be >= 0, got {num_iter}")
    g = no_decay(v) if g is None else g
    _check_layout(q, k, v, g, alpha, initial_state)
    check_chunk_size("gka", chunk_size)
    kw = dict(ridge_a=ridge_a, ridge_eps=ridge_eps, num_iter=num_iter, solver=solver, grad=grad, scale=scale,
              initial_state=initial_state)
    chosen = resolve_backend(backend, q, op="gka", available=BACKENDS)
    if chosen == "triton":
        why = _triton_refuses(q, solver, grad, num_iter, chunk_size)
        if why is not None:
            if backend == "triton":
                raise BackendUnavailable(f"gka: the triton backend {why}; or use backend='torch'")
            chosen = "torch"  # auto: the chunked PyTorch path computes the same function
    if chosen == "reference":
        return gka_reference(q, k, v, g, alpha, **kw)
    if chosen == "triton":
        from .triton import gka_triton
        return gka_triton(q, k, v, g, alpha, chunk_size=chunk_size, **kw)
    return gka_chunked(q, k, v, g, alpha, chunk_size=chunk_size, **kw)


def _check_layout(q, k, v, g, alpha, initial_state) -> None:
    """Refuse, in one line naming the tensor, inputs whose shapes disagree (the Triton kernels index every tensor
    by the sizes of ``q`` and ``v``, so a mismatched one would be read out of its bounds instead of failing)."""
    H0 = U0 = None
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise ValueError("gka: initial_state must be a pair (H0 (B, H, d_k, d_k), U0 (B, H, d_v, d_k)) or None")
        H0, U0 = initial_state
    check_layout("gka", q=(q, "B T H K"), k=(k, "B T H K"), v=(v, "B T H V"), g=(g, "B T H"), alpha=(alpha, "B T H"),
                 H0=(H0, "B H K K"), U0=(U0, "B H V K"))


def _triton_refuses(q, solver: str, grad: str, num_iter: int, chunk_size: int) -> str | None:
    """Why the triton backend cannot take these settings, or None."""
    if num_iter > 0 and solver != "chebyshev":
        return f"implements solver='chebyshev' only, not {solver!r}"
    if num_iter > 0 and grad == "autograd":
        return "has no grad='autograd' (use 'implicit' or 'reverse_chebyshev')"
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        return f"needs chunk_size a power of two >= 16, got {chunk_size}"
    if q.dtype == torch.float64:
        return NO_FP64
    return None
