"""Phases against one `up --demo` engine, a sentinel's oversleeps per phase: idle, c=8 streaming, c=1 streaming."""
import asyncio, json, os, sys, tempfile, time, subprocess
from pathlib import Path
sys.path.insert(0, "/work/main/bench")
import httpx
from isolated import cli, engine_socket, isolated_env

SENT = "/tmp/s18/stallprobe.py"

async def stream(client, model, tokens):
    body = {"model": model, "prompt": "def fibonacci(n):", "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for _ in r.aiter_raw():
            pass

async def load(uds, model, c, seconds):
    t = httpx.AsyncHTTPTransport(uds=uds)
    async with httpx.AsyncClient(transport=t, base_url="http://engine", timeout=120) as client:
        end = time.time() + seconds
        n = 0
        while time.time() < end:
            await asyncio.gather(*(stream(client, model, 256) for _ in range(c)))
            n += c
        return n

def phase(name, seconds, fn=None):
    ps = {pin: subprocess.Popen((["taskset", "-c", pin] if pin != "any" else []) + [sys.executable, SENT, str(seconds)], stdout=subprocess.PIPE, text=True) for pin in ("any",)}
    extra = fn() if fn else time.sleep(seconds)
    for pin, p in ps.items():
        out = p.communicate()[0].strip().splitlines()
        lates = [float(l.split()[2]) for l in out]
        print(f"  pin {pin}: {len(lates)} stalls >100ms, sum {sum(lates):.0f} ms, max {max(lates, default=0):.0f}")
    lates = [float(l.split()[2]) for l in out]
    print("\n".join(out[:8]))
    print(f"{name}: {len(lates)} stalls >100ms, sum {sum(lates):.0f} ms, max {max(lates, default=0):.0f}; {extra}", flush=True)

with tempfile.TemporaryDirectory(prefix="exl3s-", dir="/tmp") as tmp:
    env = isolated_env(Path(tmp))
    env.update(dict(a.split("=", 1) for a in sys.argv[1:]))
    up = cli(env, "up", "--demo")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        st = json.loads(cli(env, "status", "--json").stdout)
        uds = engine_socket(Path(tmp))
        model = st["served_model_name"]
        phase("idle", 5)
        perf = subprocess.Popen(["true"])
        phase("c8", 30, lambda: asyncio.run(load(uds, model, 8, 28)))
        perf.wait()
        pass
        pass
    finally:
        cli(env, "down")
