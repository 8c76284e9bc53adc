"""Save an SVG of `exl3local dash` while the running daemon's engine is under load.

    exl3local up --demo && .venv/bin/python -P scripts/dash-screenshot.py docs/dashboard.svg

Two client threads send completions to the engine for LOAD_S seconds while the dashboard polls;
the screenshot is taken at the end, so the sparklines show the load."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import httpx

from exl3local.api.client import DaemonClient
from exl3local.tui.app import make_dashboard

LOAD_S = 25.0
PROMPTS = ["def main():", "import os, sys, json\n", "class Server:\n    def __init__(self):"]


def load(endpoint: str, model: str, prompt: str, stop: threading.Event) -> None:
    with httpx.Client(timeout=120, trust_env=False) as http:
        while not stop.is_set():
            http.post(f"{endpoint}/completions", json={
                "model": model, "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True})  # fmt: skip


async def main(out: str) -> None:
    with DaemonClient() as client:
        st = client.status()
    stop = threading.Event()
    app = make_dashboard()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause(2.0)  # a baseline scrape before the load starts
        threads = [threading.Thread(target=load, args=(st.endpoint, st.served_model_name, p, stop), daemon=True)
                   for p in PROMPTS[:2]]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < LOAD_S:
            await pilot.pause(0.5)
        app.save_screenshot(out)
        stop.set()
    print(f"saved {out}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
