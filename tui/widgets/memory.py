"""Memory panel: system RAM, the engine's RSS and GPU memory, the KV budget and its use.

On an integrated GPU the "GPU memory" is system RAM, so the panel shows one shared pool split
into KV cache, the rest of the engine (weights, activations, runtime) and everything else.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from exl3local.api.protocol import DaemonStatus
from exl3local.units import format_bytes

BAR_WIDTH = 16


def human_bytes(n: float | None) -> str:
    return format_bytes(n, none="–")


def bar(parts: list[tuple[float, str]], total: float, width: int = BAR_WIDTH) -> Text:
    """A horizontal bar: each (bytes, style) part gets its share of `width` cells, the rest is free."""
    text = Text()
    used = 0
    for value, style in parts:
        cells = 0 if total <= 0 else max(0, min(width - used, round(width * value / total)))
        text.append("█" * cells, style=style)
        used += cells
    text.append("░" * (width - used), style="bright_black")
    return text


class MemoryPanel(Widget):
    status: reactive[DaemonStatus | None] = reactive(None)
    kv_usage: reactive[float | None] = reactive(None)  # vllm:kv_cache_usage_perc, 0..1

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._shape: tuple = ()

    def watch_status(self) -> None:
        self._relayout_if_reshaped()

    def watch_kv_usage(self) -> None:
        self._relayout_if_reshaped()

    def _relayout_if_reshaped(self) -> None:
        """The numbers change every poll; the rows shown (and so the height) rarely do."""
        st = self.status
        raw = st.raw if st is not None else {}
        shape = (
            st is None,
            None if st is None or st.gpu is None else st.gpu.kind,
            tuple(raw.get(k) is None for k in ("system_memory_total_bytes", "engine_gpu_memory_bytes")),
            None if st is None else st.kv_budget_bytes is None,
            self.kv_usage is None,
        )
        if shape != self._shape:
            self._shape = shape
            self.refresh(layout=True)

    def render(self) -> RenderableType:
        st = self.status
        if st is None:
            return Text("–", style="dim")
        raw = st.raw
        total = raw.get("system_memory_total_bytes")
        available = raw.get("system_memory_available_bytes")
        gpu_bytes = raw.get("engine_gpu_memory_bytes")
        gpu_source = raw.get("engine_gpu_memory_source")
        integrated = st.gpu is not None and st.gpu.kind == "integrated"
        grid = Table.grid(padding=(0, 1))
        # labels and bars keep their width; only the numbers' column gives way (with an ellipsis)
        grid.add_column(style="bold", no_wrap=True, min_width=len("GPU ceiling"))
        grid.add_column(no_wrap=True, min_width=BAR_WIDTH)
        # numbers never wrap (a wrapped "20.0 / GiB free" reads as two values): cut with an ellipsis instead
        grid.add_column(no_wrap=True, overflow="ellipsis")
        if integrated:
            self._shared_pool(grid, st, total, available, gpu_bytes, gpu_source)
        else:
            self._separate(grid, st, total, available, gpu_bytes, gpu_source)
        shown, size, detail = self._kv(st)
        grid.add_row("KV cache", shown, size)
        if detail:
            grid.add_row("", "", detail)
        return Group(grid)

    def _separate(self, grid: Table, st: DaemonStatus, total, available, gpu_bytes, gpu_source) -> None:
        if total is not None and available is not None:
            used = total - available
            engine = min(st.engine_rss_bytes or 0, used)
            grid.add_row(
                "System RAM",
                bar([(engine, "magenta"), (used - engine, "cyan")], total),
                f"{human_bytes(used)} used of {human_bytes(total)}",
            )
        else:
            grid.add_row("System RAM", "", Text("not reported by this daemon", style="dim"))
        grid.add_row("Engine RSS", "", Text(human_bytes(st.engine_rss_bytes), style="magenta"))
        device_total = st.gpu.memory_bytes if st.gpu is not None and st.gpu.kind == "discrete" else None
        if gpu_bytes is not None:
            shown = bar([(gpu_bytes, "green")], device_total) if device_total else Text("")
            of = f" of {human_bytes(device_total)}" if device_total else ""
            source = (gpu_source or "").replace("drm-resident-", "")
            grid.add_row("GPU memory", shown, f"{human_bytes(gpu_bytes)}{of} (fdinfo {source})")
        elif st.gpu is not None and st.gpu.kind == "cpu":
            grid.add_row("GPU memory", "", Text("none: serving on the CPU", style="dim"))
        else:
            grid.add_row("GPU memory", "", Text("not reported on this platform", style="dim"))

    def _shared_pool(self, grid: Table, st: DaemonStatus, total, available, gpu_bytes, gpu_source) -> None:
        """iGPU: weights + KV + the rest all come out of the same RAM."""
        engine = gpu_bytes if gpu_bytes is not None else st.engine_rss_bytes
        if total is None or available is None or engine is None:
            grid.add_row("Shared RAM", "", Text("not reported by this daemon", style="dim"))
            return
        kv = min(st.kv_budget_bytes or 0, engine)
        others = max(0, total - available - engine)
        grid.add_row(
            "Shared RAM",
            bar([(kv, "green"), (engine - kv, "magenta"), (others, "cyan")], total),
            f"{human_bytes(total - available)} used of {human_bytes(total)}",
        )
        source = f"fdinfo {gpu_source.replace('drm-resident-', '')}" if gpu_source else "RSS"
        grid.add_row("", Text("█ KV", style="green"), human_bytes(kv))
        grid.add_row("", Text("█ weights+rest", style="magenta"), human_bytes(engine - kv))
        grid.add_row("", Text("█ other", style="cyan"), human_bytes(others))
        grid.add_row("Engine", "", f"{human_bytes(engine)} ({source})")
        if st.gpu is not None and st.gpu.memory_bytes:
            grid.add_row("GPU ceiling", "", f"{human_bytes(st.gpu.memory_bytes)} usable by the GPU")

    def _kv(self, st: DaemonStatus) -> tuple[RenderableType, RenderableType, str]:
        """Bar, size with use, and a second line: tokens and how the budget was set."""
        if st.kv_budget_bytes is None:
            return Text(""), Text("–", style="dim"), ""
        usage = self.kv_usage
        how = "pinned" if st.kv_budget_pinned else "estimate"
        shown = bar([(usage, "green")], 1.0) if usage is not None else Text("")
        used = f"{usage * 100:.1f}% used of " if usage is not None else ""
        tokens = f"{st.kv_budget_tokens:,} tokens, " if st.kv_budget_tokens else ""
        return shown, f"{used}{human_bytes(st.kv_budget_bytes)}", f"{tokens}{how}"
