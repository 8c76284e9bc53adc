"""Engine panel: state, model, profile, GPU, endpoint, uptime, restarts, last error."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from exl3local.api.protocol import DaemonStatus, EngineState
from exl3local.units import format_duration

STATE_STYLE = {
    EngineState.READY: "bold green",
    EngineState.STARTING: "bold yellow",
    EngineState.STOPPING: "bold yellow",
    EngineState.BACKOFF: "bold dark_orange",
    EngineState.FAILED: "bold red",
    EngineState.STOPPED: "bold bright_black",
    EngineState.IDLE: "bold blue",
}


def human_duration(seconds: float | None) -> str:
    return format_duration(seconds, none="–")


class EnginePanel(Widget):
    """Shows the latest DaemonStatus, or why there is none (daemon down)."""

    status: reactive[DaemonStatus | None] = reactive(None)
    lost: reactive[str | None] = reactive(None)  # set while the daemon does not answer
    lost_hint: reactive[str] = reactive("")

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._shape: tuple = ()

    def watch_status(self, st: DaemonStatus | None) -> None:
        self.set_class(st is not None and st.state in (EngineState.FAILED, EngineState.BACKOFF), "-bad")
        self._relayout_if_reshaped()

    def watch_lost(self, lost: str | None) -> None:
        self.set_class(lost is not None, "-lost")
        self._relayout_if_reshaped()

    def _relayout_if_reshaped(self) -> None:
        """Uptime and state age change every poll; only a change in which lines are shown can
        change the panel's height, and only that needs a (costly) layout pass."""
        st = self.status
        shape = (
            self.lost,
            None if st is None else (st.state, st.progress != "", st.last_error, st.stderr_tail, st.profile_reason,
                                     st.log_errors > 0),
        )
        if shape != self._shape:
            self._shape = shape
            self.refresh(layout=True)

    def render(self) -> RenderableType:
        if self.lost is not None or self.status is None:
            head = Text.assemble(("NO DAEMON" if self.lost else "CONNECTING", "bold red"), "  reconnecting…")
            parts: list[RenderableType] = [head]
            if self.lost:
                parts.append(Text(self.lost, style="red"))
            if self.lost_hint:
                parts.append(Text(f"hint: {self.lost_hint}", style="italic"))
            if self.status is not None:
                parts.append(Text(f"last seen: {self.status.state} · {self._model_name(self.status)}", style="dim"))
            return Group(*parts)
        st = self.status
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column(overflow="fold")
        state = Text(st.state.value, style=STATE_STYLE.get(st.state, "bold"))
        state.append(f"  for {human_duration(st.state_age_s)}", style="dim")
        if st.state == EngineState.BACKOFF and st.retry_in_s is not None:
            state.append(f" · retry in {human_duration(st.retry_in_s)}", style="dark_orange")
        grid.add_row("State", state)
        grid.add_row("Model", self._model_name(st))
        # the reason, then one row per note (MTP, tool parsers, ...), each cut to its row: `p` shows them whole
        why, *notes = st.profile_reason.split("; ") if st.profile_reason else [""]
        grid.add_row("Profile", Text.assemble(st.profile or "–", (f"  {why}" if why else "", "dim"),
                                              no_wrap=True, overflow="ellipsis"))
        for note in notes:
            grid.add_row("", Text(note, style="dim", no_wrap=True, overflow="ellipsis"))
        gpu = st.gpu
        grid.add_row("GPU", f"{gpu.name} ({gpu.kind}{', ' + gpu.driver if gpu.driver else ''})" if gpu else "–")
        endpoint = Text(st.endpoint or "–")
        if st.api_key_required is not None:  # an older daemon does not say
            endpoint.append("  key required" if st.api_key_required else "  no key: open to every local program",
                            style="dim" if st.api_key_required else "yellow")
        grid.add_row("Endpoint", endpoint)
        grid.add_row("Uptime", f"{human_duration(st.uptime_s)} · restarts {st.restarts} · pid {st.engine_pid or '–'}")
        parts = [grid]
        if st.state == EngineState.STARTING and st.progress:
            parts.append(Text(st.progress, style="yellow", overflow="ellipsis", no_wrap=True))
        if st.last_error and st.state != EngineState.READY:
            parts.append(Text(st.last_error, style="red"))
        if st.log_errors:
            parts.append(Text(f"engine.log: {st.log_errors} writes failed ({st.log_last_error or '?'}); output dropped, "
                              "serving goes on", style="yellow"))  # rare and important: wraps rather than clips
        if st.state == EngineState.FAILED and st.stderr_tail:
            tail = st.stderr_tail.strip().splitlines()[-4:]
            parts.append(Text("\n".join(tail), style="red dim", overflow="ellipsis"))
        return Group(*parts)

    @staticmethod
    def _model_name(st: DaemonStatus) -> str:
        return st.served_model_name or st.model or "–"
