"""bench/model_step.py runs on CPU under the Triton interpreter (a tiny MoE model, every op kind): CI's smoke run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "model_step.py"
UNCHECKED = Path(__file__).resolve().parents[1] / "support" / "interpreter_checks.py"  # as tests/conftest.py does


@pytest.mark.slow  # a minute of interpreted kernels
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1")
def test_smoke_run_times_a_tiny_moe_model_at_decode_and_grouped_row_counts(tmp_path):
    proc = subprocess.run([sys.executable, "-P", str(UNCHECKED), str(BENCH), "--smoke", "--out", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((tmp_path / "model_step.json").read_text())
    assert [(r["model"], r["rows"]) for r in rows] == [("tiny-moe", 1), ("tiny-moe", 5)]
    assert all(r["ours"]["eager_us"] > 0 for r in rows)
    assert proc.stdout.splitlines()[-1].startswith("tiny-moe      5")  # the summary table is printed last
