"""Build the CPU EXL3 library: one shared object per ISA tier, compiled from exl3_cpu.cpp with the system C++
compiler (g++/c++, or $CXX); the tier's header comes in through the source's #include. scripts/setup runs `python -P -m exl3local.kernels.cpu.build`; the loader
(kernels/cpu/ops.py) builds on first use when the file is missing, and without a compiler the dispatch falls
back to the reference decoder with the reason.

A library's file name carries a hash of the source and flags, so an edited source is never served stale.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("exl3_cpu.cpp")
# Included by SOURCE, hashed with it.
HEADERS = ("exl3_cpu_core.h", "exl3_cpu_avx512.h", "exl3_cpu_fp16.h", "exl3_cpu_pairs.h", "exl3_cpu_amx.h",
           "exl3_cpu_amx_u.h", "exl3_cpu_gemm.h", "exl3_cpu_avx2.h", "exl3_cpu_portable.h")
# -ffp-contract=off: no multiply-add the source does not write (the fp16 rounding splits of mul1 need it).
COMMON_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-ffp-contract=off")
# Per tier: the flags, and the /proc/cpuinfo flags the machine needs to run it.
TIERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # vpermb (VBMI) gathers each state's bytes, vpdpbusd (VNNI) sums mul1's bytes, F16C rounds through fp16.
    "avx512": (
        ("-DEXL3_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vbmi",
         "-mavx512vnni", "-mfma", "-mf16c"),
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi", "avx512_vnni", "fma", "f16c"),
    ),
    # AVX2 laptops (Lunar Lake, most others): the same decode on 256-bit vectors; AVX-VNNI (Alder Lake on) sums
    # mul1's bytes in one instruction.
    "avx2vnni": (("-DEXL3_AVX2", "-mavx2", "-mfma", "-mf16c", "-mavxvnni"), ("avx2", "fma", "f16c", "avx_vnni")),
    "avx2": (("-DEXL3_AVX2", "-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
    "portable": ((), ()),
}


class BuildError(RuntimeError):
    """The library could not be built (no compiler, or it failed); the message says which and why."""


def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.cache
def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...), '' where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return ""


def best_tier(flags: frozenset[str] | None = None) -> str:
    """The fastest tier this CPU runs (x86-64 only; other CPUs get the portable tier)."""
    flags = cpu_flags() if flags is None else flags
    for tier, (_, needs) in TIERS.items():
        if all(f in flags for f in needs):
            return tier
    return "portable"


def chosen_tier() -> str:
    """The tier this process uses: EXL3LOCAL_CPU_TIER if set (a tier this CPU runs), else best_tier()."""
    from exl3local import env

    forced = env.CPU_TIER.get().strip()
    if not forced:
        return best_tier()
    if forced not in TIERS:
        raise BuildError(f"{env.CPU_TIER.name}={forced!r} is not one of {', '.join(TIERS)}")
    missing = [f for f in TIERS[forced][1] if f not in cpu_flags()]
    if missing:
        raise BuildError(f"{env.CPU_TIER.name}={forced}: this CPU lacks {', '.join(missing)}")
    return forced


def runnable_tiers() -> list[str]:
    """The tiers this CPU runs, fastest first."""
    flags = cpu_flags()
    return [tier for tier, (_, needs) in TIERS.items() if all(f in flags for f in needs)] or ["portable"]


def build_chosen() -> tuple[str, Path]:
    """(tier, library) of chosen_tier(), built if missing. Where the compiler rejects an automatic choice's flags (a
    g++ older than 11 has no -mavxvnni), the next tier this CPU runs: a slower kernel, not the reference."""
    from exl3local import env

    tier = chosen_tier()
    if env.CPU_TIER.get().strip():
        return tier, build(tier)
    tiers = runnable_tiers()
    errors = []
    for candidate in tiers[tiers.index(tier):] if tier in tiers else [tier]:
        try:
            return candidate, build(candidate)
        except BuildError as exc:
            if compiler() is None:
                raise
            errors.append(f"{candidate}: {exc}")
    raise BuildError("; ".join(errors))


def compiler() -> str | None:
    for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def library_name(tier: str) -> str:
    text = SOURCE.read_bytes() + b"".join(SOURCE.with_name(h).read_bytes() for h in HEADERS)
    digest = hashlib.sha256(text + " ".join(COMMON_FLAGS + TIERS[tier][0]).encode()).hexdigest()[:12]
    return f"libexl3cpu-{tier}-{digest}.so"


def build_dirs() -> list[Path]:
    """Where libraries live, first choice first: beside the source (a checkout), else the user cache."""
    from exl3local import paths

    return [SOURCE.parent / "_build", paths.cache_dir() / "cpu-kernels"]


def find(tier: str) -> Path | None:
    name = library_name(tier)
    for d in build_dirs():
        if (d / name).is_file():
            return d / name
    return None


def build(tier: str) -> Path:
    """Compile `tier` into the first writable build dir (atomically: concurrent builders are harmless)."""
    existing = find(tier)
    if existing is not None:
        return existing
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (g++, c++, clang++ or $CXX); install one and run scripts/setup")
    errors = []
    for d in build_dirs():
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so.partial", dir=d)
            os.close(fd)
        except OSError as exc:
            errors.append(f"{d}: {exc}")
            continue
        cmd = [cxx, *COMMON_FLAGS, *TIERS[tier][0], str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(tmp)
            raise BuildError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}")
        target = d / library_name(tier)
        os.replace(tmp, target)
        for old in d.glob(f"libexl3cpu-{tier}-*.so"):  # earlier sources' builds (a loaded one stays mapped)
            if old != target:
                old.unlink(missing_ok=True)
        return target
    raise BuildError("no writable build directory: " + "; ".join(errors))


def main(argv: list[str]) -> int:
    try:
        tier, path = (argv[0], build(argv[0])) if argv else build_chosen()
    except BuildError as exc:
        print(f"exl3 CPU kernel: not built ({exc}); EXL3 layers on the CPU will use the slow reference decoder",
              file=sys.stderr)
        return 0  # never fail an install over it: the dispatch falls back and says why
    print(f"exl3 CPU kernel: {tier} tier at {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
