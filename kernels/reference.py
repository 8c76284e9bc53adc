"""The EXL3 reference decoder: plain PyTorch, bit-exact, on CPU, CUDA and XPU alike.

This module is the spec every kernel is tested against (format spec §2-§5, §9). Layouts:

    trellis  int16 (k/16, n/16, 16*bits)   as stored; tile [tk, tn] covers W[16tk:16tk+16, 16tn:16tn+16]
    suh      fp16  (k,)                    input-side scale and sign (codebook scale folded in)
    svh      fp16  (n,)                    output-side scale and sign
    W        (k, n), y = x @ W             the transpose of nn.Linear.weight

    W = diag(suh) · Hk · Ŵ · Hn · diag(svh),  Ŵ = the decoded trellis in the rotated basis.
"""

from __future__ import annotations

import functools

import torch

from exl3local.kernels.codebook import CODEBOOKS, lut
from exl3local.kernels.hadamard import HADAMARD_BLOCK, hadamard_cols, hadamard_rows

TILE = 16  # weights per tile side; a tile holds 256 ring positions
TILE_POSITIONS = TILE * TILE
INTEGER_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
HALF_BITS = (1.5, 2.5, 3.5)  # mul1 only: even positions take KA bits, odd positions KA+1 (mask 0xAAAA)
# Tiles decoded per chunk: bounds the int64 scratch (~2 KiB per tile) to ~256 MiB on large layers.
TILES_PER_CHUNK = 1 << 17


def check_bits(bits: float, codebook: str) -> None:
    """Refuse a bit width / codebook pair that EXL3 cannot store."""
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown EXL3 codebook {codebook!r}; expected one of {CODEBOOKS}")
    if bits in HALF_BITS:
        if codebook != "mul1":
            raise ValueError(f"half-integer bits {bits} exist only with the mul1 codebook, not {codebook!r}")
    elif bits not in INTEGER_BITS:
        raise ValueError(f"EXL3 bits must be one of 1..8 or 1.5/2.5/3.5, got {bits!r}")


def words_per_tile(bits: float) -> int:
    """int16 words per 16x16 tile: 16*bits (for K = KA + 0.5 that is 16*KA + 8)."""
    return int(round(16 * bits))


def _stream_end(bits: float) -> torch.Tensor:
    """S(p) for p = 0..255: the stream bit just past position p's code."""
    p1 = torch.arange(1, TILE_POSITIONS + 1, dtype=torch.int64)
    if bits in HALF_BITS:
        ka = int(bits)
        return p1 * ka + (p1 >> 1)  # odd positions carry one extra bit
    return p1 * int(bits)


@functools.lru_cache(maxsize=32)
def _state_gather(bits: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per ring position: the two uint32 words holding its 16-bit state, and the bit offset.

    The state of position p is stream bits [S(p)-16, S(p)) modulo the ring size, read MSB-first. The
    ring is tail-biting: the first positions' states wrap around to the end of the same tile.
    """
    words32 = words_per_tile(bits) // 2
    ring_bits = 32 * words32
    start = (_stream_end(bits) - 16) % ring_bits
    first = start >> 5
    second = (first + 1) % words32
    offset = start & 31
    return first, second, offset


@functools.lru_cache(maxsize=1)
def _tile_placement() -> torch.Tensor:
    """ring position p -> row*16 + col inside a tile (the mma m16n8k16 B-fragment order, spec §4)."""
    p = torch.arange(TILE_POSITIONS, dtype=torch.int64)
    lane, j = p >> 3, p & 7
    row = 2 * (lane & 3) + (j & 1) + 8 * ((j >> 1) & 1)
    col = (lane >> 2) + 8 * (j >> 2)
    return row * TILE + col


def _check_trellis(trellis: torch.Tensor, bits: float, codebook: str) -> None:
    check_bits(bits, codebook)
    if trellis.dtype != torch.int16:
        raise ValueError(f"trellis must be int16, got {trellis.dtype}")
    if trellis.dim() != 3:
        raise ValueError(f"trellis must be 3-D (k/16, n/16, 16*bits), got shape {tuple(trellis.shape)}")
    if trellis.shape[2] != words_per_tile(bits):
        raise ValueError(
            f"trellis width {trellis.shape[2]} does not match bits={bits} "
            f"(expected {words_per_tile(bits)} int16 words per tile)"
        )


def tile_states(trellis: torch.Tensor, bits: float) -> torch.Tensor:
    """All 16-bit states of a trellis in ring order: int64 (k/16, n/16, 256)."""
    words = trellis.to(torch.int64) & 0xFFFF
    # Pairs of int16 words form little-endian uint32s; each holds 32 stream bits MSB-first.
    u32 = words[..., 0::2] | (words[..., 1::2] << 16)
    first, second, offset = (t.to(trellis.device) for t in _state_gather(bits))
    # A 48-bit window (all of the first word, top half of the next) holds any 16-bit field
    # starting at offset <= 31, and stays inside int64 without sign trouble.
    window = (u32[..., first] << 16) | (u32[..., second] >> 16)
    return (window >> (32 - offset)) & 0xFFFF


def decode_trellis(trellis: torch.Tensor, bits: float, codebook: str) -> torch.Tensor:
    """Ŵ, the decoded trellis in the rotated basis: fp16 (k, n), bit-identical to exllamav3."""
    _check_trellis(trellis, bits, codebook)
    tiles_k, tiles_n = trellis.shape[0], trellis.shape[1]
    table = lut(codebook, trellis.device)
    placement = _tile_placement().to(trellis.device)
    flat = trellis.reshape(tiles_k * tiles_n, -1)
    tiles = torch.empty(tiles_k * tiles_n, TILE_POSITIONS, dtype=torch.float16, device=trellis.device)
    for lo in range(0, flat.shape[0], TILES_PER_CHUNK):
        chunk = flat[lo : lo + TILES_PER_CHUNK]
        tiles[lo : lo + chunk.shape[0], placement] = table[tile_states(chunk, bits)]
    return (
        tiles.reshape(tiles_k, tiles_n, TILE, TILE)
        .permute(0, 2, 1, 3)
        .reshape(tiles_k * TILE, tiles_n * TILE)
    )


def _check_scales(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> tuple[int, int]:
    size_k, size_n = trellis.shape[0] * TILE, trellis.shape[1] * TILE
    if size_k % HADAMARD_BLOCK or size_n % HADAMARD_BLOCK:
        raise ValueError(f"EXL3 dims must be multiples of 128, got k={size_k}, n={size_n}")
    if tuple(suh.shape) != (size_k,):
        raise ValueError(f"suh must have shape ({size_k},) to match the trellis, got {tuple(suh.shape)}")
    if tuple(svh.shape) != (size_n,):
        raise ValueError(f"svh must have shape ({size_n},) to match the trellis, got {tuple(svh.shape)}")
    return size_k, size_n


def reconstruct(
    trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: float, codebook: str
) -> torch.Tensor:
    """W in the original basis, fp16 (k, n), rounding step by step as exllamav3's get_weight_tensor():
    Hk·Ŵ in fp32 -> fp16, ⊙suh in fp16, ·Hn in fp32 -> fp16, ⊙svh in fp16."""
    _check_trellis(trellis, bits, codebook)
    _check_scales(trellis, suh, svh)
    w_inner = decode_trellis(trellis, bits, codebook)
    left = hadamard_cols(w_inner).to(torch.float16) * suh.to(torch.float16)[:, None]
    return hadamard_rows(left).to(torch.float16) * svh.to(torch.float16)[None, :]


def linear(
    x: torch.Tensor,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    bits: float,
    codebook: str,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W (+ bias) via the Hadamard-domain form, fp32 throughout, output in x's dtype:

        y = Hblock( Hblock(x ⊙ suh) · Ŵ ) ⊙ svh + bias
    """
    _check_trellis(trellis, bits, codebook)
    size_k, size_n = _check_scales(trellis, suh, svh)
    if x.shape[-1] != size_k:
        raise ValueError(f"x has {x.shape[-1]} input features, the trellis expects {size_k}")
    if bias is not None and tuple(bias.shape) != (size_n,):
        raise ValueError(f"bias must have shape ({size_n},), got {tuple(bias.shape)}")
    lead = x.shape[:-1]
    rows = x.reshape(-1, size_k).float()
    u = hadamard_rows(rows * suh.float())
    z = u @ decode_trellis(trellis, bits, codebook).float()
    y = hadamard_rows(z) * svh.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, size_n)
