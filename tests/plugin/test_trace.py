"""Kernel-path counters: in-memory counting, the per-process file format (docs/api.md), the first-use line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

from exl3local.plugin import trace


def test_counts_reach_the_file_and_totals(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("EXL3LOCAL_TRACE_PATHS", "1")
    counters = trace.PathCounters(tmp_path)
    counters.count("gemv", 1)
    counters.count("gemv", 1)
    counters.count("moe_grouped", 37)
    counters.note_layer("TorchReferenceKernel")
    counters.set_flag("decode_once", False)
    counters.add_flag("moe_arena_bytes", 100)
    counters.add_flag("moe_arena_bytes", 23)
    counters.flush()
    data = json.loads((tmp_path / f"kernel-paths-{os.getpid()}.json").read_text())
    assert data["version"] == 1 and data["pid"] == os.getpid()
    assert {p: (v["calls"], v["tokens"]) for p, v in data["paths"].items()} == {"gemv": (2, 2), "moe_grouped": (1, 37)}
    assert data["paths"]["gemv"]["first_s"] <= data["paths"]["gemv"]["last_s"] <= data["updated"]
    assert data["layers"] == {"TorchReferenceKernel": 1}
    assert data["flags"] == {"decode_once": False, "moe_arena_bytes": 123}
    err = capfd.readouterr().err
    assert err.count("kernel path gemv engaged") == 1 and err.count("kernel path moe_grouped engaged") == 1
    assert trace.totals(trace.read_all(tmp_path)) == {"gemv": {"calls": 2, "tokens": 2}, "moe_grouped": {"calls": 1, "tokens": 37}}


def test_quiet_without_the_switch(tmp_path, monkeypatch, capfd):
    monkeypatch.delenv("EXL3LOCAL_TRACE_PATHS", raising=False)
    trace.PathCounters(tmp_path).count("gemv", 4)
    assert "engaged" not in capfd.readouterr().err


def test_reader_skips_dead_processes_and_sees_live_counts_from_another_process(tmp_path):
    (tmp_path / "kernel-paths-999999999.json").write_text(json.dumps({"pid": 999999999, "paths": {"gemv": {"calls": 5}}}))
    child = textwrap.dedent(
        """
        import sys, time
        from exl3local.plugin import trace
        trace.count("reference", 3)
        trace.count("reference", 3)
        print("counted", flush=True)
        time.sleep(60)
        """
    )
    env = {**os.environ, "EXL3LOCAL_TRACE_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-P", "-c", child], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "counted"
        # The first count writes the file at once; the second reaches it only through the flusher thread
        # (every 0.5 s; a loaded CI machine may take longer, so poll rather than sleep a fixed time).
        expected = {"reference": {"calls": 2, "tokens": 6}}
        deadline = time.monotonic() + 20
        while trace.totals(snaps := trace.read_all(tmp_path)) != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [s["pid"] for s in snaps] == [proc.pid]
        assert trace.totals(snaps) == expected
        assert len(trace.read_all(tmp_path, live_only=False)) == 2
    finally:
        proc.kill()
        proc.wait()


def test_unwritable_directory_does_not_stop_counting(tmp_path, capfd):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    counters = trace.PathCounters(blocker)  # the file would go under a regular file: ENOTDIR
    counters.count("gemv", 2)
    counters.count("gemv", 2)
    assert counters.snapshot()["paths"]["gemv"]["calls"] == 2
    assert capfd.readouterr().err.count("not written") == 1
