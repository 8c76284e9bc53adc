"""Three calls of one bound linear group on the served path (input transform + `exl3_fused_kernel`, M ≤ 16),
for Nsight Compute; the last call is the one to profile:

    ncu --clock-control none --kernel-name regex:exl3_fused_kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables ... \
        python3 -P bench/profile_fused.py [SIZE_K N[,N...] BITS ROWS FLAT]

Defaults: the 27B gate_up group (5120 -> 2 x 17408, two launches per call), K4 mul1, 1 row, FLAT=1. Prints the
relative error against the same layer's reconstruct path (17 rows, first rows compared), so a profile of a wrong
kernel is not mistaken for a result.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling modules (python -P adds no path)
from layers import rel  # noqa: E402
from model_build import Linear  # noqa: E402


def main() -> None:
    args = sys.argv[1:] + ["5120", "17408,17408", "4", "1", "1"][len(sys.argv) - 1:]
    size_k, parts, bits, rows, flat = int(args[0]), [int(n) for n in args[1].split(",")], float(args[2]), \
        int(args[3]), args[4] == "1"
    gen = torch.Generator(device="cuda").manual_seed(7)
    lin = Linear(gen, size_k, parts, int(bits) if bits.is_integer() else bits, "mul1")
    for launch, _, _ in lin.ours.launches:
        launch.fused_fixed["FLAT"] = flat
        launch.replan()
    x = torch.randn(rows, size_k, generator=gen, device="cuda").half()
    for _ in range(3):
        y = lin.ours(x)
    torch.cuda.synchronize()
    padded = torch.cat([x, torch.zeros(17 - rows, size_k, device="cuda", dtype=x.dtype)]) if rows < 17 else x
    expected = lin.ours(padded)[:rows]  # more than 16 rows: W rebuilt in fp16 + matmul
    print(f"{size_k}x{parts} K{bits:g} rows {rows} FLAT={int(flat)}: rel err vs reconstruct {rel(y, expected):.2e}")


if __name__ == "__main__":
    main()
