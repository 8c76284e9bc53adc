"""The 128-point Hadamard transform that EXL3 applies blockwise on both sides of a weight (spec §5).

H128 is the natural-order (Sylvester) Hadamard matrix, H[i][j] = (-1)^popcount(i & j), scaled by
1/sqrt(128). It is symmetric and orthonormal, so it is its own inverse. The sequency-ordered (Walsh)
matrix is a different matrix and reconstructs wrongly.
"""

from __future__ import annotations

import functools

import torch

HADAMARD_BLOCK = 128
# exllamav3 scales with this fp32 constant; keeping it identical keeps our fp32 paths comparable.
HADAMARD_SCALE = 0.088388347648


@functools.lru_cache(maxsize=8)
def hadamard_128(device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """H128 in fp32, entries ±1/sqrt(128)."""
    idx = torch.arange(HADAMARD_BLOCK, device=device)
    parity = torch.zeros(HADAMARD_BLOCK, HADAMARD_BLOCK, dtype=torch.int64, device=device)
    anded = idx[:, None] & idx[None, :]
    for bit in range(7):  # popcount parity of i & j over the 7 index bits
        parity ^= (anded >> bit) & 1
    return (1 - 2 * parity).to(torch.float32) * HADAMARD_SCALE


def hadamard_rows(v: torch.Tensor) -> torch.Tensor:
    """Apply H128 to each consecutive 128-element block of the last dimension (fp32 result)."""
    size = v.shape[-1]
    if size % HADAMARD_BLOCK:
        raise ValueError(f"Hadamard blocks need a last dimension divisible by 128, got {size}")
    h = hadamard_128(v.device)
    # One 2-D matmul over all blocks: bit-identical to the batched [..., blocks, 128] @ H form, which ran ~5-15x
    # slower on CPU.
    return (v.float().reshape(-1, HADAMARD_BLOCK) @ h).reshape(v.shape)


def hadamard_cols(w: torch.Tensor) -> torch.Tensor:
    """Apply H128 from the left to each 128-row block of a (k, n) matrix: blockdiag(H)·W (fp32)."""
    return hadamard_rows(w.float().t()).t()
