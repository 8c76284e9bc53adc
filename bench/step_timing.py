"""Timing of one model step or one layer call on the GPU, shared by bench/model_step.py and bench/layers.py:
eager wall clock over back-to-back synchronised runs, CUDA-graph replay, host time with the GPU kept busy,
device launches from the CUDA profiler. On the CPU (the interpreter smoke run) only one eager call is timed."""

from __future__ import annotations

import time

import torch

DEVICE = ["cuda"]  # "cpu" for the interpreter smoke run
GRAPH_MAX_ROWS = 64  # decode and verify steps are what graphs serve; prefill runs eager


def log(*args) -> None:
    print(*args, flush=True)


def sync():
    if DEVICE[0] == "cuda":
        torch.cuda.synchronize()


def eager_us(fn, min_s: float = 0.3, max_reps: int = 50) -> float:
    """Wall-clock µs per step over back-to-back synchronised runs (after one warm-up step)."""
    fn()
    sync()
    reps, start = 0, time.perf_counter()
    while reps < max_reps and (reps < 2 or time.perf_counter() - start < min_s):
        fn()
        reps += 1
    sync()
    return 1e6 * (time.perf_counter() - start) / reps


def graph_us(fn, reps: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up on the capture stream (workspaces are per stream)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return 1e3 * start.elapsed_time(end) / reps


def host_us(fn) -> float:
    """CPU µs to issue one step while the GPU is kept busy, summed op by op: a whole step can hold more
    launches than the launch queue, and a full queue would make the host wait on the device. The queue is
    drained before each op: without that the sleeps and launches of earlier ops piled up, and from ~1000 launches
    per step (35B at 32 and 64 tokens: 1110-1280) every op waited for queue slots (92-113 ms "host" for steps
    that ran in 25-40 ms eager; docs/PERF.md "Session 9")."""
    fn.ops[0]()
    torch.cuda.synchronize()
    total = 0.0
    for op in fn.ops:
        torch.cuda.synchronize()
        torch.cuda._sleep(4_000_000)  # ~2 ms of GPU work queued ahead of this op's launches
        start = time.perf_counter()
        op()
        total += time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * total


def launches(fn) -> int:
    """Device work items (kernels, memsets, copies) one call enqueues, from the CUDA profiler (-1 without CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    if DEVICE[0] != "cuda" or not torch.cuda.is_available():
        return -1
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def step_eager_us(fn, rows: int) -> float:
    """measure's eager µs of one step (prefill steps: two timed)."""
    return eager_us(fn) if rows <= GRAPH_MAX_ROWS else eager_us(fn, min_s=0.0, max_reps=2)


def launch_hook_set() -> bool:
    """Whether a Triton launch hook is set now (then bound launches take Triton's own, slower launch path)."""
    import triton

    from exl3local.kernels.launcher import hooked

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return runtime is not None and (hooked(runtime.launch_enter_hook) or hooked(runtime.launch_exit_hook))


def measure(fn, rows: int, graphs: bool, eager: float | None = None) -> dict:
    """eager (given: timed earlier, before any profiler), launches, host and graph µs of one step."""
    if DEVICE[0] != "cuda":  # the interpreter: one step, to check the step runs (its time means nothing)
        start = time.perf_counter()
        fn()
        return {"eager_us": 1e6 * (time.perf_counter() - start)}
    out = {"eager_us": step_eager_us(fn, rows) if eager is None else eager}
    if rows <= GRAPH_MAX_ROWS:  # the profiler's cost grows with the step; prefill launches follow from the code
        out["launches"] = launches(fn)
        out["hook_after_profiler"] = launch_hook_set()
    out["host_us"] = host_us(fn)
    if graphs and rows <= GRAPH_MAX_ROWS:
        try:
            out["graph_us"] = graph_us(fn)
        except Exception as exc:  # noqa: BLE001 -- a step that cannot be captured is a result too
            out["graph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            torch.cuda.synchronize()
    return out


def step_table(results: list[dict]) -> None:
    """One line per (model, M); a second, `tiled`, where our linears were also timed on the tiled path."""
    log("\nmodel     M     ours eager / graph / host µs, launches | exl3 eager / graph / host µs, launches | ratio e/g")

    def cells(d):
        return (f"{d.get('eager_us', float('nan')):9.0f} {d.get('graph_us', float('nan')):8.0f} "
                f"{d.get('host_us', float('nan')):8.0f} {d.get('launches', -1):6d}")

    def ratio(o, e):
        if not (o and e):
            return ""
        text = f"{e['eager_us'] / o['eager_us']:.2f}"
        return text + (f" / {e['graph_us'] / o['graph_us']:.2f}" if "graph_us" in o and "graph_us" in e else "")

    for r in results:
        o, e = r.get("ours", {}), r.get("exl3", {})
        log(f"{r['model']:9s} {r['rows']:5d} {cells(o) if o else '-':>40s} | {cells(e) if e else '-':>40s} | "
            f"{ratio(o, e)}")
        for variant in ("tiled", "units", "unbound"):
            if f"ours_{variant}" in r:
                log(f"{'  ' + variant:15s} {cells(r[f'ours_{variant}']):>40s} | {'':40s} | {ratio(r[f'ours_{variant}'], e)}")
