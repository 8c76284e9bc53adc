"""doctor's plugin section (commands/selftest.plugin_check → plugin/check.py in the engine's interpreter): the vLLM
range, one EXL3 linear built through Exl3LinearMethod and one MoE layer, run against the reference. Before it,
doctor said OK when the plugin's config imported, and the engine could still crash-loop on the first layer."""

from __future__ import annotations

import sys
from pathlib import Path

from exl3local.commands.selftest import plugin_check
from exl3local.plugin import version


def rows_by_name(rows) -> dict:
    return {name: (ok, detail) for ok, name, detail in rows}


def test_this_interpreter_builds_both_layers_and_they_match(monkeypatch):
    monkeypatch.delenv("EXL3LOCAL_DISABLED_KERNELS", raising=False)
    rows = rows_by_name(plugin_check(sys.executable))
    assert rows["vllm"][0] is True and version.RANGE in rows["vllm"][1]
    for name in ("plugin linear", "plugin moe"):
        ok, detail = rows[name]
        assert ok is True, detail
        assert "error vs reference" in detail and " on cpu via " in detail


def test_unsupported_vllm_and_unbuildable_layers_fail(tmp_path: Path, monkeypatch):
    site = tmp_path / "site" / "vllm-0.26.1.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.1\n")
    python = tmp_path / "engine-python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site.parent} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    # no kernel left for a layer on this machine: what a device where every kernel fails looks like
    monkeypatch.setenv("EXL3LOCAL_DISABLED_KERNELS", "CpuLinearKernel,TorchReferenceKernel,TritonLinearKernel")
    rows = rows_by_name(plugin_check(str(python)))
    assert rows["vllm"][0] is False and "0.26.1" in rows["vllm"][1] and "`up` refuses" in rows["vllm"][1]
    for name in ("plugin linear", "plugin moe"):
        ok, detail = rows[name]
        assert ok is False and "NoKernelError" in detail, detail
