"""The Qwen3.5 family through the product's own path: `exl3local up DIR` on the cpu profile, then the local
OpenAI endpoint, teacher-forced over the full vocabulary against exllamav3's logits (every sequence of each
fixture's oracle file), greedy continuations, the KV/state budget against vLLM's own figure, MTP drafts."""

from __future__ import annotations

import json
import re

import httpx
import pytest

import fixture_models
from oracle import MEAN_KL_GATE, OpenAIEndpoint, OracleMatch, vocab_size
from private_user import clean_box, make_box

pytestmark = pytest.mark.slow

# Small and fast: a 256-token context, a 64 MiB pinned KV pool, and every logprob of the 2048-token vocabulary.
SETTINGS = ("--set", "model.max_model_len=256", "--set", "memory.kv_max_bytes=64MiB",
            "--set", 'vllm.extra_args=["--max-logprobs","2048"]')  # fmt: skip
MTP = ("--set", 'vllm.speculative_config={method="mtp", num_speculative_tokens=1}')


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    # a short root: vLLM's IPC sockets live under the box's TMPDIR, and a unix socket path has 107 bytes
    b = make_box(tmp_path_factory.mktemp("q35"))
    yield b
    down = b.cli("down", timeout=120)
    clean_box(b)
    assert down.returncode == 0, down.stdout + down.stderr


def up(box, model_dir, *extra: str) -> dict:
    result = box.cli("up", str(model_dir), "--profile", "cpu", "--port", str(box.engine_port), *SETTINGS, *extra,
                     timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    status = json.loads(box.cli("status", "--json", timeout=60).stdout)
    assert status["state"] == "READY", status
    return status


def endpoint(box, status: dict, model_dir) -> OpenAIEndpoint:
    return OpenAIEndpoint(f"http://127.0.0.1:{box.engine_port}", status["served_model_name"], vocab_size(model_dir))


def vllm_kv_tokens(box) -> int:
    """The KV capacity the engine itself reported at start (the last start in the log)."""
    log = box.cli("logs", timeout=60).stdout
    found = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    assert found, log[-3000:]
    return int(found[-1].replace(",", ""))


def spec_decode_counter(box, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{box.engine_port}/metrics", timeout=10).text
    values = [float(m) for m in re.findall(rf"^vllm:{name}(?:{{[^}}]*}})? ([\d.e+]+)$", text, re.M)]
    return sum(values)


@pytest.mark.parametrize("name", fixture_models.qwen35_family())
def test_up_serves_qwen35_and_matches_exllamav3(box, tiny_models, fixtures_dir, name):
    """Checkpoints with an MTP head serve with MTP drafts, as the b70 profile runs them: the oracle is
    exllamav3's draft-free greedy path, so matching it up to its first near tie is "greedy output unchanged"."""
    model_dir = tiny_models[name]
    mtp = name in fixture_models.with_mtp_head()
    status = up(box, model_dir, *(MTP if mtp else ()))
    match = OracleMatch(endpoint(box, status, model_dir), fixtures_dir / "models" / name / "oracle_logits.safetensors")
    assert match.sequences
    for seq in match.sequences:
        logits = match.logit_report(seq)
        greedy = match.greedy_report(seq)
        print(name, seq, json.dumps(logits), json.dumps({k: greedy[k] for k in ("compared", "mismatch_step")}))
        assert logits["gated_disagreements"] == [], (seq, logits)
        assert logits["mean_kl"] <= MEAN_KL_GATE, (seq, logits)
        assert greedy["mismatch_step"] is None, (seq, greedy)
    if mtp:
        assert "prefix caching off" in status["profile_reason"], status["profile_reason"]
        drafts = spec_decode_counter(box, "spec_decode_num_draft_tokens_total")
        accepted = spec_decode_counter(box, "spec_decode_num_accepted_tokens_total")
        print(name, f"MTP drafts proposed {drafts:.0f}, accepted {accepted:.0f}")
        assert drafts > 0
    # The budget's token figure is the one vLLM reports for the same pool (KV + Gated DeltaNet state).
    ours, engine = status["kv_budget_tokens"], vllm_kv_tokens(box)
    print(name, "KV tokens: budget", ours, "vLLM", engine)
    assert abs(ours - engine) <= 0.02 * engine, (ours, engine)
    # The daemon's kernel-path counters say which path served the Gated DeltaNet projections and the experts.
    kernels = httpx.get(f"http://{box.env['EXL3LOCAL_HOST']}/api/kernels", timeout=30).json()
    served = {role for entry in kernels["paths"] for role in entry.get("roles", {})}
    print(name, "kernel paths", {e["path"]: e["roles"] for e in kernels["paths"] if e.get("roles")})
    assert {"gdn", "attention", "lm_head"} <= served, kernels
    text = json.loads((model_dir / "config.json").read_text())
    if "num_experts" in text.get("text_config", text):
        assert {"experts", "shared_expert"} <= served, kernels
    if mtp:
        assert "mtp" in served, kernels
    if "vision_config" in text:  # no torchvision here: the vision tower is skipped, and status says so
        assert "image and video input off" in status["profile_reason"], status["profile_reason"]
