"""zoo.host_memory: the glibc allocator tuning and the per-measurement peak of resident memory."""
from __future__ import annotations

import ctypes
import platform
import sys

import pytest
import torch

from zoo import host_memory

GLIBC_LINUX = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC_LINUX, reason="mallopt thresholds are glibc's")
def test_tune_allocator_sets_the_thresholds_once():
    assert host_memory.tune_allocator() is True
    assert host_memory.tune_allocator() is True  # idempotent
    # glibc accepts these values (mallopt returns 1): the same call the tuning makes
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(host_memory.M_MMAP_THRESHOLD, ctypes.c_int(host_memory.MMAP_THRESHOLD)) == 1


def test_peak_rss_sees_a_touched_buffer():
    """A 256 MiB tensor filled with ones inside the block raises the peak by about its size; an empty block
    raises it by far less."""
    nbytes = 256 * 2**20
    with host_memory.PeakRSS() as big:
        x = torch.ones(nbytes // 4)
        del x
    with host_memory.PeakRSS() as empty:
        pass
    if big.mib is None:
        pytest.skip("this kernel cannot reset the resident-set high-water mark")
    assert 0.9 * 256 <= big.mib <= 1.5 * 256
    assert empty.mib < 32


def test_cpu_seconds_grow_with_work():
    user0, sys0 = host_memory.cpu_seconds()
    a = torch.randn(256, 256)
    for _ in range(200):
        a = torch.tanh(a @ a.T / 256)
    user1, sys1 = host_memory.cpu_seconds()
    assert user1 + sys1 > user0 + sys0


def test_peak_rss_after_an_earlier_measurement_keeps_its_base():
    """A 64 MiB piece of work, then a 256 MiB one measured against the first one's base without releasing
    the heap in between: the second peak is about 256 MiB, not 256 minus what the first left free."""
    host_memory.tune_allocator()
    with host_memory.PeakRSS() as small:
        x = torch.ones(64 * 2**20 // 4)
        del x
    with host_memory.PeakRSS(after=small) as large:
        x = torch.ones(256 * 2**20 // 4)
        del x
    if small.mib is None:
        pytest.skip("this kernel cannot reset the resident-set high-water mark")
    assert 0.9 * 64 <= small.mib <= 1.5 * 64
    assert 0.9 * 256 <= large.mib <= 1.5 * 256
