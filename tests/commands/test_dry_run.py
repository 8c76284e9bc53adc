"""`exl3local up --dry-run` on sysfs trees of Arc machines: the exact engine command line and environment,
the budget and the reasons, from the real CLI in a subprocess, starting nothing.

Every expected number is derived from the tree's own parameters (RAM, TTM limit, BAR, cards) and the
budget the command prints, so the same checks hold on trees of other sizes.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from arc_machines import (B70_VRAM, GiB, MiB, PAGE, SMALL_BAR, b70s, device, environ, heavy_checkpoint, lunar,
                          node_bytes, xpu_standin)
from exl3local import profiles
from exl3local.machine import budget

NEO_RESERVED = 450 * 1000 * 1000  # Level Zero keeps this much of an iGPU's 80 % of RAM for itself
E223, LNL = 0xE223, 0x64A0


def up(tmp_path: Path, tree: Path, *args: str, python: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    # Without a stand-in the engine interpreter answers as this machine's does (torch for CPU: no XPU), only
    # faster than importing torch; doctor's test runs the real query.
    python = python or xpu_standin(tmp_path, [], "2.13.0+cpu", "torch 2.13.0+cpu sees no XPU device", "no-xpu-python")
    extra = {"EXL3LOCAL_SYSFS": str(tree), "TMPDIR": str(tmp_path / "tmp"), "EXL3LOCAL_ENGINE_PORT": "1",
             "EXL3LOCAL_ENGINE_PYTHON": str(python), **env}
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-P", "-m", "exl3local", "up", *args, "--dry-run", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=environ(**extra))


def planned(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.fixture
def tiny(tiny_models) -> Path:
    return tiny_models["tiny-llama-exl3-4.0bpw"]


def test_a_dry_run_starts_nothing_and_hides_secrets(tmp_path, xdg, tiny):
    tree = lunar(tmp_path / "sys", ram=32 * GiB)
    text = subprocess.run(
        [sys.executable, "-P", "-m", "exl3local", "up", str(tiny), "--dry-run"], capture_output=True, text=True,
        timeout=300, cwd=tmp_path, env=environ(EXL3LOCAL_SYSFS=str(tree), TMPDIR=str(tmp_path / "tmp"),
                                               EXL3LOCAL_API_KEY="sk-do-not-print", HF_TOKEN="hf_do_not_print"))
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "nothing was started" in out and "command    (cwd /) " in out and "-m exl3local.engine.launch serve" in out
    assert "sk-do-not-print" not in out and "hf_do_not_print" not in out and "VLLM_API_KEY=(set, not shown)" in out
    assert "budget     KV budget" in out and "claw8" in out
    # no daemon, no engine, no temp dir: the state and runtime dirs hold nothing, TMPDIR stays empty
    assert not (tmp_path / "tmp").exists() or not any((tmp_path / "tmp").iterdir())
    for d in ("xdg_runtime_dir", "xdg_state_home"):
        found = [p for p in (xdg / d).rglob("*") if p.is_file()] if (xdg / d).exists() else []
        assert not found, found
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tree) not in ps


@pytest.mark.parametrize("ram_gib", [32, 24])
def test_a_pinned_igpu_engine_asks_vllm_for_what_it_holds(tmp_path, xdg, tiny, ram_gib):
    """vLLM's XPU worker refuses to start unless free >= total x --gpu-memory-utilization, also with a pinned KV
    cache; without the flag it asks for 92 % of the device, which a desktop's iGPU never has free."""
    ram = ram_gib * GiB
    tree = lunar(tmp_path / "sys", ram=ram)
    plan = planned(up(tmp_path, tree, str(tiny)))
    argv, bud = plan["argv"], plan["budget"]
    total_ram, _ = node_bytes(ram, int(ram * 0.8))
    device_total = int(total_ram * 0.8) - NEO_RESERVED  # what Level Zero reports for an iGPU
    assert plan["gpu"]["memory_bytes"] == device_total and plan["memory"]["ram_total_bytes"] == total_ram
    assert bud["pinned"] and flag(argv, "--kv-cache-memory-bytes") == str(bud["kv_budget_bytes"])
    util = float(flag(argv, "--gpu-memory-utilization"))
    assert util == math.ceil(bud["engine_bytes"] * 10_000 / device_total) / 10_000 < 0.92
    assert math.ceil(device_total * util) >= bud["engine_bytes"]  # what vLLM asks covers what the engine holds
    # `status` says it too (the plan's reasons are the status's profile_reason)
    assert f"vLLM start check: --gpu-memory-utilization {util} " in "; ".join(plan["profile_reasons"]) + " "
    # the iGPU's buffers stay under TTM's page limit (half of RAM by default)
    ttm = plan["memory"]["ttm_pages_limit_bytes"]
    assert ttm == ram // 2 // PAGE * PAGE
    assert bud["engine_bytes"] - profiles.load("claw8").memory["engine_overhead_bytes"] <= ttm
    # idle, an iGPU's engine drops its weights (sleep level 2): a level 1 would copy them from RAM to RAM
    assert plan["idle_unload"]["how"] == "sleep level 2" and "--enable-sleep-mode" in argv
    assert plan["env"]["VLLM_SERVER_DEV_MODE"] == "1"


def test_an_igpu_runtime_without_enough_free_memory_is_refused_in_our_words(tmp_path, xdg, tiny):
    ram = 32 * GiB
    tree = lunar(tmp_path / "sys", ram=ram)
    total = int(node_bytes(ram, int(ram * 0.8))[0] * 0.8) - NEO_RESERVED
    ok = planned(up(tmp_path, tree, str(tiny)))
    need = ok["budget"]["engine_bytes"]
    python = xpu_standin(tmp_path, [device(0, LNL, total, free=need // 2, xe_cores=8)])
    proc = up(tmp_path, tree, str(tiny), python=python)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "cannot hold the engine" in proc.stderr and "vLLM refuses to start" in proc.stderr
    # with room the runtime's own numbers are used, and its Xe-core count names the part
    roomy = planned(up(tmp_path, tree, str(tiny), python=xpu_standin(tmp_path, [device(0, LNL, total, xe_cores=8)])))
    assert roomy["gpu"]["name"] == "Arc 140V"
    assert float(flag(roomy["argv"], "--gpu-memory-utilization")) == math.ceil(
        roomy["budget"]["engine_bytes"] * 10_000 / total) / 10_000


@pytest.mark.parametrize("bar", [B70_VRAM, 16 * GiB])
def test_a_b70_with_resizable_bar_is_sized_from_its_bar(tmp_path, xdg, tiny, bar):
    plan = planned(up(tmp_path, b70s(tmp_path / "sys", bar=bar), str(tiny)))
    assert plan["profile"] == "b70" and plan["gpu"]["memory_bytes"] == bar
    assert flag(plan["argv"], "--gpu-memory-utilization") == str(profiles.load("b70").memory["gpu_memory_utilization"])
    assert plan["env"]["ZE_FLAT_DEVICE_HIERARCHY"] == "COMPOSITE"
    # idle, a discrete card's engine moves its weights to host RAM (sleep level 1)
    assert plan["idle_unload"]["how"] == "sleep level 1" and "--enable-sleep-mode" in plan["argv"]


def test_a_b70_without_resizable_bar_asks_the_engine_runtime(tmp_path, xdg, tiny):
    tree = b70s(tmp_path / "sys", bar=SMALL_BAR)
    # this machine's engine interpreter (torch for CPU) sees no XPU: the size stays unknown and `up` says so
    unknown = up(tmp_path, tree, str(tiny))
    assert unknown.returncode == 5 and "memory is unknown" in unknown.stderr
    vram = 31 * GiB + 512 * MiB  # whatever the runtime says is what counts
    plan = planned(up(tmp_path, tree, str(tiny), python=xpu_standin(tmp_path, [device(0, E223, vram)])))
    assert plan["gpu"]["memory_bytes"] == vram and "runtime" in plan["gpu"]["memory_source"]
    assert plan["runtime"]["devices"][0]["total_bytes"] == vram


def test_the_user_environment_wins_and_vllm_plugins_is_extended(tmp_path, xdg, tiny):
    plan = planned(up(tmp_path, b70s(tmp_path / "sys"), str(tiny), ZE_FLAT_DEVICE_HIERARCHY="FLAT",
                      VLLM_PLUGINS="vendor_plugin"))
    assert plan["env"]["ZE_FLAT_DEVICE_HIERARCHY"] == "FLAT"
    assert plan["env"]["VLLM_PLUGINS"] == "vendor_plugin,exl3"
    assert planned(up(tmp_path, b70s(tmp_path / "sys2"), str(tiny)))["env"]["VLLM_PLUGINS"] == "exl3"


def test_the_device_index_comes_from_the_runtime_by_pci_id(tmp_path, xdg, tiny):
    """A UHD iGPU on i915 sits before the B70 in sysfs; Level Zero (with the xe-only compute runtime) lists only
    the B70. Counting sysfs would send the engine to device 1, which does not exist."""
    tree = b70s(tmp_path / "sys", old_igpu=True)
    guessed = planned(up(tmp_path, tree, str(tiny)))
    assert guessed["env"]["ZE_AFFINITY_MASK"] == "1" and any("runtime" in n for n in guessed["notes"])
    resolved = planned(up(tmp_path, tree, str(tiny), python=xpu_standin(tmp_path, [device(0, E223, B70_VRAM)])))
    assert resolved["env"]["ZE_AFFINITY_MASK"] == "0" and resolved["env"]["ZE_ENABLE_PCI_ID_DEVICE_ORDER"] == "1"
    both = planned(up(tmp_path, tree, str(tiny), python=xpu_standin(
        tmp_path, [device(0, 0x4680, 8 * GiB), device(1, E223, B70_VRAM)])))
    assert both["env"]["ZE_AFFINITY_MASK"] == "1"


@pytest.mark.parametrize("cards", [2, 4])
def test_identical_cards_serve_one_model_by_data_or_tensor_parallel(tmp_path, xdg, tiny, cards):
    tree = b70s(tmp_path / "sys", cards=cards)
    small = planned(up(tmp_path, tree, str(tiny)))
    assert flag(small["argv"], "--data-parallel-size") == str(cards) and "--tensor-parallel-size" not in small["argv"]
    assert len(small["cards"]) == cards and "ZE_AFFINITY_MASK" not in small["env"]  # no other GPU to hide
    prof = profiles.load("b70")
    one_card = int(B70_VRAM * prof.memory["gpu_memory_utilization"]) - prof.memory["engine_overhead_bytes"]
    big = heavy_checkpoint(tiny, tmp_path / "big", one_card + GiB)  # too big for one card, not for all
    split = planned(up(tmp_path, tree, str(big)))
    assert flag(split["argv"], "--tensor-parallel-size") == str(cards) and "--data-parallel-size" not in split["argv"]
    assert split["budget"]["tensor_parallel"] == cards
    assert split["budget"]["engine_bytes"] <= B70_VRAM * prof.memory["gpu_memory_utilization"]
    # with an iGPU beside them the engine is pinned to the cards, by the runtime's indices
    tree2 = b70s(tmp_path / "sys-igpu", cards=cards, old_igpu=True)
    runtime = [device(i, E223, B70_VRAM) for i in range(cards)]
    pinned = planned(up(tmp_path, tree2, str(tiny), python=xpu_standin(tmp_path, runtime)))
    assert pinned["env"]["ZE_AFFINITY_MASK"] == ",".join(str(i) for i in range(cards))


def _expected_default(ram: int, available: int, profile_id: str) -> tuple[str | None, int]:
    """The first of the profile's models whose weights + its proven KV pin fit this machine, from the facts."""
    prof = profiles.load(profile_id)
    total, avail = node_bytes(ram, available)
    ceiling = int(total * 0.8) - NEO_RESERVED
    room = min(avail - prof.memory["os_reserve_bytes"], ceiling) - prof.memory["engine_overhead_bytes"]
    room = min(room, ram // 2 // PAGE * PAGE)
    kv = prof.memory.get("kv_start_bytes") or budget.MIN_KV_BYTES
    choices = [dict(prof.model), *prof.model.get("by_memory", ())]
    return next((c["repo"] for c in choices if c["weight_bytes"] + kv <= room), None), room


@pytest.mark.parametrize("ram_gib", [16, 24, 32, 64])
def test_a_lunar_lake_laptop_serves_by_default_the_model_its_memory_holds(tmp_path, xdg, ram_gib):
    ram = ram_gib * GiB
    tree = lunar(tmp_path / "sys", ram=ram, claw=False)
    proc = subprocess.run([sys.executable, "-P", "-m", "exl3local", "profile", "--json"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env=environ(EXL3LOCAL_SYSFS=str(tree)))
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    expected, room = _expected_default(ram, int(ram * 0.8), "140v")
    default = profiles.load("140v").model["repo"]
    if expected in (default, None):
        assert shown["profile"]["model"]["repo"] == default
        if expected is None:  # nothing fits: the reason names every model of the profile
            assert "none of this profile's models fits" in shown["reason"]
            assert all(c["repo"] in shown["reason"] for c in profiles.load("140v").model["by_memory"])
    else:
        assert shown["profile"]["model"]["repo"] == expected and "default model by memory" in shown["reason"]
    if ram_gib == 16:  # the 35B-A3B's 13.5 GB of weights never fit a 16 GB machine
        assert expected != default


def test_a_by_memory_choice_that_fits_is_served(tmp_path, xdg, tiny_models):
    """A user profile whose second model fits a 16 GB laptop: the dry run names it (not pulled here)."""
    user = xdg / "xdg_config_home" / "exl3local" / "profiles"
    user.mkdir(parents=True)
    text = (profiles.BUNDLED / "140v.toml").read_text()
    text = text.replace('weight_bytes = "7GB"', 'weight_bytes = "2GB"')
    (user / "140v.toml").write_text(text)
    tree = lunar(tmp_path / "sys", ram=16 * GiB, claw=False)
    proc = up(tmp_path, tree)
    assert proc.returncode != 0 and "turboderp/Qwen3.5-9B-exl3:4.00bpw is not downloaded" in proc.stderr
