"""The fused decode matmul's K loop as ptxas compiles it for sm_90 with the installed Triton (no GPU needed): registers
per thread and the loop's SASS instructions per opcode, for the served 4-bit config and variants of it.

    python3 -P bench/sass_loop.py                                # served (fragment order), ring order, grouped parts
    python3 -P bench/sass_loop.py --bits 8 --codebook 3inst --maxnreg 56

The loop is the first backward branch of the listing (cuobjdump -sass; finish_block's loops come after it). Triton
versions differ in layouts and conversions: the H200 runs Triton 3.6, this box 3.9 (docs/PERF.md's header).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))  # compile_kernels' signatures
from compile_kernels import FUSED_ARGS, TARGETS  # noqa: E402

from exl3local.kernels import triton_decode, triton_fused, triton_gemv  # noqa: E402
from exl3local.kernels.hadamard import HADAMARD_SCALE  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
VARIANTS = {"served": {}, "frag_k2": dict(FRAG=2, PF=False), "frag_k4": dict(FRAG=4, PF=False),
            "pf_k2": dict(FRAG=2, PF=True), "pf_k4": dict(FRAG=4, PF=True),
            "ring": dict(FRAG=0, PF=False),
            "parts3": dict(PARTS=3), "parts3_ring": dict(PARTS=3, FRAG=0, PF=False)}


def compile_fused(bits: float, codebook: str, changed: dict, options: dict):
    rate = triton_decode.rate_constants(bits, codebook)
    _, kt, warps = triton_gemv.ring_dot_config(bits)
    constants = dict(rate, HAS_IDS=False, HAS_BIAS=False, SPLIT=True, SCALE=HADAMARD_SCALE, BM=16, PARTS=0, PAIRS=False,
                     FLAT=True, GROUPED=False, IN_X=False, GLU=False, SL=triton_fused.SPLIT_LOADS, KT=kt,
                     FRAG=triton_decode.FRAGMENT_KWIDTH if rate["G"] == 1 else 0, PF=rate["G"] == 1)
    constants.update(changed)
    signature = dict(FUSED_ARGS, **{name: "constexpr" for name in constants})
    return triton.compile(ASTSource(triton_fused.exl3_fused_kernel, signature, constants), target=TARGETS["cuda"],
                          options=dict(num_warps=warps, num_stages=1, **options))


def loop_mix(cubin: bytes) -> tuple[int, int, collections.Counter]:
    """(registers, loop instructions, opcode counts) of the first backward branch's body."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    code = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    index = {a: i for i, (a, _) in enumerate(code)}
    for i, (a, text) in enumerate(code):
        target = re.search(r"BRA .*0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < a and int(target.group(1), 16) in index:
            body = [t for _, t in code[index[int(target.group(1), 16)]:i + 1]]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            return regs, len(body), ops
    return regs, 0, collections.Counter()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=float, default=4)
    parser.add_argument("--codebook", default="mul1")
    parser.add_argument("--maxnreg", default="0,64,56", help="register caps to compile at (0: none)")
    args = parser.parse_args()
    bits = int(args.bits) if args.bits == int(args.bits) else args.bits
    print(f"Triton {triton.__version__}, sm_90, {args.codebook} {bits:g} bits, 16 rows, per K step "
          f"({16 * 8 * triton_gemv.ring_dot_config(bits)[1] * 16 // 128} weights per thread)")
    for name, changed in VARIANTS.items():
        if triton_decode.rate_constants(bits, args.codebook)["G"] != 1 and "FRAG" in changed:
            continue  # the ring order is served at this rate
        for cap in (int(c) for c in args.maxnreg.split(",")):
            regs, count, ops = loop_mix(compile_fused(bits, args.codebook, changed, {"maxnreg": cap} if cap else {})
                                        .asm["cubin"])
            print(f"{name:12s} cap {cap or '-':>3}: {regs:3d} registers, {count:4d} loop instructions  "
                  + " ".join(f"{op} {n}" for op, n in ops.most_common(30)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
