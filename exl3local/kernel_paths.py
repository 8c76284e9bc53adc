"""The closed list of paths an EXL3 matmul can take (kernels.dispatch picks one per call).

Its own torch-free module because both sides name these paths: the plugin counts calls per path, and the
daemon, which must not import torch, sums those counts for GET /api/kernels and the dashboard.
"""

from __future__ import annotations

import enum


class KernelPath(enum.StrEnum):
    """Every path an EXL3 matmul can take. Closed: the trace and the dashboard key on these names."""

    GEMV = "gemv"  # decode in registers: 16-row tiles, and 64-row tiles up to EXL3LOCAL_TILED_MAX_ROWS
    RECONSTRUCT_GEMM = "reconstruct_gemm"  # decode the dense weight once per call, then a torch matmul
    MOE_DECODE = "moe_decode"  # grouped (token, expert) units, one launch per projection
    MOE_VERIFY = "moe_verify"  # a few tokens (speculative verify) through the grouped kernel
    MOE_GROUPED = "moe_grouped"  # tokens sorted by expert, per-expert GEMM tiles
    MOE_BATCHED = "moe_batched"  # per-expert loop over dense reconstructions (large batches)
    CPU_GEMV = "cpu_gemv"  # kernels/cpu: one pass over the trellis, decoded in vector registers (few rows)
    CPU_GEMV_INT8 = "cpu_gemv_int8"  # the same with int8 activations (mul1, opt-in: EXL3LOCAL_CPU_INT8; not exact)
    CPU_GEMM = "cpu_gemm"  # kernels/cpu, fp32 (prefill): Ŵ decoded into the library's own GEMM, or per strip + BLAS
    CPU_GEMM_AMX = "cpu_gemm_amx"  # kernels/cpu: bf16 rows on AMX, W' decoded into three exact bf16 planes (prefill)
    REFERENCE = "reference"  # kernels/reference.py: the spec, slow, any device
