"""Read an EXL3 checkpoint directory into a frozen Manifest without loading its weights.

Sources: config.json (`quantization_config`), quantization_config.json (`tensor_storage`), and the
safetensors headers (one file, or shards listed by model.safetensors.index.json). The only tensor
bytes read are the 4-byte codebook markers, whose value must be checked (format spec §1.4).
Everything wrong is a CheckpointError naming the file, the tensor, what was expected and found.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from exl3local.errors import CheckpointError
from exl3local.model_config import unpadded_dims
from exl3local.safetensors_files import SINGLE_FILE, TensorInfo, is_int, read_json, read_marker, read_tensors
from exl3local.units import format_bytes

CONFIG_FILE = "config.json"
QUANT_CONFIG_FILE = "quantization_config.json"
FLOAT_DTYPES = {"F16", "BF16", "F32"}

# Codebook markers: an int32 scalar whose bit pattern is the codebook's multiplier (spec §1.4).
MARKER_VALUES = {"mcg": 0xCBAC1FED, "mul1": 0x83DCD12D}
GROUP_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")
HALF_RATE_WIDTHS = {24: 1.5, 40: 2.5, 56: 3.5}  # 16*KA + 8 int16 words per tile, mul1 only
TILE = 16
BLOCK = 128  # k and n of every EXL3 tensor are multiples of the Hadamard block


@dataclass(frozen=True)
class TensorGroup:
    """One quantized linear: `prefix.trellis`, `prefix.suh`, `prefix.svh` [, marker, bias]."""

    prefix: str
    bits: float
    codebook: str  # "3inst" | "mcg" | "mul1"
    size_k: int  # padded input features (16 * trellis.shape[0])
    size_n: int  # padded output features (16 * trellis.shape[1])
    unpadded_k: int | None  # from the model config, where the layer's role is known
    unpadded_n: int | None
    has_bias: bool
    file: str
    tensors: tuple[str, ...]

    @property
    def trellis_bytes(self) -> int:
        return self.size_k * self.size_n * int(round(16 * self.bits)) // 128


@dataclass(frozen=True)
class Manifest:
    path: Path
    config: Mapping[str, Any]
    quantization_config: Mapping[str, Any]
    architecture: str
    quantized: Mapping[str, TensorGroup]
    unquantized: Mapping[str, TensorInfo]
    files: tuple[str, ...]
    bytes_on_disk: int
    weight_bytes: int  # what the weights take in memory as stored (trellises stay compressed)
    bits_histogram: Mapping[float, int] = field(default_factory=dict)  # bits -> number of linears

    def group(self, prefix: str) -> TensorGroup:
        try:
            return self.quantized[prefix]
        except KeyError:
            raise CheckpointError(
                str(self.path), prefix, "an EXL3 tensor group (trellis, suh, svh)", "no such group"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "architecture": self.architecture,
            "quantization_config": dict(self.quantization_config),
            "files": list(self.files),
            "bytes_on_disk": self.bytes_on_disk,
            "weight_bytes": self.weight_bytes,
            "bits_histogram": {str(k): v for k, v in sorted(self.bits_histogram.items())},
            "quantized": {p: asdict(g) for p, g in self.quantized.items()},
            "unquantized": {
                n: {"dtype": t.dtype, "shape": list(t.shape), "file": t.file} for n, t in self.unquantized.items()
            },
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def summary(self) -> str:
        q = self.quantization_config
        codebooks = Counter(g.codebook for g in self.quantized.values())
        quant_weights = sum(g.size_k * g.size_n for g in self.quantized.values())
        quant_bits = sum(g.size_k * g.size_n * g.bits for g in self.quantized.values())
        lines = [
            f"{self.path}",
            f"  architecture   {self.architecture}",
            f"  exl3           version {q.get('version', '?')}, bits {q.get('bits', '?')}, "
            f"head_bits {q.get('head_bits', '?')}",
            f"  files          {len(self.files)} ({format_bytes(self.bytes_on_disk)} on disk)",
            f"  weights        {format_bytes(self.weight_bytes)} in memory as stored",
            f"  quantized      {len(self.quantized)} linears, "
            f"{quant_bits / quant_weights if quant_weights else 0:.2f} bpw average",
            "  bits           " + ", ".join(f"{b:g}: {n}" for b, n in sorted(self.bits_histogram.items())),
            "  codebooks      " + ", ".join(f"{c}: {n}" for c, n in sorted(codebooks.items())),
            f"  unquantized    {len(self.unquantized)} tensors "
            f"({format_bytes(sum(t.nbytes for t in self.unquantized.values()))})",
        ]
        underived = [g.prefix for g in self.quantized.values() if g.unpadded_k is None or g.unpadded_n is None]
        if underived:
            lines.append(
                f"  unknown dims   {len(underived)} linears whose role config.json does not size (e.g. {underived[0]}):"
                " served at their padded size, checked only against the format's 128-multiples"
            )
        return "\n".join([*lines, "", *self.linear_rows()])

    def linear_rows(self) -> list[str]:
        """One line per quantized linear: bits, codebook, shape (in x out as the config defines it, the padded
        size after it where they differ, `?` where the config does not size it). The experts of one projection
        share bits and codebook (checked), so they are one line, with their count."""
        rows: dict[tuple[str, float, str, str], int] = {}
        for g in self.quantized.values():
            name = _EXPERT_NUMBER.sub(".experts.*.", g.prefix)
            shape = f"{_dim(g.unpadded_k)} x {_dim(g.unpadded_n)}"
            if (g.unpadded_k, g.unpadded_n) != (g.size_k, g.size_n):
                shape += f" (padded {g.size_k} x {g.size_n})"
            key = (name, g.bits, g.codebook, shape)
            rows[key] = rows.get(key, 0) + 1
        width = max((len(name) for name, *_ in rows), default=0)
        out = [f"  {'linear':<{width}}  bits  codebook  in x out"]
        for (name, bits, codebook, shape), count in rows.items():
            many = f"  ({count} experts)" if count > 1 else ""
            out.append(f"  {name:<{width}}  {bits:<4g}  {codebook:<8}  {shape}{many}")
        return out


_EXPERT_NUMBER = re.compile(r"\.experts\.\d+\.")


def _dim(value: int | None) -> str:
    return "?" if value is None else str(value)


# ---------------------------------------------------------------------------------------------
# grouping and validation


def _bits_from_width(file: str, tensor: str, width: int) -> float:
    if width % 16 == 0 and 1 <= width // 16 <= 8:
        return float(width // 16)
    if width in HALF_RATE_WIDTHS:
        return HALF_RATE_WIDTHS[width]
    raise CheckpointError(
        file, tensor, "a trellis width of 16*K int16 (K=1..8) or 24/40/56 (K=1.5/2.5/3.5)", str(width)
    )


def _build_group(root: Path, prefix: str, parts: dict[str, TensorInfo], config: Mapping[str, Any]) -> TensorGroup:
    trellis = parts["trellis"]
    file = trellis.file
    if trellis.dtype != "I16" or len(trellis.shape) != 3:
        raise CheckpointError(
            file, trellis.name, "int16 (k/16, n/16, 16*K)", f"{trellis.dtype}{list(trellis.shape)}"
        )
    bits = _bits_from_width(file, trellis.name, trellis.shape[2])
    size_k, size_n = TILE * trellis.shape[0], TILE * trellis.shape[1]
    if size_k == 0 or size_n == 0 or size_k % BLOCK or size_n % BLOCK:
        raise CheckpointError(file, trellis.name, "k and n multiples of 128 (padded at conversion)", f"k={size_k}, n={size_n}")
    for side, size, packed in (("suh", size_k, "su"), ("svh", size_n, "sv")):
        if side in parts:
            t = parts[side]
            if t.dtype != "F16" or t.shape != (size,):
                raise CheckpointError(t.file, t.name, f"F16[{size}]", f"{t.dtype}{list(t.shape)}")
        elif packed in parts:
            t = parts[packed]
            if t.dtype != "I16" or t.shape != (size // TILE,):
                raise CheckpointError(t.file, t.name, f"I16[{size // TILE}] packed signs", f"{t.dtype}{list(t.shape)}")
        else:
            raise CheckpointError(file, f"{prefix}.{side}", f"{side} (or packed {packed}) beside the trellis", "missing")
    markers = [m for m in MARKER_VALUES if m in parts]
    if len(markers) > 1:
        raise CheckpointError(file, prefix, "at most one codebook marker", " and ".join(markers))
    codebook = markers[0] if markers else "3inst"
    if markers:
        marker = parts[codebook]
        if marker.dtype != "I32" or marker.shape != ():
            raise CheckpointError(marker.file, marker.name, "an int32 scalar marker", f"{marker.dtype}{list(marker.shape)}")
        value = read_marker(root, marker)
        if value != MARKER_VALUES[codebook]:
            raise CheckpointError(
                marker.file, marker.name, f"marker value 0x{MARKER_VALUES[codebook]:08X}", f"0x{value:08X}"
            )
    if bits != int(bits) and codebook != "mul1":
        raise CheckpointError(file, trellis.name, "half-integer bits only with the mul1 codebook", f"{bits} with {codebook}")
    if "bias" in parts:
        b = parts["bias"]
        if b.dtype not in FLOAT_DTYPES or b.shape != (size_n,):
            raise CheckpointError(b.file, b.name, f"a float bias of shape [{size_n}]", f"{b.dtype}{list(b.shape)}")
    unpadded_k, unpadded_n = unpadded_dims(prefix, config)
    for role, unpadded, padded in (("in", unpadded_k, size_k), ("out", unpadded_n, size_n)):
        if unpadded is not None and not padded - BLOCK < unpadded <= padded:
            raise CheckpointError(
                file, trellis.name, f"{role} features {unpadded} (config) padded to {padded}",
                f"{padded} (trellis shape {list(trellis.shape)})",
            )
    return TensorGroup(
        prefix, bits, codebook, size_k, size_n, unpadded_k, unpadded_n, "bias" in parts, file,
        tuple(sorted(t.name for t in parts.values())),
    )


def _check_declared_bits(qstorage: Any, groups: Mapping[str, TensorGroup]) -> None:
    """quantization_config.json's tensor_storage must agree with the trellis widths."""
    if not isinstance(qstorage, dict):
        raise CheckpointError(QUANT_CONFIG_FILE, "tensor_storage", "an object of module -> entry", type(qstorage).__name__)
    for module, entry in qstorage.items():
        if not isinstance(entry, dict) or entry.get("quant_format") != "exl3":
            continue
        declared = entry.get("bits_per_weight")
        if module not in groups:
            raise CheckpointError(QUANT_CONFIG_FILE, module, "the EXL3 tensors this entry declares", "missing in the safetensors")
        if declared != groups[module].bits:
            raise CheckpointError(
                groups[module].file, f"{module}.trellis",
                f"bits_per_weight {declared} (as {QUANT_CONFIG_FILE} declares)",
                f"a trellis width for {groups[module].bits:g} bits",
            )


def _check_uniform_experts(groups: Mapping[str, TensorGroup]) -> None:
    """Routed experts of one layer and projection must share bits and codebook (one packed arena)."""
    seen: dict[str, TensorGroup] = {}
    for prefix, g in sorted(groups.items()):
        head, sep, tail = prefix.partition(".experts.")
        if not sep or "." not in tail:
            continue
        expert, projection = tail.split(".", 1)
        if not expert.isdigit():
            continue
        key = f"{head}.experts.*.{projection}"
        first = seen.setdefault(key, g)
        if (first.bits, first.codebook) != (g.bits, g.codebook):
            raise CheckpointError(
                g.file, prefix, f"{first.bits:g} bits / {first.codebook} like {first.prefix} (uniform per projection)",
                f"{g.bits:g} bits / {g.codebook}",
            )


def _check_head(qcfg: Mapping[str, Any], groups: Mapping[str, TensorGroup], tensors: Mapping[str, TensorInfo]) -> None:
    head_bits = qcfg.get("head_bits")
    if head_bits is None:
        return
    if head_bits == 16:
        if "lm_head" in groups:
            raise CheckpointError(groups["lm_head"].file, "lm_head", "an unquantized lm_head (head_bits 16)", "EXL3 tensors")
    elif "lm_head" in groups and groups["lm_head"].bits != head_bits:
        raise CheckpointError(
            groups["lm_head"].file, "lm_head.trellis", f"head_bits {head_bits} (config.json)", f"{groups['lm_head'].bits:g} bits"
        )
    elif "lm_head" not in groups and "lm_head.weight" not in tensors:
        # exllamav3 always writes a separate head; a tied config without one got past here and was refused by
        # vLLM only after it had started
        raise CheckpointError(SINGLE_FILE, "lm_head", f"lm_head tensors (head_bits {head_bits})",
                              "none" + (" (tie_word_embeddings is set, but an EXL3 checkpoint keeps its own head)"
                                        if qcfg.get("tie_word_embeddings") else ""))


def _read_config(root: Path) -> tuple[dict[str, Any], dict[str, Any], str]:
    """config.json: the whole config, its EXL3 quantization_config, and the model class."""
    config = read_json(root / CONFIG_FILE, "the model's config.json")
    if not isinstance(config, dict):
        raise CheckpointError(CONFIG_FILE, None, "a JSON object", type(config).__name__)
    qcfg = config.get("quantization_config")
    if not isinstance(qcfg, dict) or qcfg.get("quant_method") != "exl3":
        found = qcfg.get("quant_method") if isinstance(qcfg, dict) else "no quantization_config"
        raise CheckpointError(
            CONFIG_FILE, "quantization_config.quant_method", '"exl3"', repr(found),
            hint="this is not an EXL3 checkpoint; convert it with exllamav3 or pick an EXL3 repo",
        )
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise CheckpointError(CONFIG_FILE, "architectures", "a list naming the model class", repr(architectures))
    return config, qcfg, architectures[0]


def _group_tensors(root: Path, tensors: Mapping[str, TensorInfo], config: Mapping[str, Any]) -> dict[str, TensorGroup]:
    """Every EXL3 tensor group (prefix.trellis and its siblings), checked; the other tensors stay plain."""
    by_prefix: dict[str, dict[str, TensorInfo]] = defaultdict(dict)
    for name, info in tensors.items():
        prefix, _, suffix = name.rpartition(".")
        if suffix in GROUP_SUFFIXES and prefix:
            by_prefix[prefix][suffix] = info
    groups: dict[str, TensorGroup] = {}
    for prefix, parts in sorted(by_prefix.items()):
        if "trellis" not in parts:
            stray = sorted(set(parts) - {"bias"})
            if stray:  # scales or a marker without their trellis: a broken group, not plain tensors
                raise CheckpointError(parts[stray[0]].file, f"{prefix}.trellis", f"a trellis beside {prefix}.{stray[0]}", "missing")
            continue
        if f"{prefix}.weight" in tensors:
            raise CheckpointError(parts["trellis"].file, f"{prefix}.weight", "no dense weight beside an EXL3 trellis", "both")
        groups[prefix] = _build_group(root, prefix, parts, config)
    return groups


def read(path: str | Path) -> Manifest:
    """Read and check a checkpoint directory. Raises CheckpointError; loads no weights."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(str(root), None, "a checkpoint directory", "no such directory")
    config, qcfg, architecture = _read_config(root)
    tensors = read_tensors(root)
    groups = _group_tensors(root, tensors, config)
    qconfig_path = root / QUANT_CONFIG_FILE
    if qconfig_path.exists():
        qfile = read_json(qconfig_path, "quantization_config.json")
        if not isinstance(qfile, dict):
            raise CheckpointError(QUANT_CONFIG_FILE, None, "a JSON object", type(qfile).__name__)
        _check_declared_bits(qfile.get("tensor_storage", {}), groups)
    _check_uniform_experts(groups)
    _check_head({**qcfg, "tie_word_embeddings": config.get("tie_word_embeddings")}, groups, tensors)
    if not groups:
        raise CheckpointError(str(root), None, "at least one EXL3 tensor group", "none (no *.trellis tensors)")

    grouped = {name for g in groups.values() for name in g.tensors}
    files = tuple(sorted({t.file for t in tensors.values()}))
    return Manifest(
        path=root,
        config=MappingProxyType(config),
        quantization_config=MappingProxyType(qcfg),
        architecture=architecture,
        quantized=MappingProxyType(groups),
        unquantized=MappingProxyType({n: t for n, t in sorted(tensors.items()) if n not in grouped}),
        files=files,
        bytes_on_disk=sum((root / f).stat().st_size for f in files),
        weight_bytes=sum(t.nbytes for t in tensors.values()),
        bits_histogram=MappingProxyType(dict(Counter(g.bits for g in groups.values()))),
    )
