"""The dashboard app. It talks only to the daemon, through AsyncDaemonClient, from one poll worker.

The worker asks for the status, then (engine READY) the metrics and kernel counters, then any new
engine log text, and posts each result as a message. Handlers put the values into the widgets'
reactive attributes; the widgets redraw themselves. When the daemon does not answer, the worker
posts DaemonLost and keeps polling, so the dashboard reconnects by itself.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import httpx
from rich.table import Table
from rich.text import Text
from textual import work
from textual.app import App
from textual.binding import Binding
from textual.widgets import Log

from exl3local.api import lognoise, metrics
from exl3local.api.client import AsyncDaemonClient
from exl3local.api.protocol import DaemonStatus, EngineState
from exl3local.errors import EngineError, Exl3Error
from exl3local.tui.messages import DaemonLost, KernelsUpdated, LogsAppended, MetricsUpdated, StatusUpdated
from exl3local.tui.screens.logs import LogScreen
from exl3local.tui.screens.main import MainScreen
from exl3local.tui.screens.modals import ConfirmScreen, InfoScreen
from exl3local.tui.widgets.engine import EnginePanel
from exl3local.tui.widgets.kernels import KernelPanel
from exl3local.tui.widgets.memory import MemoryPanel, human_bytes
from exl3local.tui.widgets.throughput import ThroughputPanel

W = TypeVar("W")

DEFAULT_POLL_S = 1.0
# Lines of engine.log fetched when (re)connecting, and kept for the log screen.
LOG_TAIL_LINES = 200
LOG_BUFFER_LINES = 5000

HELP = """\
q        quit (the daemon and engine keep running)
r        restart the engine (asks first)
l        show the whole engine log; l or esc goes back
p        profile, GPU and KV budget details
?        this help

The dashboard polls the daemon about once a second. When the daemon is
down it says so and reconnects by itself."""


class Dashboard(App[None]):
    CSS_PATH = "dashboard.tcss"
    TITLE = "exl3local"
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("r", "restart", "restart engine"),
        Binding("l", "logs", "logs"),
        Binding("p", "profile", "profile"),
        Binding("question_mark", "help", "help", key_display="?"),
    ]

    def __init__(
        self,
        client: AsyncDaemonClient,
        poll_s: float = DEFAULT_POLL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.client = client
        self.poll_s = poll_s
        self.clock = clock
        self.status: DaemonStatus | None = None
        self._log_offset: int | None = None  # None: fetch the tail (first time, or after a reconnect)
        self._log_lines: deque[str] = deque(maxlen=LOG_BUFFER_LINES)
        self._log_partial = ""  # text after the last newline, completed by the next chunk

    def get_default_screen(self) -> MainScreen:
        return MainScreen()

    def on_mount(self) -> None:
        self.sub_title = self.client.base_url

    def on_ready(self) -> None:
        """The main screen's panels exist only now; results that arrived earlier would be lost."""
        self.poll()

    async def on_unmount(self) -> None:
        await self.client.aclose()

    # ---- I/O: one worker, results go back as messages -----------------------------------------

    @work(exclusive=True, group="poll", exit_on_error=False, description="poll the daemon")
    async def poll(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.poll_s)

    async def poll_once(self) -> None:
        """One round: status, then metrics and kernel counters when READY, then new log text."""
        try:
            status = await self.client.status()
        except (Exl3Error, httpx.HTTPError) as exc:
            self._log_offset = None
            self.post_message(DaemonLost(str(exc), getattr(exc, "hint", "")))
            return
        except (ValueError, KeyError, TypeError) as exc:  # something else answers on that port
            self._log_offset = None
            self.post_message(DaemonLost(f"{self.client.base_url} did not answer like an exl3local daemon: {exc!r}"))
            return
        self.post_message(StatusUpdated(status))
        if status.state == EngineState.READY:
            await self._poll_metrics()
            await self._poll_kernels()
        await self._poll_logs()

    async def _poll_metrics(self) -> None:
        try:
            text = await self.client.metrics_text()
            self.post_message(MetricsUpdated(metrics.parse(text), self.clock()))
        except (Exl3Error, httpx.HTTPError, ValueError):
            # The engine left READY between the two calls (409), or sent text prometheus_client
            # cannot parse; the next status shows which, and the panel keeps its last numbers.
            return

    async def _poll_kernels(self) -> None:
        panel = self.screen_panel(KernelPanel)
        try:
            counts = await self.client.kernels()
        except EngineError:
            return
        except (Exl3Error, httpx.HTTPError):
            if panel is not None:
                panel.available = False
            return
        if panel is not None:
            panel.available = True
        self.post_message(KernelsUpdated(counts))

    async def _poll_logs(self) -> None:
        try:
            if self._log_offset is None:
                chunk = await self.client.logs(tail=LOG_TAIL_LINES)
                reset = True
            else:
                chunk = await self.client.logs(offset=self._log_offset)
                reset = chunk.rotated
        except (Exl3Error, httpx.HTTPError, ValueError, TypeError):
            return  # no log this round; the panel keeps what it has
        self._log_offset = chunk.offset
        if chunk.text or reset:
            self.post_message(LogsAppended(chunk.text, reset))

    @work(exclusive=True, group="restart", exit_on_error=False, description="restart the engine")
    async def restart_engine(self) -> None:
        try:
            status = await self.client.restart()
        except (Exl3Error, httpx.HTTPError) as exc:
            self.notify(str(exc), title="restart failed", severity="error", timeout=10)
            return
        self.notify("engine restarting", title="restart")
        self.post_message(StatusUpdated(status))

    # ---- messages → widgets --------------------------------------------------------------------

    def screen_panel(self, kind: type[W]) -> W | None:
        """The main screen's panel of this type (the main screen stays mounted under the others)."""
        for screen in self.screen_stack:
            if isinstance(screen, MainScreen):
                found = screen.query(kind)  # empty until the screen has composed
                return found.first() if found else None
        return None

    def on_status_updated(self, message: StatusUpdated) -> None:
        st = message.status
        was_ready = self.status is not None and self.status.state == EngineState.READY
        self.status = st
        engine = self.screen_panel(EnginePanel)
        if engine is None:
            return
        engine.lost = None
        engine.lost_hint = ""
        engine.status = st
        self.screen_panel(MemoryPanel).status = st
        if was_ready and st.state != EngineState.READY:
            self._engine_gone()
        self.sub_title = (f"{st.state.value} · {st.served_model_name or st.model or 'no model'}"
                          + (f" · switching to {st.switch_to}" if st.switch_to else "")
                          + (f" · {st.requests_waiting} request(s) waiting" if st.requests_waiting else ""))

    def on_daemon_lost(self, message: DaemonLost) -> None:
        engine = self.screen_panel(EnginePanel)
        if engine is None:
            return
        engine.lost = message.error
        engine.lost_hint = message.hint
        self._engine_gone()
        self.screen_panel(MemoryPanel).status = None  # no daemon, no engine: its last RSS is no longer true
        self.sub_title = "daemon not reachable"

    def _engine_gone(self) -> None:
        """Counters restart with the next engine: drop the rate baseline and the stale numbers."""
        self.screen_panel(ThroughputPanel).clear()
        self.screen_panel(MemoryPanel).kv_usage = None
        self.screen_panel(KernelPanel).counts = None

    def on_metrics_updated(self, message: MetricsUpdated) -> None:
        panel = self.screen_panel(ThroughputPanel)
        if panel is None:
            return
        panel.record(message.snapshot, message.at_s)
        self.screen_panel(MemoryPanel).kv_usage = message.snapshot.kv_cache_usage

    def on_kernels_updated(self, message: KernelsUpdated) -> None:
        panel = self.screen_panel(KernelPanel)
        if panel is not None:
            panel.counts = message.counts

    def on_logs_appended(self, message: LogsAppended) -> None:
        if message.reset:
            self._log_lines.clear()
            self._log_partial = ""
        text = self._log_partial + message.text
        lines = text.split("\n")
        self._log_partial = lines.pop()
        self._log_lines.extend(lines)
        tail = self.screen_panel(Log)
        if tail is not None:
            if message.reset:
                tail.clear()
            tail.write_lines(lognoise.fold(lines))  # library noise as one line per run; `l` shows every line
        top = self.screen_stack[-1] if self.screen_stack else None  # empty while the app exits
        if isinstance(top, LogScreen):
            top.append(lines, message.reset)

    # ---- keys ----------------------------------------------------------------------------------

    def action_restart(self) -> None:
        def confirmed(yes: bool | None) -> None:
            if yes:
                self.restart_engine()

        self.push_screen(ConfirmScreen("Restart the engine? Requests in flight are aborted."), confirmed)

    def action_logs(self) -> None:
        self.push_screen(LogScreen(list(self._log_lines)))

    def action_profile(self) -> None:
        self.push_screen(InfoScreen("Profile", profile_info(self.status)))

    def action_help(self) -> None:
        self.push_screen(InfoScreen("Keys", Text(HELP)))


def profile_info(st: DaemonStatus | None) -> Table | Text:
    if st is None:
        return Text("no status from the daemon yet", style="dim")
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    grid.add_row("Profile", st.profile or "–")
    grid.add_row("Why", "\n".join(st.profile_reason.split("; ")) or "–")
    grid.add_row("Model", st.model or "–")
    grid.add_row("Served as", st.served_model_name or "–")
    grid.add_row("Context", f"{st.max_model_len:,} tokens" if st.max_model_len else "–")
    kv = "–"
    if st.kv_budget_bytes is not None:
        how = "pinned (--kv-cache-memory-bytes)" if st.kv_budget_pinned else "estimate"
        kv = f"{human_bytes(st.kv_budget_bytes)} · {st.kv_budget_tokens or 0:,} tokens · {how}"
    grid.add_row("KV budget", kv)
    if st.gpu is not None and st.gpu.kind == "cpu":
        grid.add_row("GPU", f"none: serving on the CPU ({human_bytes(st.gpu.memory_bytes)} RAM)")
    elif st.gpu is not None:
        g = st.gpu
        grid.add_row("GPU", f"{g.name} · {g.vendor} {g.kind}")
        details = [f"pci {g.pci_id}" if g.pci_id else "", g.slot or "", g.driver or "", g.render_node or "", g.xe_gen or ""]
        if any(details):
            grid.add_row("", " · ".join(d for d in details if d))
        grid.add_row("Memory", human_bytes(g.memory_bytes))
    return grid


def make_dashboard(
    api_url: str | None = None,
    poll_s: float = DEFAULT_POLL_S,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> Dashboard:
    """The one way to build the app, for `exl3local dash` and the tests. `api_url` defaults to
    EXL3LOCAL_HOST (default: the Unix socket daemon.sock in the runtime dir)."""
    return Dashboard(AsyncDaemonClient(api_url), poll_s=poll_s, clock=clock)
