"""manifest.read on the Qwen3.5 family: every linear sized by its role from the (nested) config, fp16 tensors
beside EXL3 groups, refusals that still name the tensor, and roles the config cannot size said, not guessed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from exl3local import manifest, model_config
from exl3local.errors import CheckpointError

QWEN35 = ("tiny-qwen35moe-exl3-4.0bpw", "tiny-qwen35-exl3-4.0bpw", "tiny-qwen35moe-vl-exl3-4.0bpw",
          "tiny-qwen35-vl-mtp-exl3-4.0bpw")  # fmt: skip
LAYER = "model.language_model.layers"


def dims(m: manifest.Manifest, prefix: str) -> tuple[int | None, int | None]:
    g = m.group(prefix)
    return g.unpadded_k, g.unpadded_n


@pytest.mark.parametrize("name", QWEN35)
def test_every_linear_is_sized_from_the_config(tiny_models, name):
    m = manifest.read(tiny_models[name])
    text = model_config.text_config(m.config)
    hidden, heads, head_dim = text["hidden_size"], text["num_attention_heads"], text["head_dim"]
    key_dim = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    value_dim = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    assert all(g.unpadded_k is not None and g.unpadded_n is not None for g in m.quantized.values()), [
        g.prefix for g in m.quantized.values() if g.unpadded_k is None or g.unpadded_n is None
    ]
    full = text["layer_types"].index("full_attention")
    linear = text["layer_types"].index("linear_attention")
    assert dims(m, f"{LAYER}.{full}.self_attn.q_proj") == (hidden, 2 * heads * head_dim)  # query + output gate
    assert dims(m, f"{LAYER}.{full}.self_attn.o_proj") == (heads * head_dim, hidden)
    assert dims(m, f"{LAYER}.{linear}.linear_attn.in_proj_qkv") == (hidden, 2 * key_dim + value_dim)
    assert dims(m, f"{LAYER}.{linear}.linear_attn.in_proj_z") == (hidden, value_dim)
    assert dims(m, f"{LAYER}.{linear}.linear_attn.out_proj") == (value_dim, hidden)
    # fp16 tensors that live beside EXL3 groups in one layer are plain tensors, not broken groups
    assert f"{LAYER}.{linear}.linear_attn.in_proj_a.weight" in m.unquantized
    if "num_experts" in text:
        assert dims(m, f"{LAYER}.0.mlp.shared_expert.down_proj") == (text["shared_expert_intermediate_size"], hidden)
        assert dims(m, f"{LAYER}.0.mlp.experts.3.up_proj") == (hidden, text["moe_intermediate_size"])
        assert f"{LAYER}.0.mlp.shared_expert_gate.weight" in m.unquantized and f"{LAYER}.0.mlp.gate.weight" in m.unquantized
    if text.get("mtp_num_hidden_layers"):
        assert dims(m, "mtp.fc") == (2 * hidden, hidden)
        assert dims(m, "mtp.layers.0.self_attn.q_proj") == (hidden, 2 * heads * head_dim)
    vision = m.config.get("vision_config")
    if vision:
        v_hidden, merged = vision["hidden_size"], vision["hidden_size"] * vision["spatial_merge_size"] ** 2
        assert dims(m, "model.visual.blocks.0.attn.q_proj") == (v_hidden, v_hidden)
        assert dims(m, "model.visual.blocks.0.mlp.linear_fc1") == (v_hidden, vision["intermediate_size"])
        assert dims(m, "model.visual.merger.linear_fc2") == (merged, vision["out_hidden_size"])
        assert m.group("model.visual.blocks.0.attn.q_proj").has_bias


def test_a_trellis_that_disagrees_with_the_config_is_still_refused_by_name(tiny_models, tmp_path):
    d = Path(shutil.copytree(tiny_models["tiny-qwen35moe-exl3-4.0bpw"], tmp_path / "m"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["linear_num_value_heads"] = 8  # in_proj_z would need 512 rows; the checkpoint has 256
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as err:
        manifest.read(d)
    assert "linear_attn.in_proj_" in str(err.value) and "expected" in str(err.value)


def test_roles_the_config_cannot_size_are_reported_not_guessed(tiny_models, tmp_path):
    """An unknown model family: q_proj may or may not carry a gate, so its width is not checked, and the
    checkpoint is not refused on a guess; inspect says which linears went unsized."""
    d = Path(shutil.copytree(tiny_models["tiny-qwen35-exl3-4.0bpw"], tmp_path / "m"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "some_future_hybrid"
    (d / "config.json").write_text(json.dumps(cfg))
    m = manifest.read(d)
    q = m.group(f"{LAYER}.3.self_attn.q_proj")
    assert (q.unpadded_k, q.unpadded_n) == (cfg["hidden_size"], None)
    out = subprocess.run([sys.executable, "-P", "-m", "exl3local", "inspect", str(d)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "unknown dims" in out.stdout and "self_attn.q_proj" in out.stdout
