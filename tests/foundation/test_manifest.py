"""manifest.read on the tiny fixture models, and each kind of corruption it must refuse by name."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from exl3local import manifest, safetensors_files
from exl3local.errors import CheckpointError

LLAMA = "tiny-llama-exl3-4.0bpw"
LLAMA_25 = "tiny-llama-exl3-2.5bpw"
MOE = "tiny-qwen3moe-exl3-4.0bpw"
Q_PROJ = "model.layers.0.self_attn.q_proj"


@pytest.fixture()
def copy_model(tiny_models, tmp_path):
    def make(name: str) -> Path:
        return Path(shutil.copytree(tiny_models[name], tmp_path / name))

    return make


def _edit_tensors(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_reads_the_dense_fixture(tiny_models):
    m = manifest.read(tiny_models[LLAMA])
    assert m.architecture == "LlamaForCausalLM"
    assert len(m.quantized) == 4 * 7 + 1  # q k v o gate up down per layer + lm_head
    q = m.group(Q_PROJ)
    assert (q.bits, q.codebook, q.size_k, q.size_n, q.unpadded_k, q.unpadded_n) == (4.0, "mul1", 256, 256, 256, 256)
    k = m.group("model.layers.0.self_attn.k_proj")
    assert (k.size_n, k.unpadded_n) == (128, 128)
    head = m.group("lm_head")
    assert (head.bits, head.size_n, head.unpadded_n) == (6.0, 2048, 2048)
    assert "model.embed_tokens.weight" in m.unquantized and "model.norm.weight" in m.unquantized
    assert not any(n.endswith((".trellis", ".suh", ".svh", ".mul1")) for n in m.unquantized)
    assert m.bits_histogram == {4.0: 28, 6.0: 1}
    assert m.bytes_on_disk == (tiny_models[LLAMA] / "model.safetensors").stat().st_size
    assert m.weight_bytes == sum(t.nbytes for t in safetensors_files.read_header(tiny_models[LLAMA] / "model.safetensors").values())


def test_reads_half_rate_and_moe_fixtures(tiny_models):
    half = manifest.read(tiny_models[LLAMA_25])
    assert half.group(Q_PROJ).bits == 2.5 and half.group(Q_PROJ).trellis_bytes == 256 * 256 * 5 // 16
    moe = manifest.read(tiny_models[MOE])
    assert moe.architecture == "Qwen3MoeForCausalLM"
    expert = moe.group("model.layers.0.mlp.experts.15.down_proj")
    assert (expert.size_k, expert.size_n, expert.unpadded_k) == (128, 256, 128)
    assert "model.layers.0.mlp.gate.weight" in moe.unquantized


def test_group_lookup_of_an_unknown_prefix_names_it(tiny_models):
    with pytest.raises(CheckpointError, match="model.layers.9.mlp.up_proj"):
        manifest.read(tiny_models[LLAMA]).group("model.layers.9.mlp.up_proj")


def test_manifest_is_frozen(tiny_models):
    m = manifest.read(tiny_models[LLAMA])
    with pytest.raises(TypeError):
        m.quantized["x"] = m.group(Q_PROJ)  # type: ignore[index]
    with pytest.raises(AttributeError):
        m.architecture = "x"  # type: ignore[misc]


def _corrupt_not_exl3(d: Path):
    _edit_json(d / "config.json", lambda c: c.pop("quantization_config"))
    return "config.json", "quant_method"


def _corrupt_missing_svh(d: Path):
    _edit_tensors(d, lambda t: t.pop(f"{Q_PROJ}.svh"))
    return "model.safetensors", f"{Q_PROJ}.svh"


def _corrupt_extra_dense_weight(d: Path):
    _edit_tensors(d, lambda t: t.update({f"{Q_PROJ}.weight": torch.zeros(256, 256, dtype=torch.float16)}))
    return "model.safetensors", f"{Q_PROJ}.weight"


def _corrupt_orphan_scale(d: Path):
    _edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.trellis"))
    return "model.safetensors", "model.layers.1.mlp.up_proj.trellis"


def _corrupt_width_vs_declared_bits(d: Path):
    _edit_tensors(d, lambda t: t.update({f"{Q_PROJ}.trellis": t[f"{Q_PROJ}.trellis"][..., :48].contiguous()}))
    return "model.safetensors", f"{Q_PROJ}.trellis"


def _corrupt_bad_width(d: Path):
    _edit_tensors(d, lambda t: t.update({f"{Q_PROJ}.trellis": t[f"{Q_PROJ}.trellis"][..., :50].contiguous()}))
    return "model.safetensors", f"{Q_PROJ}.trellis"


def _corrupt_dims_not_128(d: Path):
    def edit(t):
        t[f"{Q_PROJ}.trellis"] = t[f"{Q_PROJ}.trellis"][:12].contiguous()
        t[f"{Q_PROJ}.suh"] = t[f"{Q_PROJ}.suh"][:192].contiguous()

    _edit_tensors(d, edit)
    return "model.safetensors", f"{Q_PROJ}.trellis"


def _corrupt_suh_shape(d: Path):
    _edit_tensors(d, lambda t: t.update({f"{Q_PROJ}.suh": t[f"{Q_PROJ}.suh"][:128].contiguous()}))
    return "model.safetensors", f"{Q_PROJ}.suh"


def _corrupt_marker_value(d: Path):
    _edit_tensors(d, lambda t: t.update({f"{Q_PROJ}.mul1": torch.tensor(12345, dtype=torch.int32)}))
    return "model.safetensors", f"{Q_PROJ}.mul1"


def _corrupt_two_markers(d: Path):
    _edit_tensors(d, lambda t: t.update({f"{Q_PROJ}.mcg": torch.tensor(-877912083, dtype=torch.int32)}))
    return "model.safetensors", Q_PROJ


def _corrupt_truncated(d: Path):
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    return "model.safetensors", None


def _corrupt_header_length(d: Path):
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[:200])
    return "model.safetensors", None


def _corrupt_malformed_json(d: Path):
    path = d / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[8] = ord("[")
    raw[12] = ord("}")
    path.write_bytes(bytes(raw))
    return "model.safetensors", None


def _corrupt_missing_shard(d: Path):
    shutil.move(d / "model.safetensors", d / "model-00001-of-00002.safetensors")
    names = safetensors_files.read_header(d / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {n: "model-00001-of-00002.safetensors" for n in names}}
    index["weight_map"]["lm_head.trellis"] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return "model.safetensors.index.json", "model-00002-of-00002.safetensors"


def _corrupt_declared_bits(d: Path):
    _edit_json(d / "quantization_config.json", lambda q: q["tensor_storage"][Q_PROJ].update(bits_per_weight=3))
    return "model.safetensors", f"{Q_PROJ}.trellis"


def _corrupt_head_bits(d: Path):
    _edit_json(d / "config.json", lambda c: c["quantization_config"].update(head_bits=8))
    return "model.safetensors", "lm_head.trellis"


def _corrupt_tied_without_head(d: Path):
    """A tied config without lm_head tensors: exllamav3 always writes its own head, and vLLM refused this only
    after it had started (issue 24 item 7)."""
    _edit_json(d / "config.json", lambda c: c.update(tie_word_embeddings=True))

    def drop_head(t):
        for name in [n for n in t if n.startswith("lm_head.")]:
            t.pop(name)

    _edit_tensors(d, drop_head)
    _edit_json(d / "quantization_config.json", lambda q: q["tensor_storage"].pop("lm_head", None))
    return "model.safetensors", "lm_head"


CORRUPTIONS = [
    _corrupt_tied_without_head, _corrupt_not_exl3, _corrupt_missing_svh, _corrupt_extra_dense_weight, _corrupt_orphan_scale,
    _corrupt_width_vs_declared_bits, _corrupt_bad_width, _corrupt_dims_not_128, _corrupt_suh_shape,
    _corrupt_marker_value, _corrupt_two_markers, _corrupt_truncated, _corrupt_header_length,
    _corrupt_malformed_json, _corrupt_missing_shard, _corrupt_declared_bits, _corrupt_head_bits,
]  # fmt: skip


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.removeprefix("_corrupt_"))
def test_each_corruption_is_refused_with_file_and_tensor(copy_model, corrupt):
    d = copy_model(LLAMA)
    file, tensor = corrupt(d)
    with pytest.raises(CheckpointError) as err:
        manifest.read(d)
    assert err.value.file.endswith(file)
    if tensor:
        assert tensor in str(err.value)
    assert "expected" in str(err.value) and "found" in str(err.value)


def test_mixed_bits_across_experts_of_one_projection_is_refused(copy_model):
    d = copy_model(MOE)
    expert = "model.layers.2.mlp.experts.5.up_proj"
    _edit_tensors(d, lambda t: t.update({f"{expert}.trellis": t[f"{expert}.trellis"][..., :48].contiguous()}))
    _edit_json(d / "quantization_config.json", lambda q: q["tensor_storage"][expert].update(bits_per_weight=3))
    with pytest.raises(CheckpointError, match=r"experts\.5\.up_proj.*uniform per projection"):
        manifest.read(d)


def test_sharded_checkpoint_reads_like_the_single_file(copy_model):
    d = copy_model(LLAMA)
    single = manifest.read(d)
    tensors = load_file(d / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, part in halves.items():
        save_file({n: tensors[n] for n in part}, d / shard, metadata={"format": "pt"})
    (d / "model.safetensors").unlink()
    weight_map = {n: shard for shard, part in halves.items() for n in part}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    sharded = manifest.read(d)
    assert sharded.files == tuple(sorted(halves))
    assert {p: (g.bits, g.size_k, g.size_n) for p, g in sharded.quantized.items()} == {
        p: (g.bits, g.size_k, g.size_n) for p, g in single.quantized.items()
    }


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "exl3local"
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120, cwd="/")


def test_inspect_prints_a_summary_and_json(tiny_models):
    out = _run_cli("inspect", str(tiny_models[MOE]))
    assert out.returncode == 0, out.stderr
    assert "Qwen3MoeForCausalLM" in out.stdout and "209 linears" in out.stdout
    data = json.loads(_run_cli("inspect", "--json", str(tiny_models[LLAMA_25])).stdout)
    assert data["quantized"][Q_PROJ]["bits"] == 2.5


def test_inspect_refuses_a_corrupt_checkpoint_in_one_line(copy_model):
    d = copy_model(LLAMA)
    _corrupt_marker_value(d)
    out = _run_cli("inspect", str(d))
    assert out.returncode == CheckpointError.exit_code
    assert "Traceback" not in out.stderr
    # the file is named with the directory inspect looked in
    assert out.stderr.startswith(f"exl3local: error: {d / 'model.safetensors'}: model.layers.0.self_attn.q_proj.mul1")


def test_cli_stops_quietly_when_its_reader_goes_away(tiny_models):
    exe = Path(sys.executable).parent / "exl3local"
    pipeline = f"'{exe}' inspect --json '{tiny_models[MOE]}' | head -c 10"
    out = subprocess.run(["bash", "-o", "pipefail", "-c", pipeline], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.stdout == '{\n  "path"'
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr


def test_the_summary_lists_every_linear_with_bits_codebook_and_shape(tiny_models):
    """Issue 24 item 5: `inspect DIR` printed totals only; the README promises each linear."""
    text = manifest.read(tiny_models[LLAMA]).summary()
    assert re.search(r"^  model\.layers\.0\.self_attn\.k_proj +4 +mul1 +256 x 128$", text, re.M), text
    assert re.search(r"^  lm_head +6 +mul1 +256 x 2048$", text, re.M), text
    moe = manifest.read(tiny_models[MOE])
    rows = moe.summary().splitlines()
    experts = [r for r in rows if ".experts.*.up_proj" in r]
    assert experts and all(r.rstrip().endswith("experts)") for r in experts), experts  # one row per projection
    assert len(rows) < len(moe.quantized)
