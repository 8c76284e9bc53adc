"""The machine facts Arc decisions rest on, read from parametric sysfs trees: RAM and TTM's page limit, the
plugin's transient memory, vLLM's start-up check, and device indices matched by PCI id."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from arc_machines import GiB, PAGE, b70s, device, lunar, node_bytes
from exl3local import profiles
from exl3local.errors import BudgetError
from exl3local.machine import budget, hardware, transient, xpu
from exl3local.machine.select import find_device


@pytest.mark.parametrize(("ram", "avail", "ttm"), [(32 * GiB, 20 * GiB, -1), (16 * GiB, 9 * GiB, None),
                                                    (96 * GiB, 70 * GiB, 3 * GiB // PAGE)])
def test_ram_and_the_ttm_limit_come_from_the_tree(tmp_path, ram, avail, ttm):
    tree = lunar(tmp_path / "sys", ram=ram, available=avail, ttm_pages=ttm)
    mem = budget.MemorySnapshot.read(tree)
    assert (mem.total_bytes, mem.available_bytes) == node_bytes(ram, avail)
    assert mem.gpu_pages_limit_bytes == (None if ttm is None else (ram // 2 // PAGE if ttm == -1 else ttm) * PAGE)
    (gpu,) = hardware.probe(tree, use_udev=False, mem_total_bytes=mem.total_bytes)
    assert gpu.memory_bytes == int(mem.total_bytes * 0.8) - 450 * 10**6


def test_ram_from_memory_blocks_when_the_tree_has_no_node_meminfo(tmp_path):
    mem = tmp_path / "sys" / "devices" / "system" / "memory"
    for i in range(12):
        (mem / f"memory{i}").mkdir(parents=True)
        (mem / f"memory{i}" / "state").write_text("online\n" if i != 5 else "offline\n")
    (mem / "block_size_bytes").write_text("80000000\n")  # 2 GiB blocks
    snap = budget.MemorySnapshot.read(tmp_path / "sys")
    assert snap.total_bytes == 11 * 2 * GiB and 0 <= snap.available_bytes <= snap.total_bytes


@dataclass(frozen=True)
class Group:
    size_k: int
    size_n: int


def test_transients_follow_the_largest_layer_and_the_path_it_takes():
    groups = {"model.layers.0.mlp.down_proj": Group(17408, 5120), "model.layers.0.self_attn.q_proj": Group(5120, 6144),
              "lm_head": Group(5120, 248320),
              "model.layers.0.mlp.experts.3.up_proj": Group(2048, 512)}
    # prefill chunks rebuild the largest body linear in fp16 (the 178 MB for 5120x17408)
    t = transient.estimate(groups, 4096, max_logit_rows=4)
    assert t.bytes == max(17408 * 5120 * 2, 2048 * 512 * 12) and "down_proj" in t.why
    # the head computes only the sampled rows: rebuilt once those exceed one GEMV tile
    assert transient.estimate(groups, 4096, max_logit_rows=64).bytes == 5120 * 248320 * 2
    assert transient.estimate(groups, 16, max_logit_rows=1).bytes == 0
    dense = sum(g.size_k * g.size_n * 2 for p, g in groups.items() if ".experts." not in p)
    assert transient.estimate(groups, 16, decode_once=True).bytes == dense


def test_the_thresholds_are_the_kernels_own():
    from exl3local.kernels import dispatch

    assert transient.GEMV_MAX_ROWS == dispatch.GEMV_MAX_ROWS
    moe = pytest.importorskip("exl3local.plugin.moe", reason="the plugin needs vLLM")
    assert transient.MOE_GROUPED_MAX_TOKENS == moe.GROUPED_MAX_TOKENS


CONFIG = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
          "max_position_embeddings": 8192}


def test_the_start_check_asks_for_what_the_engine_holds_and_refuses_early():
    gpu = hardware.GpuInfo(vendor="intel", name="Arc 140V", kind="integrated", supported=True,
                           memory_bytes=int(32 * GiB * 0.8) - 450 * 10**6)
    ckpt = SimpleNamespace(config=CONFIG, weight_bytes=5 * GiB)
    prof = profiles.load("claw8")
    mem = budget.MemorySnapshot(32 * GiB, 26 * GiB)
    b = budget.compute(gpu, mem, ckpt, prof, transient_bytes=GiB)
    assert b.engine_bytes == 5 * GiB + prof.memory["engine_overhead_bytes"] + GiB + b.kv_budget_bytes
    assert math.ceil(gpu.memory_bytes * b.gpu_memory_utilization) >= b.engine_bytes
    assert b.gpu_memory_utilization < prof.memory["gpu_memory_utilization"]
    short = budget.DeviceMemory(gpu.memory_bytes, b.engine_bytes - 1, "test")
    with pytest.raises(BudgetError, match="cannot hold the engine"):
        budget.compute(gpu, mem, ckpt, prof, transient_bytes=GiB, device_memory=short)
    # the CPU engine has no such check: no flag
    assert budget.compute(hardware.cpu_device(32 * GiB), mem, ckpt, profiles.load("cpu")).gpu_memory_utilization is None


def test_the_kv_grows_past_the_proven_pin_only_by_half_the_spare_room():
    gpu = hardware.GpuInfo(vendor="intel", name="Arc 140V", kind="integrated", supported=True,
                           memory_bytes=int(32 * GiB * 0.8) - 450 * 10**6)
    ckpt = SimpleNamespace(config=CONFIG, weight_bytes=5 * GiB)
    prof = profiles.with_overrides(profiles.load("claw8"), {"memory.kv_max_bytes": "64GiB", "vllm.max_num_seqs": "64"})
    mem = budget.MemorySnapshot(32 * GiB, 26 * GiB)
    b = budget.compute(gpu, mem, ckpt, prof)
    headroom = min(26 * GiB - prof.memory["os_reserve_bytes"], gpu.memory_bytes) - 5 * GiB - \
        prof.memory["engine_overhead_bytes"]
    start = prof.memory["kv_start_bytes"]
    assert b.kv_budget_bytes == start + (headroom - start) // 2
    # TTM's limit bounds the iGPU's buffers (weights, transients, KV), not the host-side overhead
    capped = budget.compute(gpu, budget.MemorySnapshot(32 * GiB, 26 * GiB, 8 * GiB), ckpt, prof)
    assert capped.kv_budget_bytes <= 8 * GiB - 5 * GiB and "TTM page limit" in capped.explain()


def test_device_indices_are_matched_by_pci_id(tmp_path):
    tree = b70s(tmp_path / "sys", cards=2, old_igpu=True)
    gpus = hardware.probe(tree, use_udev=False, mem_total_bytes=64 * GiB)
    igpu, card0, card1 = gpus
    skipped = xpu.Runtime("py", "t", (xpu.XpuDevice(**device(0, 0xE223, 1)), xpu.XpuDevice(**device(1, 0xE223, 1))))
    assert [xpu.affinity_index(g, gpus, skipped) for g in (card0, card1)] == [0, 1]
    assert xpu.affinity_index(igpu, gpus, skipped) is None  # Level Zero does not list it
    one = xpu.Runtime("py", "t", (xpu.XpuDevice(**device(0, 0xE223, 1)),))
    assert xpu.affinity_index(card1, gpus, one) is None  # two cards in sysfs, one listed: no index is trusted
    # a torch that does not report PCI ids: matched only when it lists exactly the GPUs sysfs has
    anonymous = [xpu.XpuDevice(**(device(i, 0, 1) | {"device_id": None})) for i in range(3)]
    assert xpu.affinity_index(card1, gpus, xpu.Runtime("py", "t", tuple(anonymous))) == 2
    assert xpu.affinity_index(card1, gpus, xpu.Runtime("py", "t", tuple(anonymous[:2]))) is None
    dev = find_device(tree)
    assert [g.slot for g in dev.cards] == [card0.slot, card1.slot] and dev.affinity is None  # runtime not asked
