"""The ``delta`` family: gated DeltaProduct (n_h generalized Householder steps per token) and, as its
``n_h = 1`` case, (Gated) DeltaNet.

Per head, state ``S`` ``(d_k, d_v)``, for each token ``t``: ``S <- e^{g_t} S`` (optional log forget
gate), then for ``j = 1..n_h``: ``S <- (I - beta_j k_j k_j^T) S + beta_j k_j v_j^T``; output
``o_t = scale * S^T q_t`` after the last sub-step (Siems et al., arXiv:2502.10297; Yang et al.,
Gated DeltaNet, arXiv:2412.06464).

Layout (as flash-linear-attention's ``naive_recurrent_gated_delta_product``): ``q`` ``(B, T, H, K)``;
``k`` ``(B, T*n_h, H, K)``; ``v`` ``(B, T*n_h, H, V)``; ``beta`` ``(B, T*n_h, H)`` with sub-step ``j`` of
token ``t`` at ``t*n_h + j`` (``(B, T, n_h, H, ...)`` is accepted too); ``g`` ``(B, T, H)`` or None;
``initial_state`` ``(B, H, K, V)`` or None. Returns ``(o (B, T, H, V), final_state (B, H, K, V))``. The arguments
after ``beta`` are taken by name only: flash-linear-attention's ``chunk_gated_delta_rule`` and its gated delta
product take ``(q, k, v, g, beta)`` (its ``naive_recurrent_gated_delta_rule`` takes ``beta`` fourth), and a
positional call in the other order would swap the two ``(B, T, H)`` tensors silently.

Backends: ``reference`` (token loop, :mod:`.reference`), ``torch`` (chunked UT transform,
:mod:`.chunked`), ``triton`` (chunk kernels with a Triton backward, :mod:`.triton`; bf16 / fp16 inputs on tensor cores with
an fp32 state, fp32 inputs in exact fp32), ``fla``
(flash-linear-attention's chunked kernels, CUDA only, imported on first use, :mod:`.outside`).
"""
from __future__ import annotations

import torch

from ..backend import NO_FP64, fla_unsupported, resolve_backend, triton_fp64_unsupported
from ..common import check_chunk_size, check_layout, full_precision
from .chunked import delta_product_chunked
from .reference import delta_product_reference, delta_product_step, householder_transition

__all__ = ["BACKENDS", "delta_product", "delta_rule", "fla_runs_gated", "delta_product_step", "householder_transition"]

#: the backends this family implements (``auto`` picks among them); mixers offer these
BACKENDS = ("reference", "torch", "triton", "fla")
#: largest key / value head dim of the Triton kernels: the chunk tiles of 256 need more shared memory than a
#: GPU block has (python -m zoo.benchmark.compile_check), so their launcher refuses it
TRITON_MAX_HEAD_DIM = 128


def fla_runs_gated(dtype: torch.dtype, gated: bool) -> bool:
    """Whether the ``fla`` backend runs fla's gated kernels: with a forget gate, and in fp32, which takes
    fla's gated rule with a zero gate (:mod:`.outside`)."""
    return gated or dtype == torch.float32


def _check_layout(q, k, v, beta, g, initial_state, n: int) -> None:
    """The shapes of :func:`delta_product`'s inputs agree (``k``, ``v`` and ``beta`` each with ``T*n_h`` rows or
    ``n_h`` per token), refused in one line naming the tensor otherwise."""
    def rows(t, dims):
        return "T N" if t.dim() == dims + 1 else "TN"

    def count(sizes, what):
        T = sizes["T"]
        if sizes.get("N", n) != n or sizes.get("TN", T * n) != T * n:
            raise ValueError(f"delta_product: {what} must hold T*n_h = {T}*{n} sub-steps (or n_h per token) for the "
                             f"{T} tokens of q")
    sizes = check_layout("delta_product", q=(q, "B T H K"), k=(k, f"B {rows(k, 4)} H K"))
    count(sizes, f"k {tuple(k.shape)}")
    sizes = check_layout("delta_product", sizes, v=(v, f"B {rows(v, 4)} H V"), beta=(beta, f"B {rows(beta, 3)} H"),
                         g=(g, "B T H"), initial_state=(initial_state, "B H K V"))
    count(sizes, f"v {tuple(v.shape)} and beta {tuple(beta.shape)}")


def _refuse_positional_gate(op: str, extra: tuple) -> None:
    """``g`` and what follows it are taken by name: flash-linear-attention's ``chunk_gated_delta_rule`` takes ``(q, k,
    v, g, beta)`` and these take ``beta`` fourth, so a call written in either order by position would swap the two
    ``(B, T, H)`` tensors without a word."""
    if extra:
        raise TypeError(f"{op}: takes q, k, v, beta by position and the rest by name; pass the gate as g=... (the "
                        f"order differs from flash-linear-attention's chunk_gated_delta_rule(q, k, v, g, beta)), e.g. "
                        f"{op}(q, k, v, beta, "
                        f"g=g{', num_householder=n' if op == 'delta_product' else ''})")


@full_precision
def delta_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *positional,
    g: torch.Tensor | None = None,
    num_householder: int = 1,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta product; see the module docstring for shapes. ``scale`` defaults to ``K ** -0.5``. Everything after
    ``beta`` is taken by name (``g=``, ``num_householder=``, ...: :func:`_refuse_positional_gate`)."""
    _refuse_positional_gate("delta_product", positional)
    if num_householder < 1:
        raise ValueError(f"delta_product: num_householder must be >= 1, got {num_householder}")
    _check_layout(q, k, v, beta, g, initial_state, num_householder)
    check_chunk_size("delta_product", chunk_size)
    unsupported = {}
    if max(q.shape[-1], v.shape[-1]) > TRITON_MAX_HEAD_DIM:
        unsupported["triton"] = f"head dims above {TRITON_MAX_HEAD_DIM}"
    unsupported.update(triton_fp64_unsupported(q))
    unsupported.update(fla_unsupported(q, fla_runs_gated(q.dtype, g is not None)))
    if q.dtype == torch.float64:  # fla keeps its gates and states in fp32: an fp64 call would be rounded to them
        unsupported["fla"] = NO_FP64
    which = resolve_backend(backend, q, op="delta_product", available=BACKENDS, unsupported=unsupported)
    args = (q, k, v, beta, g, num_householder, scale, initial_state)
    if which == "reference":
        return delta_product_reference(*args)
    if which == "torch":
        return delta_product_chunked(*args, chunk_size=chunk_size)
    if which == "fla":
        from .outside import delta_product_fla

        return delta_product_fla(*args, chunk_size=chunk_size)
    from .triton import delta_product_triton  # lazy: triton is optional

    return delta_product_triton(*args, chunk_size=chunk_size)


def delta_rule(q, k, v, beta, *positional, g=None, scale=None, initial_state=None, chunk_size: int = 64,
               backend: str = "auto"):
    """(Gated) DeltaNet: :func:`delta_product` with one Householder step per token (``k`` ``(B, T, H, K)``); the
    gate and everything after ``beta`` by name, as there."""
    _refuse_positional_gate("delta_rule", positional)
    return delta_product(q, k, v, beta, g=g, num_householder=1, scale=scale, initial_state=initial_state,
                         chunk_size=chunk_size, backend=backend)
