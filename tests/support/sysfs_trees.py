"""Fixture sysfs trees that mirror real machines: the files machine/hardware.py reads, nothing else.

Layouts follow real kernels: /sys/class/drm/<minor> links into /sys/devices/pci.../<BDF>/drm/,
`device` links back to the PCI function, `driver` links to /sys/bus/pci/drivers/<name>.
"""

from __future__ import annotations

from pathlib import Path

GiB = 2**30


def _pci(root: Path, path: str, vendor: int, device: int, driver: str | None, minors: list[str],
         extra: dict[str, str] | None = None, pci_class: str = "0x030000") -> Path:
    pci = root / "devices" / path
    pci.mkdir(parents=True)
    (pci / "vendor").write_text(f"0x{vendor:04x}\n")
    (pci / "device").write_text(f"0x{device:04x}\n")
    (pci / "class").write_text(pci_class + "\n")
    (pci / "enable").write_text("1\n")
    for name, text in (extra or {}).items():
        (pci / name).parent.mkdir(parents=True, exist_ok=True)
        (pci / name).write_text(text)
    bus = root / "bus" / "pci" / "devices"
    bus.mkdir(parents=True, exist_ok=True)
    (bus / pci.name).symlink_to(pci)
    if driver:
        drv = root / "bus" / "pci" / "drivers" / driver
        drv.mkdir(parents=True, exist_ok=True)
        (pci / "driver").symlink_to(drv)
    drm = root / "class" / "drm"
    drm.mkdir(parents=True, exist_ok=True)
    for minor in minors:
        d = pci / "drm" / minor
        d.mkdir(parents=True)
        (d / "device").symlink_to(pci)
        (drm / minor).symlink_to(d)
    return pci


def _resource(bars: list[tuple[int, int, int]]) -> str:
    return "".join(f"0x{s:016x} 0x{s + size - 1:016x} 0x{flags:016x}\n" for s, size, flags in bars) + \
        "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"


def _dmi(root: Path, vendor: str, product: str) -> None:
    dmi = root / "class" / "dmi" / "id"
    dmi.mkdir(parents=True, exist_ok=True)
    (dmi / "sys_vendor").write_text(vendor + "\n")
    (dmi / "product_name").write_text(product + "\n")


def b70(root: Path) -> Path:
    """Desktop: Arc Pro B70 behind its PCIe switch, xe, ReBAR on (32 GiB BAR2), tile0 VRAM size."""
    (root / "class" / "drm").mkdir(parents=True)
    (root / "class" / "drm" / "version").write_text("drm 1.1.0 20060810\n")
    _pci(root, "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:03:00.0", 0x8086, 0xE223, "xe",
         ["card1", "renderD128"], {
             "resource": _resource([(0x80000000, 16 * 2**20, 0x40200), (0x4000000000, 32 * GiB, 0x14220c)]),
             "tile0/physical_vram_size_bytes": str(32 * GiB) + "\n",
         })
    _dmi(root, "ASUS", "System Product Name")
    return root


def claw8(root: Path) -> Path:
    """MSI Claw 8 AI+: Lunar Lake Arc 140V iGPU at 00:02.0, xe, plus a display connector entry."""
    _pci(root, "pci0000:00/0000:00:02.0", 0x8086, 0x64A0, "xe", ["card0", "renderD128"])
    (root / "class" / "drm" / "card0-eDP-1").mkdir()
    _dmi(root, "Micro-Star International Co., Ltd.", "Claw 8 AI+ A2VM")
    return root


def lunar_laptop(root: Path) -> Path:
    """A generic Lunar Lake laptop: same iGPU, another vendor."""
    _pci(root, "pci0000:00/0000:00:02.0", 0x8086, 0x64A0, "xe", ["card0", "renderD128"])
    _dmi(root, "LENOVO", "21LK")
    return root


def a770(root: Path) -> Path:
    """Desktop: Arc A770 16 GB on i915 with small BAR (256 MiB), next to a UHD 770 iGPU."""
    _pci(root, "pci0000:00/0000:00:02.0", 0x8086, 0x4680, "i915", ["card0", "renderD128"])
    _pci(root, "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:03:00.0", 0x8086, 0x56A0, "i915",
         ["card1", "renderD129"], {"resource": _resource([(0xA0000000, 16 * 2**20, 0x40200),
                                                          (0x6000000000, 256 * 2**20, 0x14220c)])})
    lmem = root / "devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:03:00.0/drm/card1/lmem_total_bytes"
    lmem.write_text(str(16 * GiB) + "\n")
    return root


def nvidia(root: Path) -> Path:
    """Development box: one NVIDIA GPU on the nvidia driver."""
    _pci(root, "pci0000:00/0000:00:03.0/0000:41:00.0", 0x10DE, 0x2335, "nvidia", ["card0", "renderD128"])
    return root


def h200(root: Path) -> Path:
    """A datacenter container (measured on the lent H200): 3D controller class 0x0302, nvidia
    driver, and no /sys/class/drm at all."""
    _pci(root, "pci0000:00/0000:00:06.0", 0x10DE, 0x2335, "nvidia", [], pci_class="0x030200")
    (root / "class" / "drm").rmdir()
    return root


def none(root: Path) -> Path:
    """A VM: no DRM class at all."""
    root.mkdir(parents=True, exist_ok=True)
    return root


MACHINES = {"b70": b70, "claw8": claw8, "140v": lunar_laptop, "a770": a770, "nvidia": nvidia, "h200": h200, "none": none}
