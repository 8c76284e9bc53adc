"""The real dashboard app, driven by Pilot against the stub daemon on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from textual.widgets import Log, RichLog

from exl3local.api import metrics
from exl3local.tui.app import Dashboard, make_dashboard
from exl3local.tui.messages import DaemonLost, KernelsUpdated, LogsAppended, MetricsUpdated, StatusUpdated
from exl3local.tui.screens.logs import LogScreen
from exl3local.tui.screens.modals import ConfirmScreen, InfoScreen
from exl3local.tui.widgets.engine import EnginePanel
from exl3local.tui.widgets.kernels import KernelPanel
from exl3local.tui.widgets.memory import MemoryPanel
from exl3local.tui.widgets.throughput import ThroughputPanel

SIZE = (120, 40)
POLL_ONCE_S = 3600.0  # the worker polls once at start; tests drive further polls with poll_once()


def rendered(widget, renderable=None) -> str:
    """What the widget draws (or `renderable` at the widget's width), without styles; runs of
    whitespace and line wraps become one space."""
    from rich.console import Console

    console = Console(width=widget.content_size.width or 60, record=True, file=open(os.devnull, "w"))
    console.print(widget.render() if renderable is None else renderable)
    return " ".join(console.export_text().split())


async def test_ready_panels_show_the_recorded_numbers(wait_until, step_clock, stub_daemon, recorded):
    stub_daemon.play_load()
    seen: list = []
    app = make_dashboard(stub_daemon.url, POLL_ONCE_S, clock=step_clock)
    async with app.run_test(size=SIZE, message_hook=seen.append) as pilot:
        # the worker's first round ends with the log fetch; polling before that would race it
        await wait_until(pilot, lambda: any(isinstance(m, LogsAppended) for m in seen))
        for _ in range(3):
            await app.poll_once()
        await pilot.pause()
        throughput = app.query_one(ThroughputPanel)
        await wait_until(pilot, lambda: throughput.snapshot is not None
                       and throughput.snapshot.generation_tokens_total
                       == metrics.parse(recorded("load_3.txt")).generation_tokens_total)
        # rate between the last two scrapes, 2 s apart on the step clock
        before = metrics.parse(recorded("load_2.txt")).generation_tokens_total
        after = metrics.parse(recorded("load_3.txt")).generation_tokens_total
        assert after > before
        assert throughput.gen_tok_s == pytest.approx((after - before) / 2.0)
        assert "tok/s" in str(app.query_one("#gen-rate").render())
        # latency percentiles over the scrapes of the last minute (all four are within it)
        window_itl = metrics.parse(recorded("load_3.txt")).itl.since(metrics.parse(recorded("load_0.txt")).itl)
        queue = str(app.query_one("#queue").content)
        assert "(last minute)" in queue and f"p50 {window_itl.quantile(0.5) * 1000:.0f} ms" in queue

        engine_text = rendered(app.query_one(EnginePanel))
        assert "READY" in engine_text and "tiny-llama-exl3-4.0bpw" in engine_text
        assert "http://127.0.0.1:11436/v1" in engine_text and "restarts 0" in engine_text

        memory = app.query_one(MemoryPanel)
        assert memory.kv_usage == metrics.parse(recorded("load_3.txt")).kv_cache_usage
        memory_text = rendered(memory)
        assert "24.0 GiB" in memory_text and "2.1 GiB" in memory_text and "16,384 tok" in memory_text

        kernels_text = rendered(app.query_one(KernelPanel))
        assert "3,072" in kernels_text and "1,536" in kernels_text
        assert "gemv served gdn 1,536, attention 512" in kernels_text  # which layers each path served
        assert "OFF" in kernels_text and "FALLBACK" in kernels_text
        assert "moe_grouped latched_off" in kernels_text
        assert "Triton compile failed on first call" in kernels_text

        log_lines = app.query_one("#log-tail", Log).lines
        # the tail folds library noise (the recording starts with Triton's CPU-backend notice and warnings)
        assert log_lines and log_lines[0].startswith("[exl3local: 5 lines of library noise folded")
        assert log_lines[1] == recorded("engine.log").splitlines()[5]
        assert not any("libtcmalloc" in line for line in log_lines)

    kinds = {type(m) for m in seen}
    assert {StatusUpdated, MetricsUpdated, KernelsUpdated, LogsAppended} <= kinds
    assert DaemonLost not in kinds
    # the log is fetched once as a tail, then followed by offset
    log_gets = [r for r in stub_daemon.requests if r.startswith("GET /api/logs")]
    assert log_gets[0] == "GET /api/logs?tail=200" and all("offset=" in r for r in log_gets[1:])


async def test_new_log_text_is_appended(wait_until, stub_daemon):
    app = make_dashboard(stub_daemon.url, POLL_ONCE_S)
    async with app.run_test(size=SIZE) as pilot:
        tail = app.query_one("#log-tail", Log)
        await wait_until(pilot, lambda: tail.line_count > 0)
        count = tail.line_count
        stub_daemon.log_text += "INFO first new line\nINFO second new line\n"
        await app.poll_once()
        await wait_until(pilot, lambda: tail.line_count >= count + 2)
        assert tail.lines[-2:] == ["INFO first new line", "INFO second new line"]


async def test_failed_engine_shows_state_and_error_and_asks_for_no_metrics(wait_until, stub_daemon):
    stub_daemon.set_status("status_failed.json")
    app = make_dashboard(stub_daemon.url, POLL_ONCE_S)
    async with app.run_test(size=SIZE) as pilot:
        engine = app.query_one(EnginePanel)
        await wait_until(pilot, lambda: engine.status is not None)
        text = rendered(engine)
        assert "FAILED" in text and "giving up" in text and "less than desired" in text
        assert engine.has_class("-bad")
        assert "no metrics" in str(app.query_one("#queue").render())
    assert not any(r.startswith("GET /api/metrics") for r in stub_daemon.requests)


async def test_survives_the_daemon_going_away_and_coming_back(wait_until, stub_daemon):
    seen: list = []
    app = make_dashboard(stub_daemon.url, poll_s=0.1)
    async with app.run_test(size=SIZE, message_hook=seen.append) as pilot:
        engine = app.query_one(EnginePanel)
        await wait_until(pilot, lambda: engine.status is not None)
        stub_daemon.stop()
        await wait_until(pilot, lambda: engine.lost is not None)
        assert "not reachable" in rendered(engine)
        assert engine.has_class("-lost")
        assert app.query_one(ThroughputPanel).snapshot is None
        # the engine went with its daemon: no RSS of it stays on screen (issue 24)
        assert "Engine RSS" not in rendered(app.query_one(MemoryPanel))
        stub_daemon.requests.clear()
        stub_daemon.start()
        await wait_until(pilot, lambda: engine.lost is None)
        await wait_until(pilot, lambda: app.query_one(ThroughputPanel).snapshot is not None)
        assert "READY" in rendered(engine)
        # after a reconnect the log is fetched again from its tail
        await wait_until(pilot, lambda: "GET /api/logs?tail=200" in stub_daemon.requests)
    lost_at = next(i for i, m in enumerate(seen) if isinstance(m, DaemonLost))
    assert any(isinstance(m, StatusUpdated) for m in seen[lost_at:])


async def test_no_daemon_at_start_says_so(wait_until, no_daemon_url):
    app = make_dashboard(no_daemon_url, poll_s=0.2)
    async with app.run_test(size=SIZE) as pilot:
        engine = app.query_one(EnginePanel)
        await wait_until(pilot, lambda: engine.lost is not None)
        text = rendered(engine)
        assert "NO DAEMON" in text and "exl3local up" in text
        assert app.sub_title == "daemon not reachable"


async def test_something_else_on_the_port_is_reported_not_fatal(wait_until, stub_daemon):
    stub_daemon.status = ["not", "a", "status"]  # JSON, but not the status object
    app = make_dashboard(stub_daemon.url, poll_s=0.1)
    async with app.run_test(size=SIZE) as pilot:
        engine = app.query_one(EnginePanel)
        await wait_until(pilot, lambda: engine.lost is not None)
        assert "did not answer like an exl3local daemon" in rendered(engine)
        stub_daemon.set_status("status_ready.json")
        await wait_until(pilot, lambda: engine.lost is None and engine.status is not None)


async def test_daemon_without_kernel_counters_says_so(wait_until, stub_daemon):
    stub_daemon.kernels = None
    app = make_dashboard(stub_daemon.url, POLL_ONCE_S)
    async with app.run_test(size=SIZE) as pilot:
        panel = app.query_one(KernelPanel)
        await wait_until(pilot, lambda: not panel.available)
        assert "does not report kernel paths" in rendered(panel)


async def test_keys_help_profile_logs_and_quit(wait_until, stub_daemon, recorded):
    recorded_first_line = recorded("engine.log").splitlines()[0]
    app = make_dashboard(stub_daemon.url, POLL_ONCE_S)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.status is not None and app.query_one("#log-tail", Log).line_count > 0)
        await pilot.press("question_mark")
        assert isinstance(app.screen, InfoScreen) and app.screen.title_text == "Keys"
        await pilot.press("escape")
        await pilot.press("p")
        assert isinstance(app.screen, InfoScreen) and app.screen.title_text == "Profile"
        profile_text = rendered(app.screen.query_one(".dialog-text"), app.screen.body)
        assert "no GPU found" in profile_text
        # the CPU is not shown as a GPU named "CPU · cpu cpu", nor with a stray dash for missing details
        assert "none: serving on the CPU (24.0 GiB RAM)" in profile_text and "cpu cpu" not in profile_text
        assert " – " not in profile_text.split("GPU", 1)[1], profile_text
        await pilot.click("#close")  # the mouse works too
        assert not isinstance(app.screen, InfoScreen)
        await pilot.press("l")
        assert isinstance(app.screen, LogScreen)
        full = app.screen.query_one("#log-full", RichLog)
        await wait_until(pilot, lambda: len(full.lines) > 0)
        # the full log shows every line, the noise the tail folds included
        assert full.lines[0].text.rstrip() == recorded_first_line[: full.lines[0].cell_length].rstrip()
        await pilot.press("l")
        assert not isinstance(app.screen, LogScreen)
        await pilot.press("q")
    assert app.return_code == 0


async def test_restart_asks_first_and_posts_only_after_yes(wait_until, stub_daemon):
    app = make_dashboard(stub_daemon.url, POLL_ONCE_S)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.status is not None)
        await pilot.press("r")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        assert not isinstance(app.screen, ConfirmScreen)
        assert stub_daemon.restarts == 0
        await pilot.press("r")
        await pilot.click("#yes")
        await wait_until(pilot, lambda: stub_daemon.restarts == 1)
        engine = app.query_one(EnginePanel)
        await wait_until(pilot, lambda: engine.status is not None and engine.status.state == "STARTING")
    assert "POST /api/restart" in stub_daemon.requests


async def test_restart_refused_by_the_daemon_is_shown_not_fatal(wait_until, stub_daemon):
    app = make_dashboard(stub_daemon.url, POLL_ONCE_S)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await wait_until(pilot, lambda: app.status is not None)
        stub_daemon.stop()
        await pilot.press("r", "y")
        await wait_until(pilot, lambda: any("not reachable" in n.message for n in app._notifications))
        assert app.is_running


def test_dash_subcommand_is_registered_and_cli_stays_free_of_textual():
    code = (
        "import sys, exl3local.cli as cli\n"
        "assert 'textual' not in sys.modules, 'cli imported textual'\n"
        "p = cli.build_parser(); a = p.parse_args(['dash', '--host', '127.0.0.1:1', '--poll', '0.5'])\n"
        "assert a.host == '127.0.0.1:1' and a.poll == 0.5\n"
        "assert 'textual' not in sys.modules, 'building the parser imported textual'\n"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True, cwd="/")


def test_make_dashboard_defaults_to_the_env_host(monkeypatch):
    monkeypatch.setenv("EXL3LOCAL_HOST", "127.0.0.1:12345")
    app = make_dashboard()
    assert isinstance(app, Dashboard) and app.client.base_url == "http://127.0.0.1:12345"


async def test_engine_log_write_errors_are_shown_while_serving(wait_until, stub_daemon):
    stub_daemon.set_status("status_ready.json")
    stub_daemon.status = {**stub_daemon.status, "log_errors": 2, "log_dropped_bytes": 8192,
                          "log_last_error": "12:00:01 [Errno 28] No space left on device"}
    app = make_dashboard(stub_daemon.url, POLL_ONCE_S)
    async with app.run_test(size=SIZE) as pilot:
        engine = app.query_one(EnginePanel)
        await wait_until(pilot, lambda: engine.status is not None)
        text = rendered(engine)
        assert "READY" in text and "2 writes failed" in text and "No space left" in text


async def test_the_engine_panel_says_whether_the_endpoint_requires_a_key(wait_until, stub_daemon):
    for required, expected in ((False, "no key: open to every local program"), (True, "key required")):
        stub_daemon.set_status("status_ready.json")
        stub_daemon.status = {**stub_daemon.status, "api_key_required": required}
        app = make_dashboard(stub_daemon.url, POLL_ONCE_S)
        async with app.run_test(size=SIZE) as pilot:
            engine = app.query_one(EnginePanel)
            await wait_until(pilot, lambda: engine.status is not None)
            assert expected in rendered(engine)
