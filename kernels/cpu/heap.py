"""What the engine's heap keeps after a prefill (glibc only; elsewhere nothing is changed).

glibc serves a block of at least its mmap threshold by mmap and unmaps it when freed. The threshold starts at 128 KiB
and rises to the size of every mmapped block freed (up to 32 MiB; the heap's trim threshold to twice that), so from
the first prefill on the engine's 512-row activations (2-11 MiB each) come from the heap, which keeps their pages once
they are freed: 55-60 MiB more resident after 512-token prefills at 16 layers (docs/PERF.md, CPU, session 15).
release_large_frees fixes the threshold (setting it stops the rise of both; the trim threshold stays at its 128 KiB
default), so blocks of LARGE_BLOCK bytes and more go back to the OS when freed. The smaller blocks of a prefill
(~30 MiB at 16 layers) are freed between live ones, where free() cannot trim: trim_after_forward hands their pages
back once, when the forward that ran a GEMM-path call ends (a lower threshold instead cost 10-20 % of a prefill).
"""

from __future__ import annotations

import ctypes
import functools
import platform
import weakref
from collections.abc import Callable

LARGE_BLOCK = 4 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter

# The engine's current forward: an object that lives exactly as long as one model forward (None outside one). The
# plugin sets it (vLLM's ForwardContext); unset, nothing is trimmed.
_forward: Callable[[], object | None] | None = None
_pending: weakref.ref | None = None  # the forward whose end already trims


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(None)
    libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return libc


@functools.cache
def release_large_frees() -> bool:
    """Once per process (on binding a layer): freed blocks of LARGE_BLOCK bytes and more go back to the OS at once
    instead of staying in the heap. True where set."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, LARGE_BLOCK))


def set_forward_scope(forward: Callable[[], object | None] | None) -> None:
    """Where trim_after_forward finds the engine's current forward (None: nowhere, nothing is trimmed)."""
    global _forward, _pending
    _forward, _pending = forward, None


def trim_after_forward(release: Callable[[], None] | None = None) -> None:
    """From a GEMM-path call: when the current forward ends, `release` (the caller's caches) and then the heap's free
    pages go back to the OS (malloc_trim(0), 2.4-3.7 ms after a 512-token prefill at 16 layers), once per forward.
    Decode steps (GEMV rows only) never trim."""
    global _pending
    libc = _libc()
    forward = _forward() if _forward is not None and libc is not None else None
    if forward is None or (_pending is not None and _pending() is forward):
        return
    weakref.finalize(forward, _forward_ended, libc, release).atexit = False
    _pending = weakref.ref(forward)


def _forward_ended(libc: ctypes.CDLL, release: Callable[[], None] | None) -> None:
    if release is not None:
        release()
    libc.malloc_trim(0)
