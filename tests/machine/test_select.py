"""probe → choose → profile → fit, asked of one module by `up`, `pull`, `list`, `profile` and `doctor`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from exl3local.errors import BudgetError
from exl3local.machine import budget
from exl3local.machine.select import find_device, select

GiB = 2**30


def _checkpoint(weight_bytes: int):
    config = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
              "max_position_embeddings": 32768}
    return SimpleNamespace(config=config, weight_bytes=weight_bytes)


def test_the_b70_gets_its_profile_and_the_reasons_say_why(machine, xdg):
    root = machine("b70")
    chosen = select(sysfs_root=root)
    assert chosen.gpu.name == "Arc Pro B70" and chosen.profile.id == "b70"
    assert "Arc Pro B70" in chosen.device.reason and "b70" in chosen.reason
    assert chosen.device == find_device(root)


def test_overrides_and_a_requested_profile_apply_on_the_same_device(machine, xdg):
    device = find_device(machine("b70"))
    chosen = select("cpu", {"vllm.max_num_seqs": "3"}, device=device)
    assert chosen.device is device and chosen.profile.id == "cpu" and chosen.profile.vllm["max_num_seqs"] == 3
    assert "this machine serves on xpu" in chosen.reason


def test_fit_is_the_budget_of_this_device_and_profile(machine, xdg):
    chosen = select(sysfs_root=machine("b70"))
    mem = budget.MemorySnapshot(total_bytes=64 * GiB, available_bytes=48 * GiB)
    fit = chosen.fit(_checkpoint(8 * GiB), mem)
    assert fit == budget.compute(chosen.gpu, mem, _checkpoint(8 * GiB), chosen.profile)
    with pytest.raises(BudgetError):
        chosen.fit(_checkpoint(40 * GiB), mem)
