"""EXL3 codebooks: a 16-bit trellis state -> one fp16 weight (format spec §3).

Every decoder (reference, Triton, exllamav3's CUDA) maps states through these same pure functions,
which is why decoding is bit-exact across all of them. The decoder applies no scale of its own:
all scaling lives in suh/svh.
"""

from __future__ import annotations

import functools

import torch

CODEBOOKS = ("3inst", "mcg", "mul1")

# 3INST: an LCG step, then "LOP3" reinterprets each 16-bit half as an fp16 in [0.125, 2).
INST3_MULTIPLIER = 0x05517C72  # 89226354
INST3_ADDEND = 0x03D45AA4  # 64248484
# MCG: the same without the addend. The value is also the bit pattern of the `.mcg` marker tensor.
MCG_MULTIPLIER = 0xCBAC1FED
# mul1: multiply, sum the four bytes, map the sum affinely. Also the `.mul1` marker's bit pattern.
MUL1_MULTIPLIER = 0x83DCD12D
# LOP3 (immLut 0x6A = (a & b) ^ c): keeps sign and low 12 bits of each half, forces exponent 0b011xx.
LOP3_MASK = 0x8FFF8FFF
LOP3_XOR = 0x3B603B60
# mul1's affine map: fp16(1024 + bsum) * k_inv + k_bias in one RNE rounding. In fp32 every term is a
# multiple of 2^-18 below 2^22, so the fp32 form is exact and a single cast to fp16 rounds like __hfma.
MUL1_K_INV = 887.0 / 131072.0  # fp16 0x1EEE
MUL1_K_BIAS = -1329.0 / 128.0  # fp16 0xC931

U32 = 0xFFFFFFFF


def _fp16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Reinterpret the low 16 bits of an int64 tensor as fp16."""
    signed = (bits & 0xFFFF) - ((bits & 0x8000) << 1)  # uint16 -> int16 value range
    return signed.to(torch.int16).view(torch.float16)


def _decode_lop3(x: torch.Tensor) -> torch.Tensor:
    y = (x & LOP3_MASK) ^ LOP3_XOR
    # The two halves' exponents differ by at most 3, so their fp32 sum is exact; one cast to fp16
    # then rounds exactly as the fp16 add (__hadd) does.
    lo = _fp16_from_bits(y).float()
    hi = _fp16_from_bits(y >> 16).float()
    return (lo + hi).to(torch.float16)


def decode_states(states: torch.Tensor, codebook: str) -> torch.Tensor:
    """Map integer states (any int dtype, values 0..65535) to fp16 weights, elementwise."""
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown EXL3 codebook {codebook!r}; expected one of {CODEBOOKS}")
    s = states.to(torch.int64) & 0xFFFF
    if codebook == "3inst":
        return _decode_lop3((s * INST3_MULTIPLIER + INST3_ADDEND) & U32)
    if codebook == "mcg":
        return _decode_lop3((s * MCG_MULTIPLIER) & U32)
    x = (s * MUL1_MULTIPLIER) & U32
    byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
    return ((1024 + byte_sum).float() * MUL1_K_INV + MUL1_K_BIAS).to(torch.float16)


@functools.lru_cache(maxsize=16)
def lut(codebook: str, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """The whole codebook as a 65536-entry fp16 table (128 KiB), cached per device."""
    return decode_states(torch.arange(65536, device=device), codebook)
