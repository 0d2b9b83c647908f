"""The bytes the C allocator has handed out and not taken back: glibc's ``mallinfo2``, through ctypes.

What it measures: ``uordblks + hblkhd`` of glibc's ``mallinfo2()`` (glibc >= 2.33), the bytes of every
chunk now in use in all malloc arenas plus the bytes of chunks served by their own ``mmap``. On a CPU,
PyTorch's tensors take their storage from this allocator (there is no caching allocator in between), so
a difference of two readings around a block of code is what the block's tensors still hold at its end,
whoever holds them: saved activations, a storage only a saved view keeps, buffers inside gloo. Nothing
has to be registered or traced, which is why it catches what counting by hand misses. It also counts
everything else the process mallocs (Python objects, other threads), so read differences, after
``gc.collect()``, around code whose tensors dominate; chunk headers and alignment add up to tens of bytes
per allocation. It is not the resident set: freed heap memory may stay mapped (``malloc_trim`` returns it).

Overhead: one call walks the free lists of every arena under its lock, microseconds to a millisecond as
fragmentation grows; it allocates nothing. Elsewhere than glibc (macOS, musl) it is unavailable:
:func:`malloc_in_use_bytes` returns ``None`` and callers skip the measurement.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

__all__ = ["malloc_in_use_bytes"]


class _Mallinfo2(ctypes.Structure):
    # glibc's struct mallinfo2: ten size_t fields, in this order (malloc.h).
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


@cache
def _mallinfo2() -> ctypes._CFuncPtr | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else ctypes.CDLL(None)
        fn = libc.mallinfo2
    except (OSError, AttributeError):  # not glibc, or a glibc older than 2.33
        return None
    fn.restype, fn.argtypes = _Mallinfo2, []
    return fn


def malloc_in_use_bytes() -> int | None:
    """Bytes now allocated through glibc's malloc (arenas and mmapped chunks), or ``None`` without glibc."""
    fn = _mallinfo2()
    if fn is None:
        return None
    info = fn()
    return int(info.uordblks + info.hblkhd)
