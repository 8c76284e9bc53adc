"""Per-process kernel-path counters: which EXL3 path ran, how often, on how many tokens.

vLLM runs our layers in its worker process, which the daemon and the dashboard cannot reach. So each
process that counts anything keeps a small JSON file up to date in the trace directory
(`EXL3LOCAL_TRACE_DIR`, default `<runtime dir>/kernel-paths`), named `kernel-paths-<pid>.json` and
replaced atomically (write + rename), so a reader never sees half a file. The format is documented
in docs/api.md under "Kernel path counters".

Counting is a dict update under a lock (no I/O in the hot path): a daemon thread rewrites the file
at most every FLUSH_INTERVAL_S when something changed, plus once when a path engages for the first
time and once at exit. `EXL3LOCAL_TRACE_PATHS=1` also prints one line per path on first use. Per-call
counting happens only when asked (`enabled()`): layers decide once at load.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from exl3local import env

FORMAT_VERSION = 1
FILE_PREFIX = "kernel-paths-"
# The dashboard polls about once a second; flushing twice as often keeps it at most ~1 s behind.
FLUSH_INTERVAL_S = 0.5


def trace_dir() -> Path:
    """Where every process writes its counters (created on first use)."""
    configured = env.TRACE_DIR.get()
    if configured:
        path = Path(configured)
        path.mkdir(parents=True, exist_ok=True)
        return path
    from exl3local import paths

    path = paths.runtime_dir() / "kernel-paths"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


class PathCounters:
    """One process's counters. Use the module-level `count`/`note_layer`; this class exists for tests."""

    def __init__(self, directory: Path | None = None, pid: int | None = None) -> None:
        self._lock = threading.Lock()
        self._dir = directory
        self._pid = pid or os.getpid()
        self._started = time.time()
        self._paths: dict[str, dict[str, int | float]] = {}
        self._layers: dict[str, int] = {}  # "<kernel class> <path>" -> layers prepared that way
        self._flags: dict[str, Any] = {}
        self._dirty = False
        self._broken = False  # set when the file cannot be written; then only memory counts
        self._flusher: threading.Thread | None = None

    @property
    def file(self) -> Path:
        return (self._dir or trace_dir()) / f"{FILE_PREFIX}{self._pid}.json"

    def count(self, path: str, tokens: int, role: str | None = None) -> None:
        """One call of `path` on `tokens` tokens, by a layer of `role` (see role_of)."""
        with self._lock:
            now = time.time()
            entry = self._paths.get(path)
            first = entry is None
            if first:
                entry = self._paths[path] = {"calls": 0, "tokens": 0, "first_s": now, "last_s": now, "roles": {}}
            entry["calls"] += 1
            entry["tokens"] += tokens
            entry["last_s"] = now
            if role is not None:
                entry["roles"][role] = entry["roles"].get(role, 0) + 1
            self._dirty = True
        if first:
            if env.TRACE_PATHS.get_bool():
                print(f"exl3local: kernel path {path} engaged (pid {self._pid}, {tokens} tokens)", file=sys.stderr, flush=True)
            self.flush()
            self._start_flusher()

    def note_layer(self, kernel: str) -> None:
        """A layer chose `kernel` at load time (shown next to the counters)."""
        with self._lock:
            self._layers[kernel] = self._layers.get(kernel, 0) + 1
            self._dirty = True

    def set_flag(self, name: str, value: Any) -> None:
        """A per-process setting the dashboard should show (e.g. decode_once)."""
        with self._lock:
            self._flags[name] = value
            self._dirty = True

    def add_flag(self, name: str, amount: int | float) -> None:
        """Add to a numeric flag (e.g. bytes allocated by several layers)."""
        with self._lock:
            self._flags[name] = self._flags.get(name, 0) + amount
            self._dirty = True

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "version": FORMAT_VERSION,
                "pid": self._pid,
                "ppid": os.getppid(),
                "started": self._started,
                "updated": time.time(),
                "paths": {p: {**v, "roles": dict(v["roles"])} for p, v in sorted(self._paths.items())},
                "layers": dict(sorted(self._layers.items())),
                "flags": dict(self._flags),
            }

    def flush(self) -> None:
        """Rewrite this process's file if anything changed since the last write."""
        with self._lock:
            if not self._dirty:
                return
            self._dirty = False
        if self._broken:
            return
        data = self.snapshot()
        try:
            target = self.file
            tmp = target.with_name(f".{target.name}.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, target)
        except OSError as err:
            # Counters are for the dashboard: an unwritable directory must not stop inference.
            self._broken = True
            print(f"exl3local: kernel path counters not written ({err}); counting continues in memory", file=sys.stderr, flush=True)

    def _start_flusher(self) -> None:
        with self._lock:
            if self._flusher is not None:
                return
            self._flusher = threading.Thread(target=self._flush_loop, name="exl3-trace", daemon=True)
        self._flusher.start()
        atexit.register(self.flush)

    def _flush_loop(self) -> None:
        while True:
            time.sleep(FLUSH_INTERVAL_S)
            self.flush()


_COUNTERS: PathCounters | None = None
_COUNTERS_LOCK = threading.Lock()


def counters() -> PathCounters:
    """This process's counters (a fresh set after fork: the pid is part of the identity)."""
    global _COUNTERS
    with _COUNTERS_LOCK:
        if _COUNTERS is None or _COUNTERS._pid != os.getpid():
            _COUNTERS = PathCounters()
        return _COUNTERS


def count(path: str, tokens: int, role: str | None = None) -> None:
    counters().count(str(path), tokens, role)


def enabled() -> bool:
    """Whether layers should count their calls: only when asked (the daemon sets EXL3LOCAL_TRACE_DIR for its
    engine; EXL3LOCAL_TRACE_PATHS=1 asks too). Layers read this once at load, so a bare vLLM with the plugin
    does no per-call counting. Load-time notes (note_layer, flags) are written either way."""
    return bool(env.TRACE_DIR.get()) or env.TRACE_PATHS.get_bool()


# Layer roles the counters tell apart, most specific first: (substring of the vLLM prefix, role).
ROLE_MARKERS = (
    ("visual.", "vision"), ("mtp.", "mtp"), (".linear_attn.", "gdn"), (".shared_expert.", "shared_expert"),
    (".experts", "experts"), ("attn.", "attention"), (".mlp.", "mlp"),
)  # fmt: skip


def role_of(prefix: str) -> str:
    """What a layer does, from its vLLM prefix: the dashboard shows which kernel path served which role."""
    dotted = f".{prefix}"
    if dotted.endswith(".lm_head"):
        return "lm_head"
    for marker, role in ROLE_MARKERS:
        if marker in dotted:
            return role
    return "other"


def note_layer(kernel: str) -> None:
    counters().note_layer(kernel)


def set_flag(name: str, value: Any) -> None:
    counters().set_flag(name, value)


def add_flag(name: str, amount: int | float) -> None:
    counters().add_flag(name, amount)


def read_all(directory: Path | None = None, live_only: bool = True) -> list[dict[str, Any]]:
    """Every process's counters in `directory` (the reader side, for the daemon and tests).

    With `live_only`, files of processes that no longer exist are skipped (they stay on disk until
    the directory is cleaned, so a crashed engine's last numbers remain inspectable).
    """
    out = []
    for file in sorted((directory or trace_dir()).glob(f"{FILE_PREFIX}*.json")):
        try:
            data = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # removed between glob and read
        if live_only and not _alive(int(data.get("pid", -1))):
            continue
        out.append(data)
    return out


def totals(snapshots: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Calls and tokens per path, summed over processes."""
    out: dict[str, dict[str, int]] = {}
    for snap in snapshots:
        for path, entry in snap.get("paths", {}).items():
            acc = out.setdefault(path, {"calls": 0, "tokens": 0})
            acc["calls"] += int(entry.get("calls", 0))
            acc["tokens"] += int(entry.get("tokens", 0))
    return out


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
