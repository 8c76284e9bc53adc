"""Time from `exl3local up` to READY against a bare vLLM start of the same command line, and the
daemon's idle CPU and RSS. Same model, same flags, alternating order, in one run.

    .venv/bin/python -P bench/up_vs_bare.py [--rounds 2] [--idle-s 30] [MODEL_DIR]

Bare = the exact argv the daemon builds (our launcher, `serve`, the profile's flags), started by
this script and timed to the first /health 200. Isolated XDG dirs, TMPDIR and ports, so it does
not touch a running daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling modules (python -P adds no path)
from isolated import cli, isolated_env  # noqa: E402


def bare(model: str, root: Path) -> float:
    """Build the daemon's own spec in-process, run it without the daemon, time /health."""
    env = isolated_env(root)
    os.environ.update({k: env[k] for k in env if k.startswith(("XDG_", "EXL3LOCAL_", "TMPDIR"))})
    tempfile.tempdir = env["TMPDIR"]  # gettempdir() caches the first answer
    from exl3local import daemon

    plan = daemon.plan(daemon.UpRequest(model=model), sysfs_root=Path("/sys"))
    spec_env = dict(plan.spec.env)
    spec_env.pop("EXL3LOCAL_ENGINE_PARENT", None)
    t0 = time.monotonic()
    proc = subprocess.Popen(plan.spec.argv, env=spec_env, cwd=str(root), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    engine = httpx.Client(transport=httpx.HTTPTransport(uds=plan.spec.uds))  # the engine serves on its socket only
    try:
        while True:
            try:
                if engine.get("http://engine/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"bare vLLM exited with {proc.returncode}")
            time.sleep(0.1)
    finally:
        engine.close()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()


def via_daemon(model: str, root: Path, idle_s: float) -> dict[str, float]:
    env = isolated_env(root)
    t0 = time.monotonic()
    up = cli(env, "up", model)
    up_s = time.monotonic() - t0
    if up.returncode != 0:
        raise SystemExit(up.stderr)
    st = json.loads(cli(env, "status", "--json").stdout)
    daemon = psutil.Process(st["daemon_pid"])
    c0 = daemon.cpu_times()
    time.sleep(idle_s)
    c1 = daemon.cpu_times()
    cpu_pct = 100 * ((c1.user + c1.system) - (c0.user + c0.system)) / idle_s
    rss = daemon.memory_info().rss
    cli(env, "down")
    return {"up_to_ready_s": up_s, "daemon_idle_cpu_pct": cpu_pct, "daemon_rss_mib": rss / 2**20,
            "engine_rss_mib": st["engine_rss_bytes"] / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=str(Path(__file__).resolve().parents[1] / "exl3local/demo/tiny-llama-exl3-4.0bpw"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=30.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="up-vs-bare-") as tmp:
        for r in range(args.rounds):
            order = ("bare", "daemon") if r % 2 == 0 else ("daemon", "bare")
            for what in order:
                root = Path(tmp) / f"{what}{r}"
                root.mkdir()
                if what == "bare":
                    print(json.dumps({"round": r, "bare_to_health_s": round(bare(args.model, root), 1)}), flush=True)
                else:
                    res = via_daemon(args.model, root, args.idle_s)
                    print(json.dumps({"round": r, **{k: round(v, 2) for k, v in res.items()}}), flush=True)


if __name__ == "__main__":
    main()
