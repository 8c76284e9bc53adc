"""Decode speed and peak memory of an EXL3 checkpoint through vLLM vs the same model dequantized to bf16.

    .venv/bin/python -P bench/plugin_throughput.py /path/to/tiny-llama-exl3-4.0bpw [--tokens 64] [--runs 3]

Each variant runs in a fresh process (offline `vllm.LLM`, --enforce-eager, 64 MiB KV); this script
samples the RSS of that process tree every 50 ms and reports the peak. Variants:
  exl3          the plugin as served by default (the reference decoder on CPU)
  exl3-decode1  the plugin with EXL3LOCAL_DECODE_ONCE=1 (dense copy kept after loading)
  bf16          the checkpoint dequantized by the reference decoder into a plain HF checkpoint
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

CHILD = r"""
import json, sys, time
def main():
    from vllm import LLM, SamplingParams
    model, quant, tokens, runs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    t0 = time.perf_counter()
    llm = LLM(model, quantization=None if quant == "none" else quant, enforce_eager=True,
              max_model_len=256, kv_cache_memory_bytes=64 * 2**20)
    init_s = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": [1, 1422, 89, 872, 295, 683, 386, 574]}
    llm.generate([prompt], sp)  # warm-up
    speeds = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = llm.generate([prompt], sp)[0]
        speeds.append(len(out.outputs[0].token_ids) / (time.perf_counter() - t0))
    print("RESULT " + json.dumps({"init_s": init_s, "tok_s": speeds, "tokens": list(out.outputs[0].token_ids)[:16]}))
if __name__ == "__main__":
    main()
"""


def dequantize(src: Path, dst: Path) -> None:
    """Write `src` (EXL3) as a plain bf16 HF checkpoint: every trellis group becomes `<prefix>.weight`."""
    import torch
    from safetensors.torch import load_file, save_file

    from exl3local import manifest
    from exl3local.kernels import reference
    from exl3local.kernels.hadamard import hadamard_cols, hadamard_rows

    m = manifest.read(src)
    tensors = load_file(src / "model.safetensors")
    out = {}
    for prefix, g in m.quantized.items():
        w_inner = reference.decode_trellis(tensors[f"{prefix}.trellis"], g.bits, g.codebook).float()
        suh, svh = tensors[f"{prefix}.suh"].float(), tensors[f"{prefix}.svh"].float()
        w = hadamard_rows(hadamard_cols(w_inner) * suh[:, None]) * svh[None, :]
        k, n = g.unpadded_k or g.size_k, g.unpadded_n or g.size_n
        out[f"{prefix}.weight"] = w[:k, :n].t().contiguous().to(torch.bfloat16)
    for name in m.unquantized:
        out[name] = tensors[name]
    dst.mkdir(parents=True)
    save_file(out, dst / "model.safetensors")
    for f in src.iterdir():
        if f.suffix == ".json" and f.name not in ("config.json", "quantization_config.json"):
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def run(model: Path, quant: str, tokens: int, runs: int, env: dict[str, str], workdir: Path) -> dict:
    script = workdir / "child.py"
    script.write_text(CHILD)
    log = workdir / f"{quant}-{len(list(workdir.glob('*.log')))}.log"
    with log.open("w") as out:
        proc = psutil.Popen(
            [sys.executable, "-P", str(script), str(model), quant, str(tokens), str(runs)],
            cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        peak = 0
        while proc.poll() is None:
            try:
                tree = [proc, *proc.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
            except psutil.Error:
                pass
            time.sleep(0.05)
    text = log.read_text()
    result = next((json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")), None)
    if result is None:
        raise RuntimeError(f"{quant} run failed:\n{text[-3000:]}")
    return {**result, "peak_rss_bytes": peak}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    base_env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory(prefix="exl3-bench-") as tmp:
        work = Path(tmp)
        bf16 = work / "bf16"
        dequantize(args.model, bf16)
        env = {**base_env, "TMPDIR": tmp, "EXL3LOCAL_TRACE_DIR": str(work / "trace")}
        variants = {
            "exl3": (args.model, "exl3", env),
            "exl3-decode1": (args.model, "exl3", {**env, "EXL3LOCAL_DECODE_ONCE": "1"}),
            "bf16": (bf16, "none", env),
        }
        for name, (model, quant, venv) in variants.items():
            r = run(model, quant, args.tokens, args.runs, venv, work)
            speeds = ", ".join(f"{s:.1f}" for s in r["tok_s"])
            print(
                f"{name:13s} decode {speeds} tok/s ({args.tokens} tokens, batch 1)  "
                f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB  init {r['init_s']:.1f} s  first tokens {r['tokens'][:8]}",
                flush=True,
            )


if __name__ == "__main__":
    main()
