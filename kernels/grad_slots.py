"""Gradients written where autograd would concatenate them: a split whose backward copies nothing.

A tensor cut into parts along its last dimension (a layer's fused projection cut into ``q|k|v``, gates, an
output gate) gets each part's gradient from that part's consumer, and autograd's backward of the split then
concatenates them into a new tensor: one more pass over the activations, read and written, per split. Here
:func:`split_in_place` cuts the tensor and registers it; a consumer's backward that asks :func:`grad_slot` for
the gradient buffer of its input ``x`` gets, where ``x`` is a view of a registered tensor's columns that no
other consumer took, the same view of one buffer laid out like the whole tensor, and writes its gradient there;
the split's backward then finds those parts in place and returns the buffer, copying in only the gradients
that came from elsewhere and zero-filling the parts that got none. The values are those of the concatenation.

A slot is handed out once per region (two consumers of one part, whose gradients autograd sums, get one slot
between them at most), only for a view that covers whole rows of a block of columns, and only while the split's
backward has not run; the registration lives as long as the autograd graph that holds the split. A consumer
that does not ask, or asks for a tensor that is not a registered part, allocates its gradient as before: the
split copies it in.
"""
from __future__ import annotations

import threading
import weakref

import torch

#: False: :func:`split_in_place` is a plain split (autograd's own backward; for comparisons)
ENABLED = True

_lock = threading.Lock()
#: storage address -> weak references to the registrations of tensors on that storage
_registry: dict[int, list[weakref.ref]] = {}


class _Registration:
    """One split tensor: the tensor (held, so that its storage is not reused while its graph lives), its gradient
    buffer once a consumer asked for it, and the column ranges handed out. What a lookup compares is read once
    here: a lookup runs at every consumer's backward, on the host's critical path on a GPU."""

    def __init__(self, base: torch.Tensor):
        self.base, self.buffer, self.taken = base, None, []
        self.key = base.untyped_storage().data_ptr()
        self.dtype, self.device_index, self.offset = base.dtype, base.get_device(), base.storage_offset()
        self.width = base.shape[-1]
        self.rows = base.numel() // self.width if self.width else 0

    def columns(self, x: torch.Tensor) -> tuple[int, int] | None:
        """``[c0, c1)``: the columns of ``base`` that the view ``x`` covers in every row, or None when ``x`` is
        not such a view (other rows, a gap inside its columns, another dtype)."""
        if x.dtype != self.dtype or x.get_device() != self.device_index:
            return None
        width, numel = self.width, x.numel()
        start = x.storage_offset() - self.offset
        if numel == 0 or not 0 <= start < width:
            return None
        inner = sorted((s, n) for s, n in zip(x.stride(), x.shape) if n > 1 and s < width)
        extent = 1
        for stride, size in inner:          # dense inside a row: strides 1, n1, n1 n2, ...
            if stride != extent:
                return None
            extent *= size
        if start + extent > width or numel != extent * self.rows:
            return None
        return start, start + extent

    def slot(self, x: torch.Tensor) -> torch.Tensor | None:
        cols = self.columns(x)
        if cols is None or any(a < cols[1] and cols[0] < b for a, b in self.taken):
            return None
        self.taken.append(cols)
        if self.buffer is None:
            self.buffer = torch.empty_like(self.base, memory_format=torch.contiguous_format)
        offset = self.buffer.storage_offset() + x.storage_offset() - self.offset
        return self.buffer.as_strided(x.shape, x.stride(), offset)


def grad_slot(x: torch.Tensor) -> torch.Tensor | None:
    """An uninitialised buffer for the gradient of ``x`` inside the gradient of the registered tensor ``x`` is a
    part of (same shape and strides as ``x``), or None: the caller then allocates its own."""
    if not _registry or x.is_meta:
        return None
    key = x.untyped_storage().data_ptr()
    with _lock:
        for ref in _registry.get(key, ()):
            reg = ref()
            if reg is not None and reg.base is not None:    # (split_in_place registers contiguous tensors only)
                got = reg.slot(x)
                if got is not None:
                    return got
    return None


def empty_grad(x: torch.Tensor) -> torch.Tensor:
    """:func:`grad_slot` of ``x``, else a new contiguous tensor of its shape and dtype."""
    slot = grad_slot(x)
    return slot if slot is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _register(reg: _Registration) -> None:
    with _lock:
        live = [r for r in _registry.get(reg.key, ()) if r() is not None]
        _registry[reg.key] = live + [weakref.ref(reg)]


def _unregister(reg: _Registration) -> None:
    with _lock:
        live = [r for r in _registry.get(reg.key, ()) if r() is not None and r() is not reg]
        if live:
            _registry[reg.key] = live
        else:
            _registry.pop(reg.key, None)


class _SplitInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, sizes):
        ctx.set_materialize_grads(False)    # a part without a gradient comes as None: zero-filled in place
        ctx.registration = _Registration(y)
        ctx.sizes, ctx.like = sizes, (y.shape, y.dtype, y.device)
        _register(ctx.registration)
        return tuple(y.split(sizes, -1))

    @staticmethod
    def backward(ctx, *grads):
        reg, (shape, dtype, device) = ctx.registration, ctx.like
        _unregister(reg)                    # (a second backward through a retained graph gets no slots)
        out, reg.base, reg.buffer = reg.buffer, None, None
        if out is None:                     # no consumer wrote in place: one concatenation, as a plain split's
            parts = [g if g is not None else torch.zeros(shape[:-1] + (size,), dtype=dtype, device=device)
                     for g, size in zip(grads, ctx.sizes)]
            return torch.cat(parts, -1), None
        lead, item, at = shape[:-1], out.element_size(), out.data_ptr()
        strides, start = out.stride(), 0
        for g, size in zip(grads, ctx.sizes):
            if g is None:
                out[..., start:start + size].zero_()
            elif not _is_view_at(g, at + start * item, strides, lead + (size,)):
                out[..., start:start + size].copy_(g)
            start += size
        return out, None


def _is_view_at(a: torch.Tensor, address: int, strides: tuple, shape: tuple) -> bool:
    """Whether ``a`` is the view of ``shape`` and ``strides`` that starts at ``address``: the same elements in the
    same order (checked without making that view). Strides of dimensions of size 1 do not matter: a slot read as
    another view of one row (batch 1, one token) carries other ones there."""
    if a.shape != shape:
        return False
    if a.numel() == 0:
        return True
    return a.data_ptr() == address and all(sa == sb for sa, sb, n in zip(a.stride(), strides, shape) if n > 1)


def split_in_place(y: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """``y.split(sizes, -1)`` whose backward returns one buffer that the parts' consumers may have written their
    gradients into (:func:`grad_slot`). Without autograd (no gradient, or ``y`` not contiguous) a plain split."""
    if not (ENABLED and torch.is_grad_enabled() and y.requires_grad and y.is_contiguous()) or y.device.type == "meta":
        return list(y.split(sizes, -1))     # (a meta tensor's storage has no address to find it by)
    return list(_SplitInPlace.apply(y, list(sizes)))
