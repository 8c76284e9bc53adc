"""What the daemon's endpoint (daemon/front.py) costs: streaming completions through it against the same
requests sent straight to vLLM's Unix socket, on one engine, alternating, in one run.

    .venv/bin/python -P bench/front_overhead.py [--rounds 20] [--tokens 256] [--concurrency 1 8] [MODEL_DIR]
    .venv/bin/python -P bench/front_overhead.py --standin tests/support/standin_engine.py MODEL_DIR

--standin SCRIPT: that Python file stands in for vLLM (it streams max_tokens SSE events STANDIN_TOKEN_S apart,
0.01 s unless set), so the difference is the endpoint's own cost, without vLLM competing for the cores.

Default model: the bundled demo (`up --demo`). A round sends `concurrency` requests down each path, the two paths
in alternating order. Per request: TTFT (request sent → first token event) and decode tok/s (events after the
first / time from first to last; the demo model coalesces short streams into a few reads, hence 256 tokens).
The verdict compares rounds pairwise (each round's front median against the same round's direct median), so a
load change across the run moves both sides: the median of those differences with a bootstrap 95% interval,
against the issue's budget (TTFT +5 ms, decode >= 0.98x). Daemon CPU per request: the daemon's CPU time (psutil)
over the front's cells, less its idle rate measured over the direct cells, over the requests.
The client's own delays are reported, and a bystander's: a sentinel process sleeping 10 ms at a time reports each
oversleep and how much of it it waited runnable (schedstat). On the 2-vCPU VM of sessions 16-18 stalls of 0.2-2.4 s,
all run-queue wait, hit most rounds while vLLM's CPU engine ran with its worker bound to one core (none with
--engine-env VLLM_CPU_OMP_THREADS_BIND=nobind): such rounds' TTFT tail is neither path's, and the rounds no stall
touched give a diagnostic estimate beside the verdict (docs/PERF.md, endpoint, sessions 17-18). The client runs at
nice -10 once the engine is up where it may (--client-nice).
Isolated XDG dirs, TMPDIR and ports: it does not touch a running daemon.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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
from stall_sentinel import Stall, longest_overlap, queued_share, watch  # noqa: E402

TTFT_BUDGET_MS = 5.0
DECODE_BUDGET = 0.98
STALL_S = 0.1  # a round in which the client or a bystander stalled this long: its TTFTs are not the path's


async def one(client: httpx.AsyncClient, model: str, tokens: int) -> tuple[float, float, int]:
    """(TTFT s, decode tok/s, SSE events) of one streaming completion.

    Counted on raw chunks (each event ends with a blank line), not parsed line by line: at c = 8 a CPU engine
    streams ~1,000 events a second, and a client that spends its share of a busy box on parsing lags, which would
    be charged to whichever path it was measuring."""
    body = {"model": model, "prompt": "def fibonacci(n):", "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    first = last = None
    n = 0
    tail = b""
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            sys.exit(f"HTTP {resp.status_code} from {client.base_url}: {(await resp.aread())[:400].decode()}")
        async for chunk in resp.aiter_raw():
            if not chunk:
                continue  # an empty read must not drop the carried byte
            ended = (tail + chunk).count(b"\n\n")  # the carried byte joins a blank line split across chunks
            tail = chunk[-1:]
            if ended and not chunk.startswith(b"data: [DONE]"):
                last = time.perf_counter()
                first = first or last
            n += ended
    n -= 1  # the closing "data: [DONE]" event
    assert first is not None and last is not None and n > 1
    return first - t0, (n - 1) / (last - first), n


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def queued_s() -> float:
    """Seconds this process's threads have waited, runnable, for a CPU (Linux schedstat; 0 where absent)."""
    total = 0
    for task in Path("/proc/self/task").glob("*"):
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return total / 1e9


async def loop_lag(worst: list[float]) -> None:
    """How late this client's event loop wakes from 10 ms sleeps, the worst kept: a late client sends late and
    reads late, and the TTFT it measures then is its own."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(0.01)
        worst[0] = max(worst[0], time.perf_counter() - t - 0.01)


async def cell(client: httpx.AsyncClient, model: str, tokens: int, c: int, daemon: psutil.Process) -> dict:
    """One round's requests down one path: their rows, the wall time, the daemon's CPU time meanwhile, and the
    client's own delays (run-queue wait, worst event-loop lag)."""
    cpu0, queued0, t0, worst, span0 = cpu_s(daemon), queued_s(), time.perf_counter(), [0.0], time.monotonic()
    lag = asyncio.create_task(loop_lag(worst))
    try:
        rows = await asyncio.gather(*(one(client, model, tokens) for _ in range(c)))
    finally:
        lag.cancel()
    return {"rows": rows, "wall_s": time.perf_counter() - t0, "cpu_s": cpu_s(daemon) - cpu0,
            "client_queued_s": queued_s() - queued0, "client_lag_s": worst[0], "span": (span0, time.monotonic())}


def ci95(values: list[float]) -> tuple[float, float]:
    """Bootstrap 95% interval of the median (seeded: the same data gives the same interval)."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(2000))
    return meds[50], meds[1949]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return q[0], statistics.median(values), q[2]


def paired(path: list[dict], baseline: list[dict]) -> tuple[tuple, tuple]:
    """Paired per round, `path` against `baseline`: TTFT difference (ms) and decode ratio of the rounds' medians,
    each as (median, 95% low, 95% high)."""
    pairs = list(zip(path, baseline, strict=True))
    diff = [1000 * (statistics.median(r[0] for r in p["rows"]) - statistics.median(r[0] for r in b["rows"]))
            for p, b in pairs]
    ratio = [statistics.median(r[1] for r in p["rows"]) / statistics.median(r[1] for r in b["rows"]) for p, b in pairs]
    return (statistics.median(diff), *ci95(diff)), (statistics.median(ratio), *ci95(ratio))


def busy_cpu_s(rounds: list[dict], idle_rate: float) -> float:
    """The daemon's CPU seconds over `rounds` beyond its idle rate (CPU s per wall s)."""
    return sum(c["cpu_s"] for c in rounds) - idle_rate * sum(c["wall_s"] for c in rounds)


def summary(cells: dict[str, list[dict]]) -> dict:
    """Per path: TTFT and decode quartiles over requests; paired per round: TTFT difference and decode ratio
    (medians with 95% intervals); the daemon's CPU per request through the front."""
    out: dict = {}
    for path, rounds in cells.items():
        rows = [r for c in rounds for r in c["rows"]]
        out[path] = {"ttft_ms": [1000 * v for v in quartiles([t for t, _, _ in rows])],
                     "decode": quartiles([s for _, s, _ in rows]), "requests": len(rows),
                     "events": sum(n for _, _, n in rows),
                     # the i-th request a round started (gather starts them in order): if the front passes a burst
                     # on one by one and the later ones miss the engine step the first ones made, their TTFT rises
                     # with i through the front and not straight to the engine (session 8's c=8 hypothesis)
                     "ttft_ms_by_start": [1000 * statistics.median(c["rows"][i][0] for c in rounds)
                                          for i in range(len(rounds[0]["rows"]))],
                     "client_queued_ms_per_round": 1000 * statistics.mean(c["client_queued_s"] for c in rounds),
                     "client_lag_p50_ms": 1000 * statistics.median(c["client_lag_s"] for c in rounds),
                     "client_lag_max_ms": 1000 * max(c["client_lag_s"] for c in rounds),
                     "rounds": len(rounds),
                     "client_lagged_rounds": sum(c["client_lag_s"] > STALL_S for c in rounds),
                     "sentinel_stalled_rounds": sum(c["sentinel_stall_s"] > STALL_S for c in rounds)}
    out["ttft_diff_ms"], out["decode_ratio"] = paired(cells["front"], cells["direct"])
    # a diagnostic beside the verdict: the pairs that no sentinel stall touched (it stands outside both paths)
    calm = [(f, d) for f, d in zip(cells["front"], cells["direct"], strict=True)
            if max(f["sentinel_stall_s"], d["sentinel_stall_s"]) <= STALL_S]
    out["calm_pairs"] = len(calm)
    if len(calm) >= 5:
        out["calm_ttft_diff_ms"], out["calm_decode_ratio"] = paired([f for f, _ in calm], [d for _, d in calm])
    idle_rate = sum(c["cpu_s"] for c in cells["direct"]) / sum(c["wall_s"] for c in cells["direct"])
    busy = busy_cpu_s(cells["front"], idle_rate)
    out["cpu_ms_per_request"] = 1000 * busy / out["front"]["requests"]
    # vLLM sends fewer, fuller SSE events when its API server lags (load): per event compares across runs
    out["cpu_ms_per_event"] = 1000 * busy / out["front"]["events"]
    out["idle_cpu_ms_per_s"] = 1000 * idle_rate
    if "burn" in cells:  # the front with extra CPU against the plain front
        out["burn_ttft_diff_ms"], out["burn_decode_ratio"] = paired(cells["burn"], cells["front"])
        out["burn_cpu_ms_per_request"] = 1000 * busy_cpu_s(cells["burn"], idle_rate) / out["burn"]["requests"]
    return out


async def measure(endpoint: str, uds: str, model: str, rounds: int, tokens: int, levels: list[int],
                  daemon: psutil.Process, keepalive: float, burn_flag: Path | None = None) -> dict:
    # idle connections dropped by this client before either server drops them (the engine closes after 60 s idle, the
    # endpoint after 30 s): a POST sent on a connection the server is closing at that moment fails with "Server
    # disconnected". 2 s (the default): every burst opens new connections on both paths; a fresh burst of Unix
    # connections reaches vLLM's loop together, which favours the direct path (docs/PERF.md, endpoint, session 11)
    limits = httpx.Limits(max_connections=None, keepalive_expiry=keepalive)
    front = httpx.AsyncClient(base_url=endpoint, timeout=600, limits=limits, trust_env=False)
    direct = httpx.AsyncClient(base_url="http://engine", transport=httpx.AsyncHTTPTransport(uds=uds, limits=limits),
                               timeout=600, trust_env=False)
    results: dict = {}
    stalls: list[Stall] = []
    watcher = asyncio.create_task(watch(stalls))
    async with front, direct:
        for c in levels:  # warm both paths, the engine, and as many pooled connections as the level needs
            await cell(front, model, 8, c, daemon)
            await cell(direct, model, 8, c, daemon)
        for c in levels:
            paths = [("front", front), ("direct", direct)] + ([("burn", front)] if burn_flag else [])
            cells: dict[str, list[dict]] = {name: [] for name, _ in paths}
            for r in range(rounds):
                order = paths[r % len(paths):] + paths[:r % len(paths)]  # each path first in turn
                for name, client in order:
                    if name == "burn":
                        burn_flag.touch()  # the daemon's front burns extra CPU (bench/front_burn_site.py)
                    try:
                        cells[name].append(await cell(client, model, tokens, c, daemon))
                    finally:
                        if name == "burn":
                            burn_flag.unlink()
            await asyncio.sleep(0.05)  # the sentinel reports a stall when it wakes: let the last one in
            for path_cells in cells.values():
                for done in path_cells:
                    done["sentinel_stall_s"] = longest_overlap(done["span"], stalls)
            results[c] = summary(cells)
            results[c]["stall_queued_share"] = queued_share(stalls, STALL_S)
            stalls.clear()
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    return results


def verdict(low: float, high: float, budget: float, *, below: bool) -> str:
    """Met when the whole interval is on the budget's side, not met when it is all beyond, else undecided."""
    ok, bad = (high <= budget, low > budget) if below else (low >= budget, high < budget)
    return "met" if ok else "NOT met" if bad else "undecided at this sample size"


def report(res: dict, head: str) -> None:
    print(head)
    for c, s in res.items():
        f, d = s["front"], s["direct"]
        t, tl, th = s["ttft_diff_ms"]
        r, rl, rh = s["decode_ratio"]
        print(f"concurrency {c} ({f['requests']} requests per path):\n"
              f"  TTFT ms p25/p50/p75  front {f['ttft_ms'][0]:.1f}/{f['ttft_ms'][1]:.1f}/{f['ttft_ms'][2]:.1f}  "
              f"direct {d['ttft_ms'][0]:.1f}/{d['ttft_ms'][1]:.1f}/{d['ttft_ms'][2]:.1f}\n"
              f"  decode tok/s p25/p50/p75  front {f['decode'][0]:.1f}/{f['decode'][1]:.1f}/{f['decode'][2]:.1f}  "
              f"direct {d['decode'][0]:.1f}/{d['decode'][1]:.1f}/{d['decode'][2]:.1f}\n"
              f"  paired per round: TTFT {t:+.1f} ms (95% {tl:+.1f}..{th:+.1f}): "
              f"{verdict(tl, th, TTFT_BUDGET_MS, below=True)} (budget +{TTFT_BUDGET_MS:g} ms); "
              f"decode {r:.3f}x (95% {rl:.3f}..{rh:.3f}): {verdict(rl, rh, DECODE_BUDGET, below=False)} "
              f"(budget >= {DECODE_BUDGET}x)\n"
              f"  daemon CPU {s['cpu_ms_per_request']:.1f} ms per request, {s['cpu_ms_per_event']:.2f} ms per SSE "
              f"event ({f['events'] / f['requests']:.0f} per request) through the front "
              f"(idle {s['idle_cpu_ms_per_s']:.1f} ms/s subtracted)")
        if "burn" in s:
            b = s["burn"]
            t, tl, th = s["burn_ttft_diff_ms"]
            r, rl, rh = s["burn_decode_ratio"]
            print(f"  burn (the front + extra CPU): TTFT ms p25/p50/p75 {b['ttft_ms'][0]:.1f}/{b['ttft_ms'][1]:.1f}/"
                  f"{b['ttft_ms'][2]:.1f}, decode p50 {b['decode'][1]:.1f} tok/s; daemon CPU "
                  f"{s['burn_cpu_ms_per_request']:.1f} ms per request; paired per round against the front: TTFT "
                  f"{t:+.1f} ms (95% {tl:+.1f}..{th:+.1f}), decode {r:.3f}x (95% {rl:.3f}..{rh:.3f})")
        print("  the client itself (both paths share it): run-queue wait per round " + ", ".join(
            f"{name} {s[name]['client_queued_ms_per_round']:.0f} ms" for name in ("front", "direct")) +
            f"; worst event-loop lag per round p50/max, rounds over {1000 * STALL_S:.0f} ms " + ", ".join(
            f"{name} {s[name]['client_lag_p50_ms']:.0f}/{s[name]['client_lag_max_ms']:.0f} ms, "
            f"{s[name]['client_lagged_rounds']} of {s[name]['rounds']}" for name in ("front", "direct")))
        stalled = ", ".join(f"{name} {s[name]['sentinel_stalled_rounds']} of {s[name]['rounds']}"
                            for name in ("front", "direct"))
        share = s["stall_queued_share"]
        queued = "" if share is None else f"; {100 * share:.0f} % of their time it was runnable, waiting for a CPU"
        print(f"  stalls over {1000 * STALL_S:.0f} ms of a bystander (a sentinel process woke that late) in rounds: "
              f"{stalled}{queued}")
        if "calm_ttft_diff_ms" in s:
            t, tl, th = s["calm_ttft_diff_ms"]
            r, rl, rh = s["calm_decode_ratio"]
            print(f"  over the {s['calm_pairs']} round pairs no sentinel stall touched: TTFT {t:+.1f} ms "
                  f"(95% {tl:+.1f}..{th:+.1f}), decode {r:.3f}x (95% {rl:.3f}..{rh:.3f}) "
                  "(a diagnostic; the verdict is above)")
        if c > 1:
            print("  TTFT ms p50 by start order in a round  " + "  ".join(
                f"{name} " + "/".join(f"{v:.0f}" for v in s[name]["ttft_ms_by_start"])
                for name in ("front", "direct", "burn") if name in s))


def engine_env(pairs: list[str]) -> dict[str, str]:
    """--engine-env's NAME=VALUE pairs: the daemon hands its environment to the engine it starts."""
    bad = [p for p in pairs if "=" not in p or not p.split("=", 1)[0]]
    if bad:
        sys.exit(f"--engine-env: expected NAME=VALUE, got {', '.join(map(repr, bad))}")
    return dict(p.split("=", 1) for p in pairs)


def raise_priority(nice: int) -> int:
    """This process's nice value after asking for `nice` (the engine and daemon, started before, keep theirs)."""
    try:
        os.nice(nice - os.nice(0))
    except PermissionError:
        print(f"note: could not set the client's nice to {nice} (no CAP_SYS_NICE); its own delays are reported")
    return os.nice(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="checkpoint dir (default: the bundled demo)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--keepalive", type=float, default=2.0, help="seconds the bench's clients keep an idle "
                    "connection (25: kept across rounds on both paths; below the endpoint's 30 s)")
    ap.add_argument("--standin", type=Path, help="a Python file that stands in for vLLM (see above)")
    ap.add_argument("--burn", type=float, nargs=2, metavar=("REQUEST_US", "EVENT_US"),
                    help="a third path: the front spending that much extra CPU per request and per streamed read "
                    "(bench/front_burn_site.py): what the daemon's CPU costs the client")
    ap.add_argument("--burn-site", type=Path, default=Path(__file__).resolve().parent / "front_burn_site.py",
                    help="the daemon's sitecustomize for the burn path (bench/front_lean_site.py: a minimal engine "
                    "reader instead of aiohttp, with --burn 0 0)")
    ap.add_argument("--engine-env", action="append", default=[], metavar="NAME=VALUE",
                    help="set in the engine's environment (repeatable), e.g. VLLM_CPU_OMP_THREADS_BIND=nobind")
    ap.add_argument("--client-nice", type=int, default=-10, help="the client's nice value once the engine is up "
                    "(default -10; needs CAP_SYS_NICE, else the client stays at its own): on a busy 2-core box it "
                    "halved the client's run-queue wait (session 17: 0.7 vs 1.5 s per round); the long run-queue "
                    "stalls the sentinel counts it did not prevent (session 18)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="exl3b-", dir="/tmp") as tmp:
        env = isolated_env(Path(tmp))
        env.update(engine_env(args.engine_env))
        burn_flag = None
        if args.burn:
            site = Path(tmp) / "burnsite"
            site.mkdir()
            shutil.copy(args.burn_site, site / "sitecustomize.py")
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
            burn_flag = Path(tmp) / "burning"
            env.update(FRONT_BURN_FLAG=str(burn_flag), FRONT_BURN_REQUEST_US=str(args.burn[0]),
                       FRONT_BURN_EVENT_US=str(args.burn[1]))
        if args.standin:
            wrapper = Path(tmp) / "engine-python"
            wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {args.standin.resolve()} \"$@\"\n")
            wrapper.chmod(0o755)
            (Path(tmp) / "nosys").mkdir()
            env.update(EXL3LOCAL_ENGINE_PYTHON=str(wrapper), EXL3LOCAL_SYSFS=str(Path(tmp) / "nosys"),
                       STANDIN_LOG=str(Path(tmp) / "engines.log"))
            env.setdefault("STANDIN_TOKEN_S", "0.01")
        up = cli(env, "up", *([args.model] if args.model else ["--demo"]))
        try:
            if up.returncode != 0:
                sys.exit(f"up failed:\n{up.stdout}{up.stderr}")
            status = json.loads(cli(env, "status", "--json").stdout)
            uds = engine_socket(Path(tmp))
            endpoint = status["endpoint"].removesuffix("/v1")
            client_nice = raise_priority(args.client_nice)
            load0 = os.getloadavg()[0]
            res = asyncio.run(measure(endpoint, uds, status["served_model_name"], args.rounds, args.tokens,
                                      args.concurrency, psutil.Process(status["daemon_pid"]), args.keepalive,
                                      burn_flag))
            load1 = os.getloadavg()[0]
        finally:
            cli(env, "down")
    engine = f"stand-in {args.standin.name}" if args.standin else "vLLM"
    engine_set = f"; engine with {' '.join(args.engine_env)}" if args.engine_env else ""
    burn = f"; burn path: +{args.burn[0]:g} us per request, +{args.burn[1]:g} us per streamed read" if args.burn else ""
    report(res, f"model {status['model']} on {engine}, {args.tokens} tokens per request, {args.rounds} rounds per "
                f"path, clients keep idle connections {args.keepalive:g} s; load average {load0:.1f} at the start, "
                f"{load1:.1f} at the end; client at nice {client_nice}{engine_set}{burn}")


if __name__ == "__main__":
    main()
