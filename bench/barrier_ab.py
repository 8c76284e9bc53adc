"""Session 12's work-group barriers (kernels/triton_sync.py) against tl.debug_barrier() alone, per linear: run once
with the kernels as committed and once with bench/sync-device.sh's copy where triton_sync's calls are replaced (the
code before), each in its own process. CUDA-graph µs (device time, comparable across processes) and a hash of each
output (the two variants must agree bit for bit) at the 27B shapes (split-K and unsplit two-launch paths) and at
35B-A3B-sized shapes that take one launch (IN_X), decode rows 1/4/16.

    python3 -P bench/barrier_ab.py --tag new --out $OUT       # on the H200 (bench/sync-device.sh runs it)
    TRITON_INTERPRET=1 python3 -P bench/barrier_ab.py --smoke  # this box: tiny shapes, checks the script runs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling modules (python -P adds no path)
from kernels_common import bound_linear, make_layer, timed  # noqa: E402
from step_timing import DEVICE, log  # noqa: E402

from exl3local.kernels import bound  # noqa: E402

SHAPES_27B = [(5120, 5120), (5120, 1024), (5120, 17408), (17408, 5120)]  # two launches (too much work for one)
SHAPES_ONE = [(2048, 4096), (2048, 512), (4096, 2048)]  # one launch where fused_launch.ONE_LAUNCH_MAX_WORK allows
BITS = (2, 4)
ROWS = (1, 4, 16)


def cell(k: int, n: int, bits: float, m: int) -> dict:
    trellis, suh, svh = make_layer(k, n, bits, "mul1", seed=k + n + int(bits))
    layer = bound_linear(trellis, suh, svh, bits, "mul1")
    g = torch.Generator(device=DEVICE[0]).manual_seed(m)
    x = torch.randn(m, k, generator=g, device=DEVICE[0]).half()
    y = layer(x)
    digest = hashlib.sha1(y.float().cpu().numpy().tobytes()).hexdigest()[:16]
    return dict(k=k, n=n, bits=bits, m=m, graph_us=timed(lambda: layer(x), graph=DEVICE[0] == "cuda"), out=digest)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tag", default="barrier_ab")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--deadline", type=float, default=0, help="epoch seconds after which cells are skipped")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    args = parser.parse_args()
    shapes = [(s, True) for s in SHAPES_27B] + [(s, False) for s in SHAPES_ONE]
    bits_list, rows = BITS, ROWS
    if args.smoke:
        DEVICE[0] = "cpu"
        shapes, bits_list, rows = [((256, 128), True)], (4,), (1,)
    elif not torch.cuda.is_available():
        log("bench/barrier_ab.py needs a CUDA device (bench/sync-device.sh)")
        return 2
    log(f"barrier_ab {args.tag}: kernels from {bound.__file__}")
    results = []
    for (k, n), dense in shapes:
        for bits in bits_list:
            for m in rows:
                if args.deadline and time.time() > args.deadline:
                    log("(past the deadline)")
                    break
                row = dict(cell(k, n, bits, m), path="two" if dense else "one-if-small")
                results.append(row)
                log(f"{k:>5}x{n:<6} K{bits} M={m:<2} {row['graph_us']:8.1f} µs  {row['out']}")
    Path(args.out, f"{args.tag}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
