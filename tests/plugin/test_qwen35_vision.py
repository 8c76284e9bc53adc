"""Qwen3.5 vision towers as exllamav3 writes them (q/k/v quantized separately beside the original fused bf16
qkv): every tower linear serves from EXL3, the split parts land in vLLM's fused qkv in order, and the bf16
copy is skipped. Built in-process (no engine): image preprocessing needs torchvision, which the CPU install
lacks, but building and running the tower's layers does not."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from exl3local.plugin.linear import Exl3LinearMethod

import fixture_models

# The tower is quantized at vision_bits 6: its output sits ~2 % from the original bf16 weights. A part in the
# wrong place (k where q belongs) or a lost bias is off by ~100 %.
QUANTIZATION_SPREAD = 0.05


@pytest.mark.parametrize("name", fixture_models.with_vision_tower())
def test_vision_tower_serves_its_exl3_linears(load_vllm_model, tiny_models, name):
    model = load_vllm_model(tiny_models[name])
    linears = {n: m for n, m in model.visual.named_modules() if hasattr(m, "quant_method") and "Linear" in type(m).__name__}
    assert linears and all(isinstance(m.quant_method, Exl3LinearMethod) for m in linears.values()), {
        n: type(m.quant_method).__name__ for n, m in linears.items()
    }
    torch.manual_seed(0)
    with safe_open(str(tiny_models[name] / "model.safetensors"), "pt") as f:
        for i, block in enumerate(model.visual.blocks):
            fused = f"model.visual.blocks.{i}.attn.qkv"
            weight, bias = f.get_tensor(f"{fused}.weight").float(), f.get_tensor(f"{fused}.bias").float()
            x = torch.randn(7, weight.shape[1], dtype=torch.bfloat16)
            ours = block.attn.qkv(x)[0].float()
            ref = x.float() @ weight.T + bias
            for part, (ours_part, ref_part) in enumerate(zip(ours.chunk(3, -1), ref.chunk(3, -1), strict=True)):
                rel = ((ours_part - ref_part).norm() / ref_part.norm()).item()
                assert rel < QUANTIZATION_SPREAD, (name, i, "qkv"[part], rel)
