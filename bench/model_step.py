"""All EXL3 work of one model step, ours (the plugin's bound layers and MoE ladder) vs exllamav3 1.6.5, one process.

Models (shapes from the public Qwen3.5 configs): `35b-a3b` (hidden 2048, 40 layers, Gated DeltaNet with gated
full attention every 4th layer, 256 experts top-8 of intermediate 512 + a shared expert of 512) and `27b`
(hidden 5120, 64 layers, same layer pattern, dense MLP of 17408). Per layer, what vLLM calls with EXL3 weights:

    GDN layer:       in_proj_qkvz (parts in_proj_qkv, in_proj_z), out_proj
    attention layer: qkv_proj (parts q with its output gate, k, v), o_proj
    dense MLP:       gate_up_proj (gate, up), down_proj
    MoE:             the routed experts (one FusedMoE call), shared_expert gate_up_proj and down_proj

Not timed: attention/GDN math, norms, router, embedding, lm_head (not EXL3 here), sampling. Random trellis
(every 16-bit pattern is a valid trellis), suh/svh ~ N(0, 0.05²), activations ~ N(0, 1) fp16, mul1 K4 unless
--bits/--codebook say otherwise; every layer has its own weights (a step streams the whole model, as in use).

Per (model, M): eager µs/step (back-to-back steps on one stream, wall clock over synchronised runs: host and
device time both count, as in vLLM's eager mode; every cell's timed first, before any profiler runs), CUDA-graph
µs/step (one captured step replayed), launches/step (CUDA profiler) and host µs/step (CPU time to issue one step with
the GPU kept busy).
exllamav3: LinearEXL3.forward per projection part (its own kernel choice per row count; EXL3_INT8_GEMV in the
environment picks its M ≤ 2 mul1 path: run the script twice, default and EXL3_INT8_GEMV=0); MoE through its
grouped expert GEMM `exl3_mgemm` with device-side ids for ≤ MGEMM_MAX_TOKENS tokens (not its fused exl3_moe
tier), else per expert with LinearEXL3 over tokens binned on the host.

    python3 -P bench/model_step.py --out $OUT                         # on the H200 (bench/model-step-device.sh)
    python3 -P bench/model_step.py --tiled 128 --rows 32,64,128       # + our linears on the tiled path (17+ rows)
    python3 -P bench/model_step.py --units --models 35b-a3b           # + our MoE one unit per program (no tiles)
    TRITON_INTERPRET=1 python -P bench/model_step.py --smoke          # CPU, tiny MoE model, ours only (CI smoke)
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
from exl3_side import MGEMM_MAX_TOKENS, Exl3Side  # noqa: E402
from model_build import TILED, build  # noqa: E402
from step_timing import DEVICE, eager_us, log, measure, step_eager_us, step_table, sync  # noqa: E402

from exl3local.kernels import moe_layer  # noqa: E402
from exl3local.kernels.bound import BoundLinear  # noqa: E402

ROWS = (1, 4, 16, 64, 512, 4096)


def step_fns(cfg, layers, rows: int):
    """(ours, theirs, ours_tiled) callables running one step's EXL3 work on fixed random inputs of `rows` rows
    (ours_tiled: ours with every linear bound on the tiled path, MoE unchanged)."""
    gen = torch.Generator(device=DEVICE[0]).manual_seed(rows)
    xs: dict[int, torch.Tensor] = {}

    def x_for(k):
        if k not in xs:
            xs[k] = torch.randn(rows, k, generator=gen, device=DEVICE[0]).half()
        return xs[k]

    routing = []
    for ops in layers:
        for kind, obj, _ in ops:
            if kind == "moe":
                scores = torch.randn(rows, obj.experts, generator=gen, device=DEVICE[0])
                w, ids = torch.topk(torch.softmax(scores, -1), obj.top_k, dim=-1)
                routing.append((w / w.sum(-1, keepdim=True), ids))
    for ops in layers:
        for kind, obj, _ in ops:
            x_for(obj.k if kind == "linear" else obj.hidden)

    ours_ops, theirs_ops, tiled_ops, r = [], [], [], 0
    for ops in layers:
        for kind, obj, fn in ops:
            if kind == "linear":
                ours_ops.append(lambda obj=obj: obj.ours(xs[obj.k]))
                theirs_ops.append(lambda obj=obj, fn=fn: fn(xs[obj.k]))
                tiled_ops.append(lambda obj=obj: (obj.tiled or obj.ours)(xs[obj.k]))
            else:
                ours_ops.append(lambda obj=obj, r=r: obj.run(xs[obj.hidden], *routing[r]))
                theirs_ops.append(lambda obj=obj, fn=fn, r=r: fn(xs[obj.hidden], *routing[r]))
                tiled_ops.append(ours_ops[-1])
                r += 1
    return tuple(runner(ops) for ops in (ours_ops, theirs_ops, tiled_ops))


def runner(ops):
    def step():
        for op in ops:
            op()

    step.ops = ops  # host_us times them one by one
    return step


def patched_step(step, swap):
    """step (a runner) with swap() in force while it runs, op by op too (host_us); swap returns its undo."""
    def patched(fn):
        def run():
            undo = swap()
            try:
                fn()
            finally:
                undo()
        return run

    run = patched(step)
    run.ops = [patched(op) for op in step.ops]
    return run


def eager_steps(exl3: Exl3Side | None, rows_list: list[int], deadline: float, variants, model: str = "27b") -> list:
    """Whole steps of `model` (K4 mul1) at each row count, eager ms of each (tag, step) that variants(ours, theirs,
    layers, row) returns (theirs None without exllamav3; a None step is skipped; row: the result row, to add facts
    to): bench/prefill_pieces.py's and prefill_forms.py's step A/Bs."""
    cfg, layers = build(model, 4, "mul1", exl3)
    results = []
    for rows in rows_list:
        if deadline and time.time() > deadline:
            log(f"(skipping {model} M={rows}: past the deadline)")
            continue
        ours, theirs, _ = step_fns(cfg, layers, rows)
        row = dict(model=model, rows=rows)
        for tag, fn in variants(ours, theirs if exl3 is not None else None, layers, row):
            if fn is not None:
                row[tag] = round(eager_us(fn, min_s=1.5, max_reps=8 if rows > 1024 else 30) / 1e3, 2)
        log(json.dumps(row))
        results.append(row)
    return results


def untiled(step):
    """step with our MoE on one unit per program at every token count (the path before expert-sorted tiles)."""
    def swap():
        old, moe_layer.TILES_MIN_UNITS_PER_EXPERT = moe_layer.TILES_MIN_UNITS_PER_EXPERT, float("inf")
        return lambda: setattr(moe_layer, "TILES_MIN_UNITS_PER_EXPERT", old)
    return patched_step(step, swap)


def unbound(step):
    """step with our linears above their bound rows through each part's kernel apply (Triton's own launch of both
    kernels, the pad, trims and concatenation: the path before kernels/bound_reconstruct.py)."""
    def swap():
        old, BoundLinear.rebuilt = BoundLinear.rebuilt, BoundLinear.unfused
        return lambda: setattr(BoundLinear, "rebuilt", old)
    return patched_step(step, swap)


def agreement(cfg, layers, rows: int) -> dict:
    """Relative difference ours vs exllamav3 per op kind on the first GDN and attention layers (same inputs)."""
    gen = torch.Generator(device=DEVICE[0]).manual_seed(7)
    out = {}
    for ops in (layers[0], layers[cfg["interval"] - 1]):
        for kind, obj, theirs in ops:
            if kind == "linear":
                x = torch.randn(rows, obj.k, generator=gen, device=DEVICE[0]).half()
                a, b = obj.ours(x), torch.cat(theirs(x), -1)
                if obj.tiled is not None and 16 < rows <= TILED[0]:
                    c = obj.tiled(x).double()
                    out[f"tiled_{kind}{len(obj.parts)}x{obj.k}"] = round(((c - b).norm() / b.double().norm()).item(), 6)
            else:
                x = torch.randn(rows, obj.hidden, generator=gen, device=DEVICE[0]).half()
                w, ids = torch.topk(torch.softmax(torch.randn(rows, obj.experts, generator=gen, device=DEVICE[0]), -1),
                                    obj.top_k, dim=-1)
                a, b = obj.run(x, w, ids), theirs(x, w, ids)
            name = kind if kind == "moe" else f"{kind}{len(obj.parts)}x{obj.k}"
            out[name] = round(((a.double() - b.double()).norm() / b.double().norm()).item(), 6)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="35b-a3b,27b")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--bits", type=float, default=4)
    parser.add_argument("--codebook", default="mul1")
    parser.add_argument("--no-exl3", action="store_true", help="ours only")
    parser.add_argument("--no-ours", action="store_true", help="exllamav3 only (the EXL3_INT8_GEMV=0 run)")
    parser.add_argument("--no-graph", action="store_true")
    parser.add_argument("--deadline", type=float, default=0, help="epoch seconds after which cells are skipped")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tag", default="model_step")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny models, ours only, eager only")
    parser.add_argument("--groups", action="store_true", help="only: fused layers grouped vs per part (GPU)")
    parser.add_argument("--tiled", type=int, default=0, metavar="ROWS",
                        help="also time our linears on the tiled path up to ROWS rows (ours_tiled; rows > 16)")
    parser.add_argument("--units", action="store_true",
                        help="also time our MoE one unit per program where it would take tiles (ours_units)")
    parser.add_argument("--unbound", action="store_true",
                        help="also time our linears above 16 rows through the kernels' apply (ours_unbound)")
    args = parser.parse_args()
    TILED[0] = args.tiled
    if args.smoke:
        DEVICE[0] = "cpu"
        args.no_exl3, args.no_graph = True, True
        if args.models == "35b-a3b,27b":
            args.models = "tiny-moe"  # every op kind (tiny-dense adds only another linear group)
        if args.rows == ",".join(map(str, ROWS)):
            args.rows = "1,5"  # MoE decode and grouped paths (on Triton every path is the unit kernel)
    elif not torch.cuda.is_available():
        log("bench/model_step.py needs a CUDA device (or --smoke for the CPU interpreter)")
        return 2
    if args.groups:
        from layers import bench_groups

        results = bench_groups([1, 4, 16], args.bits, args.codebook)
        with open(os.path.join(args.out, f"{args.tag}_groups.json"), "w") as f:
            json.dump(results, f, indent=1)
        return 0
    exl3 = None if args.no_exl3 else Exl3Side()
    if exl3 is not None and exl3.error:
        log(f"exllamav3 unavailable: {exl3.error}")
        exl3 = None
    tag = f"EXL3_INT8_GEMV={os.environ.get('EXL3_INT8_GEMV', 'default')}"
    log(f"device: {torch.cuda.get_device_name() if DEVICE[0] == 'cuda' else 'cpu (interpreter)'}; exllamav3 "
        f"{'off' if exl3 is None else tag}; K{args.bits:g} {args.codebook}")
    results = []
    rows_list = [int(r) for r in args.rows.split(",")]
    try:
        built = {}
        for name in args.models.split(","):  # every model first: the row loop then covers decode of both early
            t0 = time.time()
            built[name] = build(name, args.bits, args.codebook, exl3)
            sync()
            log(f"== {name}: {built[name][0]['layers']} layers built in {time.time() - t0:.1f} s ==")
        clean = clean_eager(built, rows_list, args, exl3) if DEVICE[0] == "cuda" else {}
        for rows in rows_list:
            for name, (cfg, layers) in built.items():
                if args.deadline and time.time() > args.deadline:
                    log(f"(skipping {name} M={rows}: past the deadline)")
                    continue
                ours, theirs, tiled = step_fns(cfg, layers, rows)
                row = dict(model=name, rows=rows, bits=args.bits, codebook=args.codebook, exl3_mode=tag)
                if not args.no_ours:
                    row["ours"] = measure(ours, rows, not args.no_graph, clean.get((name, rows, "ours")))
                    if 16 < rows <= TILED[0]:
                        row["ours_tiled"] = measure(tiled, rows, not args.no_graph)
                    if args.unbound and rows > 16:
                        row["ours_unbound"] = measure(unbound(ours), rows, not args.no_graph)
                    if args.units and "experts" in cfg and \
                            rows * cfg["top_k"] >= moe_layer.TILES_MIN_UNITS_PER_EXPERT * cfg["experts"]:
                        row["ours_units"] = measure(untiled(ours), rows, not args.no_graph)
                if exl3 is not None and exl3.error is None and (rows in (1, 4, 64) or 16 < rows <= TILED[0]):
                    try:
                        row["rel_ours_vs_exl3"] = agreement(cfg, layers, rows)
                    except Exception as exc:  # noqa: BLE001 -- report, keep going
                        row["agreement_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                if exl3 is not None and exl3.error is None:
                    # exllamav3's per-expert tier syncs with the host: no graph capture there
                    graphs = not args.no_graph and ("experts" not in cfg or rows <= MGEMM_MAX_TOKENS)
                    try:
                        row["exl3"] = measure(theirs, rows, graphs, clean.get((name, rows, "exl3")))
                    except Exception as exc:  # noqa: BLE001 -- report, keep going
                        row["exl3_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                results.append(row)
                log(json.dumps(row))
    finally:
        path = os.path.join(args.out, f"{args.tag}.json")
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        step_table(results)
    return 0


def clean_eager(built: dict, rows_list: list[int], args, exl3) -> dict:
    """{(model, rows, side): eager µs} of every cell, timed before anything runs under torch's profiler: after
    it, bound launches went through Triton's own launch path in session 14 (a launch hook left set; each row says
    whether one is: hook_after_profiler), so eager cells timed after a profiled one were not clean."""
    clean = {}
    for rows in rows_list:
        for name, (cfg, layers) in built.items():
            if args.deadline and time.time() > args.deadline:
                return clean
            ours, theirs, _ = step_fns(cfg, layers, rows)
            if not args.no_ours:
                clean[(name, rows, "ours")] = step_eager_us(ours, rows)
            if exl3 is not None and exl3.error is None:
                try:
                    clean[(name, rows, "exl3")] = step_eager_us(theirs, rows)
                except Exception:  # noqa: BLE001 -- measure() reports it
                    torch.cuda.synchronize()
            log(f"eager {name} M={rows}: " + ", ".join(f"{side} {clean[(name, rows, side)] / 1e3:.2f} ms"
                                                      for side in ("ours", "exl3") if (name, rows, side) in clean))
    return clean


if __name__ == "__main__":
    sys.exit(main())
