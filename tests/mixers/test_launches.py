"""Few launches on a GPU: one layer's forward+backward on the CUDA code path launches a fixed number of
kernels, independent of the length, and at most :data:`MAX_LAUNCHES`.

The CUDA path is selected without a GPU (:func:`kernels.device.gpu_path_on_cpu`: backend ``auto`` picks what
it picks on CUDA, among the backends that can take CPU tensors); launches are counted as
:mod:`tests.mixers.launches` defines them, the Triton kernels counted but not run (the interpreter would take
minutes for the scans that walk the sequence; the kernels' values are tested against their references in
``tests/kernels``). Every registered mixer runs with its default options (backend ``auto``, chunk sizes the
device's) at a small width, at ``T`` and ``4 T``, both several chunks long. The CPU-only sizes (token
segments, cache-sized time blocks) are set tiny here, so that a CPU trick that leaked into the GPU path would
make the count grow with the length at these small sizes.

With the kernels not run, every allocation is poisoned (NaN, indices out of range: see
:func:`tests.mixers.launches.count_launches`), so the same test shows that no mixer's GPU path reads a value a
kernel wrote on the host or indexes with one: what lets :mod:`kernels.ahead` run a layer with its kernels
compiled instead of run, on a GPU, without an index out of range stopping the device.
"""
from __future__ import annotations

import pytest
import torch

import kernels.common
import mixers.conv_time_first
from kernels.device import gpu_path_on_cpu
from kernels.gla import gla
from kernels.slots import kronecker_topk
from mixers import MIXERS, build_mixer
from tests.mixers.launches import count_launches

#: the most kernels one layer's forward+backward may launch on a GPU
MAX_LAUNCHES = 100
D_MODEL = 64
LENGTHS = (128, 512)


@pytest.fixture
def tiny_cpu_sizes(monkeypatch):
    """Segments of 16 tokens and time blocks of 512 elements: several of each at these lengths."""
    monkeypatch.setattr(kernels.common, "SEGMENT", 16)
    monkeypatch.setattr(mixers.conv_time_first, "_BLOCK_ELEMENTS", 512)


def layer_launches(name: str, T: int):
    """``(launches, by name)`` of one forward+backward of mixer ``name`` (defaults, width 64) at length T."""
    layer = build_mixer(name, D_MODEL, {})
    x = torch.randn(1, T, D_MODEL, requires_grad=True)
    dy = torch.randn(1, T, D_MODEL)

    def fwd_bwd():
        layer(x).backward(dy)

    with gpu_path_on_cpu():
        return count_launches(fwd_bwd, execute=False)


@pytest.mark.parametrize("name", MIXERS.names())
def test_one_layer_launches_a_fixed_number_of_kernels(tiny_cpu_sizes, name):
    (short, by_short), (long, by_long) = (layer_launches(name, T) for T in LENGTHS)
    grown = {k: (by_short[k], by_long[k]) for k in by_short.keys() | by_long.keys() if by_short[k] != by_long[k]}
    assert short == long, f"{name}: {short} launches at T={LENGTHS[0]}, {long} at T={LENGTHS[1]}; grown: {grown}"
    assert short <= MAX_LAUNCHES, f"{name}: {short} launches per forward+backward (at most {MAX_LAUNCHES}): " \
                                  f"{dict(by_short.most_common())}"


def test_the_count_sees_a_cpu_trick(tiny_cpu_sizes):
    """The count is able to fail: the CPU path of a chunked kernel (segments, a loop over chunks) grows with
    the length, and the same call on the GPU path does not."""
    def run(T):
        q, k, v = (torch.randn(1, T, 2, 16, requires_grad=True) for _ in range(3))
        g = -torch.rand(1, T, 2)
        return count_launches(lambda: gla(q, k, v, g)[0].sum().backward(), execute=False)[0]

    short, long = LENGTHS
    assert run(long) > run(short)
    with gpu_path_on_cpu():
        assert run(long) == run(short)


def test_glue_indexing_with_an_unwritten_kernel_output_is_caught():
    """The poison is able to fail: indexing with slot addresses a kernel was to write raises when the kernel
    did not run (and not when it did)."""
    logits, values = torch.randn(2, 5, 2, 4), torch.randn(2, 5, 16)

    def address_and_gather():
        idx, _ = kronecker_topk(logits, 3, backend="triton")
        return values.gather(-1, idx)

    count_launches(address_and_gather)
    with pytest.raises(RuntimeError, match="out of bounds|out of range"):
        count_launches(address_and_gather, execute=False)
