"""GPU detection against fixture sysfs trees of real machines, and the profile each one gets."""

from __future__ import annotations

import pytest

from exl3local import profiles
from exl3local.machine import hardware

GiB = 2**30
RAM_32G = 32 * 10**9


@pytest.mark.parametrize(
    ("name", "profile_id"),
    [("b70", "b70"), ("claw8", "claw8"), ("140v", "140v"), ("a770", "xpu"), ("nvidia", "cuda"), ("h200", "cuda"),
     ("none", "cpu")],
)
def test_each_machine_gets_its_profile(machine, name, profile_id):
    root = machine(name)
    gpu, _ = hardware.choose(hardware.probe(root, use_udev=False, mem_total_bytes=RAM_32G), RAM_32G)
    prof, why = profiles.detect(gpu, hardware.dmi_product(root))
    assert prof.id == profile_id
    assert profile_id in why


def test_b70_is_a_discrete_xe2_card_with_its_vram(machine):
    (gpu,) = hardware.probe(machine("b70"), use_udev=False)
    assert (gpu.name, gpu.kind, gpu.pci_id, gpu.xe_gen, gpu.driver) == (
        "Arc Pro B70", "discrete", "8086:e223", "Xe2-HPG", "xe")
    assert gpu.slot == "0000:03:00.0"
    assert (gpu.card_node, gpu.render_node) == ("/dev/dri/card1", "/dev/dri/renderD128")
    assert gpu.memory_bytes == 32 * GiB
    assert gpu.backend == "xpu"


def test_lunar_lake_igpu_reports_the_shared_ram_ceiling_and_both_names(machine):
    (gpu,) = hardware.probe(machine("claw8"), use_udev=False, mem_total_bytes=RAM_32G)
    assert gpu.kind == "integrated" and gpu.name == "Arc 130V/140V"
    assert gpu.memory_bytes == int(RAM_32G * 0.8) - 450 * 10**6  # Level Zero: 80 % - 450 MB
    (named,) = hardware.probe(machine("140v"), use_udev=False, mem_total_bytes=RAM_32G, xe_cores=7)
    assert named.name == "Arc 130V"


def test_a770_beats_the_unsupported_uhd_igpu_and_reads_lmem(machine):
    gpus = hardware.probe(machine("a770"), use_udev=False)
    assert [g.supported for g in gpus] == [False, True]  # 00:02.0 UHD 770, then the A770
    gpu, why = hardware.choose(gpus)
    assert gpu.name == "Arc A770" and gpu.driver == "i915" and gpu.memory_bytes == 16 * GiB
    assert "0000:03:00.0" in why


def test_small_bar_without_size_file_leaves_memory_unknown(machine, tmp_path):
    root = machine("a770")
    next(root.rglob("lmem_total_bytes")).unlink()
    gpu, _ = hardware.choose(hardware.probe(root, use_udev=False))
    assert gpu.memory_bytes is None and gpu.memory_source.startswith("unknown")


def test_no_gpu_serves_on_the_cpu(machine):
    gpu, why = hardware.choose(hardware.probe(machine("none"), use_udev=False), mem_total_bytes=8 * GiB)
    assert gpu.kind == "cpu" and gpu.memory_bytes == 8 * GiB
    assert "no GPU" in why


def test_every_table_entry_names_a_known_generation():
    assert hardware.PCI_MODELS[0xE20B].name == "Arc B580"
    assert hardware.PCI_MODELS[0x64A0].integrated
    assert {m.xe_gen for m in hardware.PCI_MODELS.values()} <= {
        "Xe2-HPG", "Xe2-LPG", "Xe-LPG", "Xe-LPG+", "Xe-HPG", "Xe3-LPG", "Xe3P"}


def test_hotplug_event_for_a_connector_is_not_a_gpu_change():
    seen = []
    watch = hardware.HotplugWatch(seen.append)

    class Dev:
        def __init__(self, action, name):
            self.action, self.sys_name = action, name

    events = [Dev("change", "card0"), Dev("add", "card0-DP-1"), Dev("remove", "renderD129"), None]

    class Monitor:
        def poll(self, timeout):
            return events.pop(0)

    watch._monitor = Monitor()
    watch._drain()
    assert seen == ["remove"]


def test_gpu_without_a_drm_minor_is_still_found(machine):
    (gpu,) = hardware.probe(machine("h200"), use_udev=False)
    assert (gpu.vendor, gpu.slot, gpu.driver, gpu.render_node) == ("nvidia", "0000:00:06.0", "nvidia", None)


def test_intel_card_with_no_driver_bound_is_reported_without_nodes(machine):
    root = machine("b70")
    (next(root.rglob("0000:03:00.0/driver"))).unlink()
    for minor in ("card1", "renderD128"):
        (root / "class" / "drm" / minor).unlink()
    (gpu,) = hardware.probe(root, use_udev=False)
    assert gpu.name == "Arc Pro B70" and gpu.driver is None and gpu.render_node is None
