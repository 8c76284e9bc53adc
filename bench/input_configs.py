"""The prefill input transform (triton_hadamard._input_kernel: u = fp16(H128(fp16(x ⊙ suh))), the reconstruct path's
first launch per part) at other launch configs than served, on the H200 (issue 21, session 17): graph µs per config
and k at --rows (u bit-equal to served checked), then whole 27B steps at --step-rows, eager ms: served, the best
config of the sweep (least µs summed over the k), served again, exllamav3.

Config BM:RB:W:S = rows per block, row blocks per program, warps, software-pipeline stages (served: 64 rows,
triton_hadamard.input_row_blocks, Triton's default 4 warps and 3 stages). Bytes moved per call: x read (2 B) and u
written (2 B) per element; the µs column's GB/s says how far from the copy bandwidth each is.

    python3 -P bench/input_configs.py --out $OUT        # on the H200 (source bench/device-setup.sh first)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling modules (python -P adds no path)
from exl3_side import Exl3Side  # noqa: E402
from model_step import eager_steps, patched_step  # noqa: E402
from step_timing import graph_us, log  # noqa: E402

from exl3local.kernels import bound_reconstruct  # noqa: E402
from exl3local.kernels.hadamard import HADAMARD_SCALE  # noqa: E402
from exl3local.kernels.launcher import DirectLaunch  # noqa: E402
from exl3local.kernels.triton_hadamard import _input_kernel, hadamard_operands, input_row_blocks  # noqa: E402

KS = (5120, 6144, 17408)  # the 27B's input widths
CONFIGS = [(64, rb, w, s) for rb, w, s in itertools.product((1, 4, 8), (4, 8), (1, 3))] + \
    [(128, rb, 8, s) for rb, s in itertools.product((1, 4), (1, 3))] + [(32, 8, 4, 1)]


def run_input(x, suh, u, config) -> None:
    bm, rb, warps, stages = config
    rows, k = x.shape
    _input_kernel[(triton.cdiv(rows, bm * rb), k // 128)](
        x, suh, suh, hadamard_operands(x.device), u, rows, k, x.stride(0), 1, k, HAS_IDS=False, SCALE=HADAMARD_SCALE,
        BM=bm, RB=rb, num_warps=warps, num_stages=stages)


def sweep(rows: int, deadline: float) -> dict:
    """{config: {k: graph µs or 'differs'}}, served first."""
    gen = torch.Generator(device="cuda").manual_seed(17)
    served = (64, input_row_blocks(rows), 4, 3)
    out = {}
    for k in KS:
        x = torch.randn(rows, k, generator=gen, device="cuda").half()
        suh = (torch.randn(k, generator=gen, device="cuda") * 0.05).half()
        ref = torch.empty(rows, k, dtype=torch.float16, device="cuda")
        run_input(x, suh, ref, served)
        for config in [served] + [c for c in CONFIGS if c != served]:
            if deadline and time.time() > deadline:
                break
            u = torch.empty_like(ref)
            try:
                run_input(x, suh, u, config)
            except Exception as exc:  # noqa: BLE001 -- a config that does not compile (resources) is reported
                out.setdefault(config, {})[k] = f"error {type(exc).__name__}"
                continue
            if not torch.equal(u, ref):
                out.setdefault(config, {})[k] = "differs"
                continue
            out.setdefault(config, {})[k] = round(graph_us(lambda: run_input(x, suh, u, config), reps=50), 1)
    log(f"\ninput transform at {rows} rows, graph µs (GB/s): config BM:RB:warps:stages, served first")
    for config, times in out.items():
        cells = [f"{t:7.1f} ({4 * rows * k / t / 1e3:5.0f})" if isinstance(t, float) else f"{t:>15s}"
                 for k, t in times.items()]
        log(f"  {':'.join(map(str, config)):12s} " + "  ".join(cells))
    return out


def best(times: dict) -> tuple:
    whole = {c: sum(t.values()) for c, t in times.items()
             if len(t) == len(KS) and all(isinstance(v, float) for v in t.values()) and c[0] == 64}
    return min(whole, key=whole.get)


def with_config(layers, config):
    """A swap (model_step.patched_step) putting every reconstruct launch's input transform at config (BM 64)."""
    _, rb, warps, stages = config
    twins: dict[int, DirectLaunch] = {}

    def swap():
        old_blocks = bound_reconstruct.input_row_blocks
        bound_reconstruct.input_row_blocks = lambda rows: rb if rows >= 1024 else old_blocks(rows)
        saved = []
        for ops in layers:
            for kind, obj, _ in ops:
                for rl in (getattr(obj.ours, "rebuilds", None) or []) if kind == "linear" else []:
                    twin = twins.get(id(rl))
                    if twin is None:
                        twin = twins[id(rl)] = DirectLaunch(_input_kernel, rl.input.varying, rl.input.hooks is None,
                                                            num_warps=warps, num_stages=stages)
                    saved.append((rl, rl.input))
                    rl.input = twin

        def undo():
            bound_reconstruct.input_row_blocks = old_blocks
            for rl, launch in saved:
                rl.input = launch
        return undo
    return swap


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--step-rows", default="4096")
    parser.add_argument("--no-exl3", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--deadline", type=float, default=0, help="epoch seconds after which cells are skipped")
    args = parser.parse_args()
    times = sweep(args.rows, args.deadline - 120 if args.deadline else 0)
    config = best(times)
    log(f"best (BM 64, least µs over k {KS}): {':'.join(map(str, config))}")

    def variants(ours, theirs, layers, row):
        ours()  # the reconstruct launches are made on the first call above the bound rows
        row["best"] = list(config)
        return [("served", ours), ("best", patched_step(ours, with_config(layers, config))), ("again", ours),
                ("exl3", theirs)]

    exl3 = None if args.no_exl3 else Exl3Side()
    steps = eager_steps(exl3, [int(r) for r in args.step_rows.split(",")], args.deadline, variants)
    with open(os.path.join(args.out, "input_configs.json"), "w") as f:
        json.dump(dict(sweep={":".join(map(str, c)): t for c, t in times.items()}, steps=steps), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
