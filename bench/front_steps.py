"""Where the front's added TTFT sits at concurrency c: each request's timeline at the engine, through the daemon's
endpoint and straight to vLLM's socket, in one run (each round runs every path, each path first in turn).

    .venv/bin/python -P bench/front_steps.py [--rounds 20] [--tokens 256] [--concurrency 8] [--warm] [--nice N]
        [--out RAW.json] [MODEL]

vLLM loads bench/front_trace_mw.py as ASGI middleware (see there), so per request, on one clock (CLOCK_MONOTONIC):
client send → arrival at vLLM's API server → body read → handed to the engine core → taken into its scheduler →
scheduled (the step that took it) → the engine's output with its first token → first SSE chunk sent → first token at
the client. Per burst: the spread of the hand-overs, how many engine steps took its requests, and how many were
handed over only after the burst's first step had begun (those wait for that step's end). Paths, by letter:
f front, d direct (clients that drop idle connections after 2 s, as bench/front_overhead.py's: every burst opens
new ones), with --warm v front and w direct with clients that keep theirs across rounds, with --nice n the front
with the daemon reniced. Per process: CPU time and time runnable but waiting for a core (/proc schedstat).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling modules (python -P adds no path)
from isolated import cli, engine_socket, isolated_env  # noqa: E402

HERE = Path(__file__).resolve().parent
# per request: (label, stamp it starts from, stamp it ends at)
SEGMENTS = [("client → API server", "sent", "arrive"), ("  client → front's app", "sent", "front_in"),
            ("  front's app → aiohttp", "front_in", "front_out"), ("  aiohttp → API server", "front_out", "arrive"),
            ("API server: head → body", "arrive", "body"),
            ("body → handed to engine core", "body", "handed"), ("handed → taken by engine loop", "handed", "queued"),
            ("taken → step start", "queued", "scheduled"), ("step start → output", "scheduled", "first_out"),
            ("output → SSE sent", "first_out", "sse"), ("SSE sent → client", "sse", "got"),
            ("TTFT (client)", "sent", "got")]


async def one(client: httpx.AsyncClient, model: str, tokens: int, name: str,
              first: asyncio.Queue | None = None) -> dict[str, float]:
    body = {"model": model, "prompt": "def fibonacci(n):", "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    stamps = {"sent": time.monotonic()}
    async with client.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": name}) as resp:
        if resp.status_code != 200:
            sys.exit(f"HTTP {resp.status_code}: {(await resp.aread())[:400].decode()}")
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and "got" not in stamps:
                stamps["got"] = time.monotonic()
                if first is not None:
                    first.put_nowait(name)
    return stamps


def procs(daemon_pid: int, engine_pid: int) -> dict[str, int]:
    """The processes that share the cores: the bench (its clients), the daemon (the front) and the engine's tree,
    each by its name in /proc (vLLM names its API server, EngineCore and worker processes)."""
    out = {"bench": os.getpid(), "daemon": daemon_pid}
    for p in [psutil.Process(engine_pid), *psutil.Process(engine_pid).children(recursive=True)]:
        out[f"engine {p.pid} {Path(f'/proc/{p.pid}/comm').read_text().strip()}"] = p.pid
    return out


def sched(pids: dict[str, int]) -> dict[str, tuple[float, float]]:
    """Per process, over its threads: (CPU s, s spent runnable but waiting for a core) so far (/proc schedstat);
    the daemon's threads also by thread name (which of them waits)."""
    out: dict[str, tuple[float, float]] = {}
    for name, pid in pids.items():
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                run_ns, wait_ns, _ = (task / "schedstat").read_text().split()
                comm = (task / "comm").read_text().strip()
            except (FileNotFoundError, ProcessLookupError):
                continue  # a thread that ended meanwhile
            for key in (name, f"{name}/{comm}") if name == "daemon" else (name,):
                cpu, wait = out.get(key, (0.0, 0.0))
                out[key] = (cpu + int(run_ns) / 1e9, wait + int(wait_ns) / 1e9)
    return out


def renice(pid: int, nice: int) -> None:
    """pid's autogroup (its session: the kernel shares the cores between sessions first, so a thread's own nice
    counts only within its session) and every thread of pid to that nice value."""
    Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
        except ProcessLookupError:
            continue


async def measure(endpoint: str, uds: str, model: str, rounds: int, tokens: int, c: int, pids: dict[str, int],
                  nice: int | None, warm: bool) -> dict:
    def clients(expiry: float) -> tuple[httpx.AsyncClient, httpx.AsyncClient]:
        limits = httpx.Limits(max_connections=None, keepalive_expiry=expiry)
        return (httpx.AsyncClient(base_url=endpoint, timeout=600, limits=limits, trust_env=False),
                httpx.AsyncClient(base_url="http://engine", timeout=600, trust_env=False,
                                  transport=httpx.AsyncHTTPTransport(uds=uds, limits=limits)))

    front, direct = clients(2.0)  # as bench/front_overhead.py (why: there): a burst opens new connections
    # kept across rounds (below the endpoint's 30 s and the engine's 60 s idle limits): a burst finds them open
    warm_front, warm_direct = clients(25.0)
    paths = [("f", front), ("d", direct)] + ([("n", front)] if nice is not None else []) + (
        [("v", warm_front), ("w", warm_direct)] if warm else [])
    client_side: dict[str, dict[str, float]] = {}
    cpu: dict[str, list[dict[str, tuple[float, float]]]] = {tag: [] for tag, _ in paths}
    async with front, direct, warm_front, warm_direct:
        for first in (front, direct, warm_front, warm_direct):
            await asyncio.gather(*(one(first, model, 8, "warm") for _ in range(c)))
        await direct.get("/_trace")  # drop the warm-up's steps
        for r in range(rounds):
            for tag, client in paths[r % len(paths):] + paths[:r % len(paths)]:  # each path first in turn
                if tag == "n":
                    renice(pids["daemon"], nice)
                names = [f"{tag}-{r}-{i}" for i in range(c)]
                firsts: asyncio.Queue = asyncio.Queue()
                before = sched(pids)
                burst = asyncio.gather(*(one(client, model, tokens, n, firsts) for n in names))
                for _ in names:  # the burst's start: until every request has its first token
                    await firsts.get()
                start = sched(pids)
                for name, stamps in zip(names, await burst):
                    client_side[name] = stamps
                cpu[tag].append({k: (start[k][0] - v[0], start[k][1] - v[1]) for k, v in before.items()})
                if tag == "n":
                    renice(pids["daemon"], 0)
        trace = (await direct.get("/_trace")).json()
    for name, stamps in client_side.items():
        trace["requests"].setdefault(name, {}).update(stamps)
    trace["sched"] = cpu
    trace["affinity"] = {k: sorted(os.sched_getaffinity(p)) for k, p in pids.items()}
    trace["autogroup"] = {k: Path(f"/proc/{p}/autogroup").read_text().strip() for k, p in pids.items()}
    trace["nice"] = nice
    return trace


def bursts(trace: dict, tag: str) -> list[list[dict]]:
    out: dict[int, list[dict]] = {}
    for name, row in trace["requests"].items():
        t, r, i = name.split("-")
        if t == tag:
            out.setdefault(int(r), []).append({**row, "i": int(i)})
    return [sorted(b, key=lambda x: x["i"]) for _, b in sorted(out.items())]


def med(values: list[float]) -> str:
    if not values:
        return "-"
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"{q[0]:.1f}/{statistics.median(values):.1f}/{q[2]:.1f}"


def paired(path: list[list[dict]], direct: list[list[dict]], a: str, b: str) -> str:
    """Path minus a direct path of the segment a→b: per round the difference of the two bursts' medians, then the median
    over rounds (each round runs every path, so a load change moves all)."""
    diffs = []
    for f, d in zip(path, direct):
        fv = [x[b] - x[a] for x in f if a in x and b in x]
        dv = [x[b] - x[a] for x in d if a in x and b in x]
        if fv and dv:
            diffs.append(1000 * (statistics.median(fv) - statistics.median(dv)))
    return f"{statistics.median(diffs):+.1f}" if diffs else "-"


def burst_marks(bs: list[list[dict]]) -> dict[str, list[float]]:
    """Per burst, when (ms after its first send): the first and last arrival at the API server, the first and last
    hand-over to the engine core, the first step's start and output, the last step's start (the one that took the
    burst's last request), the last first token at the client."""
    marks: dict[str, list[float]] = {}
    for b in bs:
        t0 = min(x["sent"] for x in b)
        first = min(x["scheduled"] for x in b)
        got = {"first arrival": min(x["arrive"] for x in b), "last arrival": max(x["arrive"] for x in b),
               "first hand-over": min(x["handed"] for x in b), "last hand-over": max(x["handed"] for x in b),
               "step 0 start": first, "step 0 output": min(x["first_out"] for x in b if x["scheduled"] == first),
               "last step start": max(x["scheduled"] for x in b), "last first token": max(x["got"] for x in b)}
        if all("front_out" in x for x in b):  # through the front: when it handed each request to aiohttp
            got = {"first front out": min(x["front_out"] for x in b), "last front out": max(x["front_out"] for x in b),
                   **got}
        for k, v in got.items():
            marks.setdefault(k, []).append(1000 * (v - t0))
    return marks


def analyse(trace: dict) -> str:
    names = {"f": "front", "d": "direct", "n": f"front, nice {trace.get('nice')}", "v": "front, warm",
             "w": "direct, warm"}
    paths = {names[t]: bursts(trace, t) for t in trace["sched"]}
    # each path against the direct one whose client keeps (or drops) its connections alike, and warm direct vs direct
    pairs = [(p, "direct, warm" if p == "front, warm" else "direct") for p in paths if p != "direct"]
    short = {names[t]: t for t in trace["sched"]}  # the columns of differences name paths by their letters
    lines = [f"{'segment (ms, p25/p50/p75)':30}" + "".join(f"{p:>19}" for p in paths) +
             "".join(f"{short[a] + '-' + short[b]:>8}" for a, b in pairs)]
    for label, a, b in SEGMENTS:
        cols = [med([1000 * (x[b] - x[a]) for bs in p for x in bs if a in x and b in x]) for p in paths.values()]
        lines.append(f"{label:30}" + "".join(f"{c:>19}" for c in cols) +
                     "".join(f"{paired(paths[x], paths[y], a, b):>8}" for x, y in pairs))
    lines.append("per burst (p25/p50/p75 over bursts):")
    for path, bs in paths.items():
        spread, steps, missed, late, step_ms = [], [], [], [], []
        by_step: dict[int, list[float]] = {}
        order = []
        for b in bs:
            b = [x for x in b if {"handed", "scheduled", "first_out", "got"} <= x.keys()]
            if not b:
                continue
            t0 = min(x["arrive"] for x in b)
            spread.append(1000 * (max(x["handed"] for x in b) - min(x["handed"] for x in b)))
            firsts = sorted({x["scheduled"] for x in b})
            steps.append(len(firsts))
            # handed to the engine core after the burst's first step had begun: it could not be in that step
            missed.append(sum(x["handed"] > firsts[0] for x in b))
            late.append(1000 * (max(x["handed"] for x in b) - firsts[0]))
            step_ms.append(1000 * (min(x["first_out"] for x in b) - firsts[0]))
            for x in b:
                by_step.setdefault(firsts.index(x["scheduled"]), []).append(1000 * (x["got"] - x["sent"]))
            order.append([1000 * (x["arrive"] - t0) for x in b])
        hist = {k: steps.count(k) for k in sorted(set(steps))}
        marks = burst_marks([b for b in bs if all({"handed", "scheduled", "first_out", "got"} <= x.keys() for x in b)])
        lines.append(f"  {path}: burst timeline, ms after its first send (p50 over bursts): " +
                     ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in marks.items()))
        lines.append(f"  {path}: {len(bs)} bursts; spread of the hand-overs to the engine core ms {med(spread)}; "
                     f"engine steps that took a burst's requests {{steps: bursts}} {hist}; requests handed over after "
                     f"the burst's first step began {med(missed)}; last hand-over after that step's start ms "
                     f"{med(late)}; that first step's start → output ms {med(step_ms)}")
        lines.append("    TTFT ms p50 by the step that took the request: " + ", ".join(
            f"step {k}: {statistics.median(v):.1f} (n={len(v)})" for k, v in sorted(by_step.items())))
        lines.append("    arrival at the API server ms after the burst's first, p50 by start order: " + "/".join(
            f"{statistics.median(o[i] for o in order if i < len(o)):.1f}" for i in range(max(map(len, order)))))
    lines.append("CPU and run-queue wait from a burst's send to its last first token (all threads; ms, p50 over "
                 "bursts), " + " | ".join(paths) + "; cores each may use: " +
                 "; ".join(f"{k} {v} ({trace['autogroup'][k]})" for k, v in trace["affinity"].items()))
    for name in sorted(set().union(*(b.keys() for bs in trace["sched"].values() for b in bs))):
        cpu, wait = (" | ".join(f"{statistics.median(1000 * b.get(name, (0, 0))[k] for b in bs):6.1f}"
                                for bs in trace["sched"].values()) for k in (0, 1))
        lines.append(f"  {name:34} CPU {cpu}   waiting {wait}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="checkpoint dir (default: the bundled demo)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", type=Path, help="write the raw timelines (JSON) here")
    ap.add_argument("--warm", action="store_true", help="two more paths, front and direct, whose clients keep their "
                    "connections across rounds (25 s), so a burst finds them open")
    ap.add_argument("--nice", type=int, help="a third path: the front with the daemon (its autogroup and threads) "
                    "at this nice value during its bursts (a negative value needs CAP_SYS_NICE)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="exl3s-", dir="/tmp") as tmp:
        env = isolated_env(Path(tmp))
        mw = Path(tmp) / "mw"  # this file alone on the engine's path: bench/ holds names that would shadow packages
        mw.mkdir()
        shutil.copy(HERE / "front_trace_mw.py", mw)
        shutil.copy(HERE / "front_trace_site.py", mw / "sitecustomize.py")  # the daemon's own stamps (see there)
        env["FRONT_TRACE_FILE"] = front_file = str(Path(tmp) / "front-trace.txt")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(mw), env.get("PYTHONPATH")) if p)
        up = cli(env, "up", *([args.model] if args.model else ["--demo"]),
                 "--set", 'vllm.extra_args=["--middleware", "front_trace_mw.Trace"]')
        try:
            if up.returncode != 0:
                sys.exit(f"up failed:\n{up.stdout}{up.stderr}")
            status = json.loads(cli(env, "status", "--json").stdout)
            uds = engine_socket(Path(tmp))
            load0 = os.getloadavg()[0]
            pids = procs(status["daemon_pid"], status["engine_pid"])
            trace = asyncio.run(measure(status["endpoint"].removesuffix("/v1"), uds, status["served_model_name"],
                                        args.rounds, args.tokens, args.concurrency, pids, args.nice, args.warm))
            load1 = os.getloadavg()[0]
            for line in Path(front_file).read_text().splitlines() if Path(front_file).exists() else ():
                name, *stamps = line.split()
                if name in trace["requests"]:
                    trace["requests"][name].update(zip(("front_in", "front_out", "front_head"), map(float, stamps)))
        finally:
            cli(env, "down")
    if args.out:
        args.out.write_text(json.dumps(trace))
    print(f"model {status['model']} on vLLM, c={args.concurrency}, {args.tokens} tokens, {args.rounds} rounds per "
          f"path; load average {load0:.1f} at the start, {load1:.1f} at the end")
    print(analyse(trace))


if __name__ == "__main__":
    main()
