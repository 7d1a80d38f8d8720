"""Host (CPU) memory: keep large tensor buffers in the process between calls, and measure peak RSS.

PyTorch's CPU allocator hands every tensor to the C library's ``malloc``. glibc serves a request above
its mmap threshold (adaptive, but capped at 32 MiB on 64-bit) with a fresh ``mmap`` and returns it with
``munmap`` when the tensor is freed. At long sequence lengths many intermediates of one forward+backward
are larger than that, so every call maps them anew and the kernel faults in (and zeroes) every page on
first touch: at ``T = 65536`` a single mixer's forward+backward then spends more time in the kernel
(system time, over a million minor page faults) than in arithmetic, and the cost per token grows with ``T``.

:func:`tune_allocator` raises glibc's mmap threshold and trim threshold (``mallopt``) so that such
buffers come from the heap and are reused by the next call instead of being unmapped; freed memory stays
with the process (up to the trim threshold above the heap top). It is a no-op on any other C library
(macOS, musl, Windows) and returns ``False`` there. ``zoo bench`` and training call it once at start.

:class:`PeakRSS` measures the peak host memory of one piece of work: it gives freed heap memory back
(``malloc_trim``), notes the resident set size, resets the kernel's high-water mark (``/proc/self/clear_refs``,
Linux) and afterwards reads it again (``VmHWM``); the difference is the memory the work needed on top of what
was live before it. Where the reset is not available it reports ``None`` (the process-wide ``ru_maxrss``
only ever grows and cannot be attributed to one measurement).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
import resource
import sys

#: mallopt parameter numbers from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: requests below this come from the heap and are reused; above it they are mapped per call
MMAP_THRESHOLD = 1 << 30
#: free memory at the heap top kept by the process instead of being given back to the OS
TRIM_THRESHOLD = 1 << 30

_tuned: bool | None = None


@functools.lru_cache(maxsize=None)
def _glibc():
    """The C library when it is glibc (loaded once; every peak measurement calls ``malloc_trim``), else None."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def tune_allocator(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); ``True`` when they are set.

    glibc caps the mmap threshold at ``HEAP_MAX / 2`` (32 MiB on 64-bit) when it is tuned adaptively,
    but takes any value given explicitly through ``mallopt``. Setting it also turns the adaptive tuning off.
    """
    global _tuned
    if _tuned is not None:
        return _tuned
    libc = _glibc()
    if libc is None:
        _tuned = False
        return False
    ok = libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(mmap_threshold)) == 1
    ok = libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(trim_threshold)) == 1 and ok
    _tuned = ok
    return ok


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def release_free_memory() -> None:
    """Give the C library's free heap memory back to the OS (glibc ``malloc_trim``; no-op elsewhere)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


class PeakRSS:
    """``with PeakRSS() as p: work()`` then ``p.mib``: the peak resident memory of ``work`` above the
    resident memory before it, in MiB, or ``None`` where the kernel's high-water mark cannot be reset.

    ``PeakRSS(after=earlier)`` measures a second piece of work against the base of an ``earlier`` one
    without giving the free heap back in between (each release costs page faults to map the memory in
    again): right for work that needs at least as much memory as the earlier piece left free in the heap,
    which the second piece then reuses.
    """

    def __init__(self, after: PeakRSS | None = None):
        self.mib: float | None = None
        self._after = after
        self._base: int | None = None

    def __enter__(self):
        if self._after is None:
            release_free_memory()
        elif self._after._base is None:
            return self
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current VmRSS
        except OSError:
            return self
        self._base = _status_kib("VmRSS") if self._after is None else self._after._base
        return self

    def __exit__(self, *exc):
        peak = _status_kib("VmHWM")
        if self._base is not None and peak is not None:
            self.mib = max(peak - self._base, 0) / 2**10
        return False


def peak_rss_mib() -> float:
    """The process's peak resident set size so far, in MiB (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def cpu_seconds() -> tuple[float, float]:
    """``(user, system)`` CPU seconds of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime
