"""Exl3Config: vLLM's view of an EXL3 checkpoint, and the answer to "which method for this layer?".

vLLM builds the config in its API process (`from_config`, then `maybe_update_config` with the model
path) and pickles it into the engine and worker processes. The Manifest (exl3local.manifest) is
read in the API process to fail fast on a broken checkpoint, and again lazily in the worker: it is
headers only, so that costs milliseconds, and it keeps the pickled config small.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from exl3local import manifest as manifest_mod
from exl3local.errors import CheckpointError, ConfigError
from exl3local.manifest import Manifest, TensorGroup

NAME = "exl3"
# Keys exllamav3 1.6.5 writes into config.json's quantization_config (format spec §1.2). Anything
# else means a format we have not read, so it is refused rather than ignored.
KNOWN_KEYS = frozenset(
    {
        "quant_method", "version", "bits", "head_bits", "calibration", "out_scales", "codebook",
        "vision_bits", "mtp_bits", "embed_bits", "original_quantization_config", "experimental_options",
    }
)  # fmt: skip
# Fused vLLM layers and the checkpoint tensors they are built from, for models that do not declare
# packed_modules_mapping themselves (every EXL3 checkpoint stores the parts separately, spec §6).
DEFAULT_PACKED = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"],
    "qkv": ["q_proj", "k_proj", "v_proj"],  # Qwen3.5's vision attention (see get_checkpoint_weight_mapper)
}  # fmt: skip


@register_quantization_config(NAME)
class Exl3Config(QuantizationConfig):
    """The `exl3` quantization method: per-tensor bits and codebook come from the checkpoint itself."""

    def __init__(self, quant_config: Mapping[str, Any], checkpoint: str | None = None) -> None:
        super().__init__()
        self.quant_config = dict(quant_config)
        self.checkpoint = checkpoint
        self._rename: Any = None  # vLLM's WeightsMapper (renames only) for this model class
        self._manifest: Manifest | None = None
        self._index: dict[str, TensorGroup] | None = None
        self._dense: frozenset[str] | None = None
        self._lock = threading.Lock()

    # -- pickling: the manifest holds read-only mappings and is cheap to re-read in each process
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_manifest=None, _index=None, _dense=None, _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Exl3Config(bits={self.quant_config.get('bits')}, checkpoint={self.checkpoint!r})"

    # -- QuantizationConfig API
    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        # No capability floor: kernel choice (exl3local.kernels.prepare) refuses per layer, with reasons.
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # quantization_config lives in config.json

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Exl3Config:
        if config.get("quant_method") != NAME:
            raise ConfigError(f"quantization_config.quant_method is {config.get('quant_method')!r}, not {NAME!r}")
        unknown = sorted(set(config) - KNOWN_KEYS)
        if unknown:
            raise ConfigError(
                f"quantization_config has keys exl3local does not know: {unknown}",
                hint="the checkpoint was written by a newer exllamav3; check docs/exl3-format.md §1.2",
            )
        return cls(config)

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        """Called in the API process with the model path: read (and so check) the manifest now."""
        path = Path(model_name)
        if not path.is_dir():
            raise CheckpointError(
                model_name, None, "a local EXL3 checkpoint directory", "no such directory",
                hint="download it first (exl3local pull) and serve the directory",
            )
        self.checkpoint = str(path)
        self.manifest  # noqa: B018 — read now: a broken checkpoint fails before any process starts

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        """vLLM renames some checkpoint prefixes (multimodal wrappers): index the manifest by vLLM names.
        Only the renames: stacked maps (Qwen3.5's in_proj_qkv -> in_proj_qkvz) would merge the parts that
        part_prefixes() must still tell apart, and drops ("mtp.": None) are the loader's business."""
        with self._lock:
            self._rename = hf_to_vllm_mapper.get_rename_mapper()
            self._index = self._dense = None

    def get_checkpoint_weight_mapper(self) -> Any:
        """Qwen3.5 vision towers as exllamav3 writes them: attention q/k/v quantized separately beside the
        original fused bf16 `attn.qkv`. Serve the EXL3 parts as the shards of vLLM's fused qkv layer and
        skip the bf16 copy, so the tower stays compressed."""
        mapper = super().get_checkpoint_weight_mapper()
        if not self._split_vision_qkv():
            return mapper
        from vllm.model_executor.models.utils import WeightsMapper

        return mapper | WeightsMapper(
            orig_to_new_regex={re.compile(r"\.attn\.qkv\.(weight|bias)$"): None},  # before the renames below
            orig_to_new_stacked={f".attn.{p}_proj.": (".attn.qkv.", p) for p in "qkv"},
        )

    def _split_vision_qkv(self) -> bool:
        return any(
            prefix.endswith(".attn.q_proj") and f"{prefix.removesuffix('q_proj')}qkv.weight" in self.manifest.unquantized
            for prefix in self.manifest.quantized
        )

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from vllm.model_executor.layers.fused_moe import RoutedExperts
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        from exl3local.plugin.linear import Exl3LinearMethod

        if isinstance(layer, RoutedExperts):
            return self._moe_method(layer, prefix)
        if isinstance(layer, ParallelLMHead):
            group = self.groups().get(prefix)
            if group is not None:
                return Exl3LinearMethod(self, prefix, [group])
            if f"{prefix}.weight" in self.dense_tensors():
                return None  # head_bits 16: vLLM's own unquantized head
            raise CheckpointError(self._file(), f"{prefix}", "lm_head tensors (trellis or weight)", "none")
        if isinstance(layer, LinearBase):
            parts = self.part_prefixes(prefix)
            groups = self.groups()
            quantized = [p for p in parts if p in groups]
            if len(quantized) == len(parts):
                return Exl3LinearMethod(self, prefix, [groups[p] for p in parts])
            dense = [p for p in parts if f"{p}.weight" in self.dense_tensors()]
            if len(dense) == len(parts):
                return UnquantizedLinearMethod()  # stored unquantized (e.g. the MoE router)
            raise CheckpointError(
                self._file(), prefix,
                f"EXL3 tensors (trellis/suh/svh) or a dense weight for each of {parts}",
                f"EXL3 for {quantized or 'none'}, dense for {dense or 'none'}",
                hint="the checkpoint does not cover this layer; it may be for another architecture",
            )
        return None  # embeddings, attention: vLLM's own methods

    # -- checkpoint lookup
    @property
    def manifest(self) -> Manifest:
        with self._lock:
            if self._manifest is None:
                if self.checkpoint is None:
                    raise CheckpointError("<unknown>", None, "the checkpoint path from vLLM", "none was given")
                self._manifest = manifest_mod.read(self.checkpoint)
            return self._manifest

    def _vllm_name(self, name: str) -> str | None:
        return name if self._rename is None else self._rename.map_name(name)

    def groups(self) -> dict[str, TensorGroup]:
        """EXL3 tensor groups by vLLM prefix, and by checkpoint prefix where vLLM keeps the name: a draft
        model (Qwen3.5's MTP head) shares this config but names its layers as the checkpoint does."""
        if self._index is None:
            index = dict(self.manifest.quantized)
            for prefix, group in self.manifest.quantized.items():
                mapped = self._vllm_name(f"{prefix}.trellis")
                if mapped is not None:
                    index[mapped.removesuffix(".trellis")] = group
            self._index = index
        return self._index

    def dense_tensors(self) -> frozenset[str]:
        """Unquantized tensor names, as vLLM and as the checkpoint names them."""
        if self._dense is None:
            names = {self._vllm_name(n) for n in self.manifest.unquantized} | set(self.manifest.unquantized)
            self._dense = frozenset(n for n in names if n is not None)
        return self._dense

    def part_prefixes(self, prefix: str) -> list[str]:
        """The checkpoint prefixes a vLLM layer is built from: [prefix], or the parts of a fused layer. The
        model's own packing comes first; ours where the checkpoint stores EXL3 parts the model expects fused
        (Qwen3.5's vision `qkv`, packed as itself by vLLM, is q/k/v_proj in EXL3 checkpoints)."""
        if prefix in self.groups():
            return [prefix]
        head, _, leaf = prefix.rpartition(".")
        candidates = [c for c in (self.packed_modules_mapping.get(leaf), DEFAULT_PACKED.get(leaf)) if c] or [[leaf]]
        layouts = [[f"{head}.{p}" if head else p for p in parts] for parts in candidates]
        for layout in layouts:
            if all(p in self.groups() for p in layout):
                return layout
        return layouts[0]

    def _file(self) -> str:
        return str(self.checkpoint)

    def _moe_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from exl3local.plugin.moe import Exl3MoEMethod

        groups = self.groups()
        first = f"{prefix}.0.{layer.ckpt_gate_proj_name}"
        if first in groups:
            return Exl3MoEMethod(self, layer, prefix)
        if f"{first}.weight" in self.dense_tensors():
            return None  # unquantized experts: vLLM's own MoE method
        raise CheckpointError(
            self._file(), first, "EXL3 expert tensors (trellis/suh/svh) or a dense weight", "none",
            hint="the checkpoint does not cover this MoE layer; it may be for another architecture",
        )
