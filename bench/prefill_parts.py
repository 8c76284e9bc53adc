"""27B prefill: a fused layer's parts sharing one input transform (issue 21, session 19), H200, one process:

pieces: per (k, parts) of the 27B's fused layers (in_proj_qkvz and gate_up: 2 parts, q/k/v: 3, all k 5120) at --rows,
    graph µs of each part's own input transform (summed) vs one launch for all parts (bound_reconstruct.InputLaunch,
    triton_hadamard._input_kernel PARTS) at RB 1 / 2 / 4 row blocks per program; u bit-equal to the parts' own checked;
steps: whole 27B steps (bench/model_step.py's) at --step-rows, eager ms: served, rb4 (the shared transform at 4 row
    blocks per program: bound_reconstruct.PARTS_ROW_BLOCKS), per_part (each part its own transform, as before session
    19), per_part_mm (gate and up in a matmul each, not one batched matmul: bound_reconstruct.BATCHED_PARTS; s19c timed
    the batched one as a bench-side swap, gate_up_bmm), exllamav3, served again, exllamav3 again. (s19a timed an order
    variant and s19b the rebuild's HALVES here: both removed, docs/PERF.md "Session 19".)

    python3 -P bench/prefill_parts.py --out $OUT        # on the H200 (source bench/device-setup.sh first)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling modules (python -P adds no path)
from exl3_side import Exl3Side  # noqa: E402
from model_step import eager_steps, patched_step  # noqa: E402
from step_timing import graph_us, log  # noqa: E402

from exl3local.kernels import bound_reconstruct  # noqa: E402
from exl3local.kernels.bound_reconstruct import InputLaunch  # noqa: E402


def setting(module, name: str, value):
    """A swap (model_step.patched_step) setting module.name to value while it runs."""
    def swap():
        old = getattr(module, name)
        setattr(module, name, value)
        return lambda: setattr(module, name, old)
    return swap


def pieces(rows: int, deadline: float) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(1)
    results = []
    for k, count in ((5120, 2), (5120, 3)):
        if deadline and time.time() > deadline:
            break
        x = torch.randn(rows, k, generator=g, device="cuda").half()
        suh = (torch.randn(count, k, generator=g, device="cuda") * 0.05).half()
        own = [InputLaunch(suh[p], k, k, x.device) for p in range(count)]
        shared = InputLaunch(suh, k, k, x.device, count)
        u = shared(x)
        row = dict(k=k, parts=count, rows=rows, same_bits=all(torch.equal(u[p], own[p](x)[0]) for p in range(count)),
                   own_us=round(graph_us(lambda: [launch(x) for launch in own], reps=20), 1), shared_us={})
        for blocks in (1, 2, 4):
            undo = setting(bound_reconstruct, "input_row_blocks", lambda r, b=blocks: b)()
            try:
                row["shared_us"][blocks] = round(graph_us(lambda: shared(x), reps=20), 1)
                row[f"same_bits_rb{blocks}"] = torch.equal(shared(x), u)
            finally:
                undo()
        log(json.dumps(row))
        results.append(row)
    return results


def steps(exl3: Exl3Side | None, rows_list: list[int], deadline: float) -> list[dict]:
    def variants(ours, theirs, layers, row):
        linears = [obj.ours for ops in layers for kind, obj, _ in ops if kind == "linear"]

        def per_part():
            saved = [(layer, layer.rebuild_input) for layer in linears]
            row["shared_layers"] = sum(shared is not None for _, shared in saved)  # the served step's, checked
            for layer in linears:
                layer.rebuild_input = None
            return lambda: [setattr(layer, "rebuild_input", shared) for layer, shared in saved]

        # exllamav3 twice, around our last timing: the spread of repeated timings on one side
        return (("served", ours), ("rb4", patched_step(ours, setting(bound_reconstruct, "PARTS_ROW_BLOCKS", 4))),
                ("per_part", patched_step(ours, per_part)),
                ("per_part_mm", patched_step(ours, setting(bound_reconstruct, "BATCHED_PARTS", False))),
                ("exl3", theirs), ("again", ours), ("exl3_again", theirs))

    return eager_steps(exl3, rows_list, deadline, variants)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--step-rows", default="4096,512")
    parser.add_argument("--no-exl3", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--deadline", type=float, default=0, help="epoch seconds after which cells are skipped")
    args = parser.parse_args()
    exl3 = None if args.no_exl3 else Exl3Side()
    if exl3 is not None and exl3.error:
        log(f"exllamav3 unavailable: {exl3.error}")
        exl3 = None
    results = {}
    try:
        results["pieces"] = pieces(args.rows, args.deadline)
        results["steps"] = steps(exl3, [int(r) for r in args.step_rows.split(",")], args.deadline)
    finally:
        with open(os.path.join(args.out, "prefill_parts.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
