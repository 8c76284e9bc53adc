"""The memory facts of a machine: RAM and TTM's page limit (from /proc via psutil, or from another machine's
sysfs tree), and a device's memory as the engine's GPU runtime reports it. Standard library only at import
(scripts/setup's GPU detection runs before any dependency is installed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PAGE_BYTES = 4096  # TTM counts pages of the kernel's base page size (4 KiB on x86)
# The per-node counters the kernel publishes in sysfs; "available" as the kernel estimates it: free pages plus
# the page cache and slab it can reclaim.
_NODE_AVAILABLE = ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable")


@dataclass(frozen=True)
class MemorySnapshot:
    total_bytes: int  # RAM
    available_bytes: int  # RAM the OS can hand out now (psutil: free + reclaimable cache)
    # TTM's global page limit (/sys/module/ttm/parameters/pages_limit, half of RAM by default): beyond it
    # the kernel swaps GPU buffers out; an iGPU's buffers count against it. None: not readable.
    gpu_pages_limit_bytes: int | None = None

    @classmethod
    def now(cls) -> MemorySnapshot:
        return cls.read(Path("/sys"))

    @classmethod
    def read(cls, sysfs_root: Path) -> MemorySnapshot:
        """RAM and TTM's page limit as the machine under `sysfs_root` has them. The real /sys takes RAM from
        /proc/meminfo (psutil); another tree (a fixture, a copy of another machine's /sys) from its NUMA nodes'
        meminfo, falling back to this machine's RAM when the tree has none."""
        root = Path(sysfs_root)
        limit = _ttm_pages_limit(root)
        nodes = _node_meminfo(root) if root != Path("/sys") else None
        if nodes is not None:
            return cls(nodes[0], nodes[1], limit)
        import psutil

        vm = psutil.virtual_memory()
        blocks = _memory_blocks(root) if root != Path("/sys") else None
        if blocks is not None:  # RAM size only: what is in use is this machine's, at most all of it
            return cls(blocks, max(0, blocks - (int(vm.total) - int(vm.available))), limit)
        return cls(int(vm.total), int(vm.available), limit)


def _ttm_pages_limit(root: Path) -> int | None:
    try:
        pages = int((root / "module" / "ttm" / "parameters" / "pages_limit").read_text().strip())
    except (OSError, ValueError):
        return None
    return pages * PAGE_BYTES if pages > 0 else None


def _memory_blocks(root: Path) -> int | None:
    """RAM from memory hotplug blocks: devices/system/memory/block_size_bytes (hex) x the blocks online."""
    mem = root / "devices" / "system" / "memory"
    try:
        size = int((mem / "block_size_bytes").read_text().strip(), 16)
    except (OSError, ValueError):
        return None
    online = 0
    for state in mem.glob("memory*/state"):
        try:
            online += state.read_text().strip() == "online"
        except OSError:
            continue
    return size * online if online else None


def _node_meminfo(root: Path) -> tuple[int, int] | None:
    """(total, available) summed over devices/system/node/node*/meminfo ("Node 0 MemTotal: 32768 kB")."""
    total = avail = 0
    found = False
    for path in sorted((root / "devices" / "system" / "node").glob("node*/meminfo")):
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            parts = line.split()
            if len(parts) < 4 or not parts[3].isdigit():
                continue
            key, kib = parts[2].rstrip(":"), int(parts[3]) * 1024
            if key == "MemTotal":
                total += kib
                found = True
            elif key in _NODE_AVAILABLE:
                avail += kib
    return (total, min(avail, total)) if found else None


@dataclass(frozen=True)
class DeviceMemory:
    """The device's memory as the engine's runtime reports it (torch.xpu.mem_get_info in the engine's
    interpreter, machine/xpu.py): the numbers vLLM's start-up check compares."""

    total_bytes: int
    free_bytes: int | None  # None: the runtime was not asked (no XPU runtime on this machine)
    source: str
