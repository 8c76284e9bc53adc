"""The EXL3 plugin's own memory beside weights and KV, from the checkpoint's largest layers and the paths
the plugin takes. With a pinned KV cache vLLM does not profile a forward pass, so nothing else counts it,
and on a shared-memory iGPU it is exactly the memory the pin exists to keep free.

- A linear called with more rows than one GEMV tile rebuilds its weight densely in fp16 for that call
  (the reconstruct path): the largest such layer is held at once (an lm_head of 248k x 4096 is ~2 GB).
- MoE calls above the grouped-path limit rebuild one expert projection at a time in fp32, with two
  intermediate copies while the Hadamards run.
- EXL3LOCAL_DECODE_ONCE keeps every linear's dense weight in the activation dtype for the engine's life.

The thresholds mirror kernels/dispatch.py and plugin/moe.py (this layer may not import them; a test
keeps them equal).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from exl3local.units import format_gib

GEMV_MAX_ROWS = 16  # kernels.dispatch.GEMV_MAX_ROWS: more rows take the fp16 reconstruct path
MOE_GROUPED_MAX_TOKENS = 128  # plugin.moe.GROUPED_MAX_TOKENS: more tokens rebuild experts densely
DENSE_BYTES = 2  # fp16/bf16
MOE_DENSE_COPIES_BYTES = 3 * 4  # the fp32 decode, the Hadamard product and the scaled result, alive together
EXPERT_MARK = ".experts."
HEAD = "lm_head"  # computes logits for the sampled positions only, not for every prompt token


@dataclass(frozen=True)
class Transient:
    bytes: int
    why: str  # one line: which layer and which path


def estimate(groups: Mapping[str, Any], max_batched_tokens: int, decode_once: bool = False,
             max_logit_rows: int = 1) -> Transient:
    """groups: manifest.Manifest.quantized (prefix → TensorGroup with size_k, size_n). Rows per call: a prefill
    chunk (max_batched_tokens) for every linear but the head, which only sees the sampled positions
    (max_logit_rows: sequences x (1 + draft tokens))."""
    linears = {p: g for p, g in groups.items() if EXPERT_MARK not in p}
    experts = {p: g for p, g in groups.items() if EXPERT_MARK in p}
    parts: list[tuple[int, str]] = []
    rebuilt = {p: g for p, g in linears.items()
               if (max_logit_rows if p.rsplit(".", 1)[-1] == HEAD else max_batched_tokens) > GEMV_MAX_ROWS}
    if rebuilt:
        prefix, g = max(rebuilt.items(), key=lambda kv: kv[1].size_k * kv[1].size_n)
        parts.append((g.size_k * g.size_n * DENSE_BYTES,
                      f"{prefix} ({g.size_k}x{g.size_n}) rebuilt in fp16 above {GEMV_MAX_ROWS} rows"))
    if experts and max_batched_tokens > MOE_GROUPED_MAX_TOKENS:
        prefix, g = max(experts.items(), key=lambda kv: kv[1].size_k * kv[1].size_n)
        parts.append((g.size_k * g.size_n * MOE_DENSE_COPIES_BYTES,
                      f"expert {prefix} ({g.size_k}x{g.size_n}) rebuilt in fp32 above {MOE_GROUPED_MAX_TOKENS} tokens"))
    # The paths run one layer at a time: the largest one is what is held at once.
    total, why = max(parts, default=(0, ""))
    if decode_once and linears:
        dense = sum(g.size_k * g.size_n * DENSE_BYTES for g in linears.values())
        total += dense
        why = "; ".join(w for w in (why, f"EXL3LOCAL_DECODE_ONCE keeps {len(linears)} linears dense: "
                                         f"{format_gib(dense)}") if w)
    return Transient(total, why or "none (no quantized layer takes a rebuilding path)")
