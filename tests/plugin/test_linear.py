"""Exl3Config and Exl3LinearMethod in-process on real vLLM layers (no engine): mapping, loading, math.

Layers are built from vLLM's own classes and loaded through the params' weight loaders with the shard
ids vLLM's model loaders use; outputs are compared with the reference decoder on the checkpoint's
tensors (fixtures: the tiny llama 4.0bpw EXL3 checkpoint).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from exl3local.errors import CheckpointError, ConfigError
from exl3local.kernels import reference

MODEL = "tiny-llama-exl3-4.0bpw"
LAYER = "model.layers.0"


@pytest.fixture(scope="module")
def vllm_linear():
    from exl3local.plugin import register

    register()
    import vllm.model_executor.layers.linear as linear

    return linear


@pytest.fixture(scope="module")
def config(tiny_models, vllm_linear):
    from exl3local.plugin.config import Exl3Config

    cfg = Exl3Config.from_config(json.loads((tiny_models[MODEL] / "config.json").read_text())["quantization_config"])
    cfg.maybe_update_config(str(tiny_models[MODEL]))
    return cfg


@pytest.fixture(scope="module")
def tensors(tiny_models):
    return load_file(tiny_models[MODEL] / "model.safetensors")


def load(layer, tensors, parts: dict, loaded_via_layer: bool) -> None:
    """Feed checkpoint tensors as vLLM does: fused layers pass a shard id, plain layers none."""
    for shard, prefix in parts.items():
        for kind in ("trellis", "suh", "svh", "mul1"):
            param = getattr(layer, kind)
            w = tensors[f"{prefix}.{kind}"]
            if loaded_via_layer:
                param.weight_loader(param, w, shard)
            else:
                param.weight_loader(param, w)
    layer.quant_method.process_weights_after_loading(layer)


def ref(x: torch.Tensor, tensors, prefix: str) -> torch.Tensor:
    """The reference decoder on one checkpoint linear, x zero-padded to its k."""
    t = tensors[f"{prefix}.trellis"]
    pad = t.shape[0] * 16 - x.shape[-1]
    xp = torch.nn.functional.pad(x, (0, pad))
    return reference.linear(xp, t, tensors[f"{prefix}.suh"], tensors[f"{prefix}.svh"], 4.0, "mul1")


def qkv(vllm_linear, config):
    return vllm_linear.QKVParallelLinear(
        256, 64, 4, 2, bias=False, quant_config=config, prefix=f"{LAYER}.self_attn.qkv_proj", disable_tp=True
    )


def test_register_is_idempotent_and_entry_point_is_installed():
    from importlib.metadata import entry_points

    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from exl3local.plugin import register
    from exl3local.plugin.config import Exl3Config

    register()
    register()
    assert QUANTIZATION_METHODS.count("exl3") == 1
    assert get_quantization_config("exl3") is Exl3Config
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("exl3") == "exl3local.plugin:register"


def test_from_config_refuses_unknown_keys_and_other_methods(vllm_linear):
    from exl3local.plugin.config import Exl3Config

    with pytest.raises(ConfigError, match="frobnicate"):
        Exl3Config.from_config({"quant_method": "exl3", "bits": 4.0, "frobnicate": 1})
    with pytest.raises(ConfigError, match="gptq"):
        Exl3Config.from_config({"quant_method": "gptq"})


def test_config_survives_pickling_and_rereads_the_manifest(config):
    import pickle

    clone = pickle.loads(pickle.dumps(config))
    assert clone.checkpoint == config.checkpoint
    assert "lm_head" in clone.groups()


def test_fused_qkv_keeps_each_parts_own_suh(vllm_linear, config, tensors):
    layer = qkv(vllm_linear, config)
    load(layer, tensors, {s: f"{LAYER}.self_attn.{s}_proj" for s in "qkv"}, loaded_via_layer=True)
    x = torch.randn(5, 256)
    y = layer.quant_method.apply(layer, x)
    expected = torch.cat([ref(x, tensors, f"{LAYER}.self_attn.{s}_proj") for s in "qkv"], -1)
    # Part by part; the CPU kernel (the default on CPU) sums in another fp32 order than the reference.
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    # And the math is right: against dense W (fp16-rounded reconstruction), per part.
    dense = torch.cat(
        [
            reference.reconstruct(
                tensors[f"{LAYER}.self_attn.{s}_proj.trellis"], tensors[f"{LAYER}.self_attn.{s}_proj.suh"],
                tensors[f"{LAYER}.self_attn.{s}_proj.svh"], 4.0, "mul1",
            ).float()
            for s in "qkv"
        ],
        1,
    )  # fmt: skip
    torch.testing.assert_close(y, x @ dense, rtol=2e-2, atol=2e-2)
    # Concatenating suh would be wrong: q's suh applied to k's trellis changes k's output.
    parts_suh = [tensors[f"{LAYER}.self_attn.{s}_proj.suh"] for s in "qkv"]
    assert not torch.equal(parts_suh[0], parts_suh[1])


def test_gate_up_and_padding_trim(vllm_linear, config, tensors):
    layer = vllm_linear.MergedColumnParallelLinear(
        256, [768, 768], bias=False, quant_config=config, prefix=f"{LAYER}.mlp.gate_up_proj", disable_tp=True
    )
    load(layer, tensors, {0: f"{LAYER}.mlp.gate_proj", 1: f"{LAYER}.mlp.up_proj"}, loaded_via_layer=True)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    y = layer.quant_method.apply(layer, x)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 1536)
    expected = torch.cat([ref(x, tensors, f"{LAYER}.mlp.{p}_proj") for p in ("gate", "up")], -1)
    torch.testing.assert_close(y, expected)  # bf16 outputs: one rounding step apart at most

    # A layer narrower than the checkpoint's 128-padded tensor: x is zero-padded, the output trimmed.
    narrow = vllm_linear.RowParallelLinear(
        200, 200, bias=False, quant_config=config, prefix=f"{LAYER}.self_attn.o_proj", disable_tp=True
    )
    load(narrow, tensors, {None: f"{LAYER}.self_attn.o_proj"}, loaded_via_layer=False)
    x = torch.randn(4, 200)
    torch.testing.assert_close(narrow.quant_method.apply(narrow, x), ref(x, tensors, f"{LAYER}.self_attn.o_proj")[:, :200],
                               rtol=1e-5, atol=1e-5)


def tp_layers(monkeypatch, vllm_linear, make, size: int = 2):
    layers = []
    for rank in range(size):
        monkeypatch.setattr(vllm_linear, "get_tensor_model_parallel_rank", lambda rank=rank: rank)
        monkeypatch.setattr(vllm_linear, "get_tensor_model_parallel_world_size", lambda: size)
        layers.append(make())
    return layers


def test_tensor_parallel_splits_at_128_blocks(monkeypatch, vllm_linear, config, tensors):
    """TP=2 simulated in one process: each rank loads the full checkpoint tensor and keeps its slice."""
    gate_up = tp_layers(
        monkeypatch, vllm_linear,
        lambda: vllm_linear.MergedColumnParallelLinear(256, [768, 768], bias=False, quant_config=config, prefix=f"{LAYER}.mlp.gate_up_proj"),
    )  # fmt: skip
    for layer in gate_up:
        load(layer, tensors, {0: f"{LAYER}.mlp.gate_proj", 1: f"{LAYER}.mlp.up_proj"}, loaded_via_layer=True)
    x = torch.randn(3, 256)
    outs = [layer.quant_method.apply(layer, x) for layer in gate_up]
    gate = torch.cat([o[:, :384] for o in outs], -1)
    up = torch.cat([o[:, 384:] for o in outs], -1)
    torch.testing.assert_close(gate, ref(x, tensors, f"{LAYER}.mlp.gate_proj"), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(up, ref(x, tensors, f"{LAYER}.mlp.up_proj"), rtol=1e-5, atol=1e-5)

    down = tp_layers(
        monkeypatch, vllm_linear,
        lambda: vllm_linear.RowParallelLinear(768, 256, bias=False, quant_config=config, prefix=f"{LAYER}.mlp.down_proj"),
    )  # fmt: skip
    for layer in down:
        load(layer, tensors, {None: f"{LAYER}.mlp.down_proj"}, loaded_via_layer=False)
    h = torch.randn(3, 768)
    partial = [layer.quant_method.apply(layer, h[:, r * 384 : (r + 1) * 384]) for r, layer in enumerate(down)]
    torch.testing.assert_close(partial[0] + partial[1], ref(h, tensors, f"{LAYER}.mlp.down_proj"), rtol=1e-4, atol=1e-4)

    # k/v have 2 heads x 64 = 128 features: TP=2 would cut them at 64, inside a Hadamard block.
    with pytest.raises(ConfigError, match="multiple of 128"):
        tp_layers(
            monkeypatch, vllm_linear,
            lambda: vllm_linear.QKVParallelLinear(256, 64, 4, 2, bias=False, quant_config=config, prefix=f"{LAYER}.self_attn.qkv_proj"),
        )  # fmt: skip


def test_loader_refuses_wrong_tensors_with_checkpoint_errors(vllm_linear, config, tensors):
    layer = qkv(vllm_linear, config)
    with pytest.raises(CheckpointError, match="k_proj.trellis"):
        layer.trellis.weight_loader(layer.trellis, tensors[f"{LAYER}.self_attn.q_proj.trellis"], "k")  # q's shape
    with pytest.raises(CheckpointError, match="marker"):
        layer.mul1.weight_loader(layer.mul1, torch.tensor(-877912083, dtype=torch.int32), "q")  # the mcg value
    with pytest.raises(CheckpointError, match="fused"):
        layer.suh.weight_loader(layer.suh, tensors[f"{LAYER}.self_attn.q_proj.suh"], None)
    # Parts that never arrived are named after loading, before any forward.
    for kind in ("trellis", "suh", "svh", "mul1"):
        getattr(layer, kind).weight_loader(getattr(layer, kind), tensors[f"{LAYER}.self_attn.q_proj.{kind}"], "q")
    with pytest.raises(CheckpointError, match=r"k_proj\.\w+: expected the tensor to be loaded"):
        layer.quant_method.process_weights_after_loading(layer)


def test_get_quant_method_per_layer_kind(vllm_dist, vllm_linear, config, tiny_models):
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    from exl3local.plugin.config import Exl3Config
    from exl3local.plugin.linear import Exl3LinearMethod

    head = ParallelLMHead(2048, 256, quant_config=config, prefix="lm_head")
    assert isinstance(head.quant_method, Exl3LinearMethod)  # head_bits 6: a quantized head
    embed = VocabParallelEmbedding(2048, 256, quant_config=config, prefix="model.embed_tokens")
    assert type(embed.quant_method).__name__ == "UnquantizedEmbeddingMethod"
    with pytest.raises(CheckpointError, match="model.layers.9.mlp.down_proj"):
        vllm_linear.RowParallelLinear(768, 256, quant_config=config, prefix="model.layers.9.mlp.down_proj", disable_tp=True)

    moe = Exl3Config({"quant_method": "exl3"})
    moe.maybe_update_config(str(tiny_models["tiny-qwen3moe-exl3-4.0bpw"]))
    router = vllm_linear.ReplicatedLinear(256, 16, bias=False, quant_config=moe, prefix="model.layers.0.mlp.gate")
    assert isinstance(router.quant_method, vllm_linear.UnquantizedLinearMethod)  # stored fp16 in the checkpoint


def test_quantized_head_projects_the_whole_vocab(vllm_dist, vllm_linear, config, tensors):
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    head = ParallelLMHead(2048, 256, quant_config=config, prefix="lm_head")
    for kind in ("trellis", "suh", "svh", "mul1"):
        getattr(head, kind).weight_loader(getattr(head, kind), tensors[f"lm_head.{kind}"])
    head.quant_method.process_weights_after_loading(head)
    x = torch.randn(2, 256)
    t = tensors["lm_head.trellis"]
    expected = reference.linear(x, t, tensors["lm_head.suh"], tensors["lm_head.svh"], 6.0, "mul1")
    torch.testing.assert_close(head.quant_method.apply(head, x), expected, rtol=1e-5, atol=1e-5)


def test_mtp_draft_head_layers_resolve_to_exl3(vllm_linear, tiny_models, tmp_path):
    """A checkpoint that ships an EXL3 MTP/draft block (stored under mtp.*) maps those linears to EXL3."""
    from exl3local.plugin.config import Exl3Config
    from exl3local.plugin.linear import Exl3LinearMethod

    src = tiny_models[MODEL]
    dst = tmp_path / "with-mtp"
    shutil.copytree(src, dst)
    (dst / "quantization_config.json").unlink()  # its tensor_storage would not list the new tensors
    tensors = load_file(src / "model.safetensors")
    for name in list(tensors):
        if name.startswith("model.layers.3."):
            tensors[name.replace("model.layers.3.", "mtp.layers.0.")] = tensors[name].clone()
    save_file(tensors, dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["mtp_bits"] = 4
    (dst / "config.json").write_text(json.dumps(cfg))

    config = Exl3Config.from_config(cfg["quantization_config"])
    config.maybe_update_config(str(dst))
    layer = vllm_linear.QKVParallelLinear(
        256, 64, 4, 2, bias=False, quant_config=config, prefix="mtp.layers.0.self_attn.qkv_proj", disable_tp=True
    )
    assert isinstance(layer.quant_method, Exl3LinearMethod)
    assert [g.prefix for g in layer.quant_method.groups] == [f"mtp.layers.0.self_attn.{s}_proj" for s in "qkv"]


def test_decode_once_keeps_a_dense_copy_with_the_same_result(monkeypatch, vllm_linear, config, tensors):
    from exl3local.plugin import trace

    monkeypatch.setenv("EXL3LOCAL_DECODE_ONCE", "1")
    layer = vllm_linear.RowParallelLinear(
        768, 256, bias=False, quant_config=config, prefix=f"{LAYER}.mlp.down_proj", disable_tp=True
    )
    load(layer, tensors, {None: f"{LAYER}.mlp.down_proj"}, loaded_via_layer=False)
    assert layer.exl3_dense is not None and layer.exl3_dense.shape == (256, 768)
    x = torch.randn(3, 768)
    torch.testing.assert_close(layer.quant_method.apply(layer, x), ref(x, tensors, f"{LAYER}.mlp.down_proj"), rtol=1e-4, atol=1e-4)
    snap = trace.counters().snapshot()
    assert snap["flags"]["decode_once"] is True and snap["paths"]["decode_once"]["calls"] >= 1


def test_register_adds_exl3_to_a_platform_list_once(tmp_path):
    """On XPU/ROCm the platform keeps a non-empty supported list; register() must land in it, once."""
    import subprocess
    import sys

    script = (
        "from vllm.platforms import current_platform as p\n"
        "p.__class__.supported_quantization = ['awq', 'gptq']\n"
        "from exl3local.plugin import register\n"
        "register(); register()\n"
        "assert p.supported_quantization.count('exl3') == 1, p.supported_quantization\n"
        "p.verify_quantization('exl3')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_legacy_packed_signs_are_refused_by_name(vllm_linear, config):
    import dataclasses

    from exl3local.plugin.linear import Exl3LinearMethod

    group = config.groups()[f"{LAYER}.self_attn.o_proj"]
    legacy = dataclasses.replace(
        group, tensors=tuple(t.replace(".suh", ".su") for t in group.tensors)
    )
    layer = torch.nn.Module()
    with pytest.raises(CheckpointError, match=r"o_proj\.suh.*legacy packed signs su"):
        Exl3LinearMethod(config, group.prefix, [legacy]).create_weights(layer, 256, [256], 256, 256, torch.bfloat16)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1")
def test_forced_triton_layer_runs_its_bound_launches_and_matches_the_reference(monkeypatch, vllm_linear, config, tensors):
    """The path GPUs take: launches bound at load time; q/k/v at one rate in one arena run as one grouped grid."""
    from exl3local.kernels.bound_group import GroupLaunch

    monkeypatch.setenv("EXL3LOCAL_DISABLED_KERNELS", "CpuLinearKernel,TorchReferenceKernel")
    layer = qkv(vllm_linear, config)
    load(layer, tensors, {s: f"{LAYER}.self_attn.{s}_proj" for s in "qkv"}, loaded_via_layer=True)
    (group, _, _), = layer.exl3_bound.launches
    assert isinstance(group, GroupLaunch) and group.count == 3
    x = torch.randn(3, 256, dtype=torch.float16)
    y = layer.quant_method.apply(layer, x)
    expected = torch.cat([ref(x.float(), tensors, f"{LAYER}.self_attn.{s}_proj") for s in "qkv"], -1)
    assert y.shape == expected.shape
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=2e-2)  # fp16 activations, fp32 accumulation


def test_compiled_forward_holds_the_linear_as_one_custom_op(vllm_linear, config, tensors):
    """What vLLM's compiler sees: apply traced without graph breaks (fullgraph) into one exl3local::linear node
    whose fake implementation gives the shape; the compiled result equals eager."""
    layer = qkv(vllm_linear, config)
    load(layer, tensors, {s: f"{LAYER}.self_attn.{s}_proj" for s in "qkv"}, loaded_via_layer=True)
    x = torch.randn(3, 256, dtype=torch.float16)
    eager = layer.quant_method.apply(layer, x)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda t: layer.quant_method.apply(layer, t), fullgraph=True, backend=backend)
    assert torch.equal(compiled(x), eager)
    (gm,) = graphs
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [torch.ops.exl3local.linear.default]


def test_calls_are_counted_only_when_asked(monkeypatch, vllm_linear, config, tensors, tmp_path):
    from exl3local.plugin import trace

    monkeypatch.delenv("EXL3LOCAL_TRACE_DIR", raising=False)
    monkeypatch.delenv("EXL3LOCAL_TRACE_PATHS", raising=False)
    layer = qkv(vllm_linear, config)
    load(layer, tensors, {s: f"{LAYER}.self_attn.{s}_proj" for s in "qkv"}, loaded_via_layer=True)
    assert not layer.exl3_count and layer.exl3_forward is layer.exl3_bound  # nothing per call but the launches
    monkeypatch.setenv("EXL3LOCAL_TRACE_DIR", str(tmp_path))
    layer.quant_method.process_weights_after_loading(layer)
    before = trace.counters().snapshot()["paths"]
    layer.quant_method.apply(layer, torch.randn(2, 256, dtype=torch.float16))
    after = trace.counters().snapshot()["paths"]
    assert sum(v["calls"] for v in after.values()) == sum(v["calls"] for v in before.values()) + 1
