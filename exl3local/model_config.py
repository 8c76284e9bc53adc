"""What a model's config.json says about its linears: the language model's part of a multimodal wrapper, and
each linear's (in, out) features by its role, against which a checkpoint's trellis shapes are checked."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from exl3local.safetensors_files import is_int


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config: nested under `text_config` in multimodal wrappers."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


# Model families whose attention q_proj also carries the output gate (2 x heads x head_dim rows).
GATED_Q_FAMILIES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"})
# Families whose q_proj is plain heads x head_dim; for any other family q_proj's width is not guessed.
PLAIN_Q_FAMILIES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})


def _int(c: Mapping[str, Any], key: str) -> int | None:
    value = c.get(key)
    return value if is_int(value) and value > 0 else None


def _mul(*values: int | None) -> int | None:
    return math.prod(values) if all(v is not None for v in values) else None  # type: ignore[arg-type]


def _text_roles(c: Mapping[str, Any], prefix: str) -> dict[str, tuple[int | None, int | None]]:
    hidden, heads = _int(c, "hidden_size"), _int(c, "num_attention_heads")
    head_dim = _int(c, "head_dim") or (hidden // heads if hidden and heads else None)
    kv_out = _mul(_int(c, "num_key_value_heads") or heads, head_dim)
    q_out = _mul(heads, head_dim)
    family = c.get("model_type") if isinstance(c.get("model_type"), str) else None
    gated = c.get("attn_output_gate")
    if not isinstance(gated, bool):
        gated = True if family in GATED_Q_FAMILIES else (False if family in PLAIN_Q_FAMILIES else None)
    q_rows = None if gated is None else _mul(q_out, 2 if gated else 1)
    if ".experts." in prefix:
        inter = _int(c, "moe_intermediate_size")
    elif ".shared_expert." in prefix:
        inter = _int(c, "shared_expert_intermediate_size")
    else:
        inter = _int(c, "intermediate_size")
    key_dim = _mul(_int(c, "linear_num_key_heads"), _int(c, "linear_key_head_dim"))
    value_dim = _mul(_int(c, "linear_num_value_heads"), _int(c, "linear_value_head_dim"))
    qkv_dim = None if key_dim is None or value_dim is None else 2 * key_dim + value_dim
    return {
        "self_attn.q_proj": (hidden, q_rows), "self_attn.k_proj": (hidden, kv_out),
        "self_attn.v_proj": (hidden, kv_out), "self_attn.o_proj": (q_out, hidden),
        "linear_attn.in_proj_qkv": (hidden, qkv_dim), "linear_attn.in_proj_z": (hidden, value_dim),
        "linear_attn.out_proj": (value_dim, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
        "mtp.fc": (_mul(hidden, 2), hidden), "lm_head": (hidden, _int(c, "vocab_size")),
    }  # fmt: skip


def _vision_roles(v: Mapping[str, Any]) -> dict[str, tuple[int | None, int | None]]:
    hidden, inter = _int(v, "hidden_size"), _int(v, "intermediate_size")
    merged = _mul(hidden, _int(v, "spatial_merge_size"), _int(v, "spatial_merge_size"))
    return {
        "attn.q_proj": (hidden, hidden), "attn.k_proj": (hidden, hidden), "attn.v_proj": (hidden, hidden),
        "attn.proj": (hidden, hidden), "mlp.linear_fc1": (hidden, inter), "mlp.linear_fc2": (inter, hidden),
        "merger.linear_fc1": (merged, merged), "merger.linear_fc2": (merged, _int(v, "out_hidden_size")),
    }  # fmt: skip


def unpadded_dims(prefix: str, config: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(in, out) features of a linear by its role, from the model config; (None, None) where the role or
    its sizes are unknown: the trellis is then checked only against the format's own rules."""
    vision = config.get("vision_config")
    if ".visual." in f".{prefix}" and isinstance(vision, dict):
        roles = _vision_roles(vision)
    else:
        roles = _text_roles(text_config(config), prefix)
    parts = prefix.split(".")
    for width in (3, 2, 1):  # the most specific role first: "mtp.fc" before "fc", "self_attn.q_proj" before "q_proj"
        role = ".".join(parts[-width:])
        if role in roles:
            return roles[role]
    return None, None
