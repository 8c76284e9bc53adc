"""Compile every Triton kernel ahead of time for a real GPU target, no GPU needed:

    python -P compile_kernels.py cuda   sm_90 with the installed Triton's CUDA backend (ptxas ships in the wheel)
    python -P compile_kernels.py xpu    SPIR-V with Intel's XPU backend (the `triton-xpu` package that
                                        scripts/setup puts in .venv/triton-xpu; run with it first on PYTHONPATH)
    python -P compile_kernels.py xpu DIR  also writes each kernel's LLVM IR (xpu) or PTX (cuda) to DIR, numbered
                                        in compile order, to read what a construct lowers to

The interpreter accepts code that a compiler refuses (e.g. module-level ints read inside a kernel), and a
construct Intel's backend does not lower would only show on Arc, so CI compiles SPIR-V (and the GPU test runs
sm_90). A kernel with a `tl.dot` must also get the target's matrix-unit layout (NVIDIA mma, Intel DPAS): a dot
lowered to plain FMAs would be a silent slow path. Run with TRITON_INTERPRET unset (under the interpreter
`triton.jit` returns objects that cannot be compiled). Exits 1 naming the first kernel that fails.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from exl3local.kernels import triton_decode, triton_fused, triton_gemm, triton_gemv, triton_hadamard, triton_moe
from exl3local.kernels.hadamard import HADAMARD_SCALE

# What an Xe2 GPU (Arc B-series, Arc 140V) reports to Intel's backend: 16-wide sub-groups, DPAS, 2D block IO
# (../shared/docs/arc-platform.md §5.5). No device is queried; `architecture` 0 means "unknown".
XE2_PROPERTIES = dict(name="Intel Arc (Xe2, offline)", architecture=0, sub_group_sizes=[16, 32],
                      max_work_group_size=1024, max_num_sub_groups=64, has_fp64=False,
                      has_subgroup_matrix_multiply_accumulate=True,
                      has_subgroup_matrix_multiply_accumulate_tensor_float32=False,
                      has_subgroup_2d_block_io=True, has_bfloat16_conversions=True)
TARGETS = {"cuda": GPUTarget("cuda", 90, 32), "xpu": GPUTarget("xpu", XE2_PROPERTIES, 16)}
MATRIX_LAYOUT = {"cuda": "#ttg.nvidia_mma<", "xpu": "#triton_intel_gpu.dpas<"}
DOT_OPS = ("tt.dot ", "ttng.warp_group_dot ")  # Hopper's wgmma form replaces tt.dot for 64-row tiles
MATMUL_ARGS = {"u_ptr": "*fp16", "w_ptr": "*i32", "ids_ptr": "*i32", "z_ptr": "*fp32", "M": "i32", "size_k": "i32",
               "tiles_n": "i32", "steps_per_split": "i32", "expert_words": "i32", "stride_zs": "i32"}
FUSED_ARGS = {"u_ptr": "*fp16", "w_ptr": "*i32", "svh_ptr": "*fp16", "bias_ptr": "*fp16", "ids_ptr": "*i64",
              "y_ptr": "*bf16", "z_ptr": "*fp32", "cnt_ptr": "*i32", "parts_ptr": "*i64",
              **{name: "i32" for name in ("M", "tiles_n", "stride_ym", "n_out", "k_steps", "steps_per_split",
                                          "expert_words", "stride_zs")},
              # in signature order: Triton 3.3 (Intel's) takes the signature by position
              "x_ptr": "*bf16", "suh_ptr": "*fp16", "stride_xm": "i32", "k_valid": "i32", "x_div": "i32"}
INPUT_ARGS = {"x_ptr": "*bf16", "suh_ptr": "*fp16", "ids_ptr": "*i32", "had_ptr": "*fp16", "u_ptr": "*fp16",
              "M": "i32", "size_k": "i32", "stride_xm": "i32", "x_div": "i32", "k_valid": "i32"}
FMA_ARGS = {"u_ptr": "*fp16", "w_ptr": "*i32", "z_ptr": "*fp32", "M": "i32", "size_k": "i32", "tiles_n": "i32",
            "tk_per_split": "i32", "stride_zs": "i32",
            "svh_ptr": "*fp16", "bias_ptr": "*fp16", "y_ptr": "*bf16", "cnt_ptr": "*i32", "stride_ym": "i32",
            "n_out": "i32"}
BACKEND = ["cuda"]
IR_DIR: list[Path] = []  # where to write each kernel's IR (second argument), none by default
# A work-group barrier whose semantics include CrossWorkgroupMemory (0x200): OpenCL's barrier(CLK_GLOBAL_MEM_FENCE).
# tl.debug_barrier() lowers to `_Z7barrierj(i32 1)`, a local-memory fence only (kernels/triton_sync.py).
SPIRV_BARRIER = re.compile(r"__spirv_ControlBarrieriii\(i32 2, i32 2, i32 (\d+)\)")


def offline_intel_backend() -> None:
    """Intel's backend builds a C++ helper against the SYCL runtime only to name the device's architecture
    for `ocloc` queries; with no device (architecture 0) that name is empty, so give it that directly."""
    from triton.backends import backends

    class NoDeviceArch:
        @staticmethod
        def parse_device_arch(architecture: int) -> str:
            return ""

    backends["intel"].compiler.__init__.__globals__["compile_module_from_src"] = lambda *args, **kwargs: NoDeviceArch


def compile_one(fn, args: dict[str, str], constants: dict, global_barriers: int = 0, **options) -> None:
    """global_barriers: how many work-group barriers ordering global memory the kernel needs (each place where a
    program's threads read what its other threads stored to global memory); checked in Intel's LLVM IR."""
    signature = dict(args, **{name: "constexpr" for name in constants})
    try:
        kernel = triton.compile(ASTSource(fn, signature, constants), target=TARGETS[BACKEND[0]], options=options)
    except Exception as exc:  # noqa: BLE001 -- report which kernel and specialisation failed, then stop
        print(f"FAILED {fn.__name__} {constants}: {type(exc).__name__}: {exc} {exc.__cause__!r}")
        sys.exit(1)
    ttgir = kernel.asm["ttgir"]
    has_dot = any(op in ttgir for op in DOT_OPS)
    if has_dot and MATRIX_LAYOUT[BACKEND[0]] not in ttgir:
        print(f"FAILED {fn.__name__} {constants}: its tl.dot did not get the {MATRIX_LAYOUT[BACKEND[0]]} layout")
        sys.exit(1)
    if BACKEND[0] == "xpu":
        found = sum(int(bits) & 0x200 != 0 for bits in SPIRV_BARRIER.findall(kernel.asm["llir"]))
        if found < global_barriers:
            print(f"FAILED {fn.__name__} {constants}: {found} work-group barriers order global memory, "
                  f"{global_barriers} needed (kernels/triton_sync.py)")
            sys.exit(1)
    if IR_DIR:
        count = len(list(IR_DIR[0].iterdir()))
        ir, comment = ("llir", ";") if BACKEND[0] == "xpu" else ("ptx", "//")
        (IR_DIR[0] / f"{count:02d}_{fn.__name__}.{ir}").write_text(f"{comment} {constants}\n" + kernel.asm[ir])
    print(f"ok {fn.__name__} {constants}" + (" (matrix units)" if has_dot else ""))


def main() -> None:
    compile_one(triton_hadamard._hadamard_operands_kernel, {"out_ptr": "*fp16"}, {})
    for has_ids in (False, True):
        compile_one(triton_hadamard._input_kernel, INPUT_ARGS,
                    dict(HAS_IDS=has_ids, SCALE=HADAMARD_SCALE, BM=16, PAIRS=False, GLU=False, RB=1, PARTS=1))
        compile_one(triton_hadamard._output_kernel,
                    {"z_ptr": "*fp32", "svh_ptr": "*fp16", "bias_ptr": "*fp16", "ids_ptr": "*i32", "y_ptr": "*fp16",
                     "M": "i32", "size_n": "i32", "splits": "i32", "stride_zs": "i32"},
                    dict(HAS_IDS=has_ids, HAS_BIAS=True, SCALE=HADAMARD_SCALE,
                         BM=triton_hadamard.OUTPUT_ROWS_PER_PROGRAM))
    # prefill rows: programs of several 64-row blocks (triton_hadamard.input_row_blocks), one part or a fused layer's
    # three (bound_reconstruct.InputLaunch: x read once for every part)
    for parts in (1, 3):
        compile_one(triton_hadamard._input_kernel, INPUT_ARGS,
                    dict(HAS_IDS=False, SCALE=HADAMARD_SCALE, BM=64, PAIRS=False, GLU=False,
                         RB=triton_hadamard.INPUT_ROW_BLOCKS, PARTS=parts))
    # the reconstruct path's Hadamard on y (triton_gemm: up to HY_MAX_ROWS rows), 64-row tiles
    compile_one(triton_hadamard._product_output_kernel,
                {"z_ptr": "*fp32", "svh_ptr": "*fp16", "bias_ptr": "*fp16", "had_ptr": "*fp16", "y_ptr": "*bf16",
                 "M": "i32", "size_n": "i32", "stride_ym": "i32", "n_valid": "i32"},
                dict(HAS_BIAS=True, SCALE=HADAMARD_SCALE, BM=64))
    # the MoE units' variants: gate/up pairs from ids, and the down projection's silu(gate)·up input; the combine
    compile_one(triton_hadamard._input_kernel, dict(INPUT_ARGS, x_ptr="*fp32"),
                dict(HAS_IDS=True, SCALE=HADAMARD_SCALE, BM=64, PAIRS=True, GLU=True, RB=1, PARTS=1))
    compile_one(triton_moe._tile_table_kernel, {"ids_ptr": "*i64", "cnt_ptr": "*i32", "out_ptr": "*i32", "units": "i32",
                                                "tiles": "i32", "experts": "i32"},
                dict(TILE=16, EB=512, BLOCK=triton_moe.TABLE_BLOCK), global_barriers=4)
    compile_one(triton_moe._combine_kernel, {"y_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": "*i32", "out_ptr": "*bf16",
                                             "size_n": "i32", "n_out": "i32"},
                dict(TOP_K=8, BN=triton_moe.COMBINE_BLOCK))
    # the v3 ring-dot kernel is bench/kernels.py's baseline only (its ring_dot body is compiled inside the fused
    # kernel at every rate below): once, with ids, so a CI run does not spend a fifth of its compile time on it
    block_nt, block_kt, warps = triton_gemv.ring_dot_config(3)
    compile_one(triton_gemv.exl3_ring_dot_kernel, MATMUL_ARGS,
                dict(triton_decode.rate_constants(3, "mcg"), HAS_IDS=True, BM=16, BNT=block_nt, KT=block_kt),
                num_warps=warps)
    # One rate per super-lane width G (1, 2, 4, 8) and every codebook: each kernel once per rate in the variant the
    # decode rows are served with; each other variant of the fused kernel once, at a rate of its own. A variant's code
    # (ids, splits, grouped parts, word loads, MoE tiles, 64-row tiles) does not depend on the rate's decode, so every
    # pair need not compile: all pairs were 30 fused compiles, two thirds of each target's time.
    served = dict(HAS_IDS=False, HAS_BIAS=True, SPLIT=True, SCALE=HADAMARD_SCALE, BM=16, PARTS=0, PAIRS=False,
                  FLAT=True, GROUPED=False, IN_X=False, GLU=False, SL=triton_fused.SPLIT_LOADS)
    variants = {  # rate: what differs from `served`
        ("mul1", 4): [dict(PARTS=3),  # grouped q/k/v parts
                      dict(IN_X=True), dict(IN_X=True, PARTS=3),  # decode rows in one launch: u from x in the program
                      dict(IN_X=True, HAS_IDS=True, PAIRS=True), dict(IN_X=True, HAS_IDS=True, GLU=True),  # MoE units
                      dict(GROUPED=True, PAIRS=True),  # MoE over expert-sorted tiles: gate/up pairs
                      dict(BM=triton_gemv.TILE_ROWS, PARTS=3),  # the tiled path (more than 16 rows), grouped
                      dict(SL=triton_fused.MANY_SPLIT_LOADS),  # launches of many splits: more partials per step
                      # the fragment orders this target does not serve (XPU: ring order; else the other kWidth's),
                      # with and without the words loaded one K step ahead
                      *([dict(FRAG=2), dict(FRAG=4, PF=1)] if BACKEND[0] == "xpu" else
                        [dict(FRAG=6 - triton_decode.FRAGMENT_KWIDTH), dict(PF=0)])],
        ("3inst", 2): [dict(SPLIT=False)],
        ("mcg", 3): [dict(FLAT=False),  # words as [KT, BNT, 32/G] loads, at a rate whose super-lanes span 3 words
                     dict(GROUPED=True)],  # MoE tiles: down
        ("mul1", 2.5): [dict(HAS_IDS=True, PAIRS=True),  # MoE units from ids
                        dict(BM=triton_gemv.TILE_ROWS)],
    }
    for (codebook, bits), others in variants.items():
        rate = triton_decode.rate_constants(bits, codebook)
        block_nt, block_kt, warps = triton_gemv.ring_dot_config(bits)
        tile_kt, tile_warps = triton_gemv.tiled_config(bits)
        for changed in [{}, *others]:
            # the weight operand in fragment order where a lane's weights are a fragment, not on XPU (fragment_order)
            frag = triton_decode.FRAGMENT_KWIDTH if rate["G"] == 1 and BACKEND[0] != "xpu" else 0
            constants = dict(rate, **served, KT=block_kt, FRAG=frag, PF=int(frag > 0))  # bound.FusedLaunch's
            constants.update(changed)
            tiled = constants["BM"] == triton_gemv.TILE_ROWS  # 64-row tiles: their own KT and warps
            if tiled:
                constants.update(KT=tile_kt, FRAG=0, PF=0)
            # with GROUPED, ids_ptr is the int32 tile table
            args = dict(FUSED_ARGS, ids_ptr="*i32") if constants["GROUPED"] else FUSED_ARGS
            # the partials before the epilogue (split-K: before the counter, and the acquired partials after it), u
            compile_one(triton_fused.exl3_fused_kernel, args, constants,
                        global_barriers=1 + constants["SPLIT"] + constants["IN_X"],
                        num_warps=tile_warps if tiled else warps, num_stages=1)
        block_m, block_nt = triton_gemv.ring_config(1, bits)
        compile_one(triton_gemv.exl3_gemv_ring_kernel, FMA_ARGS,
                    dict(rate, BM=block_m, BNT=block_nt, EPILOGUE=True, HAS_BIAS=True, SCALE=HADAMARD_SCALE),
                    global_barriers=2)
        compile_one(triton_gemm._right_reconstruct_kernel,
                    {"w_ptr": "*i32", "had_ptr": "*fp16", "svh_ptr": "*fp16", "out_ptr": "*fp16", "tiles_n": "i32",
                     "tk_per_program": "i32"}, dict(rate, SCALE=HADAMARD_SCALE, KT=4),
                    num_stages=triton_gemm.REBUILD_STAGES)
        compile_one(triton_decode._decode_dense_kernel, {"w_ptr": "*i32", "out_ptr": "*fp16", "tiles_n": "i32"},
                    dict(rate, KT=4, BNT=8))


if __name__ == "__main__":
    BACKEND[0] = sys.argv[1]
    if len(sys.argv) > 2:
        IR_DIR.append(Path(sys.argv[2]))
        IR_DIR[0].mkdir(parents=True, exist_ok=True)
    print(f"Triton {triton.__version__} ({triton.__file__}), target {TARGETS[BACKEND[0]]}")
    if BACKEND[0] == "xpu":
        offline_intel_backend()
    main()
