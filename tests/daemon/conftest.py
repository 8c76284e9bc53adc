"""Real daemon subprocesses on 127.0.0.1 with private XDG dirs, TMPDIR and ports; the engine is
the stand-in (tests/support/standin_engine.py) unless a test asks for real vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from private_user import clean_box, make_box

STANDIN_ENGINE = Path(__file__).resolve().parents[1] / "support" / "standin_engine.py"


@pytest.fixture
def box(tmp_path: Path):
    b = make_box(tmp_path, STANDIN_ENGINE)
    yield b
    clean_box(b)
