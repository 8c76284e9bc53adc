"""engine_stats: DRM fdinfo memory and the GET /api/kernels summary, on fixture trees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from exl3local.engine import stats as engine_stats

XE_DGPU_FDINFO = """pos:\t0
flags:\t02100002
drm-driver:\txe
drm-client-id:\t{client}
drm-pdev:\t0000:03:00.0
drm-total-system:\t8 KiB
drm-resident-system:\t8 KiB
drm-total-vram0:\t{vram} MiB
drm-resident-vram0:\t{vram} MiB
drm-active-vram0:\t0
drm-cycles-ccs:\t123
"""

XE_IGPU_FDINFO = """drm-driver:\txe
drm-client-id:\t7
drm-pdev:\t0000:00:02.0
drm-resident-system:\t1 GiB
drm-resident-gtt:\t2048 MiB
drm-resident-stolen:\t64 MiB
drm-total-gtt:\t4096 MiB
"""


def fake_proc(root: Path, pid: int, fds: dict[int, tuple[str, str]]) -> None:
    """/proc/<pid>/fd/<n> → link target, /proc/<pid>/fdinfo/<n> → text."""
    (root / str(pid) / "fd").mkdir(parents=True)
    (root / str(pid) / "fdinfo").mkdir()
    for fd, (target, info) in fds.items():
        os.symlink(target, root / str(pid) / "fd" / str(fd))
        (root / str(pid) / "fdinfo" / str(fd)).write_text(info)


def test_parse_fdinfo_turns_sizes_into_bytes():
    info = engine_stats.parse_fdinfo(XE_DGPU_FDINFO.format(client=3, vram=512))
    assert info["drm-resident-vram0"] == 512 * 2**20
    assert info["drm-resident-system"] == 8 * 2**10
    assert info["drm-active-vram0"] == 0
    assert info["drm-driver"] == "xe" and info["drm-pdev"] == "0000:03:00.0"
    assert "pos" not in info


def test_discrete_counts_vram_once_per_client(tmp_path):
    shared_client = XE_DGPU_FDINFO.format(client=3, vram=1000)
    fake_proc(tmp_path, 100, {5: ("/dev/dri/renderD128", shared_client), 6: ("/dev/dri/renderD128", shared_client),
                              7: ("/tmp/not-a-gpu", XE_DGPU_FDINFO.format(client=9, vram=99999))})
    fake_proc(tmp_path, 101, {4: ("/dev/dri/renderD128", XE_DGPU_FDINFO.format(client=4, vram=24))})
    used, source = engine_stats.gpu_memory([100, 101, 999], integrated=False, proc_root=tmp_path)
    assert used == (1000 + 24) * 2**20
    assert source == "drm-resident-vram0"


def test_integrated_counts_every_resident_region(tmp_path):
    fake_proc(tmp_path, 200, {3: ("/dev/dri/renderD128", XE_IGPU_FDINFO)})
    used, source = engine_stats.gpu_memory([200], integrated=True, proc_root=tmp_path)
    assert used == 2**30 + 2048 * 2**20 + 64 * 2**20
    assert source == "drm-resident-gtt+drm-resident-stolen+drm-resident-system"


def test_no_drm_client_means_unknown(tmp_path):
    fake_proc(tmp_path, 300, {3: ("/dev/null", "")})
    assert engine_stats.gpu_memory([300], integrated=False, proc_root=tmp_path) == (None, None)


def test_memory_fields_for_a_cpu_engine_has_system_ram_only():
    fields = engine_stats.memory_fields(os.getpid(), "cpu")
    assert fields["system_memory_total_bytes"] > fields["system_memory_available_bytes"] > 0
    assert fields["engine_gpu_memory_bytes"] is None


def test_kernel_summary_sums_processes_and_flags_fallback_and_latched_paths():
    snapshots = [
        {"pid": 1, "updated": 1000.0, "paths": {"gemv": {"calls": 10, "tokens": 10, "roles": {"mlp": 6, "attention": 4}},
                                                 "reconstruct_gemm": {"calls": 2, "tokens": 64}}},
        {"pid": 2, "updated": 1004.0, "paths": {"gemv": {"calls": 5, "tokens": 5, "last_s": 1003.5, "roles": {"attention": 5}},
                                                 "reference": {"calls": 1, "tokens": 1}},
         "flags": {"latched_off": {"moe_grouped": "Triton compile failed"}}},
    ]
    out = engine_stats.kernel_summary(snapshots, now=1005.0)
    rows = {r["path"]: r for r in out["paths"]}
    assert [r["path"] for r in out["paths"]] == list(engine_stats.KNOWN_PATHS)
    assert rows["gemv"] == {"path": "gemv", "calls": 15, "tokens": 15, "last_seen": 1003.5,
                            "roles": {"attention": 9, "mlp": 6}, "state": "ok", "reason": None}
    assert list(rows["gemv"]["roles"]) == ["attention", "mlp"]  # most calls first
    assert rows["reconstruct_gemm"]["roles"] == {}  # a writer without roles
    assert rows["reconstruct_gemm"]["last_seen"] == 1000.0
    assert rows["reference"]["state"] == "fallback"
    assert rows["moe_grouped"]["state"] == "latched_off" and rows["moe_grouped"]["reason"] == "Triton compile failed"
    assert rows["moe_decode"]["calls"] == 0 and rows["moe_decode"]["last_seen"] is None
    assert out["processes"] == 2 and out["updated"] == 1005.0


def test_reference_is_the_first_choice_on_the_cpu_not_a_fallback():
    snap = [{"updated": 1.0, "paths": {"reference": {"calls": 3, "tokens": 9}}}]
    rows = {r["path"]: r for r in engine_stats.kernel_summary(snap, now=2.0, device_kind="cpu")["paths"]}
    assert rows["reference"]["state"] == "ok" and rows["reference"]["calls"] == 3
    rows = {r["path"]: r for r in engine_stats.kernel_summary(snap, now=2.0, device_kind="discrete")["paths"]}
    assert rows["reference"]["state"] == "fallback"


def test_kernel_summary_reads_what_trace_writes(tmp_path):
    trace = pytest.importorskip("exl3local.plugin.trace")
    counters = trace.PathCounters(directory=tmp_path, pid=os.getpid())
    counters.count("gemv", 1)
    counters.count("gemv", 1)
    counters.count("reconstruct_gemm", 16)
    counters.flush()
    out = engine_stats.kernel_summary(trace.read_all(tmp_path), now=0.0)
    rows = {r["path"]: r for r in out["paths"]}
    assert (rows["gemv"]["calls"], rows["gemv"]["tokens"]) == (2, 2)
    assert (rows["reconstruct_gemm"]["calls"], rows["reconstruct_gemm"]["tokens"]) == (1, 16)

