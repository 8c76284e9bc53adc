"""The load-time kernel self-test inside a real vLLM engine: the worker checks the kernel the dispatch picks for
each rate of the checkpoint before a layer gets it, logs it (what `up` shows), and its trace file carries the
results (what status, doctor and the dashboard read)."""

from __future__ import annotations

import pytest

from exl3local.manifest import read
from exl3local.plugin import trace

pytestmark = pytest.mark.slow


def test_engine_self_tests_each_rate_of_the_checkpoint_before_serving(serve, tiny_models):
    from exl3local.kernels.cpu import ops

    if ops.refusal() is not None:
        pytest.skip(f"no CPU kernel here ({ops.refusal()}): the reference serves and is not self-tested")
    model = tiny_models["tiny-llama-exl3-4.0bpw"]
    server = serve(model)
    server.post("/v1/completions", {"prompt": "hello", "max_tokens": 2})
    rates = {(g.codebook, float(g.bits)) for g in read(model).quantized.values()}
    log = server.tail(200_000)
    for codebook, bits in rates:
        assert f"exl3local: self-test CpuLinearKernel {bits:g}-bit {codebook}: ok" in log
    results = [r for snap in trace.read_all(server.trace_dir) for r in snap["flags"].get("selftest", [])]
    assert {(r["codebook"], r["bits"]) for r in results} == rates
    assert results and all(r["ok"] and r["kernel"] == "CpuLinearKernel" for r in results)
    assert not any(snap["flags"].get("latched_off") for snap in trace.read_all(server.trace_dir))
