"""Kronecker-addressed slot memory with power-decay moving averages (Xiao et al., "RAM-Net",
arXiv 2602.11958).

    (W_t, w_t) = top-K of softmax(k_t^(1)/tau) (x) ... (x) softmax(k_t^(U)/tau)     (kronecker_topk)
    S_t = diag(1 - w_t)^gamma S_{t-1} + w_t v_t^T,   z_t = diag(1 - w_t)^gamma z_{t-1} + w_t
    o_t = sum_m r_{t,m} S_t[m] / (z_t[m] + eps)                                    (slot_memory)

Backends of :func:`slot_memory` (:data:`BACKENDS`): ``reference`` (token loop over the dense
``M x d_v`` memory, via the decode step :func:`slot_step`), ``torch`` in one of two layouts
(:data:`LAYOUTS`): ``layout="dense"``, chunked, the intra-chunk interactions gathered at the ``K`` read
slots and a dense ``M x d_v`` state passed between chunks, for small and moderate ``M``;
``layout="sparse"``, a sequential scan that touches only ``K`` rows per token, for large ``M``;
``layout="auto"`` picks dense when ``M <= DENSE_MAX_SLOTS``), and ``triton`` (Triton kernels, forward and
backward: chunk-parallel for ``M <= kernels.slots.triton.CHUNKED_MAX_SLOTS``, the sparse scan above).
``auto`` means Triton on CUDA, else torch. ``chunk_size`` is the chunk length of both chunked paths.
:func:`kronecker_topk` has a ``torch`` and a ``triton`` backend (:data:`ADDRESS_BACKENDS`; one kernel each way,
for any number of addresses), ``auto`` choosing as for the memory.
"""
from __future__ import annotations

import torch

from ..backend import resolve_backend
from ..common import check_chunk_size, full_precision
from ..launch import kernels_run
from .addressing import ADDRESS_BACKENDS, kronecker_dense, kronecker_topk
from .chunked import slot_memory_chunked
from .reference import init_slot_state, slot_memory_reference, slot_step
from .sparse import slot_memory_sparse

__all__ = ["slot_memory", "kronecker_topk", "kronecker_dense", "slot_step", "init_slot_state",
           "slot_memory_reference", "slot_memory_chunked", "slot_memory_sparse", "DENSE_MAX_SLOTS",
           "BACKENDS", "ADDRESS_BACKENDS", "LAYOUTS"]

#: ``layout="auto"`` uses the dense chunked path up to this many slots. The chunked path costs
#: O(T (C K d_v + M d_v)) per head (the chunk-start states are M x d_v per chunk of C tokens), the sparse
#: scan O(T K d_v) in a Python loop over T. Measured on one CPU thread, fwd+bwd of the memory kernel at
#: B = 1, T = 2048, H = 2, d_v = 64, K = 4, C = 32: chunked 58 / 253 / 980 ms, sparse 259 / 255 / 269 ms
#: at M = 256 / 1024 / 4096: equal near M = 1024, and the chunked path saves M (d_v + 1) / C per token.
DENSE_MAX_SLOTS = 512

#: the backends of :func:`slot_memory` (``auto`` picks among them); mixers offer these
BACKENDS = ("reference", "torch", "triton")
#: the memory layouts of the torch backend
LAYOUTS = ("auto", "dense", "sparse")


def _check(write_idx, write_w, read_idx, read_w, v, gamma, num_slots):
    if v.ndim != 4:
        raise ValueError(f"slot_memory: v must be (B, T, H, d_v), got shape {tuple(v.shape)}")
    B, T, H, _ = v.shape
    for name, x in (("write_idx", write_idx), ("write_w", write_w), ("read_idx", read_idx), ("read_w", read_w)):
        if x.ndim != 4 or tuple(x.shape[:3]) != (B, T, H):
            raise ValueError(f"slot_memory: {name} must be (B, T, H, K) = ({B}, {T}, {H}, K), got {tuple(x.shape)}")
    if write_idx.shape != write_w.shape or read_idx.shape != read_w.shape:
        raise ValueError("slot_memory: indices and weights must have the same shape (B, T, H, K)")
    if write_idx.dtype != torch.int64 or read_idx.dtype != torch.int64:
        raise TypeError("slot_memory: slot indices must be int64 (as returned by kronecker_topk)")
    if gamma.shape != (H,):
        raise ValueError(f"slot_memory: gamma must have shape (H,) = ({H},), got {tuple(gamma.shape)}")
    if num_slots < write_idx.shape[-1]:
        raise ValueError(f"slot_memory: K={write_idx.shape[-1]} exceeds num_slots={num_slots}")
    named = {"write_idx": write_idx, "write_w": write_w, "read_idx": read_idx, "read_w": read_w, "v": v, "gamma": gamma}
    elsewhere = [name for name, x in named.items() if x.device != v.device]
    if elsewhere:
        raise ValueError(f"slot_memory: {', '.join(elsewhere)} on another device than v ({v.device}); "
                         "move every input to one device")
    for name, idx in (("write_idx", write_idx), ("read_idx", read_idx)):
        # on the CPU only: on a GPU the check would wait for the device at every call (indices from
        # kronecker_topk are in range by construction); and only where kernels run (else indices that a kernel
        # would have written are uninitialised)
        if idx.device.type != "cpu" or not idx.numel() or not kernels_run():
            continue
        low, high = int(idx.min()), int(idx.max())
        if low < 0 or high >= num_slots:
            raise ValueError(f"slot_memory: {name} holds slot {low if low < 0 else high}, "
                             f"outside 0..{num_slots - 1} (num_slots={num_slots}); pass slot numbers below "
                             f"num_slots, as kronecker_topk returns them")
    # a slot written twice in one token has no single decay (the backends resolve it differently); a slot read
    # twice is well defined (its value is read with both weights)
    if write_idx.device.type == "cpu" and write_idx.shape[-1] > 1 and write_idx.numel() and kernels_run():
        ordered = write_idx.sort(-1).values
        if (ordered[..., 1:] == ordered[..., :-1]).any():
            raise ValueError("slot_memory: write_idx repeats a slot within one token; the K slots a token writes "
                             "must be distinct, as kronecker_topk returns them")


@full_precision
def slot_memory(write_idx, write_w, read_idx, read_w, v, gamma, num_slots: int, eps: float = 1e-6,
                chunk_size: int = 32, initial_state=None, backend: str = "auto", layout: str = "auto"):
    """Returns ``(o (B, T, H, d_v), (S_T (B, H, M, d_v), z_T (B, H, M)))``: ``o`` in ``v``'s dtype, the state in
    :func:`kernels.common.state_dtype` of it, ``torch.promote_types(v.dtype, torch.float32)`` (fp32 for 16-bit
    inputs, on every backend), so that a state passed to the next call is not rounded to 16 bits; an fp32
    ``initial_state`` is read as it is.

    ``write_idx, read_idx (B, T, H, K)`` int64 in ``0..M-1`` (checked on the CPU), the written ones distinct within
    a token (checked on the CPU),
    ``write_w, read_w (B, T, H, K)``, ``v (B, T, H, d_v)``, ``gamma (H,)`` positive, ``num_slots`` = M;
    ``initial_state = (S, z)`` or None.
    ``layout`` selects the torch path (ignored by the other backends).
    """
    _check(write_idx, write_w, read_idx, read_w, v, gamma, num_slots)
    check_chunk_size("slot_memory", chunk_size)
    if layout not in LAYOUTS:
        raise ValueError(f"slot_memory: unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    chosen = resolve_backend(backend, v, op="slot_memory", available=BACKENDS)
    args = (write_idx, write_w, read_idx, read_w, v, gamma, num_slots)
    if chosen == "reference":
        return slot_memory_reference(*args, eps=eps, initial_state=initial_state)
    if chosen == "triton":
        from .triton import slot_memory_triton
        return slot_memory_triton(*args, eps=eps, initial_state=initial_state, chunk_size=chunk_size)
    if layout == "dense" or (layout == "auto" and num_slots <= DENSE_MAX_SLOTS):
        return slot_memory_chunked(*args, eps=eps, chunk_size=chunk_size, initial_state=initial_state)
    return slot_memory_sparse(*args, eps=eps, initial_state=initial_state)
