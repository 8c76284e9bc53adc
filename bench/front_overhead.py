"""What the daemon's endpoint (daemon/front.py) costs: streaming completions through it against the same
requests sent straight to vLLM's Unix socket, on one engine, alternating, in one run.

    .venv/bin/python -P bench/front_overhead.py [--rounds 3] [--tokens 64] [--concurrency 1 8] [MODEL_DIR]
    .venv/bin/python -P bench/front_overhead.py --standin tests/support/standin_engine.py MODEL_DIR

--standin SCRIPT: that Python file stands in for vLLM (it streams max_tokens SSE events STANDIN_TOKEN_S apart,
0.01 s unless set), so the difference is the endpoint's own cost, without vLLM competing for the cores.

Default model: the bundled demo (`up --demo`). Per concurrency level and path: TTFT p50 (request sent →
first token event) and decode tok/s per request (tokens after the first / time from first to last),
averaged. Isolated XDG dirs, TMPDIR and ports: it does not touch a running daemon.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling modules (python -P adds no path)
from isolated import cli, isolated_env  # noqa: E402


async def one(client: httpx.AsyncClient, model: str, tokens: int) -> tuple[float, float]:
    """(TTFT s, decode tok/s) of one streaming completion."""
    body = {"model": model, "prompt": "def fibonacci(n):", "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    first = last = None
    n = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            last = time.perf_counter()
            first = first or last
            n += 1
    assert first is not None and last is not None and n > 1
    return first - t0, (n - 1) / (last - first)


async def level(client: httpx.AsyncClient, model: str, tokens: int, concurrency: int) -> list[tuple[float, float]]:
    return await asyncio.gather(*(one(client, model, tokens) for _ in range(concurrency)))


async def measure(endpoint: str, uds: str, model: str, rounds: int, tokens: int, levels: list[int]) -> dict:
    limits = httpx.Limits(max_connections=None)
    front = httpx.AsyncClient(base_url=endpoint, timeout=600, limits=limits, trust_env=False)
    direct = httpx.AsyncClient(base_url="http://engine", transport=httpx.AsyncHTTPTransport(uds=uds), timeout=600,
                               limits=limits, trust_env=False)
    results: dict = {}
    async with front, direct:
        await level(front, model, 8, 2)  # warm both paths and the engine
        await level(direct, model, 8, 2)
        for c in levels:
            got: dict[str, list[tuple[float, float]]] = {"front": [], "direct": []}
            for r in range(rounds):
                order = [("front", front), ("direct", direct)] if r % 2 == 0 else [("direct", direct), ("front", front)]
                for name, client in order:
                    got[name] += await level(client, model, tokens, c)
            results[c] = {name: {"ttft_p50_ms": 1000 * statistics.median(t for t, _ in rows),
                                 "decode_tok_s": statistics.mean(s for _, s in rows), "requests": len(rows)}
                          for name, rows in got.items()}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="checkpoint dir (default: the bundled demo)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--standin", type=Path, help="a Python file that stands in for vLLM (see above)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="exl3b-", dir="/tmp") as tmp:
        env = isolated_env(Path(tmp))
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
            record = json.loads((Path(tmp) / "state" / "exl3local" / "engine.json").read_text())
            uds = str(Path(record["tmpdir"]) / "engine.sock")
            endpoint = status["endpoint"].removesuffix("/v1")
            res = asyncio.run(measure(endpoint, uds, status["served_model_name"], args.rounds, args.tokens,
                                      args.concurrency))
        finally:
            cli(env, "down")
    engine = f"stand-in {args.standin.name}" if args.standin else "vLLM"
    print(f"model {status['model']} on {engine}, {args.tokens} tokens per request, {args.rounds} rounds per path")
    for c, paths in res.items():
        f, d = paths["front"], paths["direct"]
        print(f"concurrency {c}: TTFT p50 front {f['ttft_p50_ms']:.1f} ms, direct {d['ttft_p50_ms']:.1f} ms "
              f"(+{f['ttft_p50_ms'] - d['ttft_p50_ms']:.1f} ms); decode front {f['decode_tok_s']:.1f} tok/s, "
              f"direct {d['decode_tok_s']:.1f} tok/s ({f['decode_tok_s'] / d['decode_tok_s']:.3f}x); "
              f"{f['requests']} requests each")


if __name__ == "__main__":
    main()
