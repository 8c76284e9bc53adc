"""27B prefill: a fused layer's parts sharing one input transform (issue 21, session 19), H200, one process:

pieces: per (k, parts) of the 27B's fused layers (in_proj_qkvz and gate_up: 2 parts, q/k/v: 3, all k 5120) at --rows,
    graph µs of each part's own input transform (summed) vs one launch for all parts (bound_reconstruct.InputLaunch,
    triton_hadamard._input_kernel PARTS) at RB 1 / 2 / 4 row blocks per program; u bit-equal to the parts' own checked;
steps: whole 27B steps (bench/model_step.py's) at --step-rows, eager ms: served, rb4 (the shared transform at 4 row
    blocks per program: bound_reconstruct.PARTS_ROW_BLOCKS), per_part (each part its own transform, as before session
    19), gate_up_bmm (two W_r parts of one shape in one batched matmul: batched_rebuilt), exllamav3, served again,
    exllamav3 again. (s19a timed an order variant and s19b the rebuild's HALVES here:
    both removed, docs/PERF.md "Session 19".)

    python3 -P bench/prefill_parts.py --out $OUT        # on the H200 (source bench/device-setup.sh first)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling modules (python -P adds no path)
from exl3_side import Exl3Side  # noqa: E402
from model_step import eager_steps, patched_step  # noqa: E402
from step_timing import graph_us, log  # noqa: E402

from exl3local.kernels import bound_reconstruct  # noqa: E402
from exl3local.kernels.bound import BoundLinear  # noqa: E402
from exl3local.kernels.triton_gemm import hadamard_on_y  # noqa: E402
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


def batched_rebuilt(layer, x: torch.Tensor) -> torch.Tensor:
    """BoundLinear.rebuilt for two W_r parts of one shape (gate/up), bench-only: both weights rebuilt into one
    buffer and one batched matmul writing both parts' columns of y in place (the grid of one GEMM of twice the tiles:
    does a 17408-wide part's last partial wave of tiles cost the step anything?)."""
    x2d = x.reshape(-1, x.shape[-1])
    rows, (first, _) = x2d.shape[0], layer.rebuilds
    if hadamard_on_y(rows, first.size_k, x.device) or x.dtype != torch.float16:
        return BoundLinear.rebuilt(layer, x)
    u = layer.rebuild_input(x2d)
    w = torch.empty(2, first.size_k, first.size_n, dtype=torch.float16, device=x.device)
    stream = first.stream()
    for i, part in enumerate(layer.rebuilds):
        part.rebuild(part.rebuild_grid, stream, (), part.rebuild_fixed, (w[i],), (w[i].data_ptr(),))
    y = torch.empty(rows, 2 * first.size_n, dtype=x.dtype, device=x.device)
    torch.bmm(u, w, out=y.view(rows, 2, first.size_n).transpose(0, 1))
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


def steps(exl3: Exl3Side | None, rows_list: list[int], deadline: float) -> list[dict]:
    def variants(ours, theirs, layers, row):
        linears = [obj.ours for ops in layers for kind, obj, _ in ops if kind == "linear"]

        def per_part():
            saved = [(layer, layer.rebuild_input) for layer in linears]
            row["shared_layers"] = sum(shared is not None for _, shared in saved)  # the served step's, checked
            for layer in linears:
                layer.rebuild_input = None
            return lambda: [setattr(layer, "rebuild_input", shared) for layer, shared in saved]

        def batched():
            pairs = [layer for layer in linears if layer.rebuild_input is not None and len(layer.parts) == 2
                     and layer.bias is None and len({(r.size_k, r.size_n, out) for r, (*_, out)
                                                     in zip(layer.rebuilds, layer.parts)}) == 1
                     and layer.parts[0][4] == layer.rebuilds[0].size_n]
            row["batched_layers"] = len(pairs)
            for layer in pairs:
                layer.rebuilt = types.MethodType(batched_rebuilt, layer)
            return lambda: [delattr(layer, "rebuilt") for layer in pairs]

        # exllamav3 twice, around our last timing: the spread of repeated timings on one side
        return (("served", ours), ("rb4", patched_step(ours, setting(bound_reconstruct, "PARTS_ROW_BLOCKS", 4))),
                ("per_part", patched_step(ours, per_part)), ("gate_up_bmm", patched_step(ours, batched)),
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
