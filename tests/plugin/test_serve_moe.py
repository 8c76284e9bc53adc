"""The tiny Qwen3-MoE EXL3 model served by the real vLLM, against exllamav3's logits (all oracle sequences)."""

from __future__ import annotations

import json

import pytest

from exl3local.plugin import trace

pytestmark = pytest.mark.slow

MOE = "tiny-qwen3moe-exl3-4.0bpw"


@pytest.fixture(scope="module")
def served(serve, tiny_models, fixtures_dir, oracle_match_cls):
    server = serve(tiny_models[MOE])
    return server, oracle_match_cls(server, fixtures_dir / "models" / MOE / "oracle_logits.safetensors")


def test_teacher_forced_logits_match_oracle(served):
    _, match = served
    assert match.sequences
    for seq in match.sequences:
        report = match.logit_report(seq)
        print(MOE, seq, json.dumps(report))
        assert report["gated_disagreements"] == [], (seq, report)
        assert report["mean_kl"] <= 0.01, (seq, report)


def test_greedy_continuation_matches_oracle(served):
    _, match = served
    for seq in match.sequences:
        report = match.greedy_report(seq)
        print(MOE, seq, json.dumps(report))
        assert report["mismatch_step"] is None, (seq, report)
        assert report["compared"] >= 1, (seq, report)


def test_moe_paths_counted_and_printed(served):
    server, _ = served
    server.post("/v1/completions", {"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 3, "temperature": 0})
    totals = trace.totals(trace.read_all(server.trace_dir))
    # Prefill of 8 and of the 33-token oracle prompts is grouped; every generated token is a decode.
    assert totals.get("moe_decode", {}).get("calls", 0) > 0, totals
    assert totals.get("moe_grouped", {}).get("calls", 0) > 0, totals
    log = server.tail(500_000)
    assert "kernel path moe_decode engaged" in log and "kernel path moe_grouped engaged" in log


def test_expert_arenas_stay_compressed(served):
    """The worker reports its routed-expert arena bytes; fp16 experts would need about 4x more."""
    server, _ = served
    cfg = json.loads((server.model / "config.json").read_text())
    layers, experts = cfg["num_hidden_layers"], cfg["num_experts"]
    fp16_bytes = layers * experts * 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 2
    flags = [s["flags"] for s in trace.read_all(server.trace_dir) if "moe_arena_bytes" in s["flags"]]
    assert flags, "no worker reported its expert arenas"
    arena = flags[0]["moe_arena_bytes"]
    print(f"expert arenas {arena} B vs fp16 experts {fp16_bytes} B ({arena / fp16_bytes:.1%})")
    assert arena < 0.3 * fp16_bytes
