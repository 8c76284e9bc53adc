"""SVG snapshots of the main screen (pytest-textual-snapshot): READY under load, FAILED, no daemon.
Update after an intended change with `pytest tests/tui --snapshot-update` and look at the diff."""

from __future__ import annotations


from exl3local.tui.app import make_dashboard
from exl3local.tui.widgets.engine import EnginePanel
from exl3local.tui.widgets.kernels import KernelPanel

SIZE = (120, 40)
POLL_ONCE_S = 3600.0
# Port 9 (discard) on loopback: nothing listens there, and the address in the message stays fixed.
NO_DAEMON_URL = "http://127.0.0.1:9"


async def composed(pilot, wait_until) -> None:
    """snap_compare calls run_before before the main screen has composed its panels."""
    await wait_until(pilot, lambda: pilot.app.screen_panel(EnginePanel) is not None)


async def log_scrolled_to_end(pilot, wait_until) -> None:
    """The log tail scrolls after a refresh; wait for it, or the snapshot catches it half-way."""
    tail = pilot.app.query_one("#log-tail")
    await wait_until(pilot, lambda: tail.line_count > 0 and 0 < tail.max_scroll_y == tail.scroll_y)


def test_ready_under_load(snap_compare, stub_daemon, step_clock, wait_until, play_recorded_load):
    stub_daemon.play_load()
    app = make_dashboard(stub_daemon.url, POLL_ONCE_S, clock=step_clock)

    async def play_the_recording(pilot):
        await play_recorded_load(app, pilot, wait_until)
        await log_scrolled_to_end(pilot, wait_until)

    assert snap_compare(app, run_before=play_the_recording, terminal_size=SIZE)


def test_failed(snap_compare, stub_daemon, wait_until):
    stub_daemon.set_status("status_failed.json")
    app = make_dashboard(stub_daemon.url, POLL_ONCE_S)

    async def loaded(pilot):
        await composed(pilot, wait_until)
        await wait_until(pilot, lambda: app.query_one(EnginePanel).status is not None)
        await log_scrolled_to_end(pilot, wait_until)

    assert snap_compare(app, run_before=loaded, terminal_size=SIZE)


def test_no_daemon(snap_compare, wait_until):
    app = make_dashboard(NO_DAEMON_URL, POLL_ONCE_S)

    async def lost(pilot):
        await composed(pilot, wait_until)
        await wait_until(pilot, lambda: app.query_one(EnginePanel).lost is not None)

    assert snap_compare(app, run_before=lost, terminal_size=SIZE)


def test_integrated_gpu_shows_one_shared_pool(snap_compare, stub_daemon, wait_until):
    stub_daemon.set_status("status_igpu.json")
    app = make_dashboard(stub_daemon.url, POLL_ONCE_S)

    async def loaded(pilot):
        await composed(pilot, wait_until)
        await wait_until(pilot, lambda: app.query_one(EnginePanel).status is not None)
        await wait_until(pilot, lambda: app.query_one(KernelPanel).counts is not None)
        await log_scrolled_to_end(pilot, wait_until)

    assert snap_compare(app, run_before=loaded, terminal_size=SIZE)
