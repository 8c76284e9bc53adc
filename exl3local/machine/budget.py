"""KV cache budget: a pure function of the device, a memory snapshot, the checkpoint and the
profile. It either returns the KV bytes and the tokens they hold, or raises BudgetError with
the arithmetic and what to change.

Shared memory (iGPU, CPU) is pinned: the engine gets exactly `kv_budget_bytes` through
`--kv-cache-memory-bytes`, sized from what the OS can spare *now* minus a reserve for the
desktop, and never above Level Zero's device ceiling (80 % of RAM - 450 MB). Without a pin the
140V engine grew until the OOM killer took it. Dedicated VRAM may instead use vLLM's own
profiling (`--gpu-memory-utilization`); the number here is then an estimate that still refuses
models that cannot fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from exl3local.errors import BudgetError
# Multimodal configs (Qwen3.5) nest the language model under text_config; the manifest owns that rule.
from exl3local.manifest import text_config
from exl3local.units import format_gib

# Bytes per KV element by --kv-cache-dtype; "auto" follows the model dtype.
KV_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "bfloat16": 2, "float16": 2, "float32": 4}
MODEL_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class CheckpointLike(Protocol):
    """What the budget needs from manifest.Manifest."""

    @property
    def config(self) -> dict[str, Any]: ...

    @property
    def weight_bytes(self) -> int: ...


@dataclass(frozen=True)
class MemorySnapshot:
    total_bytes: int  # RAM
    available_bytes: int  # RAM the OS can hand out now (psutil: free + reclaimable cache)

    @classmethod
    def now(cls) -> MemorySnapshot:
        import psutil

        vm = psutil.virtual_memory()
        return cls(int(vm.total), int(vm.available))


@dataclass(frozen=True)
class Budget:
    kv_budget_bytes: int
    kv_budget_tokens: int
    kv_bytes_per_token: int
    max_model_len: int
    pinned: bool  # pass --kv-cache-memory-bytes (else --gpu-memory-utilization)
    lines: tuple[str, ...] = field(default=(), compare=False)  # the arithmetic, for `status`/errors

    def explain(self) -> str:
        return "\n".join(self.lines)


def full_attention_layers(config: dict[str, Any]) -> int:
    """Layers that keep a KV cache. Hybrid models (Qwen3.5/3-Next: Gated DeltaNet + attention)
    list `layer_types` or give `full_attention_interval`; linear-attention layers keep a small
    fixed state per sequence instead, which the engine overhead covers."""
    cfg = text_config(config)
    n_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        return sum(1 for t in types if "full" in str(t) or t == "attention")
    interval = cfg.get("full_attention_interval")
    if isinstance(interval, int) and interval > 0:
        return n_layers // interval
    return n_layers


def kv_bytes_per_token(config: dict[str, Any], kv_cache_dtype: str = "auto") -> int:
    """K and V for one token over all full-attention layers."""
    cfg = text_config(config)
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    if kv_cache_dtype == "auto":
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or config.get("dtype") or "bfloat16")
        elem = MODEL_DTYPE_BYTES.get(dtype, 2)
    else:
        elem = KV_DTYPE_BYTES[kv_cache_dtype]
    return 2 * full_attention_layers(config) * kv_heads * head_dim * elem


def model_max_len(config: dict[str, Any]) -> int | None:
    value = text_config(config).get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def compute(gpu: Any, mem: MemorySnapshot, checkpoint: CheckpointLike, profile: Any,
            max_model_len: int | None = None) -> Budget:
    """gpu: hardware.GpuInfo; profile: profiles.Profile. Pure: no I/O."""
    mp = profile.memory
    config = checkpoint.config
    per_token = kv_bytes_per_token(config, profile.vllm.get("kv_cache_dtype", "auto"))
    ctx = max_model_len or int(profile.model["max_model_len"])
    limit = model_max_len(config)
    if limit:
        ctx = min(ctx, limit)
    seqs = int(profile.vllm.get("max_num_seqs", 1))
    weights = int(checkpoint.weight_bytes)
    overhead = int(mp["engine_overhead_bytes"])
    shared = gpu.kind in ("integrated", "cpu")
    pinned = mp["policy"] == "pinned"
    lines: list[str] = []

    if shared:
        reserve = int(mp["os_reserve_bytes"])
        ram_free = mem.available_bytes - reserve
        lines.append(f"RAM available now {format_gib(mem.available_bytes)} - OS/desktop reserve {format_gib(reserve)}"
                     f" = {format_gib(ram_free)}")
        room = ram_free
        if gpu.kind == "integrated" and gpu.memory_bytes:
            lines.append(f"iGPU ceiling (80 % of RAM - 450 MB) {format_gib(gpu.memory_bytes)}")
            room = min(room, int(gpu.memory_bytes))
    else:
        if not gpu.memory_bytes:
            raise BudgetError(
                f"the size of {gpu.name}'s memory is unknown, so the model's fit cannot be checked",
                hint="enable resizable BAR, or set memory.kv_max_bytes with policy = \"pinned\" "
                     "via `--set memory.policy=pinned --set memory.kv_max_bytes=4GiB`",
            )
        util = float(mp["gpu_memory_utilization"])
        room = int(gpu.memory_bytes * util)
        lines.append(f"device memory {format_gib(gpu.memory_bytes)} x utilization {util:.2f} = {format_gib(room)}")
    headroom = room - weights - overhead
    lines.append(f"- weights {format_gib(weights)} - engine overhead {format_gib(overhead)} = KV headroom {format_gib(headroom)}")

    need_one = per_token * ctx
    lines.append(f"KV per token {per_token} B ({full_attention_layers(config)} attention layers);"
                 f" one {ctx}-token sequence needs {format_gib(need_one)}")
    if headroom < need_one:
        shortfall = need_one - headroom
        fit_ctx = max(headroom, 0) // per_token
        hints = []
        if fit_ctx >= 256:
            hints.append(f"a shorter context (`--set model.max_model_len={fit_ctx // 256 * 256}`)")
        if profile.vllm.get("kv_cache_dtype", "auto") == "auto":
            hints.append("an fp8 KV cache (`--set vllm.kv_cache_dtype=fp8`)")
        hints.append("a smaller model or lower bpw")
        if shared:
            hints.append("closing other programs, or a smaller `memory.os_reserve_bytes`")
        hints.append("another profile (`exl3local profile`)")
        raise BudgetError(
            "the model does not fit: " + "; ".join(lines) + f". Short by {format_gib(shortfall)}.",
            hint="try " + ", or ".join(hints),
        )
    kv = headroom
    useful = per_token * ctx * seqs
    if kv > useful:
        kv = useful
        lines.append(f"capped at {seqs} sequences x {ctx} tokens = {format_gib(useful)}")
    cap = mp.get("kv_max_bytes")
    if cap is not None and kv > cap:
        kv = max(int(cap), need_one)
        lines.append(f"capped by memory.kv_max_bytes at {format_gib(kv)}")
    lines.append(f"KV budget {kv} B = {kv // per_token} tokens ({'pinned' if pinned else 'estimate'})")
    return Budget(kv_budget_bytes=int(kv), kv_budget_tokens=int(kv // per_token), kv_bytes_per_token=per_token,
                  max_model_len=ctx, pinned=pinned, lines=tuple(lines))
