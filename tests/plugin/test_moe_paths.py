"""Exl3MoEMethod on the tiny Qwen3-MoE checkpoint, loaded in-process by vLLM's own model loader.

Every path of the ladder runs at the token counts it serves and is compared with a per-expert
reference loop built straight from the checkpoint's tensors (not from our arenas). Loading is
watched by an allocation tracker: no dense or fp16 expert weight may appear.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from exl3local.kernels import KernelPath, reference
from exl3local.kernels.hadamard import hadamard_rows

MODEL = "tiny-qwen3moe-exl3-4.0bpw"
TOP_K = 4
DECODED: dict[str, torch.Tensor] = {}  # Ŵ per checkpoint tensor, for the fp16-u reference loop


class AllocationTracker(TorchDispatchMode):
    """Bytes of every new tensor storage that aten ops create while active, summed without ever
    subtracting frees: an upper bound on the peak they can reach together."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.float_shapes: list[tuple[torch.dtype, tuple[int, ...]]] = []
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key in self._seen or key[1] == 0:
                continue  # a view, or an in-place result
            self._seen.add(key)
            if func.overloadpacket is torch.ops.aten.set_:
                continue  # safetensors maps the checkpoint file: page cache, not an allocation
            self.total += key[1]
            if t.is_floating_point():
                self.float_shapes.append((t.dtype, tuple(t.shape)))
        return out


@pytest.fixture(scope="module")
def loaded(load_vllm_model, tiny_models):
    # The load-time kernel self-test's inputs and outputs (tested in tests/kernels/test_selftest.py) are
    # transient and would count here, where frees are never subtracted: this measures what the load allocates.
    tracker = AllocationTracker()
    before = os.environ.get("EXL3LOCAL_KERNEL_SELFTEST")
    os.environ["EXL3LOCAL_KERNEL_SELFTEST"] = "0"
    try:
        with tracker:
            model = load_vllm_model(tiny_models[MODEL])
    finally:
        if before is None:
            os.environ.pop("EXL3LOCAL_KERNEL_SELFTEST")
        else:
            os.environ["EXL3LOCAL_KERNEL_SELFTEST"] = before
    return model, tracker


@pytest.fixture(scope="module")
def experts(loaded):
    model, _ = loaded
    return [m for m in model.modules() if type(m).__name__ == "RoutedExperts"]


@pytest.fixture(scope="module")
def ckpt(tiny_models):
    return load_file(tiny_models[MODEL] / "model.safetensors")


def reference_moe(ckpt, prefix: str, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, fp16_u: bool = False) -> torch.Tensor:
    """Per token, per chosen expert: w * down(silu(gate(x)) * up(x)), accumulated in fp32. With fp16_u,
    each projection rounds as the Triton input transform does: x ⊙ suh to fp16, then u = H(·) to fp16
    (exllamav3's had_hf order), and the rest stays fp32."""

    def lin(v, name):
        t, suh, svh = ckpt[f"{name}.trellis"], ckpt[f"{name}.suh"], ckpt[f"{name}.svh"]
        if not fp16_u:
            return reference.linear(v, t, suh, svh, 4.0, "mul1")
        if name not in DECODED:
            DECODED[name] = reference.decode_trellis(t, 4.0, "mul1").float()
        u = hadamard_rows((v * suh.float()).half().float()).half().float()
        return hadamard_rows(u @ DECODED[name]) * svh.float()

    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        row = x[t : t + 1].float()
        for j in range(ids.shape[1]):
            e = f"{prefix}.{int(ids[t, j])}"
            h = F.silu(lin(row, f"{e}.gate_proj")) * lin(row, f"{e}.up_proj")
            out[t] += weights[t, j].float() * lin(h, f"{e}.down_proj")[0]
    return out


def routing(tokens: int, experts: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed + tokens)
    x = torch.randn(tokens, 256, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:TOP_K] for _ in range(tokens)]).to(torch.int32)
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=g), -1)
    return x, weights, ids


def test_path_selection_by_token_count():
    from exl3local.plugin.moe import select_path

    assert select_path(1) == KernelPath.MOE_DECODE
    assert select_path(2) == select_path(4) == KernelPath.MOE_VERIFY
    assert select_path(5) == select_path(64) == select_path(128) == KernelPath.MOE_GROUPED
    assert select_path(129) == select_path(512) == KernelPath.MOE_BATCHED


@pytest.mark.parametrize(
    ("path", "tokens", "exact"),
    [
        (KernelPath.MOE_DECODE, 1, True),
        (KernelPath.MOE_VERIFY, 2, True),
        (KernelPath.MOE_VERIFY, 4, True),
        (KernelPath.MOE_GROUPED, 64, False),
        (KernelPath.MOE_BATCHED, 512, False),
    ],
)
def test_every_path_matches_the_per_expert_reference_loop(experts, ckpt, path, tokens, exact):
    layer = experts[1]
    method = layer.quant_method
    x, weights, ids = routing(tokens)
    got = method.run_path(layer, path, x, weights, ids)
    sample = slice(0, min(tokens, 12))  # the Python reference loop is slow; its rows are independent
    want = reference_moe(ckpt, layer.layer_name, x[sample], weights[sample], ids[sample])
    if exact and layer.exl3_experts.kernels["gate"].backend == "reference":  # same arithmetic, same order
        assert torch.equal(got[sample], want)
    elif exact:  # kernels/cpu's units: the same math in another fp32 summation order
        torch.testing.assert_close(got[sample], want, rtol=1e-5, atol=1e-6)
    else:  # grouped GEMM rows / dense reconstruction: fp32 summation order differs
        torch.testing.assert_close(got[sample], want, rtol=1e-4, atol=1e-5)


def test_paths_agree_with_each_other_at_shared_token_counts(experts):
    layer = experts[0]
    x, weights, ids = routing(4, seed=7)
    outs = {p: layer.quant_method.run_path(layer, p, x, weights, ids) for p in (KernelPath.MOE_VERIFY, KernelPath.MOE_GROUPED, KernelPath.MOE_BATCHED)}
    torch.testing.assert_close(outs[KernelPath.MOE_GROUPED], outs[KernelPath.MOE_VERIFY], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[KernelPath.MOE_BATCHED], outs[KernelPath.MOE_VERIFY], rtol=1e-4, atol=1e-5)


def test_paths_fail_closed_outside_their_range(experts):
    layer = experts[0]
    x, weights, ids = routing(2)
    with pytest.raises(ValueError, match="exactly one token"):
        layer.quant_method.run_path(layer, KernelPath.MOE_DECODE, x, weights, ids)
    x, weights, ids = routing(5)
    with pytest.raises(ValueError, match="independent M=1 units"):
        layer.quant_method.run_path(layer, KernelPath.MOE_VERIFY, x, weights, ids)


def test_apply_counts_the_selected_path(experts):
    from exl3local.plugin import trace

    layer = experts[0]
    before = trace.counters().snapshot()["paths"].get("moe_verify", {"calls": 0, "tokens": 0})
    x, weights, ids = routing(3)
    out = layer.quant_method.apply(layer, x.to(torch.bfloat16), weights, ids)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 256)
    after = trace.counters().snapshot()["paths"]["moe_verify"]
    assert (after["calls"] - before["calls"], after["tokens"] - before["tokens"]) == (1, 3)


def test_experts_with_different_bits_in_one_projection_are_refused(experts):
    import dataclasses

    from exl3local.errors import CheckpointError
    from exl3local.plugin.moe import Exl3MoEMethod

    layer = experts[0]
    config = layer.quant_method.config
    odd = f"{layer.layer_name}.5.down_proj"
    groups = dict(config.groups())
    groups[odd] = dataclasses.replace(groups[odd], bits=3.0)

    class Patched(type(config)):
        def groups(self):
            return groups

    patched = Patched(config.quant_config, config.checkpoint)
    with pytest.raises(CheckpointError, match=rf"{odd}: expected down like .*4 bits.*found 3 bits"):
        Exl3MoEMethod(patched, layer, layer.layer_name).create_weights(
            layer, 16, 256, 128, torch.bfloat16, global_num_experts=16
        )


def test_an_empty_batch_routes_nothing(experts):
    layer = experts[0]
    x = torch.zeros(0, 256, dtype=torch.bfloat16)
    out = layer.quant_method.apply(layer, x, torch.zeros(0, TOP_K), torch.zeros(0, TOP_K, dtype=torch.int32))
    assert out.shape == (0, 256) and out.dtype == torch.bfloat16


def test_loading_never_allocates_dense_expert_weights(loaded, experts, tiny_models):
    """All tensor memory allocated while loading the whole model (an upper bound on its peak: frees
    are never subtracted) stays below what the fp16 experts alone would take, by at least 20 %."""
    import json

    _, tracker = loaded
    cfg = json.loads((tiny_models[MODEL] / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    fp16_expert_bytes = cfg["num_hidden_layers"] * cfg["num_experts"] * 3 * hidden * inter * 2
    print(f"allocated {tracker.total} B during load; fp16 experts alone {fp16_expert_bytes} B")
    assert tracker.total < 0.8 * fp16_expert_bytes
    expert_shapes = {(2 * inter, hidden), (inter, hidden), (hidden, inter)}
    dense = [(d, s) for d, s in tracker.float_shapes if s[-2:] in expert_shapes]
    assert dense == [], dense
    for layer in experts:
        params = dict(layer.named_parameters(recurse=False))
        assert "w13_weight" not in params and "w2_weight" not in params
        assert all(not p.is_floating_point() or p.dtype == torch.float16 and p.dim() <= 3 and p.shape[-1] <= hidden for p in params.values())


def test_decode_on_cpu_runs_the_cpu_units_not_a_loop_over_experts(experts, ckpt, monkeypatch):
    """Decode, verify and grouped calls (1, 3, 6 tokens) run as CPU library units, never one expert at a time."""
    from exl3local.plugin import trace
    from exl3local.plugin.moe import select_path

    layer = experts[0]
    assert layer.exl3_moe_refusal == "the dispatch chose CpuLinearKernel for gate"
    assert trace.counters().snapshot()["flags"]["moe_decode_refused"] == layer.exl3_moe_refusal
    assert layer.exl3_experts.cpu is not None

    def no_per_expert_loop(*args, **kwargs):
        raise AssertionError("decode/verify/grouped went through the per-expert loop")

    monkeypatch.setattr(layer.exl3_experts, "expert", no_per_expert_loop)
    for tokens in (1, 3, 6):
        x, weights, ids = routing(tokens, seed=5)
        ids[0, 1] = -1  # another rank's expert: contributes nothing
        got = layer.quant_method.run_path(layer, select_path(tokens), x, weights, ids)
        keep = weights.clone()
        keep[0, 1] = 0
        want = reference_moe(ckpt, layer.layer_name, x, keep, torch.where(ids < 0, 0, ids))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_triton_moe_refuses_gate_and_up_of_different_bits(experts):
    import dataclasses

    from exl3local.kernels import KernelSpec, dispatch
    from exl3local.plugin.moe import triton_moe_refusal

    layer = experts[0]
    triton = {n: dispatch.TritonLinearKernel(KernelSpec(128, 128, 4, "mul1"), dispatch.DeviceInfo("cuda")) for n in ("gate", "up", "down")}
    proj = dict(layer.exl3_proj)
    assert triton_moe_refusal(triton, proj) is None
    proj["up"] = dataclasses.replace(proj["up"], bits=3.0)
    assert triton_moe_refusal(triton, proj) == "gate (4 bits) and up (3 bits) differ: no stacked w13 view"


@pytest.mark.slow  # minutes of interpreted MoE kernels
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1")
# decode and the smallest grouped call: every path is the same unit kernel on Triton (verify's 2-4 tokens included),
# and under CI's interpreter each token costs ~25 s
@pytest.mark.parametrize("tokens", [1, 5])
def test_forced_triton_moe_kernel_matches_the_per_expert_reference_loop(experts, ckpt, monkeypatch, tokens):
    from exl3local.plugin import trace
    from exl3local.plugin.moe import select_path

    layer = experts[1]
    method = layer.quant_method
    chosen = "triton_moe.moe_decode moe"
    before = trace.counters().snapshot()["layers"].get(chosen, 0)
    monkeypatch.setenv("EXL3LOCAL_DISABLED_KERNELS", "CpuLinearKernel,TorchReferenceKernel")
    try:
        method.process_weights_after_loading(layer)
        assert layer.exl3_moe_refusal is None
        assert trace.counters().snapshot()["layers"][chosen] == before + 1

        def no_per_expert_loop(*args, **kwargs):
            raise AssertionError("decode/verify went through the per-expert loop")

        monkeypatch.setattr(layer.exl3_experts, "expert", no_per_expert_loop)
        x, weights, ids = routing(tokens, seed=11)
        got = method.run_path(layer, select_path(tokens), x, weights, ids)
    finally:
        monkeypatch.undo()
        method.process_weights_after_loading(layer)
    assert layer.exl3_moe_refusal is not None  # back on the reference for the other tests
    # Against the same arithmetic (rounded to fp16 where the kernel rounds): fp32 noise, plus the odd
    # element of the down projection's input whose fp32 noise crosses an fp16 rounding boundary (one fp16
    # ulp there moves the outputs by ~1.5e-5).
    want = reference_moe(ckpt, layer.layer_name, x, weights, ids, fp16_u=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=4e-5)
    if tokens == 1:  # against the fp32 loop (the existing paths match it bit-exactly): fp16 u costs ~1e-3
        exact = reference_moe(ckpt, layer.layer_name, x, weights, ids)
        assert (got - exact).norm() / exact.norm() < 2e-3
