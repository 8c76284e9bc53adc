"""What the reconstruct path's pieces cost per 27B part, graph µs (issue 21 item 4's sizing): the W_r rebuild
(triton_gemm.right_reconstruct: decode + H·svh in the weight), the plain dense decode (triton_decode.decode_dense),
the input transform and the fp16 matmul at 32 and 64 rows. Random mul1 K4 trellis.

    python3 -P bench/rebuild_parts.py [--sweep]    # on the H200 (source bench/device-setup.sh first)

--sweep: the rebuild alone at other (tile rows per program, KT, warps) than triton_gemm.right_reconstruct's default
(32, 4, 4), bit-identical W_r checked.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling modules (python -P adds no path)
from step_timing import graph_us, log  # noqa: E402

from exl3local.kernels import triton_decode, triton_gemm  # noqa: E402
from exl3local.kernels.triton_hadamard import input_transform  # noqa: E402


SWEEP = [(rows, kt, warps) for rows in (16, 32, 64) for kt in (2, 4, 8) for warps in (4, 8) if rows >= 2 * kt]


def sweep(trellis: torch.Tensor, svh: torch.Tensor, label: str) -> None:
    served = triton_gemm.right_reconstruct(trellis, svh, 4, "mul1")
    out = {}
    for rows, kt, warps in SWEEP:
        def call():
            return triton_gemm.right_reconstruct(trellis, svh, 4, "mul1", rows, kt, warps)
        same = torch.equal(call(), served)
        out[f"r{rows}_kt{kt}_w{warps}"] = f"{graph_us(call, reps=50):.1f}" + ("" if same else " DIFFERS")
    log(f"{label} rebuild sweep (tile rows, KT, warps) µs: {out}")


def main() -> int:
    g = torch.Generator(device="cuda").manual_seed(1)
    for k, n in ((5120, 17408), (17408, 5120), (5120, 10240)):
        trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 64), generator=g, dtype=torch.int16, device="cuda")
        svh = (torch.randn(n, generator=g, device="cuda") * 0.05).half()
        suh = (torch.randn(k, generator=g, device="cuda") * 0.05).half()
        w = triton_gemm.right_reconstruct(trellis, svh, 4, "mul1")
        row = {"rebuild_us": graph_us(lambda: triton_gemm.right_reconstruct(trellis, svh, 4, "mul1"), reps=50),
               "decode_dense_us": graph_us(lambda: triton_decode.decode_dense(trellis, 4, "mul1"), reps=50)}
        for rows in (32, 64):
            x = torch.randn(rows, k, generator=g, device="cuda").half()
            u = input_transform(x, suh)
            row[f"input_{rows}_us"] = graph_us(lambda: input_transform(x, suh), reps=50)
            row[f"mm_{rows}_us"] = graph_us(lambda: u @ w, reps=50)
        log(f"{k}x{n} K4 mul1 {({a: round(b, 1) for a, b in row.items()})}")
        if "--sweep" in sys.argv:
            sweep(trellis, svh, f"{k}x{n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
