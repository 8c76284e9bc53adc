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
device time both count, as in vLLM's eager mode), CUDA-graph µs/step (one captured step replayed),
launches/step (CUDA profiler) and host µs/step (CPU time to issue one step with the GPU kept busy).
exllamav3: LinearEXL3.forward per projection part (its own kernel choice per row count; EXL3_INT8_GEMV in the
environment picks its M ≤ 2 mul1 path: run the script twice, default and EXL3_INT8_GEMV=0); MoE through its
grouped expert GEMM `exl3_mgemm` with device-side ids for ≤ MGEMM_MAX_TOKENS tokens (not its fused exl3_moe
tier), else per expert with LinearEXL3 over tokens binned on the host.

    python3 -P bench/model_step.py --out $OUT                         # on the H200 (bench/model-step-device.sh)
    TRITON_INTERPRET=1 python -P bench/model_step.py --smoke          # CPU, tiny MoE model, ours only (CI smoke)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from exl3local.kernels import KernelSpec, prepare, reference
from exl3local.kernels.bound import BoundLinear
from exl3local.kernels.codebook import MCG_MULTIPLIER, MUL1_MULTIPLIER
from exl3local.kernels.moe_layer import ExpertLayer, path_refusal, select_path

MODELS = {
    "35b-a3b": dict(hidden=2048, layers=40, interval=4, heads=16, kv_heads=2, head_dim=256, lin_k_heads=16,
                    lin_k_dim=128, lin_v_heads=32, lin_v_dim=128, experts=256, top_k=8, moe_inter=512,
                    shared_inter=512),
    "27b": dict(hidden=5120, layers=64, interval=4, heads=24, kv_heads=4, head_dim=256, lin_k_heads=16,
                lin_k_dim=128, lin_v_heads=48, lin_v_dim=128, inter=17408),
    # --smoke: every op kind once, small enough for the interpreter
    "tiny-moe": dict(hidden=128, layers=2, interval=2, heads=1, kv_heads=1, head_dim=128, lin_k_heads=1,
                     lin_k_dim=128, lin_v_heads=1, lin_v_dim=128, experts=2, top_k=2, moe_inter=128, shared_inter=128),
    "tiny-dense": dict(hidden=128, layers=2, interval=2, heads=1, kv_heads=1, head_dim=128, lin_k_heads=1,
                       lin_k_dim=128, lin_v_heads=1, lin_v_dim=128, inter=128),
}
ROWS = (1, 4, 16, 64, 512, 4096)
GRAPH_MAX_ROWS = 64  # decode and verify steps are what graphs serve; prefill runs eager
MGEMM_MAX_TOKENS = 64
DEVICE = ["cuda"]


def log(*args) -> None:
    print(*args, flush=True)


def layer_ops(cfg: dict, index: int) -> list[tuple]:
    """What vLLM calls with EXL3 weights in layer `index`: ("linear", name, k, [n per part]) and ("moe", ...)."""
    h = cfg["hidden"]
    if (index + 1) % cfg["interval"] == 0:
        q, kv = cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"]
        ops = [("linear", "qkv_proj", h, [2 * q, kv, kv]), ("linear", "o_proj", q, [h])]
    else:
        key, value = cfg["lin_k_heads"] * cfg["lin_k_dim"], cfg["lin_v_heads"] * cfg["lin_v_dim"]
        ops = [("linear", "in_proj_qkvz", h, [2 * key + value, value]), ("linear", "out_proj", value, [h])]
    if "experts" in cfg:
        s = cfg["shared_inter"]
        ops += [("moe", "experts", cfg["experts"], cfg["top_k"], h, cfg["moe_inter"]),
                ("linear", "shared_gate_up", h, [s, s]), ("linear", "shared_down", s, [h])]
    else:
        ops += [("linear", "gate_up_proj", h, [cfg["inter"], cfg["inter"]]), ("linear", "down_proj", cfg["inter"], [h])]
    return ops


def random_arena(gen, shape, bits: float | None = None):
    """Random trellis words (bits given) or N(0, 0.05²) fp16 scales."""
    if bits is not None:
        return torch.randint(-32768, 32768, shape, generator=gen, dtype=torch.int16, device=DEVICE[0])
    return (torch.randn(shape, generator=gen, device=DEVICE[0]) * 0.05).half()


class Proj:
    """A projection's shape as plugin.moe.Projection describes it (what ExpertLayer reads)."""

    def __init__(self, bits, codebook, size_k, size_n):
        self.bits, self.codebook, self.size_k, self.size_n = bits, codebook, size_k, size_n
        self.trellis_shape = (size_k // 16, size_n // 16, reference.words_per_tile(bits))
        self.words = self.trellis_shape[0] * self.trellis_shape[1] * self.trellis_shape[2]


class Linear:
    """One linear group laid out as the plugin lays it out (flat arenas, parts as views)."""

    def __init__(self, gen, k: int, parts: list[int], bits: float, codebook: str) -> None:
        words = reference.words_per_tile(bits)
        self.k, self.parts = k, parts
        sizes = [(k // 16) * (n // 16) * words for n in parts]
        self.trellis = random_arena(gen, (sum(sizes),), bits)
        self.suh = random_arena(gen, (len(parts) * k,))
        self.svh = random_arena(gen, (sum(parts),))
        self.views, t0, n0 = [], 0, 0
        for i, (n, size) in enumerate(zip(parts, sizes)):
            self.views.append((self.trellis[t0:t0 + size].view(k // 16, n // 16, words), self.suh[i * k:(i + 1) * k],
                               self.svh[n0:n0 + n]))
            t0, n0 = t0 + size, n0 + n
        kernels = [prepare(KernelSpec(k, n, bits, codebook, torch.float16), DEVICE[0], "triton") for n in parts]
        self.ours = BoundLinear([(kern, *v, n) for kern, v, n in zip(kernels, self.views, parts)], k)
        self.ours.reserve()


class Experts:
    """One routed-experts layer: the plugin's ExpertLayer over random stacked arenas."""

    def __init__(self, gen, experts: int, top_k: int, hidden: int, inter: int, bits: float, codebook: str) -> None:
        gate, down = Proj(bits, codebook, hidden, inter), Proj(bits, codebook, inter, hidden)
        self.proj = {"gate": gate, "up": gate, "down": down}
        self.w13 = (random_arena(gen, (experts, 2 * gate.words), bits), random_arena(gen, (experts, 2, hidden)),
                    random_arena(gen, (experts, 2, inter)))
        self.w2 = (random_arena(gen, (experts, *down.trellis_shape), bits), random_arena(gen, (experts, inter)),
                   random_arena(gen, (experts, hidden)))
        self.ours = ExpertLayer(*self.w13, *self.w2, self.proj, top_k, backend="triton")
        self.experts, self.top_k, self.hidden, self.inter = experts, top_k, hidden, inter

    def run(self, x, weights, ids):
        """Exl3MoEMethod.apply's work: path by token count, fp32 ladder, back to x's dtype."""
        path = select_path(x.shape[0])
        assert path_refusal(path, x.shape[0]) is None
        return self.ours.run(path, x, weights, ids)


class Exl3Side:
    """exllamav3 1.6.5 on the same tensors: LinearEXL3 per part, exl3_mgemm / per-expert LinearEXL3 for MoE."""

    def __init__(self) -> None:
        self.error = None
        try:
            from exllamav3.ext import exllamav3_ext as ext
            from exllamav3.modules.quant.exl3 import LinearEXL3

            self.ext, self.cls = ext, LinearEXL3
        except Exception as exc:  # noqa: BLE001 -- the bench reports why the column is empty
            self.error = f"{type(exc).__name__}: {exc}"

    def markers(self, codebook):
        mcg = torch.tensor(MCG_MULTIPLIER - (1 << 32), dtype=torch.int32, device=DEVICE[0]) if codebook == "mcg" else None
        mul1 = torch.tensor(MUL1_MULTIPLIER - (1 << 32), dtype=torch.int32, device=DEVICE[0]) if codebook == "mul1" else None
        return mcg, mul1

    def linear(self, trellis, suh, svh, codebook):
        mcg, mul1 = self.markers(codebook)
        return self.cls(None, suh.shape[0], svh.shape[0], suh=suh, svh=svh, trellis=trellis, mcg=mcg, mul1=mul1)

    def bind_linear(self, lin: Linear, codebook: str):
        mods = [self.linear(*v, codebook) for v in lin.views]

        def call(x):
            return [m.forward(x, {}) for m in mods]

        return call

    def bind_experts(self, ex: Experts, bits: float, codebook: str):
        """exllamav3's grouped expert GEMM for few tokens; per-expert LinearEXL3 on host-binned rows above."""
        E, hidden, inter, top_k = ex.experts, ex.hidden, ex.inter, ex.top_k
        gate = ex.proj["gate"]
        w13t = ex.w13[0].view(E, 2, *gate.trellis_shape)
        projs = [(w13t[:, 0], ex.w13[1][:, 0], ex.w13[2][:, 0]), (w13t[:, 1], ex.w13[1][:, 1], ex.w13[2][:, 1]),
                 ex.w2]
        ptrs = [[torch.tensor([a[e].data_ptr() for e in range(E)], dtype=torch.long, device=DEVICE[0]) for a in p]
                for p in projs]
        mcg_flag, mul1_flag = codebook == "mcg", codebook == "mul1"
        mods: dict[tuple[int, int], object] = {}

        def module(e, i):
            if (e, i) not in mods:
                mods[(e, i)] = self.linear(projs[i][0][e], projs[i][1][e], projs[i][2][e], codebook)
            return mods[(e, i)]

        bufs: dict[int, tuple] = {}

        def call(x, weights, ids):
            tokens = x.shape[0]
            slots = tokens * top_k
            if tokens <= MGEMM_MAX_TOKENS:
                if tokens not in bufs:
                    half = dict(dtype=torch.half, device=DEVICE[0])
                    bufs[tokens] = (torch.empty(slots, 1, inter, **half), torch.empty(slots, 1, inter, **half),
                                    torch.empty(slots, 1, hidden, **half), torch.empty(slots, 1, hidden, **half),
                                    torch.empty(slots, 1, inter, **half))
                c_g, c_u, c_d, had_gu, had_d = bufs[tokens]
                flat = ids.reshape(1, slots)
                xa = x.repeat_interleave(top_k, 0).view(slots, 1, hidden)
                for (tp, sp, vp), inp, c, had in ((ptrs[0], xa, c_g, had_gu), (ptrs[1], xa, c_u, had_gu)):
                    self.ext.exl3_mgemm(inp, tp, c, sp, had, vp, flat, None, bits, -1, mcg_flag, mul1_flag, -1, -1, 0,
                                        1, None, None)
                a = (torch.nn.functional.silu(c_g) * c_u).view(slots, 1, inter)
                tp, sp, vp = ptrs[2]
                self.ext.exl3_mgemm(a, tp, c_d, sp, had_d, vp, flat, None, bits, -1, mcg_flag, mul1_flag, -1, -1, 0,
                                    1, None, None)
                return (c_d.view(tokens, top_k, hidden).float() * weights[..., None]).sum(1).half()
            flat = ids.flatten()
            order = torch.argsort(flat)
            counts = torch.bincount(flat, minlength=E).tolist()
            token_of = order // top_k
            out = torch.zeros(tokens, hidden, dtype=torch.float, device=x.device)
            start = 0
            for e, n in enumerate(counts):
                if n:
                    rows = token_of[start:start + n]
                    xe = x[rows]
                    h = torch.nn.functional.silu(module(e, 0).forward(xe, {})) * module(e, 1).forward(xe, {})
                    y = module(e, 2).forward(h.contiguous(), {}).float()
                    out.index_add_(0, rows, y * weights.flatten()[order[start:start + n], None])
                    start += n
            return out.half()

        return call


def build(name: str, bits: float, codebook: str, exl3: Exl3Side | None):
    cfg = MODELS[name]
    gen = torch.Generator(device=DEVICE[0]).manual_seed(0)
    layers = []
    for i in range(cfg["layers"]):
        ops = []
        for op in layer_ops(cfg, i):
            if op[0] == "linear":
                obj = Linear(gen, op[2], op[3], bits, codebook)
            else:
                obj = Experts(gen, *op[2:], bits, codebook)
            theirs = None
            if exl3 is not None and exl3.error is None:
                try:
                    theirs = (exl3.bind_linear(obj, codebook) if op[0] == "linear"
                              else exl3.bind_experts(obj, bits, codebook))
                except Exception as exc:  # noqa: BLE001 -- the column says why it is empty
                    exl3.error = f"{type(exc).__name__}: {str(exc)[:300]}"
                    log(f"exllamav3 refused {op[1]}: {exl3.error}")
            ops.append((op[0], obj, theirs))
        layers.append(ops)
    return cfg, layers


def step_fns(cfg, layers, rows: int):
    """(ours, theirs) callables running one step's EXL3 work on fixed random inputs of `rows` rows."""
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

    ours_ops, theirs_ops, r = [], [], 0
    for ops in layers:
        for kind, obj, fn in ops:
            if kind == "linear":
                ours_ops.append(lambda obj=obj: obj.ours(xs[obj.k]))
                theirs_ops.append(lambda obj=obj, fn=fn: fn(xs[obj.k]))
            else:
                ours_ops.append(lambda obj=obj, r=r: obj.run(xs[obj.hidden], *routing[r]))
                theirs_ops.append(lambda obj=obj, fn=fn, r=r: fn(xs[obj.hidden], *routing[r]))
                r += 1

    def ours():
        for op in ours_ops:
            op()

    def theirs():
        for op in theirs_ops:
            op()

    ours.ops, theirs.ops = ours_ops, theirs_ops  # host_us times them one by one
    return ours, theirs


def agreement(cfg, layers, rows: int) -> dict:
    """Relative difference ours vs exllamav3 per op kind on the first GDN and attention layers (same inputs)."""
    gen = torch.Generator(device=DEVICE[0]).manual_seed(7)
    out = {}
    for ops in (layers[0], layers[cfg["interval"] - 1]):
        for kind, obj, theirs in ops:
            if kind == "linear":
                x = torch.randn(rows, obj.k, generator=gen, device=DEVICE[0]).half()
                a, b = obj.ours(x), torch.cat(theirs(x), -1)
            else:
                x = torch.randn(rows, obj.hidden, generator=gen, device=DEVICE[0]).half()
                w, ids = torch.topk(torch.softmax(torch.randn(rows, obj.experts, generator=gen, device=DEVICE[0]), -1),
                                    obj.top_k, dim=-1)
                a, b = obj.run(x, w, ids), theirs(x, w, ids)
            name = kind if kind == "moe" else f"{kind}{len(obj.parts)}x{obj.k}"
            out[name] = round(((a.double() - b.double()).norm() / b.double().norm()).item(), 6)
    return out


def sync():
    if DEVICE[0] == "cuda":
        torch.cuda.synchronize()


def eager_us(fn, min_s: float = 0.3, max_reps: int = 50) -> float:
    """Wall-clock µs per step over back-to-back synchronised runs (after one warm-up step)."""
    fn()
    sync()
    reps, start = 0, time.perf_counter()
    while reps < max_reps and (reps < 2 or time.perf_counter() - start < min_s):
        fn()
        reps += 1
    sync()
    return 1e6 * (time.perf_counter() - start) / reps


def graph_us(fn, reps: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up on the capture stream (workspaces are per stream)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return 1e3 * start.elapsed_time(end) / reps


def host_us(fn) -> float:
    """CPU µs to issue one step while the GPU is kept busy, summed op by op: a whole step can hold more
    launches than the launch queue, and a full queue would make the host wait on the device."""
    fn.ops[0]()
    torch.cuda.synchronize()
    total = 0.0
    for op in fn.ops:
        torch.cuda._sleep(4_000_000)  # ~2 ms of GPU work queued ahead of this op's launches
        start = time.perf_counter()
        op()
        total += time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * total


def launches(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def measure(fn, rows: int, graphs: bool) -> dict:
    if DEVICE[0] != "cuda":  # the interpreter: one step, to check the step runs (its time means nothing)
        start = time.perf_counter()
        fn()
        return {"eager_us": 1e6 * (time.perf_counter() - start)}
    out = {"eager_us": eager_us(fn) if rows <= GRAPH_MAX_ROWS else eager_us(fn, min_s=0.0, max_reps=2)}
    if rows <= GRAPH_MAX_ROWS:  # the profiler's cost grows with the step; prefill launches follow from the code
        out["launches"] = launches(fn)
    out["host_us"] = host_us(fn)
    if graphs and rows <= GRAPH_MAX_ROWS:
        try:
            out["graph_us"] = graph_us(fn)
        except Exception as exc:  # noqa: BLE001 -- a step that cannot be captured is a result too
            out["graph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            torch.cuda.synchronize()
    return out


def bench_groups(rows_list, bits: float, codebook: str) -> list[dict]:
    """Each distinct fused linear of both models, one GroupLaunch (2 launches) vs a FusedLaunch per part
    (2 per part, the arrangement before GroupLaunch), same tensors, µs per call eager and graph."""
    from exl3local.kernels.bound import FusedLaunch, GroupLaunch

    gen = torch.Generator(device=DEVICE[0]).manual_seed(3)
    shapes = {}
    for name in ("35b-a3b", "27b"):
        for i in (0, MODELS[name]["interval"] - 1):
            for op in layer_ops(MODELS[name], i):
                if op[0] == "linear" and len(op[3]) > 1:
                    shapes[(op[2], tuple(op[3]))] = f"{name} {op[1]}"
    out = []
    for (k, parts), label in shapes.items():
        lin = Linear(gen, k, list(parts), bits, codebook)
        grouped = lin.ours
        assert isinstance(grouped.launches[0][0], GroupLaunch)
        split = BoundLinear(grouped.parts, k)
        split.launches, start = [], 0
        for _, t, su, sv, n in grouped.parts:
            split.launches.append((FusedLaunch(t, su, sv, bits, codebook), start, n))
            start += n
        split.reserve()
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen, device=DEVICE[0]).half()
            row = dict(kind="group", shape=label, k=k, parts=list(parts), rows=rows)
            for tag, layer in (("grouped", grouped), ("per_part", split)):
                row[f"{tag}_eager_us"] = eager_us(lambda layer=layer: layer(x), min_s=0.2, max_reps=2000)
                row[f"{tag}_graph_us"] = graph_us(lambda layer=layer: layer(x), reps=200)
            row["rel"] = round(((grouped(x).double() - split(x).double()).norm() / split(x).double().norm()).item(), 8)
            out.append(row)
            log(json.dumps(row))
    log("\nfused layer                 M   grouped eager/graph µs   per-part eager/graph µs")
    for r in out:
        log(f"{r['shape']:26s} {r['rows']:3d}   {r['grouped_eager_us']:8.1f} {r['grouped_graph_us']:8.1f}   "
            f"{r['per_part_eager_us']:8.1f} {r['per_part_graph_us']:8.1f}")
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
    args = parser.parse_args()
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
        for rows in rows_list:
            for name, (cfg, layers) in built.items():
                if args.deadline and time.time() > args.deadline:
                    log(f"(skipping {name} M={rows}: past the deadline)")
                    continue
                ours, theirs = step_fns(cfg, layers, rows)
                row = dict(model=name, rows=rows, bits=args.bits, codebook=args.codebook, exl3_mode=tag)
                if not args.no_ours:
                    row["ours"] = measure(ours, rows, not args.no_graph)
                if exl3 is not None and exl3.error is None and rows in (1, 4, 64):
                    try:
                        row["rel_ours_vs_exl3"] = agreement(cfg, layers, rows)
                    except Exception as exc:  # noqa: BLE001 -- report, keep going
                        row["agreement_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                if exl3 is not None and exl3.error is None:
                    # exllamav3's per-expert tier syncs with the host: no graph capture there
                    graphs = not args.no_graph and ("experts" not in cfg or rows <= MGEMM_MAX_TOKENS)
                    try:
                        row["exl3"] = measure(theirs, rows, graphs)
                    except Exception as exc:  # noqa: BLE001 -- report, keep going
                        row["exl3_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                results.append(row)
                log(json.dumps(row))
    finally:
        path = os.path.join(args.out, f"{args.tag}.json")
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        table(results)
    return 0


def table(results: list[dict]) -> None:
    log("\nmodel     M     ours eager / graph / host µs, launches | exl3 eager / graph / host µs, launches | ratio e/g")
    for r in results:
        o, e = r.get("ours", {}), r.get("exl3", {})

        def cells(d):
            return (f"{d.get('eager_us', float('nan')):9.0f} {d.get('graph_us', float('nan')):8.0f} "
                    f"{d.get('host_us', float('nan')):8.0f} {d.get('launches', -1):6d}")

        ratio = ""
        if o and e:
            ratio = f"{e['eager_us'] / o['eager_us']:.2f}"
            if "graph_us" in o and "graph_us" in e:
                ratio += f" / {e['graph_us'] / o['graph_us']:.2f}"
        log(f"{r['model']:9s} {r['rows']:5d} {cells(o) if o else '-':>40s} | {cells(e) if e else '-':>40s} | {ratio}")


if __name__ == "__main__":
    sys.exit(main())
