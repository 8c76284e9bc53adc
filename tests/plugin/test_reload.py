"""vLLM's reload_weights (what a wake from sleep level 2 runs) on EXL3 layers, in-process (no engine).

After the reload the layers must answer as before AND their kernels must read the layer's registered
parameters -- the memory a level-2 sleep discards and the wake refills -- not a second copy (issue 23). The tiny
Qwen3-MoE checkpoint has both kinds of EXL3 layer: linears (attention) and routed experts.
"""

from __future__ import annotations

import pytest
import torch

from torchvision_stand_in import torchvision_stand_in

MODEL = "tiny-qwen3moe-exl3-4.0bpw"
TOP_K = 4


def exl3_layers(model) -> list[torch.nn.Module]:
    kinds = ("Exl3LinearMethod", "Exl3MoEMethod")
    return [m for m in model.modules() if type(getattr(m, "quant_method", None)).__name__ in kinds]


def outputs(layers) -> list[torch.Tensor]:
    """Each EXL3 layer on one fixed input (a routing of TOP_K experts for the MoE layers)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for layer in layers:
        method = layer.quant_method
        if type(method).__name__ == "Exl3MoEMethod":
            x = torch.randn(3, layer.exl3_hidden, generator=g)
            ids = torch.stack([torch.randperm(layer.w13_trellis.shape[0], generator=g)[:TOP_K] for _ in range(3)])
            out.append(method.apply(layer, x, torch.rand(3, TOP_K, generator=g), ids.to(torch.int32)))
        else:
            x = torch.randn(3, layer.exl3_in_features, generator=g).to(layer.exl3_act_dtype)
            out.append(method.apply(layer, x))
    return out


def test_reload_weights_keeps_the_kernels_on_the_registered_parameters(vllm_dist, tiny_models):
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    args = EngineArgs(model=str(tiny_models[MODEL]), quantization="exl3", enforce_eager=True, max_model_len=256,
                      kv_cache_memory_bytes=64 * 2**20)
    with torchvision_stand_in():
        config = args.create_engine_config()
    with set_current_vllm_config(config):
        model = get_model(vllm_config=config)
        layers = exl3_layers(model)
        assert {type(m.quant_method).__name__ for m in layers} == {"Exl3LinearMethod", "Exl3MoEMethod"}
        params = [dict(m.named_parameters(recurse=False)) for m in layers]
        before = outputs(layers)
        for p in params:  # level 2's discard, simulated: the registered parameters lose their values
            for t in p.values():
                t.data.zero_()
        reload_weights(config, model, None, None, True)

    for m, p in zip(layers, params):  # the same objects are registered as before the reload
        assert all(m._parameters[name] is t for name, t in p.items())
    for got, want in zip(outputs(layers), before, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # The kernels read those parameters: clearing them again must change every layer's answer. (Before the fix
    # the kernels held vLLM's temporaries from the reload, and this changed nothing.)
    for p in params:
        for t in p.values():
            t.data.zero_()
    stale = {type(m).__name__ for m, got, want in zip(layers, outputs(layers), before, strict=True) if torch.equal(got, want)}
    assert not stale, f"these layers still answer from a copy of their weights: {sorted(stale)}"


def test_a_reload_rewrites_the_kernels_device_tables_in_place():
    """On a GPU these were made in the memory pool that a level-2 sleep discards; the reload must refill them
    where the bound launches point (here on the CPU, with Triton's interpreter, as the tests run)."""
    from exl3local.kernels import codebook, hadamard, launcher, triton_hadamard
    from exl3local.plugin import reload

    cpu = torch.device("cpu")
    tables = [hadamard.hadamard_128(cpu), triton_hadamard.hadamard_operands(cpu), codebook.lut("mul1", cpu)]
    want = [t.clone() for t in tables]
    ws = launcher.Workspace.get(cpu, 12345, 1, 1, 4)
    for t in (*tables, ws.counters):
        t.fill_(7)  # what a discarded and re-mapped page may hold
    reload.refresh_device_tables(cpu, {"mul1"})
    for got, expected in zip((hadamard.hadamard_128(cpu), triton_hadamard.hadamard_operands(cpu),
                              codebook.lut("mul1", cpu)), want, strict=True):
        assert torch.equal(got, expected)
    assert [t.data_ptr() for t in tables] == [hadamard.hadamard_128(cpu).data_ptr(),
                                              triton_hadamard.hadamard_operands(cpu).data_ptr(),
                                              codebook.lut("mul1", cpu).data_ptr()]
    assert not ws.counters.any()
    launcher.Workspace._live.pop((cpu, 12345))


def test_a_reload_refreshes_the_device_tables_once_not_per_layer(monkeypatch):
    """The tables are the device's: a 64-layer wake must rewrite them once, with every layer's codebooks, and the
    next reload once again. (The meta device stands in for a GPU: the refresh is skipped on the CPU.)"""
    from exl3local.plugin import reload

    calls = []
    monkeypatch.setattr(reload, "refresh_device_tables", lambda device, codebooks: calls.append((device, codebooks)))
    monkeypatch.setattr(reload, "_codebooks", {}, raising=False)
    monkeypatch.setattr(reload, "_reloaded", {}, raising=False)
    meta = torch.device("meta")
    layers = [(torch.nn.Module(), {codebook}) for codebook in ("mul1", "3inst", "mcg", "mul1")]
    for layer, codebooks in layers:  # the load
        layer.w = torch.nn.Parameter(torch.empty(4, device=meta), requires_grad=False)
        reload.keep_first_parameters(layer, ["w"], codebooks)
    assert calls == []
    for n in (1, 2):  # two reloads, each layer loaded into a temporary first (as vLLM's layerwise reload does)
        for layer, codebooks in layers:
            layer.w = torch.nn.Parameter(torch.empty(4, device=meta), requires_grad=False)
            reload.keep_first_parameters(layer, ["w"], codebooks)
            assert layer.w is layer.exl3_first_params["w"]
        assert calls == [(meta, {"mul1", "3inst", "mcg"})] * n
