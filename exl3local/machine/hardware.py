"""GPU detection: DRM minors → parent PCI device → GpuInfo; plus a udev hotplug watch.

Enumeration goes through pyudev when the sysfs root is the real /sys (it also sees devices
that sysfs links alone would not name the same way); otherwise, and whenever udev cannot be
used (containers), sysfs is read directly. Both paths read the PCI attributes from the same
sysfs files, so fixture trees under tests exercise the same parsing.
The facts behind the tables and the memory rules: docs/arc.md §1–§3.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from exl3local.machine.memory import MemorySnapshot

log = logging.getLogger(__name__)

INTEL = 0x8086
NVIDIA = 0x10DE
SYSFS = Path("/sys")

# Level Zero (NEO) reports an iGPU's global memory as 80 % of RAM minus 450 MB for internal
# resources (docs/arc.md §3.3); torch/vLLM see that number, so we report it too.
IGPU_RAM_FRACTION = 0.80
IGPU_NEO_RESERVED_BYTES = 450 * 1000 * 1000
# A BAR this large is VRAM behind resizable BAR; the 256 MiB window of small-BAR boards is not.
MIN_VRAM_BAR_BYTES = 512 * 2**20
IORESOURCE_PREFETCH = 0x2000


@dataclass(frozen=True)
class PciModel:
    codename: str
    name: str
    integrated: bool
    xe_gen: str
    driver: str  # the kernel driver that claims it by default


def _models() -> dict[int, PciModel]:
    """docs/arc.md §1, one entry per PCI device ID."""
    t: dict[int, PciModel] = {}

    def add(ids: list[int], codename: str, names: str | list[str], integrated: bool, xe_gen: str, drv: str) -> None:
        for i, dev in enumerate(ids):
            name = names if isinstance(names, str) else names[i]
            t[dev] = PciModel(codename, name, integrated, xe_gen, drv)

    add([0xE223, 0xE222], "BMG-G31", ["Arc Pro B70", "Arc Pro B65"], False, "Xe2-HPG", "xe")
    add([0xE220, 0xE221], "BMG-G31", "Intel Graphics (BMG-G31)", False, "Xe2-HPG", "xe")
    add([0xE20B, 0xE20C, 0xE211, 0xE212], "BMG-G21", ["Arc B580", "Arc B570", "Arc Pro B60", "Arc Pro B50"],
        False, "Xe2-HPG", "xe")
    add([0xE202, 0xE209, 0xE20D, 0xE210, 0xE215, 0xE216], "BMG-G21", "Intel Graphics (BMG-G21)", False, "Xe2-HPG", "xe")
    add([0x64A0], "LNL", "Arc 130V/140V", True, "Xe2-LPG", "xe")
    add([0x6420, 0x64B0], "LNL", "Intel Graphics (Lunar Lake)", True, "Xe2-LPG", "xe")
    add([0x7D51], "ARL-H", "Arc 130T/140T", True, "Xe-LPG+", "i915")
    add([0x7DD1], "ARL-H", "Intel Graphics (Arrow Lake-H)", True, "Xe-LPG+", "i915")
    add([0x7D41, 0x7D67, 0xB640], "ARL", "Intel Graphics (Arrow Lake)", True, "Xe-LPG", "i915")
    add([0x7D55], "MTL", "Arc Graphics (Meteor Lake)", True, "Xe-LPG", "i915")
    add([0x7D40, 0x7D45, 0x7D60, 0x7DD5], "MTL", "Intel Graphics (Meteor Lake)", True, "Xe-LPG", "i915")
    add([0x56A0, 0x56A1, 0x56A2, 0x56A5, 0x56A6], "DG2", ["Arc A770", "Arc A750", "Arc A580", "Arc A380", "Arc A310"],
        False, "Xe-HPG", "i915")
    add(list(range(0x5690, 0x5698)), "DG2", ["Arc A770M", "Arc A730M", "Arc A550M", "Arc A370M", "Arc A350M",
                                            "Arc A200M", "Arc A570M", "Arc A530M"], False, "Xe-HPG", "i915")
    add([0x56B0, 0x56B1, 0x56B2, 0x56B3, 0x56BA, 0x56BB, 0x56BC, 0x56BD, 0x56BE, 0x56BF], "DG2",
        "Arc Pro A-series", False, "Xe-HPG", "i915")
    add([0x56C0, 0x56C1, 0x56C2], "ATS-M", ["Data Center Flex 170", "Data Center Flex 140", "Data Center Flex 170V"],
        False, "Xe-HPG", "i915")
    add([0xB080, 0xB081, 0xB082, 0xB083], "PTL", ["Arc B390", "Arc B370", "Arc B390", "Arc B370"], True, "Xe3-LPG", "xe")
    add([0xB084, 0xB085, 0xB086, 0xB087], "PTL", ["Arc Pro B390", "Arc Pro B370", "Arc Pro B390", "Arc Pro B370"],
        True, "Xe3-LPG", "xe")
    add([0xB08F, 0xB090, 0xB0A0, 0xB0B0], "PTL", "Intel Graphics (Panther Lake)", True, "Xe3-LPG", "xe")
    add([0xFD80, 0xFD81], "WCL", "Intel Graphics (Wildcat Lake)", True, "Xe3-LPG", "xe")
    add([*range(0xD740, 0xD74C), *range(0xD750, 0xD760)], "NVL", "Intel Graphics (Nova Lake)", True, "Xe3P", "xe")
    return t


PCI_MODELS: dict[int, PciModel] = _models()
LNL_ARC = 0x64A0
# 140V and 130V share 0x64A0; the Xe2-core count tells them apart (8 vs 7, docs/arc.md §1).
LNL_XE_CORES = {8: "Arc 140V", 7: "Arc 130V"}


@dataclass(frozen=True)
class GpuInfo:
    vendor: str  # "intel" | "nvidia" | "cpu" | "other"
    name: str
    kind: str  # "discrete" | "integrated" | "cpu"
    supported: bool  # a device exl3local can serve on (Arc/Xe in the table, NVIDIA, or the CPU)
    slot: str | None = None  # PCI BDF
    pci_id: str | None = None  # "8086:e223"
    device_id: int | None = None
    codename: str | None = None
    xe_gen: str | None = None
    driver: str | None = None
    card_node: str | None = None
    render_node: str | None = None
    memory_bytes: int | None = None
    memory_source: str = "unknown"
    xe_cores: int | None = None

    @property
    def integrated(self) -> bool:
        return self.kind == "integrated"

    @property
    def backend(self) -> str:
        """vLLM platform this device runs under."""
        return {"intel": "xpu", "nvidia": "cuda"}.get(self.vendor, "cpu")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def cpu_device(mem_total_bytes: int | None = None) -> GpuInfo:
    return GpuInfo(vendor="cpu", name="CPU", kind="cpu", supported=True,
                   memory_bytes=mem_total_bytes if mem_total_bytes is not None else _mem_total(),
                   memory_source="system RAM")


def _mem_total() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _hex(path: Path) -> int | None:
    text = _read(path)
    try:
        return int(text, 16) if text else None
    except ValueError:
        return None


def _largest_prefetchable_bar(pci_dir: Path) -> int | None:
    text = _read(pci_dir / "resource")
    best = 0
    for line in (text or "").splitlines():
        try:
            start, end, flags = (int(x, 16) for x in line.split()[:3])
        except ValueError:
            continue
        if end > start and flags & IORESOURCE_PREFETCH:
            best = max(best, end - start + 1)
    return best if best >= MIN_VRAM_BAR_BYTES else None


def _discrete_memory(pci_dir: Path, card_dir: Path | None, driver: str | None) -> tuple[int | None, str]:
    if driver == "xe":
        tiles = [_read(t / "physical_vram_size_bytes") for t in sorted(pci_dir.glob("tile*"))]
        sizes = [int(s) for s in tiles if s and s.isdigit()]
        if sizes:
            return sum(sizes), "xe tile*/physical_vram_size_bytes (physical, includes reserved)"
    if driver == "i915" and card_dir is not None:
        lmem = _read(card_dir / "lmem_total_bytes")
        if lmem and lmem.isdigit():
            return int(lmem), "i915 lmem_total_bytes"
    bar = _largest_prefetchable_bar(pci_dir)
    if bar:
        return bar, "largest prefetchable PCI BAR (resizable BAR)"
    return None, "unknown (no VRAM size in sysfs; small BAR?)"


def _nvidia_memory(slot: str) -> int | None:
    """nvidia-smi is the only reliable source; absent on most machines, so best effort."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=pci.bus_id,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        bus, _, mib = line.partition(",")
        if bus.strip().lower().endswith(slot.lower()[-7:]) and mib.strip().isdigit():
            return int(mib.strip()) * 2**20
    return None


def _describe(pci_dir: Path, minors: dict[str, str], *, real_sys: bool, mem_total_bytes: int | None,
              xe_cores: int | None) -> GpuInfo | None:
    vendor_id = _hex(pci_dir / "vendor")
    device_id = _hex(pci_dir / "device")
    if vendor_id is None or device_id is None:
        return None
    slot = pci_dir.name
    drv_link = pci_dir / "driver"
    driver = drv_link.resolve().name if drv_link.is_symlink() else None
    card = minors.get("card")
    render = minors.get("render")
    card_dir = pci_dir / "drm" / card if card else None
    common: dict[str, Any] = dict(
        slot=slot, pci_id=f"{vendor_id:04x}:{device_id:04x}", device_id=device_id, driver=driver,
        card_node=f"/dev/dri/{card}" if card else None, render_node=f"/dev/dri/{render}" if render else None,
    )
    if vendor_id == INTEL:
        model = PCI_MODELS.get(device_id)
        if model is None:
            # Pre-Xe iGPUs (UHD etc.): shown in the list, never chosen.
            integrated = slot.endswith("00:02.0")
            return GpuInfo(vendor="intel", name=f"Intel Graphics (unsupported, 8086:{device_id:04x})",
                           kind="integrated" if integrated else "discrete", supported=False, **common)
        name = model.name
        if device_id == LNL_ARC and xe_cores in LNL_XE_CORES:
            name = LNL_XE_CORES[xe_cores]
        if model.integrated:
            ram = mem_total_bytes if mem_total_bytes is not None else _mem_total()
            mem = int(ram * IGPU_RAM_FRACTION) - IGPU_NEO_RESERVED_BYTES
            source = "shared RAM: 80 % of RAM - 450 MB (Level Zero's iGPU ceiling)"
        else:
            mem, source = _discrete_memory(pci_dir, card_dir, driver)
        return GpuInfo(vendor="intel", name=name, kind="integrated" if model.integrated else "discrete",
                       supported=True, codename=model.codename, xe_gen=model.xe_gen, memory_bytes=mem,
                       memory_source=source, xe_cores=xe_cores if device_id == LNL_ARC else None, **common)
    if vendor_id == NVIDIA:
        mem = _nvidia_memory(slot) if real_sys else None
        return GpuInfo(vendor="nvidia", name=f"NVIDIA GPU (10de:{device_id:04x})", kind="discrete", supported=True,
                       memory_bytes=mem, memory_source="nvidia-smi" if mem else "unknown", **common)
    return GpuInfo(vendor="other", name=f"GPU {vendor_id:04x}:{device_id:04x}", kind="discrete", supported=False,
                   **common)


_MINOR = re.compile(r"^(card|renderD)\d+$")


def _minors_from_sysfs(root: Path) -> dict[Path, dict[str, str]]:
    """PCI dir → {"card": "card0", "render": "renderD128"} from /sys/class/drm links."""
    out: dict[Path, dict[str, str]] = {}
    drm = root / "class" / "drm"
    if not drm.is_dir():
        return out
    for entry in sorted(drm.iterdir()):
        m = _MINOR.match(entry.name)  # skip connectors (card0-eDP-1) and the version file
        if not m:
            continue
        dev = entry / "device"
        if not dev.exists():
            continue
        pci_dir = dev.resolve()
        out.setdefault(pci_dir, {})["card" if m.group(1) == "card" else "render"] = entry.name
    return out


def _display_functions(root: Path) -> dict[Path, dict[str, str]]:
    """PCI display-class functions (0x03xxxx), with or without a DRM minor: datacenter NVIDIA
    cards (class 0x0302, no nvidia-drm in containers) and GPUs whose driver is not bound have
    none, and would otherwise look like "no GPU"."""
    out: dict[Path, dict[str, str]] = {}
    bus = root / "bus" / "pci" / "devices"
    if not bus.is_dir():
        return out
    for entry in sorted(bus.iterdir()):
        if (_read(entry / "class") or "").lower().startswith("0x03"):
            out[entry.resolve()] = {}
    return out


def _minors_from_udev() -> dict[Path, dict[str, str]]:
    import pyudev

    out: dict[Path, dict[str, str]] = {}
    for dev in pyudev.Context().list_devices(subsystem="drm"):
        m = _MINOR.match(dev.sys_name)
        parent = dev.find_parent("pci")
        if not m or parent is None:
            continue
        out.setdefault(Path(parent.sys_path), {})["card" if m.group(1) == "card" else "render"] = dev.sys_name
    return out


def probe(sysfs_root: Path = SYSFS, *, use_udev: bool | None = None, mem_total_bytes: int | None = None,
          xe_cores: int | None = None) -> list[GpuInfo]:
    """Every GPU (a DRM minor's PCI parent, or a display-class PCI function), in slot order. `xe_cores` comes from a
    runtime that can count them (torch.xpu in the engine interpreter); it only names the LNL part."""
    sysfs_root = Path(sysfs_root)
    real_sys = sysfs_root == SYSFS
    if mem_total_bytes is None and not real_sys:
        mem_total_bytes = MemorySnapshot.read(sysfs_root).total_bytes  # an iGPU's share of *that* machine's RAM
    minors: dict[Path, dict[str, str]] = {}
    if use_udev is None:
        use_udev = real_sys
    if use_udev:
        try:
            minors = _minors_from_udev()
        except (ImportError, OSError) as exc:
            log.info("udev unavailable (%s); reading sysfs directly", exc)
    if not minors:
        minors = _minors_from_sysfs(sysfs_root)
    for pci, none in _display_functions(sysfs_root).items():
        minors.setdefault(pci, none)
    gpus = [_describe(pci, mn, real_sys=real_sys, mem_total_bytes=mem_total_bytes, xe_cores=xe_cores)
            for pci, mn in minors.items()]
    return sorted((g for g in gpus if g is not None), key=lambda g: g.slot or "")


def choose(gpus: list[GpuInfo], mem_total_bytes: int | None = None) -> tuple[GpuInfo, str]:
    """The device to serve on, and why: supported Intel dGPU (most memory) > Intel iGPU >
    NVIDIA > CPU. Unsupported devices are never chosen."""
    def mem(g: GpuInfo) -> int:
        return g.memory_bytes or 0

    intel = [g for g in gpus if g.vendor == "intel" and g.supported]
    discrete = sorted((g for g in intel if not g.integrated), key=mem, reverse=True)
    if discrete:
        return discrete[0], f"{discrete[0].name} ({discrete[0].pci_id}) at {discrete[0].slot}"
    if intel:
        return intel[0], f"{intel[0].name} ({intel[0].pci_id}, integrated) at {intel[0].slot}"
    nvidia = sorted((g for g in gpus if g.vendor == "nvidia"), key=mem, reverse=True)
    if nvidia:
        return nvidia[0], f"{nvidia[0].name} at {nvidia[0].slot}"
    skipped = [g.name for g in gpus]
    why = f"no supported GPU (found: {', '.join(skipped)})" if skipped else "no GPU found"
    return cpu_device(mem_total_bytes), f"{why}: serving on the CPU"


def dmi_product(sysfs_root: Path = SYSFS) -> str:
    """Machine model, e.g. "Claw 8 AI+ A2VM" (the claw8 profile keys on it)."""
    dmi = Path(sysfs_root) / "class" / "dmi" / "id"
    parts = [_read(dmi / "sys_vendor"), _read(dmi / "product_name")]
    return " ".join(p for p in parts if p)


class HotplugWatch:
    """udev netlink monitor on the asyncio loop (no thread): calls `on_change()` after a DRM
    minor is added or removed, e.g. a Thunderbolt eGPU. Connector hotplug (`change` on a card)
    is ignored. Unavailable in most containers: `start()` then returns False."""

    def __init__(self, on_change: Callable[[str], None]) -> None:
        self._on_change = on_change
        self._monitor: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> bool:
        try:
            import pyudev

            monitor = pyudev.Monitor.from_netlink(pyudev.Context())
            monitor.filter_by("drm")
            monitor.start()
        except (ImportError, OSError) as exc:
            log.info("GPU hotplug watch unavailable: %s", exc)
            return False
        self._monitor, self._loop = monitor, loop
        loop.add_reader(monitor.fileno(), self._drain)
        return True

    def _drain(self) -> None:
        while (dev := self._monitor.poll(timeout=0)) is not None:
            if dev.action in ("add", "remove") and _MINOR.match(dev.sys_name or ""):
                self._on_change(dev.action)

    def stop(self) -> None:
        if self._monitor is not None and self._loop is not None:
            self._loop.remove_reader(self._monitor.fileno())
            self._monitor = None
