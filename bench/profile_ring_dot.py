"""Three launches of the ring-order dot kernel (mul1), for Nsight Compute (docs/PERF.md, "What would close it"):

    ncu --clock-control none --kernel-name regex:exl3_ring_dot --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight ... python3 -P bench/profile_ring_dot.py [SIZE_K SIZE_N BITS ROWS]

The first launch compiles; ncu profiles the last. Also prints the kernel's relative error against the
fp32 reference on the decoded weight, so a profile of a wrong kernel is not mistaken for a result.
"""

from __future__ import annotations

import sys

import torch

from exl3local.kernels.triton_decode import decode_dense
from exl3local.kernels.triton_gemv import ring_dot_config, ring_dot_partials

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from kernels_common import make_layer, rel  # noqa: E402  (beside this file)


def main() -> None:
    size_k, size_n, bits, rows = (float(a) for a in sys.argv[1:5]) if len(sys.argv) > 4 else (5120, 17408, 4, 16)
    size_k, size_n, rows = int(size_k), int(size_n), int(rows)
    bits = int(bits) if float(bits).is_integer() else bits  # 2.5, 3.5: the half-integer rates
    trellis, _, _ = make_layer(size_k, size_n, bits, "mul1", seed=1)
    u = torch.randn(rows, size_k, device="cuda").half()
    block_nt, block_kt, warps = ring_dot_config(bits)
    for _ in range(3):
        z = ring_dot_partials(u, trellis, bits, "mul1", 16, block_nt, block_kt, num_warps=warps)
    torch.cuda.synchronize()
    expected = u.float() @ decode_dense(trellis, bits, "mul1").float()  # z is stored in natural column order
    print(f"{size_k}x{size_n} K{bits} rows {rows}: splits {z.shape[0]}, rel err {rel(z.sum(0), expected):.2e}")


if __name__ == "__main__":
    main()
