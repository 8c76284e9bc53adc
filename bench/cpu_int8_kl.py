"""The KL gate for the CPU kernel's opt-in int8 activations (EXL3LOCAL_CPU_INT8): teacher-forced logits of an EXL3
checkpoint through the exact kernel and through the int8 path, each against an oracle file (exllamav3's logits)
and against each other. Offline vLLM, engine in-process, one process per mode.

    python -P bench/cpu_int8_kl.py MODEL_DIR ORACLE_FILE      # e.g. an untarred tiny-llama fixture + its oracle

The int8 path serves one row per call (ops.INT8_MAX_ROWS; more rows run the exact GEMV), and a prompt's logits come
from its prefill: the engine runs with max_num_batched_tokens = INT8_MAX_ROWS (chunked prefill), so every position of
the prompt goes through the path under test rather than an exact one. The gates are the endpoint tests'
(tests/support/oracle.py): mean KL(oracle || ours) <= MEAN_KL_GATE, and top-1 agreement wherever the oracle's margin
is gated. Run it under the heavy-test lock.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child(model: str, oracle_file: str, out: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    from exl3local.kernels.cpu import ops

    oracle = load_file(oracle_file)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    llm = LLM(model, max_model_len=256, enforce_eager=True, kv_cache_memory_bytes=16 << 20, skip_tokenizer_init=True,
              enable_prefix_caching=False, max_num_batched_tokens=ops.INT8_MAX_ROWS, max_num_seqs=ops.INT8_MAX_ROWS,
              max_logprobs=vocab, disable_log_stats=True, seed=0)
    seqs = sorted({k.split(".", 1)[0] for k in oracle}, key=lambda s: int(s.removeprefix("seq")))
    logprobs = {}
    for seq in seqs:
        ids = oracle[f"{seq}.input_ids"].tolist()
        prompt = ids + [int(oracle[f"{seq}.greedy_tokens"][0])]  # so the last position has prompt logprobs too
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=vocab, detokenize=False)
        rows = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].prompt_logprobs[1:]
        ours = torch.full((len(ids), vocab), float("-inf"))
        for i, row in enumerate(rows):
            for token, entry in row.items():
                ours[i, token] = entry.logprob
        logprobs[seq] = ours
    from exl3local.plugin import trace

    # which kernel paths served the EXL3 layers (the parent set EXL3LOCAL_TRACE_DIR, so layers count their calls)
    paths = {p: v["calls"] for p, v in trace.counters().snapshot()["paths"].items()}
    torch.save({"logprobs": logprobs, "paths": paths}, out)


def kl(p_log, q_log):
    """Mean over positions of KL(p || q), both log-probabilities."""
    return (p_log.exp() * (p_log - q_log)).sum(-1).mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, nargs="?")
    parser.add_argument("oracle", type=Path, nargs="?")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.model is None or args.oracle is None:
        parser.error("give the model directory and its oracle file")
    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(REPO / "tests" / "support"))
    from oracle import MEAN_KL_GATE, margin_gate  # noqa: E402  (the endpoint tests' gates; not a package)

    oracle = load_file(args.oracle)
    got = {}
    with tempfile.TemporaryDirectory(prefix="cpu-int8-kl-") as tmp:
        for mode, flag in (("exact", "0"), ("int8", "1")):
            out = Path(tmp) / f"{mode}.pt"
            env = {**os.environ, "EXL3LOCAL_CPU_INT8": flag, "EXL3LOCAL_TRACE_DIR": str(Path(tmp) / f"trace-{mode}")}
            subprocess.run([sys.executable, "-P", __file__, "--child", str(args.model.resolve()),
                            str(args.oracle.resolve()), str(out)], check=True, cwd=tempfile.gettempdir(), env=env)
            result = torch.load(out)
            got[mode] = result["logprobs"]
            print(f"{mode}: EXL3 layer calls by kernel path {result['paths']}", flush=True)
    report = {}
    for seq, exact in got["exact"].items():
        q8 = got["int8"][seq]
        vocab = exact.shape[-1]
        logits = oracle[f"{seq}.logits"].float()[:, :vocab]
        ref = torch.log_softmax(logits, -1)
        top2 = logits.topk(2, -1).values
        # where the oracle's top-1 leads by at least the endpoint tests' margin, ours must agree
        gated = top2[:, 0] - top2[:, 1] >= torch.tensor([margin_gate(v) for v in top2[:, 0].tolist()])
        report[seq] = {
            "gated_positions": int(gated.sum()),
            "gated_disagreements_exact": int((gated & (exact.argmax(-1) != ref.argmax(-1))).sum()),
            "gated_disagreements_int8": int((gated & (q8.argmax(-1) != ref.argmax(-1))).sum()),
            "kl_oracle_exact": kl(ref, exact), "kl_oracle_int8": kl(ref, q8), "kl_exact_int8": kl(exact, q8),
            "top1_int8_vs_exact": (q8.argmax(-1) == exact.argmax(-1)).float().mean().item(),
            "top1_int8_vs_oracle": (q8.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        }  # fmt: skip
        r = report[seq]
        verdict = "pass" if r["kl_oracle_int8"] <= MEAN_KL_GATE else "FAIL"
        print(f"{args.model.name} {seq}: KL(oracle||exact) {r['kl_oracle_exact']:.5f}, KL(oracle||int8) "
              f"{r['kl_oracle_int8']:.5f} (gate {MEAN_KL_GATE}: {verdict}), KL(exact||int8) {r['kl_exact_int8']:.6f}, "
              f"top-1 int8 = exact at {r['top1_int8_vs_exact']:.3f} of positions; "
              f"top-1 disagreements with the oracle where its margin is gated ({r['gated_positions']} positions): "
              f"exact {r['gated_disagreements_exact']}, int8 {r['gated_disagreements_int8']}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
