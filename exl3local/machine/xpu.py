"""What the engine's own interpreter sees of the Intel GPUs: the devices Level Zero enumerates (in PCI order),
their memory as torch reports it (torch.accelerator.get_memory_info, the call vLLM's start-up check makes;
in vLLM's own process its XPU platform may answer it through vllm-xpu-kernels), XMX, Xe cores, driver.

sysfs cannot say some of it: a B70 without resizable BAR on mainline xe has no VRAM size there, and a GPU
that Level Zero does not enumerate (an old iGPU on a legacy driver) shifts every device index after it.
`query(python)` runs QUERY in the engine's interpreter (`python -P -c QUERY`) and reads one JSON line
back; on a machine without an XPU runtime it reports no devices and says why.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

MARK = "XPU-RUNTIME "
QUERY_TIMEOUT_S = 120.0  # importing torch with the XPU runtime takes a while on a handheld
# Level Zero orders devices by PCI address only when asked to; the engine gets the same setting.
PCI_ORDER_ENV = {"ZE_ENABLE_PCI_ID_DEVICE_ORDER": "1"}


@dataclass(frozen=True)
class XpuDevice:
    index: int  # Level Zero's index with PCI ordering: what ZE_AFFINITY_MASK names
    name: str
    device_id: int | None  # the PCI device id
    total_bytes: int | None
    free_bytes: int | None
    xmx: bool | None  # has_subgroup_matrix_multiply_accumulate: Triton emits DPAS only with it
    xe_cores: int | None  # gpu_subslice_count
    driver: str | None


@dataclass(frozen=True)
class Runtime:
    python: str
    torch: str | None
    devices: tuple[XpuDevice, ...]
    error: str | None = None  # why the query said nothing (no torch, no XPU build, a crash)

    def to_json(self) -> dict[str, Any]:
        return {"python": self.python, "torch": self.torch, "error": self.error,
                "devices": [asdict(d) for d in self.devices]}

    def same_model(self, device_id: int | None) -> list[XpuDevice]:
        return [d for d in self.devices if device_id is not None and d.device_id == device_id]


def query(python: str, environ: dict[str, str] | None = None, timeout: float = QUERY_TIMEOUT_S) -> Runtime:
    """Ask `python` (the engine's interpreter) what it sees. Never raises: a failure is in `error`."""
    base = dict(os.environ if environ is None else environ)
    base.pop("ZE_AFFINITY_MASK", None)  # every device, so an index can be resolved
    try:
        proc = subprocess.run([python, "-P", "-c", QUERY], capture_output=True, text=True, timeout=timeout,
                              cwd="/", env={**base, **PCI_ORDER_ENV})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Runtime(python, None, (), f"{python}: {exc}")
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)), None)
    if line is None:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])
        return Runtime(python, None, (), f"{python} could not run the XPU query (exit {proc.returncode}): {tail}")
    try:
        data = json.loads(line[len(MARK):])
        devices = tuple(XpuDevice(**d) for d in data.get("devices", ()))
    except (ValueError, TypeError) as exc:
        return Runtime(python, None, (), f"{python}: unreadable XPU query answer ({exc})")
    return Runtime(python, data.get("torch"), devices, data.get("error"))


def affinity_index(gpu: Any, gpus: Sequence[Any], runtime: Runtime | None) -> int | None:
    """The Level Zero index of `gpu` (a hardware.GpuInfo), matched by PCI device id: the k-th card of a model
    in slot order is the k-th device of that id Level Zero enumerates in PCI order. None when the runtime does
    not list exactly as many devices of that id as sysfs has (then no index can be trusted)."""
    if runtime is None or gpu.device_id is None:
        return None
    if runtime.devices and all(d.device_id is None for d in runtime.devices):
        # A torch without device_id in its properties: only a one-for-one list in PCI order can be matched.
        intel = [g for g in gpus if g.vendor == "intel" and g.driver in ("xe", "i915")]
        same = len(intel) == len(runtime.devices) and gpu in intel
        return runtime.devices[intel.index(gpu)].index if same else None
    twins = [g for g in gpus if g.vendor == "intel" and g.device_id == gpu.device_id and g.driver in ("xe", "i915")]
    seen = runtime.same_model(gpu.device_id)
    if gpu not in twins or len(seen) != len(twins):
        return None
    return seen[twins.index(gpu)].index


# Runs in the engine's interpreter (`python -P -c QUERY`): this package never imports torch itself.
QUERY = f"""
import json
out = {{"torch": None, "devices": [], "error": None}}
try:
    import torch
    out["torch"] = torch.__version__
    xpu = getattr(torch, "xpu", None)
    if xpu is None or not xpu.is_available():
        out["error"] = "torch " + torch.__version__ + " sees no XPU device (a CPU or CUDA build, or no Level Zero GPU)"
    else:
        for i in range(xpu.device_count()):
            p = xpu.get_device_properties(i)
            try:  # what vLLM's MemorySnapshot reads; its XPU platform may route this to vllm-xpu-kernels
                accel = getattr(torch, "accelerator", None)
                query = accel.get_memory_info if hasattr(accel, "get_memory_info") else xpu.mem_get_info
                free, total = query(torch.device("xpu", i))
            except (RuntimeError, AttributeError, TypeError):
                free, total = None, getattr(p, "total_memory", None)
            out["devices"].append({{
                "index": i, "name": str(getattr(p, "name", "?")), "device_id": getattr(p, "device_id", None),
                "total_bytes": total, "free_bytes": free,
                "xmx": getattr(p, "has_subgroup_matrix_multiply_accumulate", None),
                "xe_cores": getattr(p, "gpu_subslice_count", None),
                "driver": str(getattr(p, "driver_version", "")) or None,
            }})
except Exception as exc:
    out["error"] = type(exc).__name__ + ": " + str(exc)
print({MARK!r} + json.dumps(out), flush=True)
"""
