"""The engine command lines `up --dry-run` plans for Arc machines, read back by vLLM 0.32's own argument parser,
and the start-up check vLLM's GPU workers make (v1/worker/utils.py request_memory) run on the numbers the plan
holds: it passes exactly when the device has the free memory the engine needs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import types

import pytest

from arc_machines import GiB, b70s, device, environ, lunar, xpu_standin

vllm_cli = pytest.importorskip("vllm.entrypoints.launchers.cli_args", reason="needs vLLM")
from vllm.config import CacheConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402
from vllm.v1.worker.utils import request_memory  # noqa: E402

LAUNCHER = 5  # python -P -m exl3local.engine.launch serve


def dry_run(tmp_path, tree, model, python) -> dict:
    proc = subprocess.run([sys.executable, "-P", "-m", "exl3local", "up", str(model), "--dry-run", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=environ(EXL3LOCAL_SYSFS=str(tree), EXL3LOCAL_ENGINE_PYTHON=str(python),
                                      EXL3LOCAL_ENGINE_PORT="1"))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def engine_args(argv: list[str]) -> EngineArgs:
    args = vllm_cli.make_arg_parser(FlexibleArgumentParser()).parse_args(argv[LAUNCHER:])
    # `vllm serve MODEL` puts the positional into --model, as its CLI does: otherwise --model keeps vLLM's
    # default hub id, which HF_HUB_OFFLINE (the test command's) resolves from a cache a fresh machine lacks
    args.model = args.model_tag or args.model
    return EngineArgs.from_cli_args(args)


def test_vllms_start_check_passes_with_the_free_memory_the_plan_needs_and_not_below(tmp_path, xdg, tiny_models):
    ram = 32 * GiB
    total = int(ram * 0.8) - 450 * 10**6  # Level Zero's iGPU total, as the runtime stand-in reports it
    python = xpu_standin(tmp_path, [device(0, 0x64A0, total, xe_cores=8)])
    plan = dry_run(tmp_path, lunar(tmp_path / "sys", ram=ram), tiny_models["tiny-llama-exl3-4.0bpw"], python)
    args = engine_args(plan["argv"])
    assert args.kv_cache_memory_bytes == plan["budget"]["kv_budget_bytes"]
    cache = CacheConfig(gpu_memory_utilization=args.gpu_memory_utilization,
                        kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    need = plan["budget"]["engine_bytes"]
    asked = math.ceil(total * args.gpu_memory_utilization)
    assert need <= asked <= need + math.ceil(total / 10_000)  # rounded up to 1/10000 of the device, no more

    def start(free: int) -> int:
        return request_memory(types.SimpleNamespace(total_memory=total, free_memory=free, device_="xpu:0"), cache)

    assert start(asked) == asked
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        start(asked - 1)
    # what the plan replaced: vLLM's default 0.92 fails on an iGPU with that much free
    with pytest.raises(ValueError):
        request_memory(types.SimpleNamespace(total_memory=total, free_memory=asked, device_="xpu:0"),
                       CacheConfig(kv_cache_memory_bytes=args.kv_cache_memory_bytes))


@pytest.mark.parametrize(("cards", "extra"), [(2, 0), (2, 30 * GiB)])
def test_vllm_reads_the_parallel_flags_the_plan_gives_two_cards(tmp_path, xdg, tiny_models, cards, extra):
    from arc_machines import heavy_checkpoint

    model = tiny_models["tiny-llama-exl3-4.0bpw"]
    if extra:
        model = heavy_checkpoint(model, tmp_path / "big", extra)
    plan = dry_run(tmp_path, b70s(tmp_path / "sys", cards=cards), model,
                   xpu_standin(tmp_path, [device(i, 0xE223, 32 * GiB) for i in range(cards)]))
    args = engine_args(plan["argv"])
    assert (args.tensor_parallel_size, args.data_parallel_size) == ((cards, 1) if extra else (1, cards))
    assert args.gpu_memory_utilization == 0.92 and args.kv_cache_dtype == "fp8"
