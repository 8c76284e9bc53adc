"""Exl3MoEMethod: routed experts kept as EXL3 trellises, and the MoE path ladder.

Checkpoint layout (format spec §6): every routed expert's gate/up/down is its own EXL3 linear,
`<layer>.experts.<e>.<gate|up|down>_proj.{trellis,suh,svh,<marker>}`. vLLM's RoutedExperts loader
hands them to params named `w13_*` (gate = shard w1, up = shard w3) and `w2_*` (down). Here each
tensor kind is ONE arena per layer, and no dense or fp16 expert weight is ever allocated:

    w13_trellis int16 (E, gate_words + up_words)   per expert: gate (Hp/16, Ip/16, 16*bits_g), then up
    w13_suh     fp16  (E, 2, Hp)                   gate's and up's own input scales (spec §6)
    w13_svh     fp16  (E, 2, Ip)
    w2_trellis  int16 (E, Ip/16, Hp/16, 16*bits_d) w2_suh fp16 (E, Ip)   w2_svh fp16 (E, Hp)
    w13_<cb> / w2_<cb> int32 (E, 2) / (E,)         codebook markers, checked on load

(Hp, Ip: hidden and intermediate sizes padded to 128; E: experts local to this rank.)

apply() computes the routed contribution only (the router and shared experts stay with vLLM),
accumulates in fp32 and weights each expert's down-projection output, not its input. It picks one
of four paths by token count at a single selection point (`select_path`):

    T == 1          MOE_DECODE    the token's top-k (token, expert) units, one row each
    1 < T <= 4      MOE_VERIFY    speculative verify: independent M=1 units per token
    4 < T <= 128    MOE_GROUPED   (token, expert) units (Triton), else tokens binned per expert
    T > 128         MOE_BATCHED   binned on the device (one host sync), dense per-expert matmuls

The math (paths, arenas as stacked experts, bound launches) is kernels/moe_layer.ExpertLayer, built
once per layer at load; the first three paths run as one grouped Triton launch set per projection
(kernels/triton_moe.py) where the dispatch chose Triton for every projection (CUDA/XPU, or forced),
otherwise per expert. The refusal reason is in the trace flags.

There is no unquantized fallback: a path that cannot serve a call raises with the reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.utils import set_weight_attrs

from exl3local.errors import CheckpointError, ConfigError
from exl3local.kernels import KernelPath, reference
from exl3local.kernels.moe_layer import (  # noqa: F401 -- the ladder's names, re-exported for the plugin's users
    GROUPED_MAX_TOKENS, PATHS, TRITON_MOE_PATHS, VERIFY_MAX_TOKENS, ExpertLayer, path_refusal, select_path,
    triton_moe_refusal,
)
from exl3local.manifest import MARKER_VALUES, TensorGroup
from exl3local.plugin import reload, trace
from exl3local.plugin.linear import refuse_packed_signs, split_range

TILE = reference.TILE
# vLLM's shard ids for the three projections: gate and up share the w13 params, down is w2.
SHARDS = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0)}

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Projection:
    """One projection (gate, up or down) across this rank's experts: shapes as stored here."""

    name: str  # "gate" | "up" | "down"
    bits: float
    codebook: str
    size_k: int  # padded input features held on this rank
    size_n: int  # padded output features held on this rank
    k_range: tuple[int, int]  # slice of the checkpoint tensor's padded inputs (tensor parallelism)
    n_range: tuple[int, int]

    @property
    def words(self) -> int:
        return (self.size_k // TILE) * (self.size_n // TILE) * reference.words_per_tile(self.bits)

    @property
    def trellis_shape(self) -> tuple[int, int, int]:
        return (self.size_k // TILE, self.size_n // TILE, reference.words_per_tile(self.bits))


def _uniform(groups: list[TensorGroup], name: str) -> TensorGroup:
    """All experts' tensors of one projection must agree: one arena, one kernel (spec §6)."""
    first = groups[0]
    for g in groups[1:]:
        if (g.bits, g.codebook, g.size_k, g.size_n) != (first.bits, first.codebook, first.size_k, first.size_n):
            raise CheckpointError(
                g.file, g.prefix,
                f"{name} like {first.prefix}: {first.bits:g} bits, {first.codebook}, k={first.size_k}, n={first.size_n}",
                f"{g.bits:g} bits, {g.codebook}, k={g.size_k}, n={g.size_n}",
                hint="EXL3 routed experts need one K and codebook per projection across experts",
            )
    return first


class Exl3MoEMethod(FusedMoEMethodBase):
    """Routed experts from EXL3 trellises: compressed arenas, the four-path ladder, fp32 accumulation."""

    def __init__(self, config, layer: torch.nn.Module, prefix: str) -> None:
        super().__init__(layer.moe_config)
        self.config = config
        self.prefix = prefix
        self.ckpt_names = {
            "gate": layer.ckpt_gate_proj_name,
            "up": layer.ckpt_up_proj_name,
            "down": layer.ckpt_down_proj_name,
        }
        if self.ckpt_names["up"] is None:
            raise ConfigError(f"{prefix}: EXL3 MoE supports gated experts (gate/up/down) only")

    # -- vLLM hooks
    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None  # apply() runs our own kernels; vLLM's modular kernels never see these weights

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        activation = getattr(layer.moe_config.activation, "value", str(layer.moe_config.activation))
        if activation != "silu":
            raise ConfigError(f"{self.prefix}: EXL3 MoE implements the silu-gated experts only, not {activation!r}")
        if getattr(layer, "apply_router_weight_on_input", False):
            raise ConfigError(f"{self.prefix}: routing weights on the expert input are not supported (EXL3 weights the output)")
        per_proj = self._expert_groups(extra_weight_attrs.get("global_num_experts", num_experts))
        proj = self._projections(layer, per_proj, hidden_size, intermediate_size_per_partition)
        layer.exl3_proj = proj
        layer.exl3_groups = per_proj
        layer.exl3_hidden = hidden_size
        layer.exl3_loaded = set()
        gate, up, down = proj["gate"], proj["up"], proj["down"]
        E = num_experts

        def register(name: str, tensor: torch.Tensor, stem: str) -> None:
            param = torch.nn.Parameter(tensor, requires_grad=False)
            set_weight_attrs(param, {"weight_loader": self._loader(layer, name.removeprefix(f"{stem}_"), stem)})
            layer.register_parameter(name, param)

        register("w13_trellis", torch.empty(E, gate.words + up.words, dtype=torch.int16), "w13")
        register("w13_suh", torch.empty(E, 2, gate.size_k, dtype=torch.float16), "w13")
        register("w13_svh", torch.empty(E, 2, gate.size_n, dtype=torch.float16), "w13")
        register("w2_trellis", torch.empty(E, *down.trellis_shape, dtype=torch.int16), "w2")
        register("w2_suh", torch.empty(E, down.size_k, dtype=torch.float16), "w2")
        register("w2_svh", torch.empty(E, down.size_n, dtype=torch.float16), "w2")
        if gate.codebook in MARKER_VALUES:
            register(f"w13_{gate.codebook}", torch.zeros(E, 2, dtype=torch.int32), "w13")
        if down.codebook in MARKER_VALUES:
            register(f"w2_{down.codebook}", torch.zeros(E, dtype=torch.int32), "w2")
        layer.exl3_arena_bytes = sum(
            p.numel() * p.element_size() for n, p in layer.named_parameters(recurse=False) if n.startswith(("w13_", "w2_"))
        )
        trace.add_flag("moe_arena_bytes", layer.exl3_arena_bytes)

    def _expert_groups(self, global_experts: int) -> dict[str, TensorGroup]:
        """One checkpoint group per projection, standing for all experts (uniform bits/codebook/shape)."""
        groups = self.config.groups()
        per_proj: dict[str, TensorGroup] = {}
        for proj, ckpt in self.ckpt_names.items():
            members = []
            for e in range(global_experts):
                prefix = f"{self.prefix}.{e}.{ckpt}"
                if prefix not in groups:
                    raise CheckpointError(self.config._file(), f"{prefix}.trellis", "an EXL3 expert tensor group", "missing")
                refuse_packed_signs(groups[prefix])
                members.append(groups[prefix])
            per_proj[proj] = _uniform(members, proj)
        gate, up = per_proj["gate"], per_proj["up"]
        if gate.codebook != up.codebook:
            raise CheckpointError(up.file, up.prefix, f"the gate's codebook {gate.codebook}", up.codebook)
        if gate.size_k != up.size_k or gate.size_n != up.size_n:
            raise CheckpointError(up.file, up.prefix, "gate's shape", "another shape")
        return per_proj

    def _projections(
        self, layer: torch.nn.Module, per_proj: dict[str, TensorGroup], hidden_size: int, intermediate: int
    ) -> dict[str, Projection]:
        """This rank's slice of each projection: the intermediate dimension splits under tensor parallelism."""
        par = layer.moe_config.moe_parallel_config
        tp_rank, tp_size = (par.tp_rank, par.tp_size) if not par.use_ep else (0, 1)
        proj = {}
        for name in ("gate", "up"):
            g = per_proj[name]
            n_range = split_range(g, "intermediate", intermediate, g.size_n, tp_rank, tp_size)
            k_range = split_range(g, "hidden", hidden_size, g.size_k, 0, 1)
            proj[name] = Projection(name, g.bits, g.codebook, k_range[1] - k_range[0], n_range[1] - n_range[0], k_range, n_range)
        g = per_proj["down"]
        k_range = split_range(g, "intermediate", intermediate, g.size_k, tp_rank, tp_size)
        n_range = split_range(g, "hidden", hidden_size, g.size_n, 0, 1)
        proj["down"] = Projection("down", g.bits, g.codebook, k_range[1] - k_range[0], n_range[1] - n_range[0], k_range, n_range)
        if proj["down"].size_k != proj["gate"].size_n:
            raise CheckpointError(g.file, g.prefix, f"padded input {proj['gate'].size_n} (gate's output)", str(proj["down"].size_k))
        return proj

    def _loader(self, layer: torch.nn.Module, kind: str, stem: str):
        def load(param, loaded_weight, weight_name="", shard_id="", expert_id=0, return_success=False):
            local = layer._map_global_expert_id_to_local_expert_id(expert_id)
            if local == -1:
                return False if return_success else None  # another rank's expert
            if shard_id not in SHARDS or SHARDS[shard_id][0] != stem:
                raise CheckpointError(self.config._file(), weight_name, f"a {stem} shard id", repr(shard_id))
            name = {"w1": "gate", "w3": "up", "w2": "down"}[shard_id]
            self._load(layer, param, kind, name, local, expert_id, loaded_weight)
            layer.exl3_loaded.add((kind, name, local))
            return True if return_success else None

        return load

    def _load(self, layer, param, kind: str, name: str, local: int, expert: int, w: torch.Tensor) -> None:
        p = layer.exl3_proj[name]
        g = layer.exl3_groups[name]
        tensor = f"{self.prefix}.{expert}.{self.ckpt_names[name]}.{kind}"
        part = SHARDS[{"gate": "w1", "up": "w3", "down": "w2"}[name]][1]

        def check(shape: tuple[int, ...], dtype: torch.dtype) -> None:
            if tuple(w.shape) != shape or w.dtype != dtype:
                raise CheckpointError(g.file, tensor, f"{dtype} {list(shape)}", f"{w.dtype} {list(w.shape)}")

        (k0, k1), (n0, n1) = p.k_range, p.n_range
        if kind == "trellis":
            check((g.size_k // TILE, g.size_n // TILE, reference.words_per_tile(g.bits)), torch.int16)
            src = w[k0 // TILE : k1 // TILE, n0 // TILE : n1 // TILE]
            self.trellis(layer, name, local).copy_(src)
        elif kind == "suh":
            check((g.size_k,), torch.float16)
            (param.data[local, part] if name != "down" else param.data[local]).copy_(w[k0:k1])
        elif kind == "svh":
            check((g.size_n,), torch.float16)
            (param.data[local, part] if name != "down" else param.data[local]).copy_(w[n0:n1])
        else:
            value = int(w.reshape(()).item()) & 0xFFFFFFFF
            if kind != g.codebook or value != MARKER_VALUES[kind]:
                raise CheckpointError(g.file, tensor, f"{g.codebook} marker", f"{kind} marker 0x{value:08X}")
            if name == "down":
                param.data[local] = w.reshape(()).to(torch.int32)
            else:
                param.data[local, part] = w.reshape(()).to(torch.int32)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        E = layer.w13_trellis.shape[0]
        kinds = ["trellis", "suh", "svh"]
        missing = []
        for name, p in layer.exl3_proj.items():
            for kind in kinds + ([p.codebook] if p.codebook in MARKER_VALUES else []):
                missing += [(kind, name, e) for e in range(E) if (kind, name, e) not in layer.exl3_loaded]
        if missing:
            kind, name, e = missing[0]
            g = layer.exl3_groups[name]
            raise CheckpointError(g.file, f"{self.prefix}.{e}.{self.ckpt_names[name]}.{kind}", "loaded", f"never loaded ({len(missing)} missing)")
        reload.keep_first_parameters(layer, [n for n, _ in layer.named_parameters(recurse=False) if n.startswith(("w13_", "w2_"))],
                                     {p.codebook for p in layer.exl3_proj.values()})
        layer.exl3_experts = ExpertLayer(layer.w13_trellis, layer.w13_suh, layer.w13_svh, layer.w2_trellis,
                                         layer.w2_suh, layer.w2_svh, layer.exl3_proj, layer.top_k)
        for name, kernel in layer.exl3_experts.kernels.items():
            trace.note_layer(f"{type(kernel).__name__} moe")
        layer.exl3_count = trace.enabled()
        layer.exl3_moe_refusal = layer.exl3_experts.refusal
        if layer.exl3_moe_refusal is None:
            trace.note_layer("triton_moe.moe_decode moe")
        else:
            trace.set_flag("moe_decode_refused", layer.exl3_moe_refusal)
            logger.debug("exl3: %s: decode/verify on the per-expert path: %s", self.prefix, layer.exl3_moe_refusal)

    @staticmethod
    def trellis(layer: torch.nn.Module, name: str, e: int) -> torch.Tensor:
        """Expert e's trellis of one projection: a view into the layer's arena (where the loader copies to)."""
        if name == "down":
            return layer.w2_trellis[e]
        gate_words = layer.exl3_proj["gate"].words
        flat = layer.w13_trellis[e, :gate_words] if name == "gate" else layer.w13_trellis[e, gate_words:]
        return flat.view(layer.exl3_proj[name].trellis_shape)

    # -- forward
    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        tokens = x.shape[0]
        if tokens == 0:  # an empty batch (e.g. a data-parallel dummy step): nothing routed
            return x.new_zeros(x.shape)
        path = select_path(tokens)
        if layer.exl3_count:
            trace.count(path, tokens, "experts")
        return self.run_path(layer, path, x, topk_weights, topk_ids)

    def run_path(self, layer, path: KernelPath, x, topk_weights, topk_ids) -> torch.Tensor:
        """Run one path of the ladder (tests force each path through here). Fails closed."""
        why = path_refusal(path, x.shape[0])
        if why is not None:
            raise ValueError(f"{self.prefix}: {why}")
        ids = topk_ids
        expert_map = getattr(layer, "expert_map", None)
        if expert_map is not None:
            ids = expert_map[ids.long()]  # global -> local; -1 for another rank's expert
        return layer.exl3_experts.run(path, x, topk_weights.float(), ids)
