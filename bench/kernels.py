"""Ours vs exllamav3 1.6.5 vs torch fp16 matmul on the same tensors, in one process (see docs/PERF.md).

    python3 -P bench/kernels.py [--quick] [--out DIR] [--sections a,b,...]

Run on the lent H200 by bench/kernels-device.sh (which also builds exllamav3's extension). Every
timing is triton.testing.do_bench's median with its L2 flush, output allocation inside the timed
function; M <= 16 rows are also timed as CUDA-graph replays (do_bench_cudagraph, no flush). Correctness
checks at full shapes come first: decoded Ŵ bit-exact against the reference decoder, and y against the
fp32 reference and against exllamav3.
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
from kernels_alone import bench_breakdown, bench_reconstruct, bench_splits, bench_stages  # noqa: E402
from kernels_common import (  # noqa: E402
    DEADLINE, RESULTS, Exl3, bench_copy_bandwidth, bound_linear, host_profile, host_us, late, make_layer, rel, timed,
)
from step_timing import DEVICE, launches, log  # noqa: E402

from exl3local.kernels import KernelSpec, prepare, reference  # noqa: E402
from exl3local.kernels.bound import bind_moe  # noqa: E402
from exl3local.kernels.triton_decode import decode_dense  # noqa: E402
from exl3local.kernels.triton_gemm import reconstruct_gemm  # noqa: E402
from exl3local.kernels.triton_gemv import gemv  # noqa: E402
from exl3local.kernels.triton_moe import moe_decode, moe_units  # noqa: E402

SHAPES_27B = [(5120, 5120), (5120, 1024), (5120, 17408), (17408, 5120)]
SHAPES_OTHER = [(4096, 4096), (4096, 14336), (5120, 27648)]
DECODE_BITS = (2, 3, 4, 6, 8)
DECODE_ROWS = (1, 4, 16)
PREFILL_ROWS = 2048
CROSSOVER_ROWS = (16, 32, 64, 128, 256, 512, 1024)
CROSSOVER_SHAPE = [(5120, 17408)]
BREAKDOWN_SHAPES = [(5120, 17408), (5120, 5120)]
MOE = dict(experts=256, hidden=2048, intermediate=512, top_k=8)

def check_correctness(exl3: Exl3) -> None:
    log("\n== correctness at full shapes ==")
    cases = [((4096, 4096), 4, "mul1"), ((5120, 17408), 2, "3inst"), ((17408, 5120), 3, "mcg"),
             ((4096, 14336), 2.5, "mul1"), ((5120, 1024), 8, "mul1"), ((5120, 5120), 6, "3inst")]
    if DEVICE[0] == "cpu":
        cases = [((256, 128), 4, "mul1"), ((128, 256), 2.5, "mul1")]
    for (k, n), bits, cb in cases:
        trellis, suh, svh = make_layer(k, n, bits, cb, seed=k + n)
        exact = decode_dense(trellis, bits, cb).view(torch.int16).equal(
            reference.decode_trellis(trellis, bits, cb).view(torch.int16))
        kernel = prepare(KernelSpec(k, n, bits, cb, torch.float16), DEVICE[0], "triton")
        row = dict(kind="correct", k=k, n=n, bits=bits, codebook=cb, decode_bit_exact=exact)
        bound = bound_linear(trellis, suh, svh, bits, cb)
        for m in (1, 5, 16, 300):
            x = torch.randn(m, k, device=DEVICE[0]).half()
            y = kernel.apply(x, trellis, suh, svh)
            if m <= 16:  # the bound launch (second call: the direct launcher) gives apply's bits exactly
                bound(x)
                row[f"bound_equal_m{m}"] = bool(bound(x).view(torch.int16).equal(y.view(torch.int16)))
            ref = reference.linear(x.float(), trellis, suh, svh, bits, cb)
            row[f"rel_ref_m{m}"] = rel(y, ref)
            lin = exl3.linear(trellis, suh, svh, cb)
            if lin is not None:
                row[f"rel_exl3_m{m}"] = rel(lin.forward(x, {}), ref)
        RESULTS.append(row)
        log(json.dumps(row))


def bench_decode(exl3: Exl3, shapes, bits_list, codebooks, rows_list, copy_gbps, graphs=True) -> None:
    log("\n== decode (few rows) ==")
    log(f"{'shape':>12} {'cb':>5} {'K':>3} {'M':>3} | {'ours':>7} {'exl3':>7} {'torch':>7} {'ratio':>6} | "
        f"{'ours_g':>7} {'exl3_g':>7} {'ratio_g':>7} | {'bw_floor':>8} | v3 (3 launches) graph µs")
    for k, n in shapes:
        w16 = torch.randn(k, n, device=DEVICE[0]).half()
        for cb in codebooks:
            for bits in bits_list:
                trellis, suh, svh = make_layer(k, n, bits, cb, seed=bits)
                bound = bound_linear(trellis, suh, svh, bits, cb)
                lin = exl3.linear(trellis, suh, svh, cb)
                floor = k * n * bits / 8 / copy_gbps / 1e3
                for m in rows_list:
                    if late():
                        return
                    x = torch.randn(m, k, device=DEVICE[0]).half()
                    ours = lambda: bound(x)  # noqa: E731
                    row = dict(kind="decode", k=k, n=n, codebook=cb, bits=bits, m=m, bw_floor_us=floor,
                               ours_us=timed(ours), torch_us=timed(lambda: x @ w16))
                    if lin is not None:
                        row["exl3_us"] = timed(lambda: lin.forward(x, {}))
                    if graphs:
                        row["ours_graph_us"] = timed(ours, graph=True)
                        row["v3_graph_us"] = timed(lambda: gemv(x, trellis, suh, svh, bits, cb), graph=True)
                        if lin is not None:
                            row["exl3_graph_us"] = timed(lambda: lin.forward(x, {}), graph=True)
                    RESULTS.append(row)
                    e, eg = row.get("exl3_us", float("nan")), row.get("exl3_graph_us", float("nan"))
                    og = row.get("ours_graph_us", float("nan"))
                    nan = float("nan")
                    log(f"{k:>5}x{n:<6} {cb:>5} {bits:>3} {m:>3} | {row['ours_us']:7.1f} {e:7.1f} "
                        f"{row['torch_us']:7.1f} {e / row['ours_us']:6.2f} | {og:7.1f} {eg:7.1f} {eg / og:7.2f} | "
                        f"{floor:8.1f} | v3 {row.get('v3_graph_us', nan):6.1f}")
        del w16


def bench_host(exl3: Exl3, shapes) -> None:
    """Host µs per call with the GPU busy, and device work items per call: ours bound (what the plugin
    should call), ours through kernel.apply, v3 (three launches), exllamav3. mul1 K4."""
    log("\n== host cost per linear (µs of CPU per call, GPU kept busy) and launches per call ==")
    for k, n in shapes:
        trellis, suh, svh = make_layer(k, n, 4, "mul1", seed=4)
        bound = bound_linear(trellis, suh, svh, 4, "mul1")
        kernel = prepare(KernelSpec(k, n, 4, "mul1", torch.float16), DEVICE[0], "triton")
        lin = exl3.linear(trellis, suh, svh, "mul1")
        for m in (1, 16):
            x = torch.randn(m, k, device=DEVICE[0]).half()
            calls = {"bound": lambda: bound(x), "apply": lambda: kernel.apply(x, trellis, suh, svh),
                     "v3": lambda: gemv(x, trellis, suh, svh, 4, "mul1")}
            if lin is not None:
                calls["exl3"] = lambda: lin.forward(x, {})
            row = dict(kind="host", k=k, n=n, m=m)
            for name, fn in calls.items():
                row[f"{name}_host_us"] = host_us(fn)
                row[f"{name}_launches"] = launches(fn)
            RESULTS.append(row)
            log(f"{k}x{n} M={m}: " + ", ".join(f"{name} {row[f'{name}_host_us']:.1f} µs/{row[f'{name}_launches']} launches"
                                              for name in calls))
            if (k, n, m) == (*shapes[0], 1):
                log(host_profile(calls["bound"]))
    e_count, hidden, inter, top_k = MOE["experts"], MOE["hidden"], MOE["intermediate"], MOE["top_k"]
    gate = make_layer(hidden, inter, 4, "mul1", seed=1, experts=e_count)
    bound = bind_moe(*gate, 4, "mul1")
    for tokens in (1, 4):
        ids = torch.randperm(e_count, device=DEVICE[0])[:tokens * top_k].view(tokens, top_k)
        x = torch.randn(tokens, hidden, device=DEVICE[0]).half()
        calls = {"bound": lambda: moe_units(bound, x, ids),
                 "unbound": lambda: moe_decode(x, *gate, 4, "mul1", ids)}
        row = dict(kind="host_moe", tokens=tokens)
        for name, fn in calls.items():
            row[f"{name}_host_us"] = host_us(fn)
            row[f"{name}_launches"] = launches(fn)
        RESULTS.append(row)
        log(f"MoE one projection T={tokens}: " + ", ".join(
            f"{name} {row[f'{name}_host_us']:.1f} µs/{row[f'{name}_launches']} launches" for name in calls))


def bench_prefill(exl3: Exl3, shapes, bits_list, codebooks, rows_list) -> None:
    log("\n== prefill / crossover ==")
    log(f"{'shape':>12} {'cb':>5} {'K':>3} {'M':>5} | {'gemv':>8} {'fused':>8} "
        f"{'exl3':>8} {'torch':>8} | {'best':>8} {'vs_exl3':>7} {'vs_torch':>8}")
    for k, n in shapes:
        w16 = torch.randn(k, n, device=DEVICE[0]).half()
        for cb in codebooks:
            for bits in bits_list:
                trellis, suh, svh = make_layer(k, n, bits, cb, seed=bits)
                lin = exl3.linear(trellis, suh, svh, cb)
                for m in rows_list:
                    if late():
                        return
                    x = torch.randn(m, k, device=DEVICE[0]).half()
                    row = dict(kind="prefill", k=k, n=n, codebook=cb, bits=bits, m=m,
                               fused_us=timed(lambda: reconstruct_gemm(x, trellis, suh, svh, bits, cb)),
                               torch_us=timed(lambda: x @ w16))
                    if m <= 128:  # row tiles decoded on chip (gemv with 32/64-row tiles), vs the reconstruct path
                        row["gemv_us"] = timed(lambda: gemv(x, trellis, suh, svh, bits, cb))
                    if lin is not None:
                        row["exl3_us"] = timed(lambda: lin.forward(x, {}))
                    ours = {key: v for key, v in row.items() if key.endswith("_us") and key not in ("torch_us", "exl3_us")}
                    best = min(ours, key=ours.get)
                    row["best"] = best
                    RESULTS.append(row)
                    e = row.get("exl3_us", float("nan"))
                    nan = float("nan")
                    log(f"{k:>5}x{n:<6} {cb:>5} {bits:>3} {m:>5} | {row.get('gemv_us', nan):8.1f} "
                        f"{row['fused_us']:8.1f} {e:8.1f} "
                        f"{row['torch_us']:8.1f} | {best[:-3]:>8} {e / ours[best]:7.2f} {row['torch_us'] / ours[best]:8.2f}")
        del w16


def bench_moe(exl3: Exl3, codebooks=("mul1",), bits=4) -> None:
    log("\n== MoE decode: 256 experts, hidden 2048, intermediate 512, top-8 (per projection and gate+up+down) ==")
    e_count, hidden, inter, top_k = MOE["experts"], MOE["hidden"], MOE["intermediate"], MOE["top_k"]
    for cb in codebooks:
        gate = make_layer(hidden, inter, bits, cb, seed=1, experts=e_count)
        up = make_layer(hidden, inter, bits, cb, seed=2, experts=e_count)
        down = make_layer(inter, hidden, bits, cb, seed=3, experts=e_count)
        ptrs = None
        if exl3.ok:
            def table(layer):
                t, s, v = layer
                return [torch.tensor([a[i].data_ptr() for i in range(e_count)], dtype=torch.long, device=DEVICE[0])
                        for a in (t, s, v)]

            ptrs = [table(p) for p in (gate, up, down)]
            mcg, mul1 = cb == "mcg", cb == "mul1"
        for tokens in (1, 4):
            g = torch.Generator(device=DEVICE[0]).manual_seed(tokens)
            ids = torch.stack([torch.randperm(e_count, generator=g, device=DEVICE[0])[:top_k] for _ in range(tokens)])
            x = torch.randn(tokens, hidden, device=DEVICE[0]).half()
            a = torch.randn(tokens * top_k, inter, device=DEVICE[0]).half()

            bound = [bind_moe(*p, bits, cb) for p in (gate, up, down)]

            def ours():
                moe_units(bound[0], x, ids)
                moe_units(bound[1], x, ids)
                moe_units(bound[2], a, ids)

            # correctness of one unit against the reference
            y = moe_decode(x, *gate, bits, cb, ids)
            e0 = int(ids[0, 0])
            ref = reference.linear(x[:1].float(), gate[0][e0], gate[1][e0], gate[2][e0], bits, cb)
            row = dict(kind="moe", codebook=cb, bits=bits, tokens=tokens, rel_ref=rel(y[0, 0:1], ref),
                       ours_us=timed(ours), ours_graph_us=timed(ours, graph=True), ours_host_us=host_us(ours),
                       ours_launches=launches(ours))
            if ptrs is not None:
                slots = tokens * top_k
                flat = ids.reshape(1, slots).long()
                xa = x.repeat_interleave(top_k, 0).view(slots, 1, hidden)
                aa = a.view(slots, 1, inter)
                c_gu = torch.empty(slots, 1, inter, dtype=torch.half, device=DEVICE[0])
                c_d = torch.empty(slots, 1, hidden, dtype=torch.half, device=DEVICE[0])
                had_gu = torch.empty(slots, 1, hidden, dtype=torch.half, device=DEVICE[0])
                had_d = torch.empty(slots, 1, inter, dtype=torch.half, device=DEVICE[0])

                def theirs():
                    for (tp, sp, vp), inp, c, had in ((ptrs[0], xa, c_gu, had_gu), (ptrs[1], xa, c_gu, had_gu),
                                                      (ptrs[2], aa, c_d, had_d)):
                        exl3.ext.exl3_mgemm(inp, tp, c, sp, had, vp, flat, None, bits, -1, mcg, mul1, -1, -1, 0, 1,
                                            None, None)

                try:
                    unit0 = _exl3_gate_unit(exl3, x, ptrs[0], flat, bits, mcg, mul1, hidden, inter, slots)
                    row["exl3_rel_ref"] = rel(unit0, ref)
                    row["exl3_us"] = timed(theirs)
                    row["exl3_graph_us"] = timed(theirs, graph=True)
                    row["exl3_host_us"] = host_us(theirs)
                    row["exl3_launches"] = launches(theirs)
                except Exception as exc:  # noqa: BLE001 -- report, keep benchmarking
                    row["exl3_error"] = f"{type(exc).__name__}: {exc}"
            RESULTS.append(row)
            log(json.dumps(row))


def _exl3_gate_unit(exl3, x, ptr, flat, bits, mcg, mul1, hidden, inter, slots):
    """exllamav3's grouped GEMM output for unit 0 of the gate projection (a correctness cross-check)."""
    top_k = slots // x.shape[0]
    xa = x.repeat_interleave(top_k, 0).view(slots, 1, hidden)
    c = torch.empty(slots, 1, inter, dtype=torch.half, device=DEVICE[0])
    had = torch.empty(slots, 1, hidden, dtype=torch.half, device=DEVICE[0])
    exl3.ext.exl3_mgemm(xa, ptr[0], c, ptr[1], had, ptr[2], flat, None, bits, -1, mcg, mul1, -1, -1, 0, 1, None, None)
    return c[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one shape per section (a smoke run)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for results.json")
    parser.add_argument("--sections", default="correct,decode,breakdown,prefill,moe,other")
    parser.add_argument("--no-exl3", action="store_true", help="ours and torch only (e.g. while exllamav3 builds)")
    parser.add_argument("--deadline", type=float, default=0, help="epoch seconds after which sections are skipped")
    parser.add_argument("--tag", default="results", help="results file name stem")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes: checks the script runs")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    DEADLINE[0] = args.deadline
    if args.smoke:  # exercise every section on tiny shapes under TRITON_INTERPRET=1, no GPU
        global SHAPES_27B, SHAPES_OTHER, DECODE_BITS, CROSSOVER_ROWS, PREFILL_ROWS, BREAKDOWN_SHAPES
        DEVICE[0] = "cpu"
        SHAPES_27B, SHAPES_OTHER, BREAKDOWN_SHAPES = [(256, 128)], [(128, 256)], [(256, 128)]
        CROSSOVER_SHAPE[0] = (256, 128)
        DECODE_BITS, CROSSOVER_ROWS, PREFILL_ROWS = (4,), (16, 300), 300
        MOE.update(experts=8, hidden=256, intermediate=128, top_k=2)
    elif not torch.cuda.is_available():
        log("bench/kernels.py needs a CUDA device (run it on the H200 through bench/kernels-device.sh)")
        return 2
    import triton

    name = torch.cuda.get_device_name() if DEVICE[0] == "cuda" else "cpu (interpreter smoke run)"
    log(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}")
    t0 = time.time()
    exl3 = Exl3(enabled=not args.no_exl3)
    log(f"exllamav3: {'ok' if exl3.ok else exl3.error}")

    def due(name: str) -> bool:
        if name not in sections:
            return False
        if args.deadline and time.time() > args.deadline:
            log(f"\n(skipping {name}: past the deadline)")
            return False
        return True

    copy_gbps = bench_copy_bandwidth() if DEVICE[0] == "cuda" else 1.0
    RESULTS.append(dict(kind="machine", device=name, copy_gbps=copy_gbps, exl3=exl3.error or "ok"))
    shapes = SHAPES_27B[:1] if args.quick else SHAPES_27B
    try:
        if due("correct"):
            check_correctness(exl3)
        if due("host") and DEVICE[0] == "cuda":
            bench_host(exl3, shapes)
        if due("splits") and DEVICE[0] == "cuda":
            bench_splits(SHAPES_27B)
        if due("decode"):
            bench_decode(exl3, shapes, (4,) if args.quick else DECODE_BITS, ("mul1", "3inst"), DECODE_ROWS, copy_gbps)
        if due("reconstruct"):
            bench_reconstruct(SHAPES_27B, PREFILL_ROWS)
        if due("prefill"):
            bench_prefill(exl3, shapes, (4,), ("mul1",), (PREFILL_ROWS,))
            bench_prefill(exl3, [CROSSOVER_SHAPE[0]], (4,), ("mul1",), CROSSOVER_ROWS)
        if due("moe"):
            bench_moe(exl3)
        if due("breakdown"):
            bench_breakdown(BREAKDOWN_SHAPES[:1] if args.quick else BREAKDOWN_SHAPES, MOE)
        if due("stages"):
            bench_stages(BREAKDOWN_SHAPES[:1])
        if not args.quick and due("other"):
            bench_decode(exl3, SHAPES_OTHER, (4,), ("mul1",), (1, 16), copy_gbps, graphs=False)
            bench_prefill(exl3, SHAPES_OTHER, (4,), ("mul1",), (PREFILL_ROWS,))
    finally:
        path = os.path.join(args.out, f"{args.tag}.json")
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=1)
        log(f"\nbench done in {time.time() - t0:.0f} s; results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
