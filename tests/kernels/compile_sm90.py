"""Compile every Triton kernel for sm_90 with the Triton wheel's own CUDA backend (ptxas ships in it), no
GPU needed. The interpreter accepts code that the compiler refuses (e.g. module-level ints read inside a
kernel), so CI compiles too. Run as a script with TRITON_INTERPRET unset: under the interpreter
`triton.jit` returns objects that cannot be compiled. Exits 1 naming the first kernel that fails.
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from exl3local.kernels import triton_decode, triton_gemm, triton_gemv, triton_hadamard
from exl3local.kernels.hadamard import HADAMARD_SCALE

TARGET = GPUTarget("cuda", 90, 32)
MATMUL_ARGS = {"u_ptr": "*fp16", "w_ptr": "*i32", "ids_ptr": "*i32", "z_ptr": "*fp32", "M": "i32", "size_k": "i32",
               "tiles_n": "i32", "tk_per_split": "i32", "expert_words": "i32", "stride_zs": "i32"}
FMA_ARGS = {name: kind for name, kind in MATMUL_ARGS.items() if name not in ("ids_ptr", "expert_words")}


def compile_one(fn, args: dict[str, str], constants: dict, **options) -> None:
    signature = dict(args, **{name: "constexpr" for name in constants})
    try:
        triton.compile(ASTSource(fn, signature, constants), target=TARGET, options=options)
    except Exception as exc:  # noqa: BLE001 -- report which kernel and specialisation failed, then stop
        print(f"FAILED {fn.__name__} {constants}: {type(exc).__name__}: {exc}")
        sys.exit(1)
    print(f"ok {fn.__name__} {constants}")


def main() -> None:
    compile_one(triton_hadamard._hadamard_operands_kernel, {"out_ptr": "*fp16"}, {})
    for has_ids in (False, True):
        compile_one(triton_hadamard._input_kernel,
                    {"x_ptr": "*bf16", "suh_ptr": "*fp16", "ids_ptr": "*i32", "had_ptr": "*fp16", "u_ptr": "*fp16",
                     "M": "i32", "size_k": "i32", "stride_xm": "i32", "x_div": "i32"},
                    dict(HAS_IDS=has_ids, SCALE=HADAMARD_SCALE, BM=16))
        compile_one(triton_hadamard._output_kernel,
                    {"z_ptr": "*fp32", "svh_ptr": "*fp16", "bias_ptr": "*fp16", "ids_ptr": "*i32", "y_ptr": "*fp16",
                     "M": "i32", "size_n": "i32", "splits": "i32", "stride_zs": "i32"},
                    dict(HAS_IDS=has_ids, HAS_BIAS=True, SCALE=HADAMARD_SCALE,
                         BM=triton_hadamard.OUTPUT_ROWS_PER_PROGRAM))
    # one rate per super-lane width G (1, 2, 4, 8) and every codebook
    for codebook, bits in (("mul1", 4), ("3inst", 2), ("mcg", 3), ("mul1", 2.5)):
        rate = triton_decode.rate_constants(bits, codebook)
        block_nt, block_kt, warps = triton_gemv.ring_dot_config(bits)
        for block_m, has_ids in ((16, False), (64, False), (16, True)):
            compile_one(triton_gemv.exl3_ring_dot_kernel, MATMUL_ARGS,
                        dict(rate, HAS_IDS=has_ids, BM=block_m, BNT=block_nt, KT=block_kt), num_warps=warps)
        block_m, block_nt = triton_gemv.ring_config(1, bits)
        compile_one(triton_gemv.exl3_gemv_ring_kernel, FMA_ARGS, dict(rate, BM=block_m, BNT=block_nt))
        compile_one(triton_gemm._right_reconstruct_kernel,
                    {"w_ptr": "*i32", "had_ptr": "*fp16", "svh_ptr": "*fp16", "out_ptr": "*fp16", "tiles_n": "i32",
                     "tk_per_program": "i32"}, dict(rate, SCALE=HADAMARD_SCALE, KT=4))
        compile_one(triton_decode._decode_dense_kernel, {"w_ptr": "*i32", "out_ptr": "*fp16", "tiles_n": "i32"},
                    dict(rate, KT=4, BNT=8))


if __name__ == "__main__":
    main()
