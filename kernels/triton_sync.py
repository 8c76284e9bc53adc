"""Work-group barriers that order global memory under both backends (#21 session 12; IR lines in issue-21.md).

`tl.debug_barrier()` is bar.sync on NVIDIA, which orders the CTA's global memory too, but Intel's XPU backend (Triton
3.3.0b1) lowers it to `barrier(CLK_LOCAL_MEM_FENCE)`: a work-group barrier that orders local memory only, not a
program's global stores for its other work-items. Triton has no fence op of its own. What Intel's backend does emit:
before an atomic whose result is unused, every work-item runs `__spirv_ControlBarrier(Workgroup, Workgroup,
SequentiallyConsistent | CrossWorkgroupMemory)` (OpenCL's barrier(CLK_GLOBAL_MEM_FENCE)), whatever the atomic's
mask. So a relaxed add of 0 under a mask that is never true gives that barrier on Intel, and on NVIDIA a predicated-off
`red` (a compare, no memory access, no barrier). tests/kernels/compile_kernels.py counts these barriers in the SPIR-V
build's LLVM IR, so a backend that stops emitting them fails CI's compile test instead of silently racing on Arc.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def global_fence(word_ptr, never_negative):
    """Intel: a work-group barrier ordering global memory; NVIDIA: nothing that waits or touches memory. word_ptr:
    any int32 word of the kernel's (adding 0 would be harmless); never_negative: a runtime int that is never < 0 (a
    kernel argument that is not specialised on, so the mask cannot be folded and the atomic dropped)."""
    tl.atomic_add(word_ptr, 0, mask=never_negative < 0, sem="relaxed", scope="cta")


@triton.jit
def cta_barrier(word_ptr, never_negative):
    """tl.debug_barrier() that also orders the program's global stores before its other threads' loads on Intel."""
    global_fence(word_ptr, never_negative)
    tl.debug_barrier()
