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

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from exl3local.errors import BudgetError
# What the machine has (RAM, TTM's limit, the runtime's view of the device): machine/memory.py; named here too.
from exl3local.machine.memory import DeviceMemory, MemorySnapshot
# Multimodal configs (Qwen3.5) nest the language model under text_config; exl3local.model_config owns that rule.
from exl3local.model_config import text_config
from exl3local.profiles import speculative_config
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
class Budget:
    kv_budget_bytes: int
    kv_budget_tokens: int
    kv_bytes_per_token: int
    max_model_len: int
    pinned: bool  # pass --kv-cache-memory-bytes (else --gpu-memory-utilization)
    lines: tuple[str, ...] = field(default=(), compare=False)  # the arithmetic, for `status`/errors
    # With a pinned KV cache on a GPU, vLLM still checks at start that the device has free memory >= its total x
    # --gpu-memory-utilization (default 0.92): this is the fraction the engine will really hold (weights +
    # overhead + plugin transients + KV over the device's total as the runtime reports it). None: pass none.
    gpu_memory_utilization: float | None = None
    engine_bytes: int = 0  # per device: weights + overhead + transients + KV
    transient_bytes: int = 0  # the plugin's own short-lived buffers (machine/transient.py)
    tensor_parallel: int = 1  # cards one model is split over (it does not fit one)
    data_parallel: int = 1  # copies of the model, one per card (it fits one)

    def explain(self) -> str:
        return "\n".join(self.lines)


# vLLM's default KV block per backend when the profile sets none; hybrid models round it up (below).
DEFAULT_BLOCK_TOKENS = {"cpu": 128, "xpu": 64, "cuda": 16}
SSM_STATE_BYTES = 4  # vLLM keeps Gated DeltaNet recurrent state in fp32 on every accelerated backend


def full_attention_layers(config: dict[str, Any]) -> int:
    """Layers that keep a KV cache. Hybrid models (Qwen3.5/3-Next: Gated DeltaNet + attention)
    list `layer_types` or give `full_attention_interval`; the other layers keep a fixed state."""
    cfg = text_config(config)
    n_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        return sum(1 for t in types if "full" in str(t) or t == "attention")
    interval = cfg.get("full_attention_interval")
    if isinstance(interval, int) and interval > 0:
        return n_layers // interval
    return n_layers


def _dtype_bytes(config: dict[str, Any], kv_cache_dtype: str) -> int:
    if kv_cache_dtype != "auto":
        return KV_DTYPE_BYTES[kv_cache_dtype]
    cfg = text_config(config)
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return MODEL_DTYPE_BYTES.get(dtype, 2)


def kv_bytes_per_token(config: dict[str, Any], kv_cache_dtype: str = "auto", extra_attention_layers: int = 0) -> int:
    """K and V for one token over all full-attention layers (and a draft's, when given)."""
    cfg = text_config(config)
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    layers = full_attention_layers(config) + extra_attention_layers
    return 2 * layers * kv_heads * head_dim * _dtype_bytes(config, kv_cache_dtype)


def gdn_state_bytes(config: dict[str, Any], speculative_tokens: int = 0) -> int:
    """One Gated DeltaNet layer's per-sequence state: the conv window (model dtype) and the fp32
    recurrent state (value heads x value dim x key dim). 0 for models without linear attention."""
    cfg = text_config(config)
    sizes = [cfg.get(k) for k in ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads",
                                  "linear_value_head_dim", "linear_conv_kernel_dim")]
    if not all(isinstance(v, int) and v > 0 for v in sizes):
        return 0
    k_heads, k_dim, v_heads, v_dim, kernel = sizes
    conv = (2 * k_heads * k_dim + v_heads * v_dim) * (kernel - 1 + speculative_tokens) * _dtype_bytes(config, "auto")
    return conv + v_heads * v_dim * k_dim * SSM_STATE_BYTES


@dataclass(frozen=True)
class CacheLayout:
    """What one sequence costs in vLLM's cache for this model and profile. Hybrid models share one
    page size between attention blocks and Gated DeltaNet states: vLLM grows the attention block
    until a page holds a state, pads states to the page, pads layer groups to a common size, and
    keeps 1 state per GDN layer and sequence (2 with prefix caching) plus one per draft token."""

    token_bytes: int  # KV of one token over all attention layers
    block_tokens: int  # attention tokens per page (1 for plain models: no rounding modelled)
    state_bytes: int  # per sequence, all GDN layers, padded as vLLM pads them
    attention_layers: int
    state_layers: int

    def sequence_bytes(self, tokens: int) -> int:
        blocks = -(-tokens // self.block_tokens)
        return self.token_bytes * blocks * self.block_tokens + self.state_bytes


def cache_layout(config: dict[str, Any], profile: Any) -> CacheLayout:
    cfg = text_config(config)
    vllm = profile.vllm
    kv_dtype = vllm.get("kv_cache_dtype", "auto")
    spec = speculative_config(vllm)
    draft_tokens = int(spec.get("num_speculative_tokens", 0))
    draft_layers = int(cfg.get("mtp_num_hidden_layers") or 0) if spec.get("method") == "mtp" else 0
    attention = full_attention_layers(config) + draft_layers
    token_bytes = kv_bytes_per_token(config, kv_dtype, draft_layers)
    state = gdn_state_bytes(config, draft_tokens)
    state_layers = int(cfg["num_hidden_layers"]) - full_attention_layers(config) if state else 0
    if not state_layers or not attention:
        return CacheLayout(token_bytes, 1, 0, attention, 0)
    per_layer_token = token_bytes // attention
    align = int(vllm.get("block_size") or DEFAULT_BLOCK_TOKENS.get(profile.backend, 16))
    block = align * -(-state // (align * per_layer_token))
    page = block * per_layer_token
    group = min(attention, state_layers)
    if max(attention, state_layers) < 1.5 * group:
        group = max(attention, state_layers)
    padded_attention = group * -(-attention // group)
    padded_state_layers = group * -(-state_layers // group)
    copies = (2 if vllm.get("enable_prefix_caching", True) else 1) + draft_tokens
    return CacheLayout(
        token_bytes=per_layer_token * padded_attention, block_tokens=block,
        state_bytes=padded_state_layers * page * copies, attention_layers=attention, state_layers=state_layers,
    )


def model_max_len(config: dict[str, Any]) -> int | None:
    value = text_config(config).get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def runtime_total(gpu: Any, device_memory: DeviceMemory | None) -> int | None:
    """The device total vLLM will see: the runtime's own number, else what the machine facts say (an iGPU's
    memory_bytes already is Level Zero's 80 % - 450 MB figure)."""
    if device_memory is not None:
        return device_memory.total_bytes
    return int(gpu.memory_bytes) if gpu.memory_bytes else None


def _room(gpu: Any, mem: MemorySnapshot, mp: Any, lines: list[str], device_memory: DeviceMemory | None) -> int:
    """Memory the engine may use at all: RAM the OS can spare (shared memory) or the card's share."""
    if gpu.kind in ("integrated", "cpu"):
        reserve = int(mp["os_reserve_bytes"])
        room = mem.available_bytes - reserve
        lines.append(f"RAM available now {format_gib(mem.available_bytes)} - OS/desktop reserve {format_gib(reserve)}"
                     f" = {format_gib(room)}")
        if gpu.kind == "integrated":
            ceiling = runtime_total(gpu, device_memory)
            if ceiling:
                where = device_memory.source if device_memory else "80 % of RAM - 450 MB"
                lines.append(f"iGPU ceiling ({where}) {format_gib(ceiling)}")
                room = min(room, ceiling)
        return room
    if not gpu.memory_bytes:
        raise BudgetError(
            f"the size of {gpu.name}'s memory is unknown (sysfs has no VRAM size and the engine's runtime did not "
            "report one), so the model's fit cannot be checked",
            hint="check the XPU runtime with `exl3local doctor`, enable resizable BAR, or pin the KV cache: "
                 "`--set memory.policy=pinned --set memory.kv_max_bytes=4GiB`",
        )
    util = float(mp["gpu_memory_utilization"])
    room = int(gpu.memory_bytes * util)
    lines.append(f"device memory {format_gib(gpu.memory_bytes)} x utilization {util:.2f} = {format_gib(room)}")
    return room


def _does_not_fit(lines: list[str], shortfall: int, fit_ctx: int, profile: Any, shared: bool,
                  ttm_capped: bool = False) -> BudgetError:
    hints = []
    if ttm_capped:
        hints.append("a higher TTM page limit (kernel parameter `ttm.pages_limit=<4 KiB pages>`, e.g. 3/4 of RAM)")
    if fit_ctx >= 256:
        hints.append(f"a shorter context (`--set model.max_model_len={fit_ctx // 256 * 256}`)")
    if profile.vllm.get("kv_cache_dtype", "auto") == "auto":
        hints.append("an fp8 KV cache (`--set vllm.kv_cache_dtype=fp8`)")
    hints.append("a smaller model or lower bpw")
    if shared:
        hints.append("closing other programs, or a smaller `memory.os_reserve_bytes`")
    hints.append("another profile (`exl3local profile`)")
    return BudgetError(
        "the model does not fit: " + "; ".join(lines) + f". Short by {format_gib(shortfall)}.",
        hint="try " + ", or ".join(hints),
    )


MIN_KV_BYTES = 512 * 2**20  # the least KV a default model must leave room for when a profile names no proven pin


def room(gpu: Any, mem: MemorySnapshot, profile: Any, device_memory: DeviceMemory | None = None) -> int:
    """What the engine may use at all on this machine under this profile (before weights and overhead)."""
    return _room(gpu, mem, profile.memory, [], device_memory)


UTILIZATION_STEP = 10_000  # --gpu-memory-utilization is passed rounded up to 1/10000


def start_check(gpu: Any, engine_bytes: int, device_memory: DeviceMemory | None, lines: list[str]) -> float | None:
    """The --gpu-memory-utilization a pinned engine passes so vLLM's start-up check (free >= total x utilization)
    asks for what the engine holds, not 92 % of the device; BudgetError when even that cannot pass."""
    if gpu.kind not in ("integrated", "discrete"):
        return None
    total = runtime_total(gpu, device_memory)
    if not total:
        return None
    util = math.ceil(engine_bytes * UTILIZATION_STEP / total) / UTILIZATION_STEP
    asked = math.ceil(total * util)
    free = device_memory.free_bytes if device_memory is not None else None
    said = f"{format_gib(free)} free of {format_gib(total)}" if free is not None else f"total {format_gib(total)}"
    if util > 1 or (free is not None and free < asked):
        raise BudgetError(
            f"{gpu.name} cannot hold the engine: it needs {format_gib(engine_bytes)} (weights, overhead, transients "
            f"and KV) and the GPU runtime reports {said}; vLLM refuses to start below that",
            hint="close programs that use the GPU, or lower the need: a shorter context "
                 "(`--set model.max_model_len=N`), a smaller `memory.kv_max_bytes`, a smaller model",
        )
    lines.append(f"vLLM start check: the engine holds {format_gib(engine_bytes)} of the device's {said}"
                 f" → --gpu-memory-utilization {util}")
    return util


def compute(gpu: Any, mem: MemorySnapshot, checkpoint: CheckpointLike, profile: Any,
            max_model_len: int | None = None, *, transient_bytes: int = 0,
            device_memory: DeviceMemory | None = None, tensor_parallel: int = 1, data_parallel: int = 1) -> Budget:
    """gpu: hardware.GpuInfo; profile: profiles.Profile. Pure: no I/O. With tensor_parallel N the weights and the
    KV of a sequence are split over N cards, and every number is per card; data_parallel copies are per card too."""
    mp = profile.memory
    config = checkpoint.config
    layout = cache_layout(config, profile)
    tp = max(1, int(tensor_parallel))
    per_token = -(-layout.token_bytes // tp)
    ctx = max_model_len or int(profile.model["max_model_len"])
    limit = model_max_len(config)
    if limit:
        ctx = min(ctx, limit)
    seqs = int(profile.vllm.get("max_num_seqs", 1))
    weights = -(-int(checkpoint.weight_bytes) // tp)
    overhead = int(mp["engine_overhead_bytes"])
    pinned = mp["policy"] == "pinned"
    lines: list[str] = []
    headroom = _room(gpu, mem, mp, lines, device_memory) - weights - overhead - transient_bytes
    split = f" (1/{tp} per card, tensor parallel over {tp} cards)" if tp > 1 else ""
    transient = f" - plugin transients {format_gib(transient_bytes)}" if transient_bytes else ""
    lines.append(f"- weights {format_gib(weights)}{split} - engine overhead {format_gib(overhead)}{transient}"
                 f" = KV headroom {format_gib(headroom)}")

    need_one = -(-layout.sequence_bytes(ctx) // tp)
    state_note = (f" + {format_gib(layout.state_bytes)} Gated DeltaNet state ({layout.state_layers} layers)"
                  if layout.state_bytes else "")
    lines.append(f"KV per token {per_token} B ({layout.attention_layers} attention layers){state_note};"
                 f" one {ctx}-token sequence needs {format_gib(need_one)}")
    limit = mem.gpu_pages_limit_bytes if gpu.kind == "integrated" else None
    ttm_capped = limit is not None and limit - weights - transient_bytes < headroom
    if ttm_capped:
        # The iGPU's buffers (weights, transients, KV; not the host-side overhead) count against TTM's page limit.
        headroom = limit - weights - transient_bytes
        lines.append(f"TTM page limit {format_gib(limit)} (module ttm pages_limit; GPU buffers beyond it are swapped"
                     f" out) - weights - transients = KV headroom {format_gib(headroom)}")
    if headroom < need_one:
        fit_ctx = max(headroom - layout.state_bytes // tp, 0) // per_token
        raise _does_not_fit(lines, need_one - headroom, fit_ctx, profile, gpu.kind in ("integrated", "cpu"), ttm_capped)
    kv = headroom
    start = mp.get("kv_start_bytes")
    if start is not None and kv > start:
        # A pin a field run proved: grow past it only by half of what is left after it, the rest stays a margin.
        kv = int(start) + (kv - int(start)) // 2
        lines.append(f"from the proven pin {format_gib(int(start))} plus half of the headroom beyond it = {format_gib(kv)}")
    useful = need_one * seqs
    if kv > useful:
        kv = useful
        lines.append(f"capped at {seqs} sequences x {ctx} tokens = {format_gib(useful)}")
    cap = mp.get("kv_max_bytes")
    if cap is not None and kv > cap:
        kv = max(int(cap), need_one)
        lines.append(f"capped by memory.kv_max_bytes at {format_gib(kv)}")
    # Tokens as vLLM reports them: whole max-length sequences (KV + state) times their length.
    tokens = kv * ctx // need_one
    lines.append(f"KV budget {kv} B = {tokens} tokens ({'pinned' if pinned else 'estimate'})"
                 + (f" on each of {data_parallel} cards (data parallel)" if data_parallel > 1 else ""))
    engine = weights + overhead + transient_bytes + kv
    util = start_check(gpu, engine, device_memory, lines) if pinned else None
    return Budget(kv_budget_bytes=int(kv), kv_budget_tokens=int(tokens), kv_bytes_per_token=per_token,
                  max_model_len=ctx, pinned=pinned, lines=tuple(lines), gpu_memory_utilization=util,
                  engine_bytes=int(engine), transient_bytes=int(transient_bytes), tensor_parallel=tp,
                  data_parallel=max(1, int(data_parallel)))
