"""Qwen3.5-family shapes that no converted fixture covers, as synthetic EXL3 checkpoints
(tests/support/exl3_writer.py), run by the real vLLM through our plugin against their bf16 twins (the same
weights decoded by the reference decoder, loaded by vLLM as a plain HF checkpoint):

- dense: Qwen3_5ForCausalLM, three full-attention layers among three Gated DeltaNet layers, and an MLP
  width (704) that is not a multiple of 128, so gate/up/down are padded to 768 as the converter pads;
- moe64: Qwen3_5MoeForCausalLM with 64 routed experts, top-8, plus the gated shared expert;
- vl_mtp: the MoE (16 experts, top-4) inside Qwen3_5MoeForConditionalGeneration with one MoE MTP layer,
  served language-only with MTP speculative decoding; its draft model is also loaded in this process and
  each of its EXL3 layers compared with the twin's weights.

Bounds, from bf16 noise measured on these same checkpoints and prompts: the twin against a second bf16
twin (write_pair's `rounding`: the same decoded weights rounded to bf16 stochastically instead of to
nearest), both through vLLM. Over the three cases and both prompts (186 positions) that spread reached a
mean KL of 7.5e-3 nats on one sequence (vl_mtp seq0, one position alone at KL 0.21; 0.6e-3 to 6.8e-3
elsewhere), and it moved a top-1/top-2 margin by 0.42 at the 99th percentile and 1.6 at most (one
position; logits here are ~±10, where one bf16 step is 0.0625); it never changed a top-1 whose margin
was >= 1. The EXL3 copy computes with the fp16 weights that the twin rounds to bf16, so it may sit that
far from the twin: MEAN_KL_BOUND is twice the largest spread, MARGIN_GATE = 1. Measured EXL3 vs twin:
mean KL 1.0e-3 to 2.8e-3, margin moves <= 0.56. A wrong shard order, expert map, padding or prefix gives
a KL of order 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from exl3local.engine import textonly

import exl3_writer
from engine_env import IN_PROCESS_ENGINE
from torchvision_stand_in import torchvision_stand_in

pytestmark = pytest.mark.slow

SEED = 1717
MEAN_KL_BOUND = 1.5e-2  # nats, KL(twin || exl3) averaged over a sequence's positions
MARGIN_GATE = 1.0  # top-1 must agree (and greedy paths may not part) where the twin's margin is at least this
PROMPTS = 2
PROMPT_LEN = 32
GREEDY_STEPS = 16
RUNNER = Path(exl3_writer.__file__).with_name("offline_vllm.py")
TOKENIZER_FROM = "tiny-qwen35moe-exl3-4.0bpw"
ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 64 * 2**20, "max_model_len": 256, "max_logprobs": 2048}
MTP = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}, "enable_prefix_caching": False}

L, F = "linear_attention", "full_attention"
TEXT = {
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 256, "initializer_range": 0.02,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_value_head_dim": 64, "max_position_embeddings": 4096,
    "num_attention_heads": 4, "num_key_value_heads": 2, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6,
    "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 2048, "dtype": "bfloat16",
}  # fmt: skip
MOE = {
    "model_type": "qwen3_5_moe_text", "layer_types": [L, F], "num_hidden_layers": 2, "num_experts": 64,
    "num_experts_per_tok": 8, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
    "output_router_logits": False, "router_aux_loss_coef": 0.01,
}  # fmt: skip
VISION = {
    "depth": 1, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 128, "in_channels": 3, "initializer_range": 0.02,
    "intermediate_size": 256, "model_type": "qwen3_5_moe_vision", "num_heads": 2, "num_position_embeddings": 256,
    "out_hidden_size": 256, "patch_size": 16, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
    "spatial_merge_size": 2, "temporal_patch_size": 2, "deepstack_visual_indexes": [],
}  # fmt: skip
CONFIGS = {
    "dense": {
        **TEXT, "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "intermediate_size": 704,
        "layer_types": [L, F, L, F, L, F], "num_hidden_layers": 6,
    },
    "moe64": {**TEXT, **MOE, "architectures": ["Qwen3_5MoeForCausalLM"]},
    "vl_mtp": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "dtype": "bfloat16",
        "tie_word_embeddings": False, "image_token_id": 248056, "video_token_id": 248057,
        "vision_start_token_id": 248053, "vision_end_token_id": 248054, "vision_config": VISION,
        "text_config": {
            **TEXT, **MOE, "num_experts": 16, "num_experts_per_tok": 4, "mtp_num_hidden_layers": 1,
            "mtp_use_dedicated_embeddings": False,
        },
    },
}  # fmt: skip
# Extra LLM kwargs per case for the EXL3 copy and for its twin. The MoE MTP case runs the EXL3 copy with
# speculative decoding, so its greedy output is compared with the twin's plain greedy decoding.
ENGINE_EXTRA = {
    "dense": ({}, {}),
    "moe64": ({}, {}),
    "vl_mtp": ({"language_model_only": True, **MTP}, {"language_model_only": True}),
}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(SEED)
    body = [torch.randint(3, TEXT["vocab_size"], (PROMPT_LEN - 1,), generator=g).tolist() for _ in range(PROMPTS)]
    return [[TEXT["bos_token_id"], *tokens] for tokens in body]


def start_engine(model: Path, out: Path, kwargs: dict) -> subprocess.Popen:
    env = {
        **os.environ, "VLLM_PLUGINS": "exl3", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
        "EXL3LOCAL_TRACE_DIR": str(out.parent / "trace"),
        "TORCHDYNAMO_DISABLE": "1",  # eager (ENGINE), as engine.launch starts a CPU engine: no sampler compile
        **IN_PROCESS_ENGINE,
    }  # fmt: skip
    if textonly.torchvision_missing():
        env["PYTHONPATH"] = textonly.engine_pythonpath(os.environ)
    argv = [
        sys.executable, "-P", str(RUNNER), str(model), str(out), json.dumps(kwargs), json.dumps(prompts()),
        str(GREEDY_STEPS),
    ]  # fmt: skip
    with out.with_suffix(".log").open("wb") as log:  # a file, not a pipe: two engines log at once
        return subprocess.Popen(  # its own process group: a run cut short ends with vLLM's engine process
            argv, env=env, cwd=out.parent, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def engine_result(proc: subprocess.Popen, out: Path) -> dict:
    if proc.wait(timeout=600):
        tail = out.with_suffix(".log").read_bytes()[-6000:].decode(errors="replace")
        raise RuntimeError(f"vLLM ({' '.join(proc.args[3:5])}) exited {proc.returncode}:\n{tail}")
    with safe_open(out, "pt") as f:
        spec = json.loads(f.metadata()["spec_decode"])
    return {**load_file(out), "spec_decode": spec}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, tiny_models):
    """case -> its written checkpoint pair (written once, when first asked)."""
    cache: dict[str, exl3_writer.Pair] = {}

    def get(case: str) -> exl3_writer.Pair:
        if case not in cache:
            root = tmp_path_factory.mktemp(case)
            cache[case] = exl3_writer.write_pair(CONFIGS[case], SEED, root, tiny_models[TOKENIZER_FROM])
        return cache[case]

    return get


@pytest.fixture(scope="module")
def results(pairs):
    """case -> {"exl3": outputs, "twin": outputs}; both engines of a case run at once, when first asked."""
    cache: dict[str, dict[str, dict]] = {}

    def get(case: str) -> dict[str, dict]:
        if case not in cache:
            pair = pairs(case)
            runs = {"exl3": (pair.exl3, ENGINE_EXTRA[case][0]), "twin": (pair.twin, ENGINE_EXTRA[case][1])}
            outs = {name: pair.exl3.parent / f"{name}.safetensors" for name in runs}
            procs = {}
            try:
                for name, (model, extra) in runs.items():
                    quantization = {"quantization": "exl3"} if name == "exl3" else {}
                    procs[name] = start_engine(model, outs[name], {**ENGINE, **quantization, **extra})
                cache[case] = {name: engine_result(proc, outs[name]) for name, proc in procs.items()}
            finally:
                for proc in procs.values():
                    if proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
        return cache[case]

    return get


def kl_report(ref: torch.Tensor, ours: torch.Tensor) -> dict:
    kl = (ref.exp() * (ref - ours)).sum(-1)
    top2 = ref.topk(2, -1).values
    gated = top2[:, 0] - top2[:, 1] >= MARGIN_GATE
    agree = ours.argmax(-1) == ref.argmax(-1)
    return {
        "mean_kl": kl.mean().item(), "max_kl": kl.max().item(), "top1_agreement": agree.float().mean().item(),
        "gated_positions": int(gated.sum()), "gated_disagreements": torch.nonzero(gated & ~agree).flatten().tolist(),
    }  # fmt: skip


def greedy_report(ref: dict, ours: dict, seq: str) -> dict:
    """Steps equal until the paths part; parting where the reference's margin is below the gate is a near
    tie that bf16 noise may decide either way, anywhere else a mismatch."""
    want, got = ref[f"{seq}.greedy"].tolist(), ours[f"{seq}.greedy"].tolist()
    margins = ref[f"{seq}.greedy_margins"].tolist()
    compared, mismatch = 0, None
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        if a != b:
            mismatch = step if margins[step] >= MARGIN_GATE else None
            break
        compared += 1
    return {"compared": compared, "mismatch_step": mismatch, "ref": want, "ours": got}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_teacher_forced_logprobs_match_the_bf16_twin(results, case):
    runs = results(case)
    for n in range(PROMPTS):
        report = kl_report(runs["twin"][f"seq{n}.logprobs"], runs["exl3"][f"seq{n}.logprobs"])
        print(case, f"seq{n}", json.dumps(report))
        assert report["mean_kl"] <= MEAN_KL_BOUND, report
        assert report["gated_positions"] >= PROMPT_LEN // 4, report  # the gate still leaves positions to check
        assert report["gated_disagreements"] == [], report


@pytest.mark.parametrize("case", list(CONFIGS))
def test_greedy_matches_the_bf16_twin(results, case):
    runs = results(case)
    compared = 0
    for n in range(PROMPTS):
        report = greedy_report(runs["twin"], runs["exl3"], f"seq{n}")
        print(case, f"seq{n}", json.dumps(report))
        assert report["mismatch_step"] is None, report
        compared += report["compared"]
    assert compared >= 4, "the greedy paths hit near ties too early to compare anything"


def test_mtp_drafts_are_proposed(results):
    """vLLM's own counters: the EXL3 copy decoded with MTP drafts, the twin without (so the vl_mtp case of
    test_greedy_matches_the_bf16_twin compares speculative with plain greedy decoding). The draft weights
    are random, so few drafts are accepted."""
    runs = results("vl_mtp")
    spec = runs["exl3"]["spec_decode"]
    print("spec decode counters", json.dumps(spec))
    assert spec.get("vllm:spec_decode_num_drafts", 0) > 0, spec
    assert spec.get("vllm:spec_decode_num_draft_tokens", 0) > 0, spec
    assert runs["twin"]["spec_decode"].get("vllm:spec_decode_num_drafts", 0) == 0, runs["twin"]["spec_decode"]


@pytest.fixture(scope="module")
def mtp_draft(pairs, vllm_dist):
    """The MTP draft model of the vl_mtp EXL3 checkpoint, built and loaded in this process the way vLLM's
    proposer does (get_model with the speculative config's draft model config)."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model

    # vLLM's Qwen3.5 module imports torchvision: the engine's stand-in, here and in vLLM's inspect subprocess
    with torchvision_stand_in():
        engine = {k: v for k, v in {**ENGINE, **MTP}.items() if k != "max_logprobs"}
        args = EngineArgs(model=str(pairs("vl_mtp").exl3), quantization="exl3", language_model_only=True, **engine)
        config = args.create_engine_config()
        with set_current_vllm_config(config):
            return get_model(vllm_config=config, model_config=config.speculative_config.draft_model_config)


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def twin_weight(twin: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """The twin checkpoint's (out, in) weight for a draft module: vLLM names the MTP layers `model.*`
    (`mtp.*` in the checkpoint) and fuses q/k/v and gate/up."""
    name = f"mtp.{module.removeprefix('model.')}" if module.startswith("model.") else module
    parent, _, leaf = name.rpartition(".")
    return torch.cat([twin[f"{parent}.{part}.weight".lstrip(".")] for part in FUSED.get(leaf, (leaf,))])


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_mtp_draft_weights_load_through_the_plugin_and_equal_the_twin(mtp_draft, pairs):
    """Every linear of the draft runs our EXL3 method (none expanded to dense) and computes what the twin's
    bf16 weights compute; the routed experts of the MoE MTP layer too. The twin's weights are the fp16
    decoded ones rounded to bf16 (relative error ~2e-3); a wrong shard, expert or prefix gives ~1."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase

    from exl3local.plugin.linear import Exl3LinearMethod
    from exl3local.plugin.moe import Exl3MoEMethod

    twin = load_file(pairs("vl_mtp").twin / "model.safetensors")
    top_k = CONFIGS["vl_mtp"]["text_config"]["num_experts_per_tok"]
    g = torch.Generator().manual_seed(SEED)
    checked = {}
    for name, layer in mtp_draft.named_modules():
        if isinstance(layer, LinearBase) and not isinstance(layer.quant_method, Exl3LinearMethod):
            assert name.endswith(("mlp.gate", "shared_expert_gate")), f"{name} is not EXL3: {layer.quant_method}"
        elif isinstance(layer, LinearBase):
            weight = twin_weight(twin, name)
            x = torch.randn(3, weight.shape[1], generator=g).to(torch.bfloat16)
            checked[name] = relative_error(layer.quant_method.apply(layer, x), x.float() @ weight.float().T)
        elif isinstance(layer, RoutedExperts):
            assert isinstance(layer.quant_method, Exl3MoEMethod), name
            experts = f"mtp.{name.removeprefix('model.').removesuffix('.routed_experts')}"
            count = CONFIGS["vl_mtp"]["text_config"]["num_experts"]
            x = torch.randn(3, CONFIGS["vl_mtp"]["text_config"]["hidden_size"], generator=g)
            ids = torch.stack([torch.randperm(count, generator=g)[:top_k] for _ in range(3)]).to(torch.int32)
            weights = torch.softmax(torch.randn(3, top_k, generator=g), -1)
            want = torch.zeros_like(x)
            for t in range(3):
                for j in range(top_k):
                    e = {p: twin[f"{experts}.{int(ids[t, j])}.{p}_proj.weight"].float() for p in ("gate", "up", "down")}
                    hidden = torch.nn.functional.silu(e["gate"] @ x[t]) * (e["up"] @ x[t])
                    want[t] += weights[t, j] * (e["down"] @ hidden)
            checked[name] = relative_error(layer.quant_method.apply(layer, x.to(torch.bfloat16), weights, ids), want)
    print(json.dumps(checked, indent=1))
    roles = ("fc", "qkv_proj", "o_proj", "shared_expert.gate_up_proj", "shared_expert.down_proj", "experts")
    assert all(any(n.endswith(role) for n in checked) for role in roles), sorted(checked)
    assert max(checked.values()) < 1e-2, checked
