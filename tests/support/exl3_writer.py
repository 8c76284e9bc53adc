"""Synthetic EXL3 checkpoints for shapes no converted fixture covers, each with its bf16 twin.

From a Qwen3.5-family HF config (dense or MoE, text-only or inside the multimodal wrapper, with or
without MTP layers) and a seed, `write_pair` writes:

- an EXL3 checkpoint laid out as exllamav3 1.6.5 writes these models (`model.language_model.` prefixes
  even for text-only configs, `lm_head`, `mtp.fc`, `mtp.layers.N.*`): every linear is a random trellis
  group (every 16-bit pattern is a valid trellis state) with random-sign suh/svh and the mul1 marker;
  GDN in_proj_a/b, the router and the shared-expert gate stay fp16 `.weight` tensors, norms and
  embeddings bf16. A wrapper config gets its vision tower (`model.visual.*`, linears EXL3 with fp16
  biases at vision_bits, attn.q/k/v_proj split beside the fused bf16 attn.qkv, as the converter writes).
- its twin: the same names and config without quantization_config, every EXL3 group replaced by its
  weight decoded with the reference decoder (W.T trimmed to the config's unpadded dims), all in bf16;
  the vision attention keeps only its fused attn.qkv, as an HF checkpoint has it.

Scales: the decoded trellis has std 1 and the Hadamard rotations are orthonormal, so W's entries have
std |suh|*|svh|. suh = ±1/sqrt(in) and svh = ±gain keep activations O(1) through the layers, like a
normal init; lm_head's larger gain gives peaked next-token distributions, as a trained model has.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from exl3local import manifest, model_config
from exl3local.kernels.reference import reconstruct

CODEBOOK = "mul1"
MUL1_MARKER = manifest.MARKER_VALUES[CODEBOOK] - 2**32  # stored as a signed int32 scalar
LM = "model.language_model."
HEAD_GAIN = 4.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Linear:
    """One EXL3 group: `name` is its prefix; in/out are the config's unpadded features."""

    name: str
    size_in: int
    size_out: int
    bits: float
    gain: float = 1.0
    bias: bool = False
    in_twin: bool = True  # False: only its fused copy (a Fused entry) is in the twin


@dataclass(frozen=True)
class Fused:
    """A bf16 `.weight`/`.bias` pair that concatenates the decoded weights of EXL3 groups written before it."""

    name: str
    parts: tuple[str, ...]


@dataclass(frozen=True)
class Plain:
    """One stored tensor (init: normal around `center` with std `std`, or log-uniform for A_log)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    std: float
    center: float = 0.0


@dataclass(frozen=True)
class Pair:
    exl3: Path
    twin: Path


def padded(size: int) -> int:
    return -(-size // manifest.BLOCK) * manifest.BLOCK


def _norm(name: str, size: int, center: float = 0.0) -> Plain:
    # Qwen3.5's RMSNorms scale by (1 + weight), the GDN output norm by weight: `center` picks which
    return Plain(name, (size,), torch.bfloat16, 0.1, center)


def _mlp(p: str, c: Mapping[str, Any], bits: float) -> Iterator[Linear | Plain]:
    hidden = c["hidden_size"]
    if "num_experts" not in c:
        inter = c["intermediate_size"]
        yield from (Linear(f"{p}mlp.{n}_proj", hidden, inter, bits) for n in ("gate", "up"))
        yield Linear(f"{p}mlp.down_proj", inter, hidden, bits)
        return
    yield Plain(f"{p}mlp.gate.weight", (c["num_experts"], hidden), torch.float16, hidden**-0.5)
    experts = [(f"{p}mlp.experts.{e}.", c["moe_intermediate_size"]) for e in range(c["num_experts"])]
    if c.get("shared_expert_intermediate_size"):
        experts.append((f"{p}mlp.shared_expert.", c["shared_expert_intermediate_size"]))
        yield Plain(f"{p}mlp.shared_expert_gate.weight", (1, hidden), torch.float16, hidden**-0.5)
    for e, inter in experts:
        yield from (Linear(f"{e}{n}_proj", hidden, inter, bits) for n in ("gate", "up"))
        yield Linear(f"{e}down_proj", inter, hidden, bits)


def _attention(p: str, c: Mapping[str, Any], bits: float) -> Iterator[Linear | Plain]:
    hidden, head_dim = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    yield Linear(f"{p}self_attn.q_proj", hidden, 2 * q, bits)  # query and output gate
    yield from (Linear(f"{p}self_attn.{n}_proj", hidden, kv, bits) for n in ("k", "v"))
    yield Linear(f"{p}self_attn.o_proj", q, hidden, bits)
    yield from (_norm(f"{p}self_attn.{n}_norm.weight", head_dim) for n in ("q", "k"))


def _gated_deltanet(p: str, c: Mapping[str, Any], bits: float) -> Iterator[Linear | Plain]:
    hidden, heads = c["hidden_size"], c["linear_num_value_heads"]
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value_dim = heads * c["linear_value_head_dim"]
    yield Linear(f"{p}linear_attn.in_proj_qkv", hidden, 2 * key_dim + value_dim, bits)
    yield Linear(f"{p}linear_attn.in_proj_z", hidden, value_dim, bits)
    yield Linear(f"{p}linear_attn.out_proj", value_dim, hidden, bits)
    yield from (Plain(f"{p}linear_attn.in_proj_{n}.weight", (heads, hidden), torch.float16, hidden**-0.5) for n in "ab")
    yield Plain(f"{p}linear_attn.A_log", (heads,), torch.bfloat16, 0.0)
    yield Plain(f"{p}linear_attn.dt_bias", (heads,), torch.bfloat16, 0.1, 1.0)
    kernel = c["linear_conv_kernel_dim"]
    yield Plain(f"{p}linear_attn.conv1d.weight", (2 * key_dim + value_dim, 1, kernel), torch.bfloat16, kernel**-0.5)
    yield _norm(f"{p}linear_attn.norm.weight", c["linear_value_head_dim"], center=1.0)


def _decoder_layer(p: str, c: Mapping[str, Any], kind: str, bits: float) -> Iterator[Linear | Plain]:
    hidden = c["hidden_size"]
    yield _norm(f"{p}input_layernorm.weight", hidden)
    yield from (_attention if kind == "full_attention" else _gated_deltanet)(p, c, bits)
    yield _norm(f"{p}post_attention_layernorm.weight", hidden)
    yield from _mlp(p, c, bits)


def _layer_norm(name: str, size: int) -> Iterator[Plain]:
    yield Plain(f"{name}.weight", (size,), torch.float16, 0.1, 1.0)
    yield Plain(f"{name}.bias", (size,), torch.float16, 0.1)


def _vision(v: Mapping[str, Any], bits: float) -> Iterator[Linear | Plain | Fused]:
    p = "model.visual."
    hidden, inter = v["hidden_size"], v["intermediate_size"]
    merged = hidden * v["spatial_merge_size"] ** 2
    patch = (hidden, v["in_channels"], v["temporal_patch_size"], v["patch_size"], v["patch_size"])
    yield Plain(f"{p}patch_embed.proj.weight", patch, torch.float16, math.prod(patch[1:]) ** -0.5)
    yield Plain(f"{p}patch_embed.proj.bias", (hidden,), torch.float16, 0.1)
    yield Plain(f"{p}pos_embed.weight", (v["num_position_embeddings"], hidden), torch.bfloat16, 1.0)
    for b in range(v["depth"]):
        q = f"{p}blocks.{b}."
        yield from _layer_norm(f"{q}norm1", hidden)
        yield from _layer_norm(f"{q}norm2", hidden)
        parts = [Linear(f"{q}attn.{n}_proj", hidden, hidden, bits, bias=True, in_twin=False) for n in "qkv"]
        yield from parts
        yield Fused(f"{q}attn.qkv", tuple(t.name for t in parts))
        yield Linear(f"{q}attn.proj", hidden, hidden, bits, bias=True)
        yield Linear(f"{q}mlp.linear_fc1", hidden, inter, bits, bias=True)
        yield Linear(f"{q}mlp.linear_fc2", inter, hidden, bits, bias=True)
    yield from _layer_norm(f"{p}merger.norm", hidden)
    yield Linear(f"{p}merger.linear_fc1", merged, merged, bits, bias=True)
    yield Linear(f"{p}merger.linear_fc2", merged, v["out_hidden_size"], bits, bias=True)


def tensors(
    config: Mapping[str, Any], bits: float, head_bits: float, vision_bits: float
) -> Iterator[Linear | Plain | Fused]:
    """Every tensor of the checkpoint, in a fixed order (the seed's stream follows it)."""
    c = model_config.text_config(config)
    hidden, vocab = c["hidden_size"], c["vocab_size"]
    yield Plain(f"{LM}embed_tokens.weight", (vocab, hidden), torch.bfloat16, 1.0)
    for i, kind in enumerate(c["layer_types"]):
        yield from _decoder_layer(f"{LM}layers.{i}.", c, kind, bits)
    yield _norm(f"{LM}norm.weight", hidden)
    yield Linear("lm_head", hidden, vocab, head_bits, HEAD_GAIN)
    if c.get("mtp_num_hidden_layers"):
        yield Linear("mtp.fc", 2 * hidden, hidden, bits)
        yield from (_norm(f"mtp.{n}.weight", hidden) for n in ("pre_fc_norm_hidden", "pre_fc_norm_embedding", "norm"))
        for j in range(c["mtp_num_hidden_layers"]):
            yield from _decoder_layer(f"mtp.layers.{j}.", c, "full_attention", bits)
    if "vision_config" in config:
        yield from _vision(config["vision_config"], vision_bits)


def _plain(t: Plain, gen: torch.Generator) -> torch.Tensor:
    if t.name.endswith("A_log"):  # the decay rate exp(A_log) in [1, 16], as Qwen3.5 initialises it
        return torch.empty(t.shape).uniform_(1, 16, generator=gen).log().to(t.dtype)
    return (t.center + t.std * torch.randn(t.shape, generator=gen)).to(t.dtype)


def _signs(size: int, scale: float, gen: torch.Generator) -> torch.Tensor:
    return (torch.randint(0, 2, (size,), generator=gen) * 2 - 1).to(torch.float16) * scale


def _group(t: Linear, gen: torch.Generator) -> dict[str, torch.Tensor]:
    k, n = padded(t.size_in), padded(t.size_out)
    width = manifest.TILE * int(t.bits)  # integer rates only: K = width / 16
    trellis = torch.randint(-(2**15), 2**15, (k // 16, n // 16, width), dtype=torch.int16, generator=gen)
    group = {
        f"{t.name}.trellis": trellis,
        f"{t.name}.suh": _signs(k, t.size_in**-0.5, gen),
        f"{t.name}.svh": _signs(n, t.gain, gen),
        f"{t.name}.{CODEBOOK}": torch.tensor(MUL1_MARKER, dtype=torch.int32),
    }
    if t.bias:  # stored at the padded width, zero past the config's
        group[f"{t.name}.bias"] = torch.zeros(n, dtype=torch.float16)
        group[f"{t.name}.bias"][: t.size_out] = 0.1 * torch.randn(t.size_out, generator=gen)
    return group


def decoded(group: Mapping[str, torch.Tensor], t: Linear) -> dict[str, torch.Tensor]:
    """The twin's nn.Linear tensors: weight (out, in), the decoded W (k, n) transposed and trimmed to the
    config's dims, and bias (out,)."""
    w = reconstruct(group[f"{t.name}.trellis"], group[f"{t.name}.suh"], group[f"{t.name}.svh"], t.bits, CODEBOOK)
    dense = {f"{t.name}.weight": w[: t.size_in, : t.size_out].T.contiguous()}
    if t.bias:
        dense[f"{t.name}.bias"] = group[f"{t.name}.bias"][: t.size_out]
    return dense


def _to_bf16(value: torch.Tensor, rounding: torch.Generator | None) -> torch.Tensor:
    """Round to nearest, or pick either bf16 neighbour with odds by distance (unbiased)."""
    if rounding is None or not value.is_floating_point():
        return value.to(torch.bfloat16)
    bits = value.float().view(torch.int32)
    low = (bits & ~0xFFFF).view(torch.float32)  # toward zero
    high = ((bits & ~0xFFFF) + 0x10000).view(torch.float32)  # away from zero
    up = torch.rand(value.shape, generator=rounding) < (value.float() - low) / (high - low)
    return torch.where(up, high, low).to(torch.bfloat16)


def _record(storage: dict[str, Any], module: str, stored: Mapping[str, torch.Tensor], exl3: Linear | None) -> None:
    """Add to quantization_config.json's tensor_storage entry of one module (format spec §1.3)."""
    entry = storage.setdefault(module, {"stored_tensors": {}})
    for name, v in stored.items():
        size = v.numel() * v.element_size()
        entry["stored_tensors"][name] = {"shape": list(v.shape), "n_bytes": size, "dtype": str(v.dtype)}
    if exl3 is not None:
        multiplier = manifest.MARKER_VALUES[CODEBOOK]
        entry.update(quant_format="exl3", bits_per_weight=int(exl3.bits), mul1_multiplier=multiplier)


def _quantization_config(
    config: Mapping[str, Any], bits: float, head_bits: float, vision_bits: float
) -> dict[str, Any]:
    qcfg = {
        "quant_method": "exl3", "version": "1.6.5", "bits": bits, "head_bits": head_bits,
        "calibration": {"rows": 250, "cols": 2048}, "out_scales": "auto", "codebook": CODEBOOK,
    }  # fmt: skip
    if model_config.text_config(config).get("mtp_num_hidden_layers"):
        qcfg["mtp_bits"] = bits
    if "vision_config" in config:
        qcfg["vision_bits"] = vision_bits
    return qcfg


def write_pair(
    config: Mapping[str, Any], seed: int, root: Path, tokenizer_dir: Path, bits: int = 4, head_bits: int = 6,
    vision_bits: int = 6, rounding: torch.Generator | None = None,
) -> Pair:
    """Write root/exl3 and root/twin; the EXL3 one must pass manifest.read (checked here). With a
    `rounding` generator the twin's weights are rounded to bf16 stochastically instead of to nearest:
    a second, equally faithful bf16 twin, whose distance from the first measures bf16 noise."""
    gen = torch.Generator().manual_seed(seed)
    quantized: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}  # every group's decoded tensors, for Fused copies
    storage: dict[str, Any] = {}
    for t in tensors(config, bits, head_bits, vision_bits):
        if isinstance(t, Linear):
            group = _group(t, gen)
            quantized.update(group)
            weights = decoded(group, t)
            dense.update(weights)
            if t.in_twin:
                twin.update(weights)
            _record(storage, t.name, group, t)
        elif isinstance(t, Fused):
            fused = {
                f"{t.name}.{k}": torch.cat([dense[f"{p}.{k}"] for p in t.parts]).to(torch.bfloat16)
                for k in ("weight", "bias")
            }
            quantized.update(fused)
            twin.update(fused)
            _record(storage, t.name, fused, None)
        else:
            value = _plain(t, gen)
            quantized[t.name] = value
            twin[t.name] = value
            _record(storage, t.name.rpartition(".")[0], {t.name: value}, None)
    twin = {name: _to_bf16(value, rounding) for name, value in twin.items()}

    qcfg = _quantization_config(config, bits, head_bits, vision_bits)
    pair = Pair(root / "exl3", root / "twin")
    for path, state, cfg in (
        (pair.exl3, quantized, {**config, "quantization_config": qcfg}),
        (pair.twin, twin, dict(config)),
    ):
        path.mkdir(parents=True)
        save_file(state, path / manifest.SINGLE_FILE, metadata={"format": "pt"})
        (path / manifest.CONFIG_FILE).write_text(json.dumps(cfg, indent=2))
        for name in TOKENIZER_FILES:
            shutil.copy(tokenizer_dir / name, path / name)
    (pair.exl3 / manifest.QUANT_CONFIG_FILE).write_text(json.dumps({**qcfg, "tensor_storage": storage}, indent=2))
    manifest.read(pair.exl3)
    return pair

