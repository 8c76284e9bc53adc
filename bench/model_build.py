"""The models' EXL3 layers for bench/model_step.py and the benches built on it: shapes (MODELS, layer_ops), random
arenas laid out as the plugin lays them out, our bound layers and MoE ladder over them (Linear, Experts) and
exllamav3 1.6.5's modules bound to the same tensors (build, through exl3_side.Exl3Side)."""

from __future__ import annotations

import os

import torch
from exl3_side import Exl3Side
from step_timing import DEVICE, log

from exl3local.kernels import KernelSpec, prepare, reference
from exl3local.kernels.bound import BoundLinear, tiled_max_rows
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
TILED = [0]  # --tiled: each linear also bound with EXL3LOCAL_TILED_MAX_ROWS at this (its `tiled` layer)


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
        bound = [(kern, *v, n) for kern, v, n in zip(kernels, self.views, parts)]
        self.ours = BoundLinear(bound, k)
        self.ours.reserve()
        self.tiled = None
        if TILED[0]:
            self.tiled = with_tiled_rows(TILED[0], lambda: BoundLinear(bound, k))
            self.tiled.reserve()


def with_tiled_rows(rows: int, make):
    """make() with EXL3LOCAL_TILED_MAX_ROWS=rows (read when launches are bound), the environment restored."""
    old = os.environ.get("EXL3LOCAL_TILED_MAX_ROWS")
    os.environ["EXL3LOCAL_TILED_MAX_ROWS"] = str(rows)
    try:
        assert tiled_max_rows() == max(rows, 16)
        return make()
    finally:
        if old is None:
            del os.environ["EXL3LOCAL_TILED_MAX_ROWS"]
        else:
            os.environ["EXL3LOCAL_TILED_MAX_ROWS"] = old


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
