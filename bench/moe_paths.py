"""Per-path timings of the EXL3 MoE ladder on one layer of an EXL3 MoE checkpoint, in-process.

    .venv/bin/python -P bench/moe_paths.py /path/to/tiny-qwen3moe-exl3-4.0bpw [--tokens 1 2 4 64 512]

Loads the model with vLLM's own loader in this process (as the CPU worker does), then times every
path that accepts each token count on layer 0 (CPU time, best of a few calls: the shared machine is noisy, random top-k routing), and
marks the path `select_path` would choose. GROUPED_MAX_TOKENS in plugin/moe.py comes from this.
"""

from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path

import torch


def load(model: Path):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model

    torch.accelerator.empty_cache = lambda *a, **k: None  # as the CPU model runner does
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        initialize_model_parallel(1, 1)
    args = EngineArgs(model=str(model), quantization="exl3", enforce_eager=True, max_model_len=1024,
                      kv_cache_memory_bytes=64 * 2**20)  # fmt: skip
    cfg = args.create_engine_config()
    with set_current_vllm_config(cfg):
        return get_model(vllm_config=cfg)


def main() -> None:
    from exl3local.kernels import KernelPath
    from exl3local.plugin.moe import PATHS, path_refusal, select_path

    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 64, 512])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    model = load(args.model)
    layer = next(m for m in model.modules() if type(m).__name__ == "RoutedExperts")
    experts, top_k = layer.w13_trellis.shape[0], layer.top_k
    print(f"layer {layer.layer_name}: {experts} experts, top-{top_k}, threads {torch.get_num_threads()}")
    print(f"{'T':>5} " + " ".join(f"{str(p):>14}" for p in PATHS) + "   (CPU ms per layer call, best of reps; * = selected)")
    g = torch.Generator().manual_seed(0)
    for tokens in args.tokens:
        x = torch.randn(tokens, layer.hidden_size, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
        weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
        cells = []
        for path in PATHS:
            if path_refusal(path, tokens) is not None:
                cells.append(f"{'-':>14}")
                continue
            times = []
            for _ in range(args.reps):
                t0 = time.process_time()  # CPU time of all threads: less skewed by other load than wall time
                layer.quant_method.run_path(layer, KernelPath(path), x, weights, ids)
                times.append((time.process_time() - t0) * 1e3)
            mark = "*" if select_path(tokens) == path else " "
            cells.append(f"{min(times):13.1f}{mark}")
        print(f"{tokens:>5} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
