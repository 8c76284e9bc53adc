"""The tiny dense EXL3 model through vLLM's offline engine WITHOUT enforce_eager: vLLM's compiler traces the
model (our linears as one exl3local::linear op each, plugin/ops.py) and the greedy continuation still matches
exllamav3's oracle wherever the oracle's top-1 margin is clear."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from engine_env import IN_PROCESS_ENGINE
from oracle import greedy_gate, iter_sequences

pytestmark = pytest.mark.slow

MODEL = "tiny-llama-exl3-4.0bpw"
SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
prompts = json.loads(sys.argv[2])
llm = LLM(model=sys.argv[1], quantization="exl3", enforce_eager=False, max_model_len=256,
          kv_cache_memory_bytes=64 << 20)
print("COMPILATION", llm.llm_engine.vllm_config.compilation_config.mode, flush=True)
outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids, _ in prompts],
                    [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in prompts])
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
"""


def test_compiled_engine_matches_the_oracle(tiny_models, fixtures_dir, tmp_path):
    from safetensors.torch import load_file

    oracle = load_file(fixtures_dir / "models" / MODEL / "oracle_logits.safetensors")
    seqs = list(iter_sequences(oracle))
    prompts = [(oracle[f"{s}.input_ids"].tolist(), len(oracle[f"{s}.greedy_tokens"])) for s in seqs]
    # the compiler runs the same with the engine core in this process
    env = {**os.environ, "VLLM_PLUGINS": "exl3", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
           "TMPDIR": str(tmp_path), **IN_PROCESS_ENGINE}
    proc = subprocess.run([sys.executable, "-P", "-c", SCRIPT, str(tiny_models[MODEL]), json.dumps(prompts)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    mode = next(line for line in out.splitlines() if line.startswith("COMPILATION"))
    assert "NONE" not in mode, mode  # the compiler ran: not an eager engine in disguise
    results = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    for seq, ours in zip(seqs, results, strict=True):
        expected = oracle[f"{seq}.greedy_tokens"].tolist()
        margins = oracle[f"{seq}.greedy_margins"].tolist()
        for step, (a, b, m) in enumerate(zip(ours, expected, margins, strict=True)):
            if a != b:
                assert m < greedy_gate(oracle, seq), (seq, step, ours, expected)
                break
