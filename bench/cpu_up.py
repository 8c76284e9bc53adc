"""A tiny EXL3 model end to end through `exl3local up` on the CPU: decode tok/s at the endpoint with kernels/cpu (the
default) and with the reference decoder (EXL3LOCAL_DISABLED_KERNELS=CpuLinearKernel: the "before" of issue 22).

    python -P bench/cpu_up.py [MODEL_DIR] [--tokens 128] [--repeat 3]

Per variant: a private daemon (bench/isolated.py), `up`, then greedy completions of the same prompt through the
OpenAI endpoint, `tokens` and 1 token long (ignore_eos): decode tok/s = (tokens - 1) / the difference, best of
`repeat`; then `down`. Run it under the heavy-test lock: it starts a real vLLM engine per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling modules (python -P adds no path)
from isolated import cli, isolated_env  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def completion_s(client: httpx.Client, url: str, model: str, tokens: int) -> float:
    body = {"model": model, "prompt": "The quick brown fox jumps over the lazy dog and", "max_tokens": tokens,
            "min_tokens": tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    assert r.json()["usage"]["completion_tokens"] == tokens
    return time.perf_counter() - t0


def variant(model: str, root: Path, extra: dict[str, str], tokens: int, repeat: int) -> dict:
    env = {**isolated_env(root), **extra}
    t0 = time.perf_counter()
    up = cli(env, "up", model)
    if up.returncode != 0:
        raise SystemExit(up.stderr)
    up_s = time.perf_counter() - t0
    try:
        url = json.loads(cli(env, "status", "--json").stdout)["endpoint"].rstrip("/").removesuffix("/v1")
        with httpx.Client(timeout=600) as client:
            name = client.get(f"{url}/v1/models").json()["data"][0]["id"]
            completion_s(client, url, name, 4)  # warm-up
            decode = []
            for _ in range(repeat):
                decode.append((completion_s(client, url, name, tokens) - completion_s(client, url, name, 1)) / (tokens - 1))
    finally:
        cli(env, "down")
    return {"up_s": up_s, "decode_tok_s": 1 / min(decode), "load_average": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=str(REPO / "exl3local/demo/tiny-llama-exl3-4.0bpw"))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="cpu-up-") as tmp:
        for name, extra in (("cpu", {}), ("reference", {"EXL3LOCAL_DISABLED_KERNELS": "CpuLinearKernel"})):
            root = Path(tmp) / name
            root.mkdir()
            results[name] = r = variant(args.model, root, extra, args.tokens, args.repeat)
            print(f"{Path(args.model).name} via {name}: decode {r['decode_tok_s']:.1f} tok/s at the endpoint, up in "
                  f"{r['up_s']:.0f} s (load {r['load_average']:.1f})", flush=True)
    print(f"kernels/cpu vs reference: {results['cpu']['decode_tok_s'] / results['reference']['decode_tok_s']:.1f}x")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
