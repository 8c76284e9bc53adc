"""Every EXL3LOCAL_* environment variable, with its default and a one-line doc.

Read them through `EnvVar.get()` at the moment they are needed, never at import time,
so tests and the daemon can change them per process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    doc: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)

    def get_bool(self) -> bool:
        return self.get().strip().lower() in {"1", "true", "yes", "on"}


HOST = EnvVar(
    "EXL3LOCAL_HOST", "",
    "daemon API address: empty = the Unix socket daemon.sock in the runtime dir; HOST:PORT = TCP there instead "
    "(then only the API token guards it)",
)
TRACE_PATHS = EnvVar("EXL3LOCAL_TRACE_PATHS", "0", "print one line per EXL3 kernel path the first time it runs")
TRACE_DIR = EnvVar(
    "EXL3LOCAL_TRACE_DIR", "", "where vLLM processes write kernel-path counters (default: <runtime dir>/kernel-paths)"
)
DECODE_ONCE = EnvVar(
    "EXL3LOCAL_DECODE_ONCE", "0", "plugin: keep a dense copy of each weight after the first decode (CPU speed-up, more memory)"
)
DISABLED_KERNELS = EnvVar(
    "EXL3LOCAL_DISABLED_KERNELS", "", "comma-separated EXL3 kernel class names to skip (e.g. TritonLinearKernel)"
)
CPU_INT8 = EnvVar(
    "EXL3LOCAL_CPU_INT8", "0",
    "CPU kernel: int8 activations for mul1 layers at decode (opt-in, faster, not exact: see docs/PERF.md's CPU section)",
)
CPU_TIER = EnvVar(
    "EXL3LOCAL_CPU_TIER", "", "CPU kernel: force an ISA tier (avx512, avx2vnni, avx2, portable; default: the best this CPU runs)"
)
KERNEL_SELFTEST = EnvVar(
    "EXL3LOCAL_KERNEL_SELFTEST", "auto",
    "check each EXL3 kernel against the reference before a layer uses it: auto (all but Triton's CPU interpreter), "
    "1 (that too), 0 (none)",
)
TILED_MAX_ROWS = EnvVar(
    "EXL3LOCAL_TILED_MAX_ROWS", "16",
    "Triton: rows up to which EXL3 linears decode on chip in 64-row tiles instead of rebuilding fp16 weights per call "
    "(16 or less: off, the default: slower than the rebuild on the H200, see docs/PERF.md)",
)
# Triton's own switch, read here so kernel choice knows Triton will run in its CPU interpreter (CI).
TRITON_INTERPRET = EnvVar("TRITON_INTERPRET", "0", "Triton's: run Triton kernels in its CPU interpreter")

ENGINE_PORT = EnvVar("EXL3LOCAL_ENGINE_PORT", "11436", "port of vLLM's OpenAI endpoint on 127.0.0.1 (`up --port` overrides)")
ENGINE_PYTHON = EnvVar("EXL3LOCAL_ENGINE_PYTHON", "", "interpreter that runs vLLM (default: the daemon's own)")
SYSFS = EnvVar("EXL3LOCAL_SYSFS", "/sys", "sysfs root for GPU detection (tests point it at fixture trees)")
ENGINE_PARENT = EnvVar(
    "EXL3LOCAL_ENGINE_PARENT", "", "internal: the daemon's pid, set for the engine launcher so it dies with the daemon"
)
STALL_TIMEOUT = EnvVar(
    "EXL3LOCAL_STALL_TIMEOUT", "300", "seconds a loading engine may go without output or /health before it is restarted"
)
HANG_TIMEOUT = EnvVar(
    "EXL3LOCAL_HANG_TIMEOUT", "30",
    "seconds a READY engine may leave /health unanswered before it is killed and restarted "
    "(a stopped engine process is restarted within ~4 s regardless)",
)
API_IDLE_TIMEOUT = EnvVar(
    "EXL3LOCAL_API_IDLE_TIMEOUT", "30",
    "seconds the daemon API waits for the next request on an open connection (or for the rest of one) before closing it",
)
API_KEY_FILE = EnvVar(
    "EXL3LOCAL_API_KEY_FILE", "", "file whose first line is the key clients must send to the OpenAI endpoint (Bearer)"
)
API_KEY = EnvVar("EXL3LOCAL_API_KEY", "", "the endpoint's key itself, when no key file is set (the file is safer)")

ALL: tuple[EnvVar, ...] = (
    HOST, ENGINE_PORT, ENGINE_PYTHON, SYSFS, STALL_TIMEOUT, HANG_TIMEOUT, API_IDLE_TIMEOUT, API_KEY_FILE, API_KEY,
    ENGINE_PARENT, TRACE_PATHS, TRACE_DIR, DECODE_ONCE, DISABLED_KERNELS, CPU_INT8, KERNEL_SELFTEST,
    TILED_MAX_ROWS, TRITON_INTERPRET, CPU_TIER,
)
