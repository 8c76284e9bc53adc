"""One routed-experts layer of the 35B-A3B shape (bench/model_step.py's Experts) at T tokens, expert-grouped tiles
vs one unit per program: device µs per call (CUDA-graph replay), eager µs per call (back-to-back), host µs to
issue one call with the GPU kept busy, and the CPU profiler's top ops of one call (where the host time goes).

    python3 -P bench/moe_host.py --rows 16,32,64 --out $OUT        # on the H200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling modules (python -P adds no path)
from kernels_common import host_us  # noqa: E402
from model_build import MODELS, Experts  # noqa: E402
from step_timing import eager_us, graph_us, log  # noqa: E402

from exl3local.kernels import moe_layer  # noqa: E402


def top_cpu_ops(fn, count: int = 8) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:count]
    return [(e.key, round(e.self_cpu_time_total, 1)) for e in events]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,32,64")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    cfg = MODELS["35b-a3b"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = Experts(gen, cfg["experts"], cfg["top_k"], cfg["hidden"], cfg["moe_inter"], 4, "mul1")
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, cfg["hidden"], generator=gen, device="cuda").half()
        w, ids = torch.topk(torch.softmax(torch.randn(rows, cfg["experts"], generator=gen, device="cuda"), -1),
                            cfg["top_k"], dim=-1)
        for name, threshold in (("tiles", 0.0), ("units", float("inf"))):
            moe_layer.TILES_MIN_UNITS_PER_EXPERT = threshold
            fn = lambda: layer.run(x, w, ids)  # noqa: E731
            row = dict(rows=rows, path=name, graph_us=graph_us(fn, reps=50), eager_us=eager_us(fn, max_reps=500),
                       host_us=host_us(fn), top_cpu_ops=top_cpu_ops(fn))
            results.append(row)
            log(json.dumps(row))
    with open(os.path.join(args.out, "moe_host.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
