"""`exl3local doctor`'s plugin check, run in the engine's interpreter: `python -P -m exl3local.plugin.check`.

Importing the plugin's config alone says little (vLLM may import and the plugin register, and the engine still
crash-loops on the first layer). This imports plugin.linear and plugin.moe (the vLLM interfaces they subclass),
builds one small EXL3 linear through Exl3LinearMethod (create_weights, the weight loaders, load-time kernel
choice with its self-test) and one MoE layer through the same ExpertLayer the MoE method builds, on the engine's
device, and runs both against the reference decoder. One line on stdout: MARK + JSON.
"""

from __future__ import annotations

import json
import sys
import traceback

import torch

MARK = "EXL3CHECK "
LINEAR = (256, 384, 4.0, "mul1")  # k, n (three 128-blocks: more than one output block), bits, codebook
MOE = (3, 2, 256, 256, 3.0, "3inst")  # experts, top_k, hidden, intermediate, bits, codebook
TOLERANCE = 2e-3  # relative, one projection (kernels/selftest.TOLERANCE)
MOE_TOLERANCE = 5e-3  # three projections chained, each rounding its input to fp16 on the way


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


def _rel(y: torch.Tensor, expected: torch.Tensor) -> float:
    y, expected = y.double().cpu(), expected.double().cpu()
    if not torch.isfinite(y).all():
        return float("nan")
    return ((y - expected).norm() / expected.norm()).item()


def _random(k: int, n: int, bits: float, codebook: str, seed: int, lead: tuple = ()):
    from exl3local.kernels import reference

    g = torch.Generator().manual_seed(seed)
    trellis = torch.randint(-32768, 32768, (*lead, k // 16, n // 16, reference.words_per_tile(bits)), generator=g,
                            dtype=torch.int16)
    suh = (torch.randn(*lead, k, generator=g) * 0.05).half()
    return trellis, suh, (torch.randn(*lead, n, generator=g) * 0.05).half()


def check_linear(device: torch.device) -> dict:
    from exl3local.kernels import reference
    from exl3local.manifest import MARKER_VALUES, TensorGroup
    from exl3local.plugin.config import Exl3Config
    from exl3local.plugin.linear import Exl3LinearMethod

    k, n, bits, codebook = LINEAR
    prefix = "model.layers.0.mlp.down_proj"
    tensors = tuple(f"{prefix}.{kind}" for kind in ("trellis", "suh", "svh", codebook))
    group = TensorGroup(prefix, bits, codebook, k, n, k, n, False, "<doctor>", tensors)
    method = Exl3LinearMethod(Exl3Config({"quant_method": "exl3"}), prefix, [group])
    layer = torch.nn.Module()
    with torch.device(device):
        method.create_weights(layer, k, [n], k, n, torch.float16)
    trellis, suh, svh = _random(k, n, bits, codebook, seed=1)
    marker = MARKER_VALUES[codebook]
    loaded = {"trellis": trellis, "suh": suh, "svh": svh,
              codebook: torch.tensor(marker - (1 << 32) if marker >= 1 << 31 else marker, dtype=torch.int32)}
    for name, tensor in loaded.items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor)
    method.process_weights_after_loading(layer)
    kernel = layer.exl3_kernels[0]
    out = {"kernel": type(kernel).__name__, "bits": bits, "codebook": codebook, "errors": {}}
    for rows in (1, 3, 17):  # both sides of every row crossover the kernels have
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).half()
        y = method.apply(layer, x.to(device))
        out["errors"][str(kernel.path_for(rows)) + f"@{rows}"] = _rel(y, reference.linear(x.float(), trellis, suh, svh,
                                                                                         bits, codebook))
    out["ok"] = all(err <= TOLERANCE for err in out["errors"].values())
    return out


def check_moe(device: torch.device) -> dict:
    import torch.nn.functional as F

    from exl3local.kernels import reference
    from exl3local.kernels.moe_layer import ExpertLayer, select_path
    from exl3local.plugin.moe import Projection

    experts, top_k, hidden, inter, bits, codebook = MOE
    proj = {name: Projection(name, bits, codebook, k, n, (0, k), (0, n))
            for name, k, n in (("gate", hidden, inter), ("up", hidden, inter), ("down", inter, hidden))}
    gate = _random(hidden, inter, bits, codebook, seed=2, lead=(experts,))
    up = _random(hidden, inter, bits, codebook, seed=3, lead=(experts,))
    down = _random(inter, hidden, bits, codebook, seed=4, lead=(experts,))
    w13 = torch.cat((gate[0].reshape(experts, -1), up[0].reshape(experts, -1)), 1)
    layer = ExpertLayer(w13.to(device), torch.stack((gate[1], up[1]), 1).to(device),
                        torch.stack((gate[2], up[2]), 1).to(device), down[0].to(device), down[1].to(device),
                        down[2].to(device), proj, top_k)
    out = {"kernels": sorted({type(kern).__name__ for kern in layer.kernels.values()}),
           "grouped_triton": layer.refusal is None, "bits": bits, "codebook": codebook, "errors": {}}
    if layer.refusal is not None:
        out["grouped_refusal"] = layer.refusal
    g = torch.Generator().manual_seed(5)
    for tokens in (1, 6):
        x = torch.randn(tokens, hidden, generator=g)
        ids = torch.randint(0, experts, (tokens, top_k), generator=g)
        weights = torch.rand(tokens, top_k, generator=g)
        path = select_path(tokens)
        y = layer.run(path, x.to(device), weights.to(device), ids.to(device))
        expected = torch.zeros(tokens, hidden)
        for t in range(tokens):
            for j, e in enumerate(ids[t].tolist()):
                def ref(w, v):
                    return reference.linear(v, w[0][e], w[1][e], w[2][e], bits, codebook)
                h = F.silu(ref(gate, x[t : t + 1])) * ref(up, x[t : t + 1])
                expected[t] += weights[t, j] * ref(down, h)[0]
        out["errors"][f"{path}@{tokens}"] = _rel(y, expected)
    out["ok"] = all(err <= MOE_TOLERANCE for err in out["errors"].values())
    return out


def main() -> dict:
    from exl3local.kernels import selftest
    from exl3local.plugin import version

    device = _device()
    result: dict = {"vllm": version.probe(), "device": str(device)}
    for name, check in (("linear", check_linear), ("moe", check_moe)):
        try:
            result[name] = check(device)
        except Exception as exc:  # the doctor reports it; the traceback's last frame says where
            last = traceback.extract_tb(exc.__traceback__)[-1]
            result[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc} "
                                                  f"({last.filename.rsplit('/', 1)[-1]}:{last.lineno})"}
    result["refused"] = selftest.refused_paths()
    return result


if __name__ == "__main__":
    print(MARK + json.dumps(main()), flush=True)
    sys.exit(0)
