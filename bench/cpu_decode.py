"""EXL3 vs bf16 end to end on the CPU engine: offline vLLM, batch 1, one synthetic Llama-shaped model in both forms.

    python -P bench/cpu_decode.py [--layers 4] [--hidden 2048] [--intermediate 5632] [--bits 4] [--out DIR]
    python -P bench/cpu_decode.py --model DIR     # an EXL3 checkpoint: kernels/cpu vs the reference decoder
    python -P bench/cpu_linears.py [--step] [--threads N]   # no engine: per linear / one step (that file's doc)

The EXL3 checkpoint (mul1, every linear of every layer a random trellis, lm_head left bf16 in both) and its bf16
twin (the same weights decoded) are written with tests/support/exl3_writer.py's group helpers. Each
model then runs in its own process with vLLM's engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the
resident-memory growth of that process over LLM() is the engine's weights + KV + workspaces. Per model:
decode tok/s (a 128-token greedy run minus a 1-token run, same 16-token prompt, best of 3; also as CPU seconds per
token, all threads, which a loaded machine inflates less), the 16-token prompt's time to its one token (best of those 3
1-token runs), prefill tok/s
(a 512-token prompt, one output token), RSS growth. Then (unless --skip-linears) bench/cpu_linears.py's per-linear part. Run it under the heavy-test lock: one engine at a time here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def llama_config(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "dtype": "bfloat16",
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
        "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "attention_bias": False,
        "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The synthetic Llama's shapes and rate (the issue's: hidden 2048, intermediate 5632, mul1 K4), shared with
    bench/cpu_linears.py."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--bits", type=int, default=4)


def model_config(args: argparse.Namespace) -> dict:
    return llama_config(args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab)


def write_models(root: Path, cfg: dict, bits: int, seed: int = 0) -> tuple[Path, Path]:
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(REPO / "tests" / "support"))
    import exl3_writer as w  # noqa: E402  (tests/support is not a package on the path)

    gen = torch.Generator().manual_seed(seed)
    hidden, inter, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    exl3: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    storage: dict = {}

    def plain(name: str, value: torch.Tensor) -> None:
        exl3[name] = twin[name] = value.to(torch.bfloat16)
        w._record(storage, name.rpartition(".")[0], {name: exl3[name]}, None)

    plain("model.embed_tokens.weight", torch.randn(cfg["vocab_size"], hidden, generator=gen))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        plain(f"{p}input_layernorm.weight", 1 + 0.1 * torch.randn(hidden, generator=gen))
        plain(f"{p}post_attention_layernorm.weight", 1 + 0.1 * torch.randn(hidden, generator=gen))
        for name, size_in, size_out in (
            ("self_attn.q_proj", hidden, q), ("self_attn.k_proj", hidden, kv), ("self_attn.v_proj", hidden, kv),
            ("self_attn.o_proj", q, hidden), ("mlp.gate_proj", hidden, inter), ("mlp.up_proj", hidden, inter),
            ("mlp.down_proj", inter, hidden),
        ):  # fmt: skip
            t = w.Linear(p + name, size_in, size_out, bits)
            group = w._group(t, gen)
            exl3.update(group)
            twin[f"{t.name}.weight"] = dense_weight(group, t).to(torch.bfloat16)
            w._record(storage, t.name, group, t)
    plain("model.norm.weight", 1 + 0.1 * torch.randn(hidden, generator=gen))
    plain("lm_head.weight", torch.randn(cfg["vocab_size"], hidden, generator=gen) * hidden**-0.5 * 4)
    qcfg = {"quant_method": "exl3", "version": "1.6.5", "bits": bits, "head_bits": 16, "codebook": "mul1",
            "calibration": {"rows": 250, "cols": 2048}, "out_scales": "auto"}  # fmt: skip
    paths = root / "exl3", root / "bf16"
    for path, state, c in ((paths[0], exl3, {**cfg, "quantization_config": qcfg}), (paths[1], twin, cfg)):
        path.mkdir(parents=True)
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(c, indent=2))
    (paths[0] / "quantization_config.json").write_text(json.dumps({**qcfg, "tensor_storage": storage}, indent=2))
    return paths


def dense_weight(group: dict, t) -> "torch.Tensor":
    """exl3_writer.decoded's weight (out, in), with Ŵ from kernels/cpu (bit-exact, tests/kernels/test_cpu.py):
    the reference decoder would take an hour over these shapes."""
    import torch

    from exl3local.kernels.cpu import ops
    from exl3local.kernels.hadamard import hadamard_cols, hadamard_rows

    trellis, suh, svh = (group[f"{t.name}.{k}"] for k in ("trellis", "suh", "svh"))
    w_inner = ops.CpuLinear(trellis, suh, svh, t.bits, "mul1").decode()
    left = hadamard_cols(w_inner).to(torch.float16) * suh[:, None]  # reference.reconstruct's rounding steps
    w = hadamard_rows(left).to(torch.float16) * svh[None, :]
    return w[: t.size_in, : t.size_out].T.contiguous()


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def rss_parts() -> dict[str, int]:
    """Resident bytes by kind (/proc/self/status): anonymous (tensors, Python objects, the allocator's heap) and
    file-backed (mapped libraries and files): the weights, KV and workspaces are all anonymous."""
    parts = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "RssShmem"):
            parts[key] = int(value.split()[0]) * 1024
    return parts


def tensor_bytes(model) -> dict[str, int]:
    """The engine's tensors by kind, each storage once: the model's parameters and buffers, its attention layers'
    KV cache, and kernels/cpu's GEMM workspace (this thread's, where the in-process engine runs). vLLM's CPU path
    moves bf16 linear weights into oneDNN's packed copies and empties the parameters, so the parameters undercount
    bf16: the parent counts the checkpoint's bytes as the weights instead."""
    import torch

    from exl3local.kernels.cpu import ops

    seen: set[int] = set()

    def once(tensors) -> int:
        total = 0
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total

    def caches(module) -> list:
        kv = getattr(module, "kv_cache", None)
        return [kv] if isinstance(kv, torch.Tensor) else list(kv or ())

    params = once(list(model.parameters()) + list(model.buffers()))
    kv = once(t for m in model.modules() for t in caches(m))
    workspace = once(ops._local.__dict__.get("buffers", {}).values())
    return {"params": params, "kv": kv, "workspace": workspace}


def model_bytes(r: dict) -> int:
    """Weights (the checkpoint's bytes: held as loaded by EXL3, repacked one to one by oneDNN for bf16) + KV +
    kernels/cpu's workspace: the engine's own data, without vLLM's and Python's share of the RSS growth."""
    checkpoint = sum(f.stat().st_size for f in Path(r["model"]).glob("*.safetensors"))
    return checkpoint + r["tensors"]["kv"] + r["tensors"]["workspace"]


def child(model: str, out: str, *flags: str) -> None:
    """One model, engine in this process: RSS growth, decode and prefill speed. Flag "wide": kernels/cpu's one-row
    mul1 loop on 32-bit lanes even where the CPU has AVX512-FP16 (the loop before session 10; identical outputs). Flag
    "wplanes": every AMX GEMM through the W' planes, also for few rows (before session 11's u split)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    import torch

    if "wide" in flags:
        from exl3local.kernels.cpu import ops

        ops.library().exl3_cpu_fp16(0)
    if "wplanes" in flags:
        from exl3local.kernels.cpu import ops

        ops.AMX_U_MAX_ROWS = 0

    torch.zeros(1)  # torch's allocator and threads up before the baseline
    before, before_parts = rss(), rss_parts()
    start = time.perf_counter()
    layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    # 8 MiB of KV per layer: 32 MiB at 4 layers (sessions 6-7), and always room for one 1024-token sequence.
    llm = LLM(model, max_model_len=1024, enforce_eager=True, kv_cache_memory_bytes=(8 << 20) * layers,
              skip_tokenizer_init=True, enable_prefix_caching=False, disable_log_stats=True, seed=0)
    load_s = time.perf_counter() - start
    loaded = rss()
    loaded_parts = rss_parts()

    cpu = []  # CPU seconds of the last run (all threads): on a shared machine the steadier measure

    def run(prompt: list[int], tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0, ignore_eos=True, detokenize=False)
        t0, c0 = time.perf_counter(), time.process_time()
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        cpu[:] = [time.process_time() - c0]
        return time.perf_counter() - t0

    short = list(range(3, 19))
    long = [3 + (i * 7919) % 2000 for i in range(512)]
    run(short, 4)  # warm-up: first calls bind kernels, size workspaces
    decode, decode_cpu, first = [], [], []
    for _ in range(3):
        wall = run(short, 128)
        busy = cpu[0]
        first.append(run(short, 1))
        decode.append((wall - first[-1]) / 127)
        decode_cpu.append((busy - cpu[0]) / 127)
    decoded = rss()
    prefill = min(run(long, 1) for _ in range(2))
    end_parts = rss_parts()
    tensors = llm.apply_model(tensor_bytes)[0]
    result = {"tensors": tensors,"model": model, "threads": torch.get_num_threads(), "load_s": load_s, "rss_growth": rss() - before,
              "rss_after_load": loaded - before, "rss_after_decode": decoded - before,
              "anon_after_load": loaded_parts["RssAnon"] - before_parts["RssAnon"],
              "anon_growth": end_parts["RssAnon"] - before_parts["RssAnon"],
              "file_growth": end_parts["RssFile"] - before_parts["RssFile"],
              "decode_s_per_token": min(decode), "decode_tok_s": 1 / min(decode), "decode_cpu_s_per_token": min(decode_cpu),
              "prefill_s": prefill, "prefill_tok_s": 512 / prefill, "ttft16_s": min(first)}
    Path(out).write_text(json.dumps(result))


def compare_kernels(model: Path) -> None:
    """One EXL3 checkpoint (e.g. a tiny test fixture) served through kernels/cpu, then through the reference
    decoder (EXL3LOCAL_DISABLED_KERNELS=CpuLinearKernel): the speed-up every end-to-end test sees."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="cpu-decode-") as tmp:
        for name, disabled in (("cpu", ""), ("reference", "CpuLinearKernel")):
            out = Path(tmp) / f"{name}.json"
            env = {**os.environ, "EXL3LOCAL_DISABLED_KERNELS": disabled}
            subprocess.run([sys.executable, "-P", __file__, "--child", str(model), str(out)], check=True,
                           cwd=tempfile.gettempdir(), env=env)
            results[name] = r = json.loads(out.read_text())
            print(f"{model.name} via {name}: decode {r['decode_tok_s']:.2f} tok/s, prefill-512 {r['prefill_tok_s']:.1f} "
                  f"tok/s, load {r['load_s']:.1f} s", flush=True)
    c, r = results["cpu"], results["reference"]
    print(f"cpu/reference: decode {c['decode_tok_s'] / r['decode_tok_s']:.1f}x, "
          f"prefill-512 {c['prefill_tok_s'] / r['prefill_tok_s']:.1f}x")
    print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--out", type=Path, help="keep the checkpoints and results here (default: a temp dir)")
    parser.add_argument("--skip-linears", action="store_true")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for both engines (vLLM then keeps torch at that "
                        "count; by default it serves with one thread)")
    parser.add_argument("--rounds", type=int, default=1, help="alternate bf16 and EXL3 this many times; each "
                        "model's best decode and prefill count")
    parser.add_argument("--int8", action="store_true", help="also the EXL3 model with EXL3LOCAL_CPU_INT8=1 (the opt-in "
                        "int8-activation decode, not exact)")
    parser.add_argument("--wide", action="store_true", help="also the EXL3 model with the one-row mul1 loop on 32-bit "
                        "lanes where the CPU has AVX512-FP16 (a same-run before/after of session 10's loop)")
    parser.add_argument("--wplanes", action="store_true", help="also the EXL3 model with every AMX GEMM through the W' "
                        "planes, short prompts too (a same-run before/after of session 11's u split)")
    parser.add_argument("--model", type=Path, help="instead: this EXL3 checkpoint, CPU kernel vs reference decoder")
    parser.add_argument("--child", nargs="+", metavar="MODEL OUT [FLAG]", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.model:
        compare_kernels(args.model)
        return
    cfg = model_config(args)
    with tempfile.TemporaryDirectory(prefix="cpu-decode-") as tmp:
        root = args.out or Path(tmp)
        t0 = time.perf_counter()
        if (root / "models" / "bf16" / "config.json").is_file():  # --out of an earlier run with the same flags
            exl3, bf16 = root / "models" / "exl3", root / "models" / "bf16"
        else:
            exl3, bf16 = write_models(root / "models", cfg, args.bits)
            print(f"checkpoints written in {time.perf_counter() - t0:.0f} s", flush=True)
        env = dict(os.environ)
        if args.threads:
            env["OMP_NUM_THREADS"] = str(args.threads)
        results = {}
        runs = [("bf16", bf16, {}, []), ("exl3", exl3, {}, [])]
        runs += [("exl3_int8", exl3, {"EXL3LOCAL_CPU_INT8": "1"}, [])] * args.int8
        runs += [("exl3_wide", exl3, {}, ["wide"])] * args.wide
        runs += [("exl3_wplanes", exl3, {}, ["wplanes"])] * args.wplanes
        for round_ in range(args.rounds):  # the models alternate, so a change in the machine's load hits both
            for name, path, extra, flags in runs:
                out = root / f"{name}.json"
                subprocess.run([sys.executable, "-P", __file__, "--child", str(path), str(out), *flags], check=True,
                               cwd=tempfile.gettempdir(), env={**env, **extra})
                r = json.loads(out.read_text())
                r["load_average"] = os.getloadavg()[0]
                print(f"round {round_ + 1}: {name} ({r['threads']} threads, load {r['load_average']:.1f}): decode "
                      f"{r['decode_tok_s']:.2f} tok/s ({1e3 * r['decode_cpu_s_per_token']:.1f} ms CPU/token), prefill-512 {r['prefill_tok_s']:.1f} tok/s, 16-token prompt "
                      f"{1e3 * r['ttft16_s']:.0f} ms, RSS growth "
                      f"{r['rss_growth'] / 2**20:.0f} MiB (after load {r['rss_after_load'] / 2**20:.0f}, anonymous "
                      f"{r['anon_growth'] / 2**20:.0f}), load {r['load_s']:.1f} s; MiB: weights + KV + workspace "
                      f"{model_bytes(r) / 2**20:.1f} (" + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in r["tensors"].items())
                      + f"), the rest of the growth (vLLM's, Python's) {(r['rss_growth'] - model_bytes(r)) / 2**20:.0f}",
                      flush=True)
                results.setdefault("rounds", []).append({name: r})
                best = results.get(name)
                if best is None:
                    results[name] = dict(r)
                else:  # the fastest of the rounds (a shared machine only ever slows a run down)
                    for key in ("decode", "prefill"):
                        if r[f"{key}_tok_s"] > best[f"{key}_tok_s"]:
                            best.update({k: v for k, v in r.items() if k.startswith(key) and "cpu" not in k})
                    best["decode_cpu_s_per_token"] = min(best["decode_cpu_s_per_token"], r["decode_cpu_s_per_token"])
                    best["ttft16_s"] = min(best["ttft16_s"], r["ttft16_s"])
    b = results["bf16"]
    for name in [run[0] for run in runs[1:]]:
        e = results[name]
        results[f"ratios_{name}"] = {
            "decode": e["decode_tok_s"] / b["decode_tok_s"], "prefill": e["prefill_tok_s"] / b["prefill_tok_s"],
            "decode_cpu": b["decode_cpu_s_per_token"] / e["decode_cpu_s_per_token"],
            "ttft16": b["ttft16_s"] / e["ttft16_s"],
            "rss_growth": e["rss_growth"] / b["rss_growth"], "anon_growth": e["anon_growth"] / b["anon_growth"],
            "tensors": model_bytes(e) / model_bytes(b),
        }  # fmt: skip
        print(f"{name}/bf16: " + "decode {decode:.2f}x (by CPU time per token {decode_cpu:.2f}x), prefill-512 "
              "{prefill:.2f}x, 16-token prompt {ttft16:.2f}x, RSS growth {rss_growth:.2f}x (anonymous {anon_growth:.2f}x; the tensors alone: weights "
              "+ KV + workspace {tensors:.2f}x)".format(**results[f"ratios_{name}"]))
    if not args.skip_linears:
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench (python -P adds no path)
        from cpu_linears import linears

        linears(args, cfg, results)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
