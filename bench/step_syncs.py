"""Whether one model step syncs with the host, and where its issue time goes: each model's step (bench/model_step.py,
ours only) at a few row counts, run once under torch's sync debug mode (every synchronizing CUDA call warns, with
the Python line that made it), then each op kind's host ms with the GPU kept busy (step_timing.host_us's method,
op by op), and the step's host_us / eager / graph ms.

    python3 -P bench/step_syncs.py [--rows 1,32,64]     # on the H200 (source bench/device-setup.sh first)
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling modules (python -P adds no path)
import model_build  # noqa: E402
import model_step  # noqa: E402
from step_timing import eager_us, graph_us, host_us, log  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="35b-a3b,27b")
    parser.add_argument("--rows", default="1,32,64")
    args = parser.parse_args()
    for name in args.models.split(","):
        cfg, layers = model_build.build(name, 4, "mul1", None)
        kinds = [f"{kind}:{getattr(obj, 'parts', '')}" for ops in layers for kind, obj, _ in ops]
        for rows in [int(r) for r in args.rows.split(",")]:
            ours, _, _ = model_step.step_fns(cfg, layers, rows)
            ours()
            ours()  # plans, workspaces and lazily bound launches exist before the checked step
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ours()
            torch.cuda.set_sync_debug_mode(0)
            where = collections.Counter(f"{w.filename.split('/')[-1]}:{w.lineno} {str(w.message)[:60]}" for w in caught)
            log(f"{name} {rows}: sync warnings {len(caught)} {where.most_common(4)}")
            per = collections.defaultdict(float)
            for kind, op in zip(kinds, ours.ops):
                torch.cuda.synchronize()
                torch.cuda._sleep(4_000_000)  # ~2 ms of GPU work ahead of the op: its launches only queue
                start = time.perf_counter()
                op()
                per[kind] += (time.perf_counter() - start) * 1e3
            torch.cuda.synchronize()
            log(f"{name} {rows}: host ms by op kind {({k: round(v, 2) for k, v in per.items()})}, total "
                f"{sum(per.values()):.2f}; step host_us {host_us(ours) / 1e3:.2f} eager {eager_us(ours) / 1e3:.2f} "
                f"graph {graph_us(ours) / 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
