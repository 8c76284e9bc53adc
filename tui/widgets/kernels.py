"""Kernel-path panel: per EXL3 kernel path, calls, tokens, when it last ran and which layers it served
(attention, gdn = Gated DeltaNet projections, mlp, shared_expert, experts, lm_head, mtp, vision; most calls first).

A path the plugin latched off, and calls that fell back (to the reference decoder), are red: they
are the first thing to look at when tokens/s is lower than expected.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from exl3local.api.protocol import KernelCounts
from exl3local.tui.widgets.engine import human_duration


STATE_LABEL = {"ok": "ok", "latched_off": "OFF", "fallback": "FALLBACK"}


class KernelPanel(Widget):
    counts: reactive[KernelCounts | None] = reactive(None)
    available: reactive[bool] = reactive(True)  # False: the daemon has no /api/kernels (older daemon)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._shape: tuple = ()

    def watch_counts(self) -> None:
        self._relayout_if_reshaped()

    def watch_available(self) -> None:
        self._relayout_if_reshaped()

    def _relayout_if_reshaped(self) -> None:
        """Counts change every poll under load; the panel's height changes only with its rows."""
        counts = self.counts
        shape = (
            self.available,
            None if counts is None else tuple((p.path, p.state, p.reason) for p in counts.paths),
        )
        if shape != self._shape:
            self._shape = shape
            self.refresh(layout=True)

    def render(self) -> RenderableType:
        if not self.available:
            return Text("this daemon does not report kernel paths (GET /api/kernels)", style="dim")
        counts = self.counts
        if counts is None:
            return Text("no counters yet: the engine is not READY", style="dim")
        table = Table(box=None, padding=(0, 1), expand=True, show_edge=False)
        table.add_column("path", no_wrap=True)
        table.add_column("calls", justify="right", no_wrap=True)
        table.add_column("tokens", justify="right", no_wrap=True)
        table.add_column("seen", justify="right", no_wrap=True)
        table.add_column("state", no_wrap=True)
        problems: list[Text] = []
        # Below the table, where it can wrap: which layers each path served (calls per role).
        served = [
            Text.assemble((f"{entry.path} served ", "dim"), ", ".join(f"{role} {n:,}" for role, n in entry.roles.items()))
            for entry in counts.paths
            if entry.roles
        ]
        for entry in counts.paths:
            bad = entry.state != "ok"
            style = "bold red" if bad else ("" if entry.calls else "bright_black")
            if entry.last_seen is None or counts.updated is None:
                seen = "never"
            else:
                seen = f"{human_duration(max(0.0, counts.updated - entry.last_seen))} ago"
            table.add_row(
                Text(entry.path, style=style),
                Text(f"{entry.calls:,}", style=style),
                Text(f"{entry.tokens:,}", style=style),
                Text(seen, style=style),
                Text(STATE_LABEL.get(entry.state, entry.state.upper()), style="bold red" if bad else "green"),
            )
            if bad:
                problems.append(Text(f"{entry.path} {entry.state}: {entry.reason or '?'}", style="red"))
        plural = "es" if counts.processes != 1 else ""
        footer = Text(f"{counts.processes} engine process{plural} reporting", style="dim")
        return Group(table, *served, *problems, footer)
