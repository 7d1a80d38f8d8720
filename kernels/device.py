"""Device choices in one place: what the CPU path and the GPU path of a kernel or layer do differently.

A CPU runs one core's worth of work at a time and wins by keeping operands in its caches: long sequences
go through in segments of whole chunks (:func:`kernels.common.in_segments`), element-wise passes in time
blocks sized for a core's L2 cache, states cross chunks in a Python loop, and small chunks are fastest. A
GPU loses by every one of these: each piece is one more kernel launch (tens of microseconds of CPU time
for microseconds of GPU work), so on CUDA every such pass runs once over the whole tensor, and the chunk
sizes are those that fill a tensor-core tile.

Every kernel family and mixer reads its choices from :func:`plan_for` (the plan of its inputs' device),
never from ``tensor.is_cuda`` directly. :func:`gpu_path_on_cpu` selects the GPU plan for CPU tensors, so
the test-suite runs the code that runs on CUDA (Triton kernels through the interpreter) without a GPU.

Where the plan is read: ``backend="auto"`` (:func:`kernels.backend.resolve_backend`), the segments of
:func:`kernels.common.in_segments`, the state pass across chunks (:mod:`kernels.scan`), the short
convolution (:mod:`mixers.conv_time_first`), the mixers' normalisations, gates and projections
(:mod:`mixers.layers`, :mod:`mixers.l2norm`) and the unset ``chunk_size`` options
(:func:`mixers.options.chunk_size_for`).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from types import MappingProxyType

import torch


@dataclass(frozen=True)
class DevicePlan:
    """The choices that differ between devices (``None`` where the GPU does a thing in one pass)."""

    name: str                                 # "cpu" or "gpu"
    #: every pass over the whole tensor at once: no segments, no cache-sized time blocks, no Python loop
    #: over chunks (each site keeps its CPU sizes beside its code and asks this flag)
    one_pass: bool
    chunk_sizes: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))

    @property
    def gpu(self) -> bool:
        return self.name == "gpu"

    def chunk_size(self, family: str, default: int = 64) -> int:
        """The default chunk length of ``family`` (a mixer's ``chunk_size`` option left at ``None``)."""
        return self.chunk_sizes.get(family, default)


#: the CPU plan: chunk lengths measured fastest on a CPU (small chunks keep the per-chunk matrices in cache;
#: these are the lengths the mixers' ``chunk_size`` options defaulted to before they followed the device,
#: so recorded recipes keep their meaning, see :func:`mixers.options.chunk_size_opt`)
CPU = DevicePlan("cpu", one_pass=False,
                 chunk_sizes=MappingProxyType({"delta": 32, "gka": 32, "ssd": 32, "slots": 32, "gla": 64,
                                               "blockscan": 64}))
#: the GPU plan: one pass per stage, chunks of 64 that fill tensor-core tiles (a 64 x 64 ``tl.dot`` per
#: chunk; flash-linear-attention's chunk kernels use 64 as well)
GPU = DevicePlan("gpu", one_pass=True)

_forced: contextvars.ContextVar[DevicePlan | None] = contextvars.ContextVar("forced_device_plan", default=None)


def plan_for(x: torch.Tensor | torch.device | str) -> DevicePlan:
    """The plan for the device of ``x`` (a tensor or a device): :data:`GPU` on CUDA, else :data:`CPU`,
    unless :func:`gpu_path_on_cpu` is active."""
    forced = _forced.get()
    if forced is not None:
        return forced
    device = x.device if torch.is_tensor(x) else torch.device(x)
    return GPU if device.type == "cuda" else CPU


@contextlib.contextmanager
def gpu_path_on_cpu():
    """Within this block every tensor gets the GPU plan: CPU tensors take the code path CUDA tensors take
    (with ``TRITON_INTERPRET=1``, the Triton kernels run through the interpreter). For tests and tools."""
    token = _forced.set(GPU)
    try:
        yield GPU
    finally:
        _forced.reset(token)
