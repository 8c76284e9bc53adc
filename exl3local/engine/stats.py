"""Daemon-side numbers for the dashboard that vLLM's /metrics does not have (docs/api.md).

- `memory_fields`: system RAM and the engine's GPU memory from DRM fdinfo, for GET /api/status;
  `tree_rss`: the resident memory of the engine's whole process tree.
- `kernel_counts`: the plugin's per-process kernel-path counter files (plugin/trace.py) summed
  into the GET /api/kernels answer.

Only the daemon calls these: it spawned the engine, so it may read the engine's fdinfo (same UID),
and it owns the engine's trace directory. Light imports only (psutil), no torch/vLLM.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import psutil

from exl3local.kernel_paths import KernelPath
from exl3local.plugin import trace

KNOWN_PATHS = tuple(path.value for path in KernelPath)
# Reaching the reference decoder on a GPU means no fast kernel accepted those layers. On the CPU it serves
# where the C++ kernel cannot be built (kernels.dispatch.CANDIDATES["cpu"]), so there it is not painted red.
FALLBACK_PATHS = frozenset({"reference"})

_UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_FDINFO_LINE = re.compile(r"^(drm-[\w-]+):\s+(\d+)\s*(\w*)\s*$")


def parse_fdinfo(text: str) -> dict[str, str | int]:
    """One /proc/<pid>/fdinfo/<fd> file → its drm-* keys (sizes in bytes, other values as text)."""
    out: dict[str, str | int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if not key.startswith("drm-"):
            continue
        match = _FDINFO_LINE.match(line)
        if match and match.group(3) in _UNITS:
            out[key] = int(match.group(2)) * _UNITS[match.group(3)]
        else:
            out[key] = value.strip()
    return out


def _counted_key(key: str, integrated: bool) -> bool:
    """Which resident sizes are the GPU's memory (docs/arc.md §3): VRAM on a discrete
    card (xe `vram0`, i915 `local0`); on an iGPU everything resident is RAM (gtt, system, stolen)."""
    if not key.startswith("drm-resident-"):
        return False
    region = key.removeprefix("drm-resident-")
    return integrated or region.startswith(("vram", "local"))


def gpu_memory(pids: Iterable[int], integrated: bool, proc_root: Path = Path("/proc")) -> tuple[int | None, str | None]:
    """Resident GPU memory of these processes: (bytes, the fdinfo keys summed), or (None, None) when
    none of them has a DRM client open (CPU, NVIDIA, or fdinfo without memory keys).

    A DRM client shows up in every fd that shares it (dup, fork), so each (drm-pdev,
    drm-client-id) is counted once."""
    clients: dict[tuple[str, str], dict[str, str | int]] = {}
    for pid in pids:
        fd_dir = proc_root / str(pid) / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue  # exited, or not ours
        for fd in fds:
            try:
                if not os.readlink(fd_dir / fd).startswith("/dev/dri/"):
                    continue
                info = parse_fdinfo((proc_root / str(pid) / "fdinfo" / fd).read_text())
            except OSError:
                continue
            if "drm-client-id" in info:
                clients[(str(info.get("drm-pdev", "")), str(info["drm-client-id"]))] = info
    total = 0
    keys: set[str] = set()
    for info in clients.values():
        for key, value in info.items():
            if isinstance(value, int) and _counted_key(key, integrated):
                total += value
                keys.add(key)
    if not keys:
        return None, None
    return total, "+".join(sorted(keys))


def memory_fields(engine_pid: int | None, gpu_kind: str | None) -> dict[str, Any]:
    """The memory keys of GET /api/status (docs/api.md): system RAM, and the GPU memory resident
    for the engine's whole process tree (API server, EngineCore, workers)."""
    vm = psutil.virtual_memory()
    fields: dict[str, Any] = {
        "system_memory_total_bytes": vm.total,
        "system_memory_available_bytes": vm.available,
        "engine_gpu_memory_bytes": None,
        "engine_gpu_memory_source": None,
    }
    if engine_pid is None or gpu_kind not in ("discrete", "integrated"):
        return fields
    try:
        root = psutil.Process(engine_pid)
        pids = [root.pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.Error:
        return fields
    used, source = gpu_memory(pids, integrated=gpu_kind == "integrated")
    fields["engine_gpu_memory_bytes"] = used
    fields["engine_gpu_memory_source"] = source
    return fields


def tree_rss(pid: int | None) -> int | None:
    """Resident memory of a process and all its descendants; None when it is gone."""
    if pid is None:
        return None
    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return None


def kernel_counts(trace_dir: Path, now: float, device_kind: str | None = None) -> dict[str, Any]:
    """The GET /api/kernels answer from the counter files the engine's processes keep in `trace_dir`."""
    return kernel_summary(trace.read_all(trace_dir), now, device_kind)


def kernel_summary(
    snapshots: Iterable[Mapping[str, Any]], now: float, device_kind: str | None = None
) -> dict[str, Any]:
    """Per-process counter files (trace.read_all()) → the GET /api/kernels answer.

    Every known path is listed, unused ones with zero calls. A path is `latched_off` when a process
    lists it in its `latched_off` flag ({path: reason}), `fallback` when it is a fallback path
    (the reference decoder) that ran on a GPU (`device_kind` not "cpu"); the dashboard paints both red."""
    calls: dict[str, int] = {}
    tokens: dict[str, int] = {}
    last_seen: dict[str, float] = {}
    roles: dict[str, dict[str, int]] = {}
    latched: dict[str, str] = {}
    processes = 0
    for snap in snapshots:
        processes += 1
        updated = float(snap.get("updated", now))
        for path, entry in snap.get("paths", {}).items():
            calls[path] = calls.get(path, 0) + int(entry.get("calls", 0))
            tokens[path] = tokens.get(path, 0) + int(entry.get("tokens", 0))
            for role, n in (entry.get("roles") or {}).items():
                by_role = roles.setdefault(path, {})
                by_role[role] = by_role.get(role, 0) + int(n)
            # `last_s` when the writer records it; else the file's write time is the latest call
            # it can vouch for (files are rewritten only when a count changed).
            seen = float(entry.get("last_s", updated))
            last_seen[path] = max(last_seen.get(path, seen), seen)
        for path, reason in (snap.get("flags", {}).get("latched_off") or {}).items():
            latched[path] = str(reason)
    rows = []
    # a path the kernel self-test took out of service is listed even if it has no counter (e.g. bound_direct)
    for path in [*KNOWN_PATHS, *sorted((set(calls) | set(latched)) - set(KNOWN_PATHS))]:
        state, reason = "ok", None
        if path in latched:
            state, reason = "latched_off", latched[path]
        elif path in FALLBACK_PATHS and calls.get(path, 0) > 0 and device_kind != "cpu":
            state, reason = "fallback", "layers ran on the slow reference decoder: no fast kernel accepted them"
        rows.append({
            "path": path,
            "calls": calls.get(path, 0),
            "tokens": tokens.get(path, 0),
            "last_seen": last_seen.get(path),
            "roles": dict(sorted(roles.get(path, {}).items(), key=lambda kv: -kv[1])),  # layer role -> calls
            "state": state,
            "reason": reason,
        })  # fmt: skip
    return {"paths": rows, "processes": processes, "updated": now}
