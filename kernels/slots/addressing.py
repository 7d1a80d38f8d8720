"""Kronecker-product addressing: the top-K slots of ``softmax(l_1/tau) (x) ... (x) softmax(l_U/tau)``.

The key (or query) of a head is split into ``U`` factors of ``d_p`` logits; the slot distribution over
``M = d_p^U`` slots is the Kronecker (outer) product of the factor softmaxes (Xiao et al., "RAM-Net",
arXiv 2602.11958). Slot ``m`` has digits ``(i_1, ..., i_U)`` in base ``d_p``, most significant first,
``m = sum_u i_u d_p^(U-u)``: the order of ``torch.kron``.

The product is never materialised. Every factor is nonnegative, so an entry of the top-K of the product
uses, in every factor, one of that factor's top-K entries (otherwise K larger entries of that factor
would give K strictly larger products). The search keeps the top-K partial products after each factor:
``K * min(K, d_p)`` candidates per step, ``O(U K^2)`` per token instead of ``O(d_p^U)``.

Equal products are common (all-zero logits, say: the shifted write address of a first token), and both
backends break a tie the same way, to the lower slot number, at every step (a partial slot number is the
leading digits of its completions, so this is the top-K of the materialised distribution with ties to the
lower slot): a model selects the same slots on a CPU and on a GPU. The one exception: a prefix whose product
has underflowed to zero, whose zero-weight completions the torch backend takes among the factor's top-K only.

The selection is piecewise constant; the returned weights ``prod_u p_u[i_u]`` are differentiable
functions of the logits (the gradient reaches every logit through the factor softmaxes). Optionally the
weights are renormalised to sum to one, and a straight-through variant returns ``1/K`` forward with the
gradient of the soft weights.

Backends: ``torch`` (below, the CPU path) and ``triton`` (:func:`kernels.slots.triton.kronecker_topk_triton`:
softmaxes, search, product, renormalisation in one kernel, their gradient in one more); ``auto`` follows
the device plan (:func:`kernels.backend.resolve_backend`).
"""
from __future__ import annotations

import torch

from ..backend import resolve_backend, triton_fp64_unsupported
from ..common import at_least_fp32

#: the backends of :func:`kronecker_topk`
ADDRESS_BACKENDS = ("torch", "triton")


def kronecker_topk(logits: torch.Tensor, k: int, tau: float = 1.0, renormalize: bool = False,
                   straight_through: bool = False, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``logits (..., U, d_p)`` -> ``(idx (..., k) int64, weights (..., k))``, best first.

    ``weights`` are the product probabilities of the selected slots, in fp32 (fp64 for fp64 logits);
    ``renormalize``: divided by their sum; ``straight_through``: ``1/k`` forward, the gradient of the (possibly
    renormalised) product probabilities backward.
    """
    if logits.ndim < 2:
        raise ValueError(f"kronecker_topk: logits must have shape (..., U, d_p), got {tuple(logits.shape)}")
    U, dp = logits.shape[-2:]
    if not 1 <= k <= dp ** U:
        raise ValueError(f"kronecker_topk: k={k} must be in [1, d_p^U = {dp ** U}]; lower k or enlarge d_p / U")
    if tau <= 0:
        raise ValueError(f"kronecker_topk: tau must be positive, got {tau}")
    if resolve_backend(backend, logits, op="kronecker_topk", available=ADDRESS_BACKENDS,
                       unsupported=triton_fp64_unsupported(logits)) == "triton":
        from .triton import kronecker_topk_triton
        return kronecker_topk_triton(logits, k, tau, renormalize, straight_through)
    # softmax written out: torch.softmax over a last axis of a few logits is several times slower on CPU
    z = at_least_fp32(logits) / tau
    e = (z - z.detach().amax(-1, keepdim=True)).exp()
    p = e / e.sum(-1, keepdim=True)
    with torch.no_grad():
        kk = min(k, dp)
        digit = torch.arange(dp, device=logits.device)
        top_p, top_i = _largest_lower_first(p, kk, digit, dp ** U)  # (..., U, kk)
        val, idx = top_p[..., 0, :], top_i[..., 0, :]  # (..., c): partial products and slot numbers
        for u in range(1, U):
            cand = (val.unsqueeze(-1) * top_p[..., u, None, :]).flatten(-2)  # (..., c kk)
            cand_idx = (idx.unsqueeze(-1) * dp + top_i[..., u, None, :]).flatten(-2)
            val, pos = _largest_lower_first(cand, min(k, cand.shape[-1]), cand_idx, dp ** U)
            idx = cand_idx.gather(-1, pos)
        place = dp ** torch.arange(U - 1, -1, -1, device=logits.device)
        digits = idx.unsqueeze(-1) // place % dp  # (..., k, U)
    # differentiable weights: the product of the selected factor probabilities
    weights = torch.gather(p.unsqueeze(-3).expand(*digits.shape[:-1], U, dp), -1,
                           digits.unsqueeze(-1)).squeeze(-1).prod(-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if straight_through:
        weights = weights + (torch.full_like(weights, 1.0 / k) - weights).detach()
    return idx, weights


def _largest_lower_first(values: torch.Tensor, n: int, order: torch.Tensor,
                         order_bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` largest of nonnegative ``values`` along the last axis, best first, equal values by increasing
    ``order`` (distinct integers in ``[0, order_bound)``, broadcast to ``values``): ``(values, positions)``.
    ``torch.topk`` leaves the order of equal values unspecified (on a CPU it is not the lower position)."""
    if values.dtype == torch.float32 and order_bound <= 2 ** 32:
        # one top-k over distinct int64 keys: the bit pattern of a float >= 0 sorts as the float does
        key = (values.view(torch.int32).to(torch.int64) << 32) - order
        pos = key.topk(n, dim=-1).indices
    else:  # sort by order, then a stable sort by value
        by_order = order.expand_as(values).argsort(dim=-1)
        pos = by_order.gather(-1, values.gather(-1, by_order).argsort(dim=-1, descending=True, stable=True))[..., :n]
    return values.gather(-1, pos), pos


def kronecker_dense(logits: torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """The materialised product distribution ``(..., d_p^U)`` (for small ``M`` and for tests)."""
    p = torch.softmax(logits / tau, dim=-1)
    out = p[..., 0, :]
    for u in range(1, p.shape[-2]):
        out = (out.unsqueeze(-1) * p[..., u, None, :]).flatten(-2)
    return out
