"""Run the real vLLM offline (vllm.LLM) on one checkpoint and save what a comparison between two
checkpoints needs, so each engine lives in its own process and is gone when the file is written.

    python -P offline_vllm.py MODEL OUT.safetensors LLM_KWARGS_JSON PROMPTS_JSON GREEDY_STEPS

OUT holds, per prompt N: `seqN.logprobs` fp32 (L-1, vocab), the teacher-forced full-vocabulary log-probs
(row i predicts prompt token i+1); `seqN.greedy`
int64 (steps), the greedy continuation; `seqN.greedy_margins` fp32 (steps), top-1 minus top-2 log-prob
at each greedy step. The safetensors metadata key `spec_decode` holds vLLM's spec-decode counters (JSON).
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import save_file


def main(model: str, out: str, kwargs: dict, prompts: list[list[int]], steps: int) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model, disable_log_stats=False, **kwargs)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    result: dict[str, torch.Tensor] = {}
    for n, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=vocab)
        rows = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].prompt_logprobs[1:]
        logprobs = torch.full((len(rows), vocab), float("-inf"))
        for i, row in enumerate(rows):
            for token, entry in row.items():
                logprobs[i, token] = entry.logprob
        result[f"seq{n}.logprobs"] = logprobs
        params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprobs=2)
        sample = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
        result[f"seq{n}.greedy"] = torch.tensor(list(sample.token_ids))
        margins = []
        for step in sample.logprobs:
            top = sorted((e.logprob for e in step.values()), reverse=True)
            margins.append(top[0] - top[1])
        result[f"seq{n}.greedy_margins"] = torch.tensor(margins)
    counters = {
        m.name: getattr(m, "value", getattr(m, "values", None))
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode")
    }
    save_file(result, out, metadata={"spec_decode": json.dumps(counters)})


if __name__ == "__main__":  # vLLM's engine process is spawned: the entry point must be guarded
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5]))
