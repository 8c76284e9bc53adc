"""The EXL3 linear as a torch custom op, so vLLM's compiler and CUDA graphs hold it as one opaque node.

Eager calls (vLLM XPU, enforce_eager) go straight to the layer's bound launches: a custom op's dispatcher
costs host time per call, and eager engines are host-bound. Only while torch.compile traces does apply()
emit `torch.ops.exl3local.linear(x, key, out_features)`: the traced graph then holds no Python side effects,
no raw pointers, no host syncs, and the fake implementation gives the compiler the output's shape.

A layer is found by its key (the vLLM prefix, unique per model and stable across processes, which compile
caches need). The MoE path needs no op of its own: vLLM already runs FusedMoE behind its `moe_forward` op.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LINEARS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}


def register_linear(key: str, forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """`forward(x) -> y` serves the op for `key` (re-registering replaces: weights reloaded)."""
    _LINEARS[key] = forward


@torch.library.custom_op("exl3local::linear", mutates_args=())
def linear(x: torch.Tensor, key: str, out_features: int) -> torch.Tensor:
    """y = the EXL3 linear `key` applied to x (..., in_features) -> (..., out_features), no bias."""
    forward = _LINEARS.get(key)
    if forward is None:
        raise KeyError(f"exl3local::linear: no EXL3 layer registered as {key!r} in this process")
    return forward(x)


@linear.register_fake
def _linear_fake(x: torch.Tensor, key: str, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))
