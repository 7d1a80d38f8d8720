"""Small tensor helpers shared by every kernel family (one home for each idiom).

- :func:`compute_dtype` / :func:`at_least_fp32`: statistics, scans and solves run in fp32, but an fp64
  input (a reference or contract check) stays fp64 — never downcast a reference computation.
- :func:`state_dtype` / :func:`as_state`: the one rule for the final state of every state-carrying op, on every
  backend: ``torch.promote_types(input dtype, torch.float32)`` (fp32 for fp16 / bf16 / fp32 inputs, fp64 for
  fp64), while the output keeps the input dtype. The state accumulates in fp32 inside the kernels anyway; handed
  back so, a state passed from one call to the next (chunked prefill, streaming) is never rounded to 16 bits at
  a boundary.
- :func:`segment_log_decays`: the log of the causal decay mask of a chunk, each entry summed over its own
  segment of per-step log decays (accurate where strong and weak decays share a chunk, and in its gradient).
- :func:`causal_decay_mask`: ``exp(G_t - G_s)`` for ``s <= t`` within a chunk, from inclusive cumulative
  log decays, for a caller that holds only those (the references of the Triton stages, which form the decays
  so). The differences ``G_t - G_s`` are formed directly, never as ``e^{G_t} / e^{G_s}``, so strong decays over
  long chunks do not overflow; but they keep only ``G``'s rounding, which :func:`segment_log_decays` avoids.
- :func:`pad_time` / :func:`chunk_count`: pad the time axis (dim 1) to a multiple of the chunk length.
- :func:`in_segments` / :data:`SEGMENT`: on the CPU plan (:mod:`kernels.device`), run a chunked path over a
  long sequence in segments of whole chunks with the recurrent state carried from one to the next, so that
  every full-length intermediate (decay masks, chunk states, their gradients) is at most one segment long:
  the cost per token and the size of every temporary buffer no longer grow with ``T``, and the result is
  the same function. On the GPU plan the whole sequence is one call (each segment would be a fixed
  number of kernel launches more).
- :func:`pow2` / :func:`cdiv`: a power-of-two tile size and a grid's extent, from the host.
- :func:`as_rows` / :func:`token_stride` / :func:`unit_last`: how a kernel reads a column block of a wider tensor in
  place.
- :func:`autocast_dtype` / :func:`linear_input_dtype`: the dtype an autocast region computes linear layers in,
  so that a tensor headed only for a linear layer is produced in it instead of being cast there;
  :func:`autocast_off` switches it off for one device.
- :func:`full_precision`: the public op of a recurrent family runs with autocast off, so a bf16
  autocast region (mixed-precision training) hands it bf16 inputs that it computes in fp32 instead of
  having matmuls inside the scan silently dropped to bf16 next to fp32 decays.
"""
from __future__ import annotations

import contextlib
import functools
import math
import numbers

import torch
import torch.nn.functional as F

from .device import plan_for


def pow2(n: int, lo: int = 1) -> int:
    """The smallest power of two >= ``max(n, lo)``: a tile size (Triton's ``next_power_of_2`` is a constexpr
    function, several times slower to call from a launcher, which runs at every call)."""
    return 1 << (max(int(n), lo, 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for a launch grid (Triton's ``cdiv`` is a constexpr function, slower to call from the host)."""
    return -(-int(a) // int(b))


def compute_dtype(*dtypes) -> torch.dtype:
    """fp32 for half / bf16 / fp32 inputs, fp64 for fp64 inputs.

    Takes one or more dtypes (or tensors, or None, which are skipped) and promotes them all together
    with fp32: ``compute_dtype(q.dtype)``, ``compute_dtype(q, k, g_or_none)``.
    """
    out = torch.float32
    for d in dtypes:
        if d is not None:
            out = _promoted(out, d.dtype if torch.is_tensor(d) else d)
    return out


@functools.lru_cache(maxsize=None)
def _promoted(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """``torch.promote_types``, remembered: the launchers ask at every call, and each torch call is a dispatch the
    host pays for on a GPU."""
    return torch.promote_types(a, b)


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in :func:`compute_dtype` of its dtype (a no-op for fp32 and fp64)."""
    return x.to(compute_dtype(x.dtype))


def state_dtype(x) -> torch.dtype:
    """The dtype of the final state a state-carrying op returns for inputs of ``x``'s dtype (``x`` a tensor or a
    dtype): ``torch.promote_types(dtype, torch.float32)``."""
    return _promoted(x.dtype if torch.is_tensor(x) else x, torch.float32)


def as_state(state, like):
    """The final ``state`` (a tensor, or a tuple / list of them) in :func:`state_dtype` of ``like``: the cast
    every backend applies to the state it returns (a no-op where it has that dtype already; differentiable, so
    an fp32 gradient of the state flows into the backward)."""
    dtype = state_dtype(like)
    if torch.is_tensor(state):
        return state.to(dtype)
    return tuple(s.to(dtype) for s in state)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t (..., D)`` as a ``(rows, D)`` matrix with any row stride (the column block of a wider projection is
    read in place), copied only when its last dimension is strided or its leading ones cannot be merged: what
    a row-wise Triton kernel addresses as ``row * stride + column``."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:                                 # leading dims that cannot be merged
        return t.contiguous().view(-1, t.shape[-1])


def unit_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its last dimension, copied only where it has not (the other strides stay: a
    kernel that takes them reads a column block of a wider tensor in place; its vector loads need the unit one)."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def standard_strides(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous with the strides of a new tensor of its shape, copied only where it is not contiguous.
    ``contiguous()`` alone keeps any stride of a size-1 dimension (a one-token view of a heads-first tensor counts
    as contiguous), and a kernel that takes the strides would address its rows by them."""
    return t.contiguous().view(-1).view(t.shape)


def token_stride(x: torch.Tensor) -> int | None:
    """The stride between tokens of ``x (B, T, H, n)`` when a kernel can address it as rows ``(b T + t) stride
    + h n + i`` (the ``H n`` entries of a token contiguous, batches ``T`` tokens apart), else None. A slice of a
    wider tensor, such as the value columns of a layer's fused projections, qualifies without a copy."""
    return token_stride_of(x.shape, x.stride())


def token_stride_of(shape, stride) -> int | None:
    """:func:`token_stride` of a ``(B, T, H, n)`` layout given as its sizes and strides (a view's, without making
    the view)."""
    B, T, H, n = shape
    ok = (n == 1 or stride[3] == 1) and (H == 1 or stride[2] == n) and (B == 1 or stride[0] == T * stride[1])
    return stride[1] if ok else None


def check_layout(op: str, sizes: dict[str, int] | None = None, **tensors) -> dict[str, int]:
    """Refuse, in one line naming ``op`` and the tensor, inputs whose shapes disagree with their layouts. Each
    keyword is ``name=(tensor or None, "B T H K")``: a dimension name must have one size across every tensor (the
    first tensor that has it sets it, or ``sizes`` from an earlier call). Returns the sizes by name. The kernels
    index by the sizes of their first inputs, so a mismatched tensor would be read out of its bounds instead of
    failing."""
    sizes = dict(sizes or {})
    for name, (t, layout) in tensors.items():
        if t is None:
            continue
        dims = layout.split()
        if t.dim() != len(dims):
            raise ValueError(f"{op}: {name} must be ({', '.join(dims)}), got a {t.dim()}-d tensor of shape "
                             f"{tuple(t.shape)}")
        for dim, n in zip(dims, t.shape):
            if sizes.setdefault(dim, n) != n:
                raise ValueError(f"{op}: {name} of shape {tuple(t.shape)} must be ({', '.join(dims)}) with {dim} = "
                                 f"{sizes[dim]}, as the tensors before it have")
    return sizes


def check_chunk_size(op: str, chunk_size) -> None:
    """Refuse, in one line naming ``op``, a ``chunk_size`` that is not a positive integer. The chunked paths
    divide and reshape by it (a zero or a negative one failed there in a ``ZeroDivisionError`` or a shape error),
    while the reference and some Triton paths never read it: checked once, before a backend is chosen, every
    backend refuses what one refuses."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be a positive integer, got {chunk_size!r}")


def no_decay(v: torch.Tensor) -> torch.Tensor:
    """The zero log decays ``(B, T, H)`` of a gated op's ``g`` given as None (no forget gate), for values
    ``v (B, T, H, d_v)`` (of another rank: none, for the op's layout check to name), in :func:`compute_dtype`
    of ``v``."""
    return torch.zeros(v.shape[:3], dtype=compute_dtype(v), device=v.device) if v.dim() == 4 else None


def causal_mask(size: int, device=None) -> torch.Tensor:
    """Lower-triangular boolean ``(size, size)`` mask, ``True`` where ``s <= t``."""
    return torch.ones(size, size, dtype=torch.bool, device=device).tril()


def segment_log_decays(g: torch.Tensor) -> torch.Tensor:
    """``S[..., t, s] = sum_{s<r<=t} g_r`` for ``s <= t`` (0 on the diagonal), ``-inf`` above it, from the
    per-step log decays ``g (..., C)`` of a chunk; ``S.exp()`` is the causal decay mask, ``S[..., -1, :]`` the
    log decay from each step to the chunk's end.

    Each sum adds the steps of its own segment (a masked cumulative sum, as Mamba-2's ``segsum``): its rounding
    is relative to the segment, and its gradient reaches ``g_r`` from the segments that hold ``r`` alone. As
    ``G_t - G_s`` of the cumulative sums, a step of -0.02 after one of -30 in the chunk kept only ~3 digits
    (``G`` ~ -1000 rounds to 6e-5), and the gradient of a step of -50 (``e^{-50}``-sized) was the difference of
    O(1) sums, i.e. rounding noise, in fp64 as in fp32.
    """
    C = g.shape[-1]
    later = causal_mask(C, g.device).tril(-1)                           # [r, s]: r > s
    steps = g.unsqueeze(-1).expand(*g.shape, C).masked_fill(~later, 0.0)  # [r, s] = g_r where r > s
    return steps.cumsum(-2).masked_fill(~causal_mask(C, g.device), float("-inf"))


def cumulative_log_mask(G: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``L[..., t, s, ...] = G_t - G_s`` for ``s <= t``, else ``-inf``: the log of :func:`causal_decay_mask`.

    ``G`` holds inclusive cumulative log decays along ``dim`` (the within-chunk time axis); the result has that
    axis replaced by two, ``t`` then ``s``. It is :func:`segment_log_decays` for a caller that holds only ``G``.
    """
    dim = dim % G.ndim
    seg = G.unsqueeze(dim + 1) - G.unsqueeze(dim)  # [..., t, s, ...] = G_t - G_s
    C = G.shape[dim]
    shape = [1] * seg.ndim
    shape[dim], shape[dim + 1] = C, C
    anti_causal = ~causal_mask(C, G.device).reshape(shape)
    return seg.masked_fill_(anti_causal, float("-inf"))


def causal_decay_mask(G: torch.Tensor, dim: int = 2) -> torch.Tensor:
    """``M[..., t, s, ...] = exp(G_t - G_s)`` for ``s <= t``, else 0.

    ``G`` holds inclusive cumulative log decays along ``dim`` (the within-chunk time axis); the result
    has that axis replaced by two, ``t`` then ``s``: ``G (b, n, C, h)`` with ``dim=2`` gives
    ``(b, n, C, C, h)``. A caller with the per-step decays takes ``segment_log_decays(g).exp()`` instead:
    accurate where strong and weak decays share a chunk, and in its gradient.
    """
    return cumulative_log_mask(G, dim).exp_()


def pad_time(x: torch.Tensor, multiple: int, value: float = 0.0) -> torch.Tensor:
    """Pad dim 1 (time) of ``x`` at the end to a multiple of ``multiple``."""
    pad = (-x.shape[1]) % multiple
    if not pad:
        return x
    spec = [0, 0] * (x.ndim - 2) + [0, pad]
    return F.pad(x, spec, value=value)


def heads_first(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``(b, n*chunk, h, *rest)`` -> ``(b, h, n, chunk, *rest)`` (a view; batched matmuls then run per
    (batch, head, chunk) without the permute copies an einsum over a trailing head axis makes)."""
    b, T, h = x.shape[:3]
    return x.reshape(b, T // chunk, chunk, h, *x.shape[3:]).movedim(3, 1)


def time_first(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`heads_first`: ``(b, h, n, chunk, *rest)`` -> ``(b, n*chunk, h, *rest)``."""
    b, h, n, c = x.shape[:4]
    return x.movedim(1, 3).reshape(b, n * c, h, *x.shape[4:])


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype when autocast is on for ``device_type`` (cpu or cuda), else None."""
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def autocast_off(device_type: str):
    """A context with autocast switched off for ``device_type`` where it is on, else one that does nothing (a
    device without autocast, ``meta`` say, has no switch)."""
    if autocast_dtype(device_type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def linear_input_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer computes ``x`` in: the autocast dtype inside an autocast region (for a
    floating ``x``), else ``x``'s own. A tensor produced in it enters the layer without a cast (forward) and
    leaves the layer's backward without one; its values are those the cast would give."""
    dtype = autocast_dtype(x.device.type) if x.is_floating_point() else None
    return dtype or x.dtype


def full_precision(fn):
    """Decorator: run ``fn`` with CPU and CUDA autocast disabled (it casts to :func:`compute_dtype` itself)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)
    return wrapper


#: time steps per segment of :func:`in_segments` on the CPU plan (rounded down to whole chunks by
#: :func:`segment_length`); read at call time, so a test may set a tiny value
SEGMENT = 4096


def segment_length(chunk_size: int, multiple: int = 1) -> int:
    """:data:`SEGMENT` rounded down to a multiple of ``chunk_size`` (and of ``multiple``), at least one chunk."""
    unit = math.lcm(chunk_size, multiple)
    return max(unit, SEGMENT // unit * unit)


def in_segments(fn, inputs, state, length: int, dim: int = 1):
    """``fn(*pieces, state) -> (out, state)`` over consecutive pieces of ``length`` steps along ``dim`` of
    every tensor in ``inputs`` (a ``None`` passes through as ``None``), the state of one piece handed to the
    next; returns ``(out, final state)`` with the pieces' outputs concatenated along ``dim``.

    One call of ``fn`` when the sequence is at most ``length`` long, and always on the GPU plan
    (:func:`kernels.device.plan_for` of the first input). The pieces are views (``split``), so autograd
    sees a split and a concatenation: the gradients flow as through one call.
    """
    first = next(x for x in inputs if x is not None)
    T = first.shape[dim]
    if T <= length or plan_for(first).one_pass:
        return fn(*inputs, state)
    pieces = [x.split(length, dim) if x is not None else None for x in inputs]
    n = -(-T // length)
    outs = []
    for i in range(n):
        out, state = fn(*(p[i] if p is not None else None for p in pieces), state)
        outs.append(out)
    return torch.cat(outs, dim=dim), state
