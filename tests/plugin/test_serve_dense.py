"""The tiny dense EXL3 models served by the real vLLM through our launcher, against exllamav3's logits.

Runs on every sequence of each model's oracle file, so held-out oracle files are checked the same way
(point EXL3LOCAL_SHARED at them).
"""

from __future__ import annotations

import json

import pytest

from exl3local.plugin import trace

pytestmark = pytest.mark.slow

DENSE = ["tiny-llama-exl3-4.0bpw", "tiny-llama-exl3-2.5bpw"]


@pytest.fixture(scope="module", params=DENSE)
def served(request, serve, tiny_models, fixtures_dir, oracle_match_cls):
    name = request.param
    server = serve(tiny_models[name])
    return name, server, oracle_match_cls(server, fixtures_dir / "models" / name / "oracle_logits.safetensors")


def test_teacher_forced_logits_match_oracle(served):
    name, _, match = served
    assert match.sequences, "the oracle file has no sequences"
    for seq in match.sequences:
        report = match.logit_report(seq)
        print(name, seq, json.dumps(report))
        assert report["gated_disagreements"] == [], (name, seq, report)
        assert report["mean_kl"] <= 0.01, (name, seq, report)


def test_greedy_continuation_matches_oracle(served):
    name, _, match = served
    for seq in match.sequences:
        report = match.greedy_report(seq)
        print(name, seq, json.dumps(report))
        assert report["mismatch_step"] is None, (name, seq, report)
        assert report["compared"] >= 1, (name, seq, report)


def test_openai_endpoints_answer(served):
    _, server, _ = served
    out = server.post("/v1/completions", {"prompt": "def hello():", "max_tokens": 8, "temperature": 0})
    assert out["choices"][0]["text"] and out["usage"]["completion_tokens"] == 8
    out = server.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0},
    )
    assert out["choices"][0]["message"]["content"] is not None
    assert out["usage"]["completion_tokens"] >= 1


def test_kernel_path_counters_reach_the_trace_dir(served):
    _, server, _ = served
    server.post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0})
    snapshots = trace.read_all(server.trace_dir)
    assert snapshots, f"no counter files in {server.trace_dir}"
    totals = trace.totals(snapshots)
    assert totals.get("cpu_gemv", {}).get("calls", 0) > 0, totals  # kernels/cpu serves EXL3 on the CPU
    assert "kernel path cpu_gemv engaged" in server.tail(200_000)
