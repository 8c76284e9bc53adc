"""What the engine's heap keeps after a prefill (kernels/cpu/heap.py, glibc only). Each check runs in a fresh
interpreter: in a test worker the heap holds whatever earlier tests freed (glibc serves a large request from a free
heap chunk before it looks at the mmap threshold), and the process-wide allocator settings would outlive the test."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the heap settings are glibc's")


def _run(script: str, mode: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-P", "-c", script, mode], cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


_BLOCK_PLACEMENT = """
import ctypes, sys, torch
from exl3local.kernels import reference
from exl3local.kernels.cpu import ops

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "bind":
    trellis = torch.randint(-32768, 32768, (8, 8, reference.words_per_tile(4)), dtype=torch.int16)
    ops.CpuLinear(trellis, torch.ones(128).half(), torch.ones(128).half(), 4, "mul1")
freed = torch.empty(31 << 20, dtype=torch.uint8)
del freed
mapped = libc.mallinfo2().hblkhd
block = torch.empty(28 << 20, dtype=torch.uint8)
print("mmapped" if libc.mallinfo2().hblkhd - mapped >= block.numel() else "heap")
"""


def test_binding_a_layer_hands_large_freed_blocks_back_to_the_os(tmp_path):
    """A prefill's activations (MiBs each) must not stay resident in the heap once freed (heap.release_large_frees):
    after a 31 MiB block is freed, which raises glibc's own mmap threshold to 31 MiB, a 28 MiB block must still be
    mmapped (its free then unmaps it) in a process that has bound a layer, and comes from the heap in one that has
    not."""
    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("needs glibc's mallinfo2 to see where a block lives")
    assert _run(_BLOCK_PLACEMENT, "unbound", tmp_path) == "heap", \
        "glibc's threshold did not rise: the check below would prove nothing"
    assert _run(_BLOCK_PLACEMENT, "bind", tmp_path) == "mmapped", "a 28 MiB block came from the heap"


_FORWARD_TRIM = """
import ctypes, os, sys, torch
from exl3local.kernels import reference
from exl3local.kernels.cpu import heap, ops

class Forward:  # stands for vLLM's ForwardContext: alive for exactly one model forward
    pass

def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

trellis = torch.randint(-32768, 32768, (8, 8, reference.words_per_tile(4)), dtype=torch.int16)
lin = ops.CpuLinear(trellis, torch.ones(128).half(), torch.ones(128).half(), 4, "mul1")
# fp32 rows past both the GEMV and AMX's u split: the GEMM path's fp32 workspace serves them on every CPU
x = torch.randn(max(ops.GEMV_MAX_ROWS_SIMD, ops.AMX_U_MAX_ROWS) + 1 if sys.argv[1] == "gemm" else 1, 128)
forward = None
heap.set_forward_scope(lambda: forward)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
# 48 MiB of freed 2 MiB blocks (under the 4 MiB mmap threshold: heap), each before a live block, so free() cannot
# trim them: a prefill's activations as the heap keeps them. The live blocks are as large (never touched: not
# resident), so no free chunk the interpreter's start left in the heap can take them instead (64 KiB ones went into
# such holes on the H200's host, leaving the freed blocks next to the top, where free() trimmed them).
start = resident()
blocks, live = [], []
for _ in range(24):
    blocks.append(libc.malloc(2 << 20))
    ctypes.memset(blocks[-1], 1, 2 << 20)
    live.append(libc.malloc(2 << 20))
for b in blocks:
    libc.free(b)
forward = Forward()
before = resident()
lin(x)
lin(x)
during, workspace = resident(), sum(b.numel() for b in ops._local.__dict__.get("buffers", {}).values())
forward = None
left = sum(b.numel() for b in ops._local.__dict__.get("buffers", {}).values())
print((before - start) >> 20, (before - during) >> 20, (during - resident()) >> 20, workspace, left)
"""


def test_the_heap_goes_back_to_the_os_when_a_forward_with_a_gemm_call_ends(tmp_path):
    """Freed heap pages (48 MiB here) stay resident through a forward's GEMM-path calls and go back to the OS when
    that forward ends (heap.trim_after_forward), and so does the GEMM path's workspace; a forward of one-row calls
    only (a decode step) leaves them."""
    if not Path("/proc/self/statm").exists():
        pytest.skip("needs /proc to read the resident size")
    for mode in ("gemm", "gemv"):
        kept, during, at_end, workspace, left = map(int, _run(_FORWARD_TRIM, mode, tmp_path).split())
        assert kept >= 40, f"the freed blocks were not kept resident ({kept} MiB): the check would prove nothing"
        assert during < 8, f"{mode} forward: {during} MiB given back before it ended"
        if mode == "gemm":
            assert at_end >= 40, f"GEMM forward: {at_end} MiB given back at its end"
            assert workspace > 0 and left == 0, f"GEMM workspace: {workspace} floats in the forward, {left} after it"
        else:
            assert at_end < 8, f"decode forward: {at_end} MiB given back at its end (a decode step must not trim)"
