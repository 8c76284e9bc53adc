"""Exl3LinearMethod: EXL3 trellis weights inside vLLM's linear layers (and a quantized lm_head).

Checkpoint layout (format spec §1.4, §6), per part P of a layer, with k/n padded to 128:

    P.trellis  int16 (k/16, n/16, 16*bits)     P.suh fp16 (k,)     P.svh fp16 (n,)     [P.mul1|P.mcg int32 ()]

Layer layout here: one flat arena per tensor kind and layer (`trellis`, `suh`, `svh`, one marker
vector per codebook), each part a view into it. Fused vLLM layers (qkv_proj from q/k/v, gate_up_proj
from gate/up) keep every part separate: the parts share the input but each has its own suh, so each
needs its own input transform H(x ⊙ suh_part) (spec §6); bits may differ between parts too.

Padding: the vLLM layer sees unpadded sizes. apply() zero-pads x to the padded k and trims each
part's output to its unpadded n. Tensor parallelism slices the trellis in whole 128-blocks (spec §6
"Tensor-parallel slicing"); splits that are not 128-aligned are refused with the sizes involved.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.utils import set_weight_attrs

from exl3local import env, kernels
from exl3local.errors import CheckpointError, ConfigError
from exl3local.kernels import reference
from exl3local.kernels.bound import BoundLinear
from exl3local.kernels.hadamard import HADAMARD_BLOCK, hadamard_cols, hadamard_rows
from exl3local.manifest import MARKER_VALUES, TensorGroup
from exl3local.plugin import ops, reload, trace

logger = logging.getLogger("exl3local.plugin")

TILE = reference.TILE
DECODE_ONCE_PATH = "decode_once"  # trace path name of the opt-in dense copy (not a KernelPath)


@dataclass(frozen=True)
class PartLayout:
    """One checkpoint tensor group as this rank stores it: the slice it owns and where it lives."""

    group: TensorGroup
    index: int
    k_range: tuple[int, int]  # padded input rows of the checkpoint tensor held here
    n_range: tuple[int, int]  # padded output columns held here
    out_features: int  # unpadded output width this part contributes to the layer's output
    trellis_offset: int  # into the flat trellis arena (int16 words)
    svh_offset: int  # into the flat svh arena

    @property
    def size_k(self) -> int:
        return self.k_range[1] - self.k_range[0]

    @property
    def size_n(self) -> int:
        return self.n_range[1] - self.n_range[0]

    @property
    def trellis_shape(self) -> tuple[int, int, int]:
        return (self.size_k // TILE, self.size_n // TILE, reference.words_per_tile(self.group.bits))

    @property
    def trellis_words(self) -> int:
        a, b, c = self.trellis_shape
        return a * b * c


def split_range(group: TensorGroup, what: str, local: int, padded: int, rank: int, size: int) -> tuple[int, int]:
    """The padded range that rank `rank` of `size` holds when vLLM gives it `local` unpadded features."""
    if size == 1:
        if not padded - HADAMARD_BLOCK < local <= padded:
            raise CheckpointError(
                group.file, f"{group.prefix}.trellis",
                f"{local} {what} features (the model config), padded up to a multiple of 128", str(padded),
            )  # fmt: skip
        return 0, padded
    if local % HADAMARD_BLOCK:
        raise ConfigError(
            f"{group.prefix}: tensor parallelism {size} splits {what} features into {local} per rank, which is not a "
            f"multiple of 128; EXL3 weights split only at 128-blocks",
            hint="serve with a tensor-parallel size that keeps every per-rank slice a multiple of 128",
        )
    start, end = rank * local, (rank + 1) * local
    if end > padded:
        raise CheckpointError(group.file, f"{group.prefix}.trellis", f"at least {end} {what} features", str(padded))
    return start, end


def refuse_packed_signs(group: TensorGroup) -> None:
    """Legacy packed sign vectors (su/sv) instead of suh/svh: no released quantizer writes them (spec §1.4)."""
    for scale in ("suh", "svh"):
        if f"{group.prefix}.{scale}" not in group.tensors:
            raise CheckpointError(
                group.file, f"{group.prefix}.{scale}", f"{scale} (fp16 scales)",
                f"legacy packed signs {scale[:2]}, which exl3local does not load",
            )  # fmt: skip


class Exl3LinearMethod(LinearMethodBase):
    """An EXL3 linear: compressed trellis in memory, one kernel choice per part at load time."""

    def __init__(self, config, prefix: str, groups: list[TensorGroup]) -> None:
        super().__init__()
        self.config = config
        self.prefix = prefix
        self.groups = groups

    # -- weights
    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        spans = self._partition_spans(output_partition_sizes)
        self._refuse_unservable(layer, spans, output_partition_sizes)
        parts = self._lay_out_parts(layer, spans, input_size_per_partition, input_size, output_size)
        k_local = parts[0].size_k
        trellis_words = sum(p.trellis_words for p in parts)
        svh_size = sum(p.size_n for p in parts)
        layer.exl3_parts = parts
        layer.exl3_part_of_shard = {first: i for i, (first, _) in enumerate(spans)}
        layer.exl3_role = trace.role_of(self.prefix)
        layer.exl3_in_features = input_size_per_partition
        layer.exl3_loaded = set()

        def register(name: str, tensor: torch.Tensor) -> None:
            param = torch.nn.Parameter(tensor, requires_grad=False)
            set_weight_attrs(param, {"weight_loader": self._loader(layer, name)})
            layer.register_parameter(name, param)

        register("trellis", torch.empty(trellis_words, dtype=torch.int16))
        register("suh", torch.empty(len(parts) * k_local, dtype=torch.float16))
        register("svh", torch.empty(svh_size, dtype=torch.float16))
        for codebook in sorted({g.codebook for g in self.groups} & set(MARKER_VALUES)):
            register(codebook, torch.zeros(len(parts), dtype=torch.int32))
        layer.exl3_act_dtype = params_dtype

    def _refuse_unservable(self, layer: torch.nn.Module, spans: list[tuple[int, int]], output_partition_sizes: list[int]) -> None:
        for g in self.groups:
            refuse_packed_signs(g)
        if getattr(layer, "has_bias", False) != any(g.has_bias for g in self.groups):
            raise CheckpointError(
                self.config._file(), f"{self.prefix}.bias", f"bias={getattr(layer, 'has_bias', False)} (model config)",
                f"bias={any(g.has_bias for g in self.groups)} in the checkpoint",
            )
        if getattr(layer, "tp_size", 1) > 1 and len(spans) != len(output_partition_sizes):
            raise ConfigError(
                f"{self.prefix}: tensor parallelism splits each of vLLM's {len(output_partition_sizes)} output parts, "
                f"but the checkpoint stores them as {len(spans)} EXL3 tensors; a rank's slice of one tensor would not "
                "be contiguous",
                hint="serve this model with tensor-parallel size 1",
            )

    def _lay_out_parts(
        self, layer: torch.nn.Module, spans: list[tuple[int, int]], input_size_per_partition: int, input_size: int,
        output_size: int,
    ) -> list[PartLayout]:
        """Where each part's slice (this rank's, under tensor parallelism) sits in the layer's flat arenas."""
        tp_rank, tp_size = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
        split_in = tp_size > 1 and input_size_per_partition != input_size
        split_out = tp_size > 1 and not split_in and sum(n for _, n in spans) != output_size
        parts: list[PartLayout] = []
        trellis_words = svh_size = 0
        for i, (group, (_, n_local)) in enumerate(zip(self.groups, spans, strict=True)):
            k_range = split_range(
                group, "input", input_size_per_partition, group.size_k, tp_rank if split_in else 0,
                tp_size if split_in else 1,
            )
            out_rank = tp_rank
            if split_out and i > 0 and getattr(layer, "num_kv_head_replicas", 1) > 1:
                out_rank = tp_rank // layer.num_kv_head_replicas  # k/v heads replicated across ranks
            n_range = split_range(
                group, "output", n_local, group.size_n, out_rank if split_out else 0, tp_size if split_out else 1
            )
            part = PartLayout(group, i, k_range, n_range, n_local, trellis_words, svh_size)
            if parts and part.size_k != parts[0].size_k:
                raise CheckpointError(
                    self.config._file(), group.prefix, f"padded k {parts[0].size_k} like its siblings", str(part.size_k)
                )
            parts.append(part)
            trellis_words += part.trellis_words
            svh_size += part.size_n
        return parts

    def _loader(self, layer: torch.nn.Module, kind: str):
        def load(param: torch.nn.Parameter, loaded_weight: torch.Tensor, shard_id=None, *args, **kwargs) -> None:
            part = layer.exl3_parts[self._part_index(layer, shard_id)]
            self._load_part(layer, param, kind, part, loaded_weight)
            layer.exl3_loaded.add((kind, part.index))

        return load

    def _part_index(self, layer: torch.nn.Module, shard_id) -> int:
        """The part a checkpoint tensor loads into: vLLM names it by the first output shard it covers."""
        n = len(layer.exl3_parts)
        if shard_id is None:
            if n != 1:
                raise CheckpointError(
                    self.config._file(), self.prefix, "EXL3 parts stored separately (q/k/v, gate/up)", "a fused tensor"
                )
            return 0
        if isinstance(shard_id, str):
            first = {"q": 0, "k": 1, "v": 2}.get(shard_id)
        elif isinstance(shard_id, int):
            first = shard_id
        elif isinstance(shard_id, tuple) and shard_id:  # one tensor over consecutive shards (in_proj_qkv)
            first = shard_id[0]
        else:
            first = None
        index = layer.exl3_part_of_shard.get(first)
        if index is None:
            raise CheckpointError(
                self.config._file(), self.prefix, f"a tensor starting at one of shards {sorted(layer.exl3_part_of_shard)}",
                repr(shard_id),
            )
        return index

    def _partition_spans(self, output_partition_sizes: list[int]) -> list[tuple[int, int]]:
        """(first vLLM output shard, output features) per checkpoint group. Mostly one group per shard; some
        models fuse shards that the checkpoint stores together (Qwen3.5's in_proj_qkv feeds q, k and v)."""
        if len(output_partition_sizes) == len(self.groups):
            return [(i, n) for i, n in enumerate(output_partition_sizes)]
        spans, first = [], 0
        for g in self.groups:
            total = 0
            for last in range(first, len(output_partition_sizes)):
                total += output_partition_sizes[last]
                if total == g.unpadded_n or (g.unpadded_n is None and g.size_n - HADAMARD_BLOCK < total <= g.size_n):
                    break
            else:
                break  # no run of shards from `first` makes this group: refused below
            spans.append((first, total))
            first = last + 1
        if len(spans) != len(self.groups) or first != len(output_partition_sizes):
            raise CheckpointError(
                self.config._file(), self.prefix,
                f"EXL3 tensors covering vLLM's output parts {output_partition_sizes} in order",
                ", ".join(f"{g.prefix} ({g.unpadded_n or g.size_n} features)" for g in self.groups),
            )
        return spans

    def _load_part(self, layer, param, kind: str, part: PartLayout, w: torch.Tensor) -> None:
        g = part.group
        if kind == "trellis":
            expected = (g.size_k // TILE, g.size_n // TILE, reference.words_per_tile(g.bits))
            self._check(g, kind, w, expected, torch.int16)
            (k0, k1), (n0, n1) = part.k_range, part.n_range
            dst = param.data[part.trellis_offset : part.trellis_offset + part.trellis_words].view(part.trellis_shape)
            dst.copy_(w[k0 // TILE : k1 // TILE, n0 // TILE : n1 // TILE])
        elif kind == "suh":
            self._check(g, kind, w, (g.size_k,), torch.float16)
            k_local = part.size_k
            param.data[part.index * k_local : (part.index + 1) * k_local].copy_(w[part.k_range[0] : part.k_range[1]])
        elif kind == "svh":
            self._check(g, kind, w, (g.size_n,), torch.float16)
            param.data[part.svh_offset : part.svh_offset + part.size_n].copy_(w[part.n_range[0] : part.n_range[1]])
        else:  # a codebook marker: its value is the codebook's multiplier (spec §1.4)
            value = int(w.reshape(()).item()) & 0xFFFFFFFF
            if g.codebook != kind or value != MARKER_VALUES[kind]:
                raise CheckpointError(
                    g.file, f"{g.prefix}.{kind}", f"{g.codebook} (marker 0x{MARKER_VALUES.get(g.codebook, 0):08X})",
                    f"{kind} marker 0x{value:08X}",
                )
            param.data[part.index] = w.reshape(()).to(torch.int32)

    def _check(self, g: TensorGroup, kind: str, w: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if tuple(w.shape) != shape or w.dtype != dtype:
            raise CheckpointError(
                g.file, f"{g.prefix}.{kind}", f"{dtype} {list(shape)} (as the header said)", f"{w.dtype} {list(w.shape)}"
            )

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        required = {("trellis", p.index) for p in layer.exl3_parts}
        required |= {("suh", p.index) for p in layer.exl3_parts} | {("svh", p.index) for p in layer.exl3_parts}
        required |= {(p.group.codebook, p.index) for p in layer.exl3_parts if p.group.codebook in MARKER_VALUES}
        missing = sorted(required - layer.exl3_loaded)
        if missing:
            kind, index = missing[0]
            g = layer.exl3_parts[index].group
            raise CheckpointError(g.file, f"{g.prefix}.{kind}", "the tensor to be loaded", f"never loaded ({len(missing)} missing)")
        reload.keep_first_parameters(layer, [name for name, _ in layer.named_parameters(recurse=False)],
                                     {p.group.codebook for p in layer.exl3_parts})
        device = layer.trellis.device
        layer.exl3_kernels = []
        for part in layer.exl3_parts:
            spec = kernels.KernelSpec(part.size_k, part.size_n, part.group.bits, part.group.codebook, layer.exl3_act_dtype)
            kernel = kernels.prepare(spec, device)
            layer.exl3_kernels.append(kernel)
            trace.note_layer(type(kernel).__name__)
        layer.exl3_dense = None
        layer.exl3_count = trace.enabled()
        if env.DECODE_ONCE.get_bool():
            layer.exl3_dense = self.dense_weight(layer).to(layer.exl3_act_dtype)
            if not trace.counters().snapshot()["flags"].get("decode_once"):
                logger.warning("exl3: EXL3LOCAL_DECODE_ONCE=1: linears keep a dense copy of their weights (faster, more memory)")
            trace.set_flag("decode_once", True)
            return
        # Launches bound once (weights, grids, scratch): a decode call then costs two launches per part and no
        # Python-side shape logic; parts whose kernel is not Triton run through each kernel's apply.
        layer.exl3_bound = BoundLinear(
            [(k, *self.part_tensors(layer, p), p.out_features) for p, k in zip(layer.exl3_parts, layer.exl3_kernels, strict=True)],
            layer.exl3_in_features,
        )
        layer.exl3_bound.reserve()
        layer.exl3_forward = self._counted(layer) if layer.exl3_count else layer.exl3_bound
        layer.exl3_key = self.prefix
        ops.register_linear(self.prefix, layer.exl3_forward)

    @staticmethod
    def _counted(layer: torch.nn.Module):
        """The bound layer, counting each call's path(s) in this process's trace (trace.enabled())."""
        bound, kernels, role = layer.exl3_bound, layer.exl3_kernels, layer.exl3_role

        def forward(x: torch.Tensor) -> torch.Tensor:
            rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
            for path in {kernel.path_for(rows) for kernel in kernels}:  # parts may differ in bits
                trace.count(path, rows, role)
            return bound(x)

        return forward

    # -- views
    @staticmethod
    def part_tensors(layer: torch.nn.Module, part: PartLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        trellis = layer.trellis[part.trellis_offset : part.trellis_offset + part.trellis_words].view(part.trellis_shape)
        suh = layer.suh[part.index * part.size_k : (part.index + 1) * part.size_k]
        svh = layer.svh[part.svh_offset : part.svh_offset + part.size_n]
        return trellis, suh, svh

    def dense_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        """The layer's weight as nn.Linear holds it (out, in), fp32: W = diag(suh)·Hk·Ŵ·Hn·diag(svh), trimmed."""
        rows = []
        for part in layer.exl3_parts:
            trellis, suh, svh = self.part_tensors(layer, part)
            w_inner = reference.decode_trellis(trellis, part.group.bits, part.group.codebook).float()
            w = hadamard_rows(hadamard_cols(w_inner) * suh.float()[:, None]) * svh.float()[None, :]
            rows.append(w[: layer.exl3_in_features, : part.out_features].t())
        return torch.cat(rows, 0)

    # -- forward
    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.exl3_dense is not None:
            if layer.exl3_count:
                trace.count(DECODE_ONCE_PATH, x.numel() // x.shape[-1] if x.shape[-1] else 0, layer.exl3_role)
            return F.linear(x, layer.exl3_dense, bias)
        if torch.compiler.is_compiling():  # one opaque node in the traced graph (plugin/ops.py)
            out = ops.linear(x, layer.exl3_key, layer.exl3_bound.out_features)
        else:
            out = layer.exl3_forward(x)
        return out + bias if bias is not None else out
