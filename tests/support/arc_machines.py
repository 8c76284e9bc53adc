"""Arc machines as sysfs trees whose size is a parameter (RAM, TTM's page limit, BAR, cards), a stand-in for
the engine interpreter's XPU query, and checkpoints that claim large weights without storing them.

The trees hold what exl3local reads and nothing else: the PCI functions and DRM minors (sysfs_trees'
layout), NUMA node meminfo (RAM), /sys/module/ttm/parameters/pages_limit and DMI. Tests derive every
expected number from the parameters given here, never from a particular tree.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import sys
from pathlib import Path

from sysfs_trees import _dmi, _pci, _resource

GiB = 2**30
MiB = 2**20
PAGE = 4096
B70_VRAM = 32 * GiB
SMALL_BAR = 256 * MiB
LNL_SLOT = "pci0000:00/0000:00:02.0"


def _memory(root: Path, ram: int, available: int, ttm_pages: int | None) -> None:
    """One NUMA node with `ram` total, of which `available` is free or reclaimable page cache."""
    node = root / "devices" / "system" / "node" / "node0"
    node.mkdir(parents=True, exist_ok=True)
    free, cache = available // 2, available - available // 2
    node.joinpath("meminfo").write_text(
        f"Node 0 MemTotal:       {ram // 1024} kB\n"
        f"Node 0 MemFree:        {free // 1024} kB\n"
        f"Node 0 MemUsed:        {(ram - free) // 1024} kB\n"
        f"Node 0 Active(file):   {cache // 2 // 1024} kB\n"
        f"Node 0 Inactive(file): {(cache - cache // 2) // 1024} kB\n"
        f"Node 0 SReclaimable:   0 kB\n")
    if ttm_pages is not None:
        ttm = root / "module" / "ttm" / "parameters"
        ttm.mkdir(parents=True, exist_ok=True)
        ttm.joinpath("pages_limit").write_text(f"{ttm_pages}\n")


def node_bytes(ram: int, available: int) -> tuple[int, int]:
    """What the tree's meminfo says after its kB rounding: (total, available)."""
    free, cache = available // 2, available - available // 2
    return ram // 1024 * 1024, (free // 1024 + cache // 2 // 1024 + (cache - cache // 2) // 1024) * 1024


def lunar(root: Path, ram: int = 32 * GiB, available: int | None = None, ttm_pages: int | None = -1,
          claw: bool = True) -> Path:
    """A Lunar Lake machine (Arc 140V/130V iGPU on xe): the MSI Claw 8 AI+ or another vendor's laptop.
    ttm_pages=-1: the kernel's default, half of RAM; None: no ttm module parameter."""
    _pci(root, LNL_SLOT, 0x8086, 0x64A0, "xe", ["card0", "renderD128"])
    (root / "class" / "drm" / "card0-eDP-1").mkdir()
    if claw:
        _dmi(root, "Micro-Star International Co., Ltd.", "Claw 8 AI+ A2VM")
    else:
        _dmi(root, "LENOVO", "21LK")
    _memory(root, ram, int(ram * 0.8) if available is None else available,
            ram // 2 // PAGE if ttm_pages == -1 else ttm_pages)
    return root


def b70_slot(i: int) -> str:
    return f"pci0000:00/0000:00:01.{i}/0000:0{2 * i + 1}:00.0/0000:0{2 * i + 2}:01.0/0000:0{2 * i + 3}:00.0"


def b70s(root: Path, cards: int = 1, bar: int = B70_VRAM, tile_file: bool = False, ram: int = 64 * GiB,
         old_igpu: bool = False) -> Path:
    """A desktop with `cards` Arc Pro B70s on xe. `bar`: the prefetchable BAR (VRAM with resizable BAR on,
    256 MiB without); tile_file: the 6.8-era tile0/physical_vram_size_bytes, which mainline xe no longer has.
    old_igpu: a UHD 770 iGPU on i915 at 00:02.0, which Level Zero may not enumerate."""
    if old_igpu:
        _pci(root, "pci0000:00/0000:00:02.0", 0x8086, 0x4680, "i915", ["card0", "renderD128"])
    for i in range(cards):
        extra = {"resource": _resource([(0x80000000 + i * 2**28, 16 * MiB, 0x40200),
                                        (0x4000000000 + i * 2**36, bar, 0x14220c)])}
        if tile_file:
            extra["tile0/physical_vram_size_bytes"] = f"{B70_VRAM}\n"
        n = i + (1 if old_igpu else 0)
        _pci(root, b70_slot(i), 0x8086, 0xE223, "xe", [f"card{n}", f"renderD{128 + n}"], extra)
    _dmi(root, "ASUS", "System Product Name")
    _memory(root, ram, int(ram * 0.7), ram // 2 // PAGE)
    return root


def xpu_standin(where: Path, devices: list[dict], torch_version: str = "2.13.0+xpu", error: str | None = None,
                name: str = "engine-python") -> Path:
    """An engine interpreter whose XPU runtime reports `devices` (index, name, device_id, total_bytes,
    free_bytes, xmx, xe_cores, driver): it answers the query exl3local runs there (machine/xpu.py QUERY) and
    hands every other command to this test's Python, so the rest of the engine interpreter is real."""
    from exl3local.machine import xpu

    answer = xpu.MARK + json.dumps({"torch": torch_version, "devices": devices, "error": error})
    script = where / name
    script.write_text("#!/bin/sh\n"
                      f"case \"$*\" in *{xpu.MARK.strip()}*) cat <<'EOF'\n{answer}\nEOF\n exit 0;; esac\n"
                      f"exec {sys.executable} \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def device(index: int, device_id: int, total: int, free: int | None = None, **kw) -> dict:
    return {"index": index, "name": kw.get("name", "Intel(R) Graphics"), "device_id": device_id,
            "total_bytes": total, "free_bytes": total if free is None else free, "xmx": kw.get("xmx", True),
            "xe_cores": kw.get("xe_cores"), "driver": kw.get("driver", "1.6.33276")}


def heavy_checkpoint(src: Path, dst: Path, extra_bytes: int) -> Path:
    """`src` (a real tiny EXL3 checkpoint) plus an unquantized tensor of `extra_bytes`, stored sparse: the
    manifest (headers only) counts it in the weights, the disk holds almost nothing."""
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    data = raw[8 + length:]
    elems = extra_bytes // 2
    header["model.padding_for_size.weight"] = {"dtype": "F16", "shape": [elems],
                                               "data_offsets": [len(data), len(data) + elems * 2]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
        f.truncate(8 + len(text) + len(data) + elems * 2)
    return dst


def environ(**extra: str) -> dict[str, str]:
    """This process's environment (private XDG dirs from the `xdg` fixture included) plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXL3LOCAL_")}
    return {**env, **extra}
