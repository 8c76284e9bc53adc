"""A study, not served: mul1 with int8 activations at M <= 2 rows as ONE int8 `tl.dot` per K step (issue #21,
session 19; docs/dev/notes/issue-21.md "Session 19: int8-activation M <= 2 study").

exllamav3's default for mul1 at m <= 2 is an int8-activation dp4a GEMV (spec §5): per k-slice q = max|u|/127,
v = RNE(u/q) clamped to ±127, and z = Σ_slices q·(k_inv·Σ v·bsum + (1024·k_inv + k_bias)·Σ v) with the unrounded
affine mul1 value. Without dp4a (no inline PTX: Intel's backend compiles every kernel) the byte sum goes through the
matrix unit instead. With p = state·0x83DCD12D, the bytes of p ^ 0x80808080 read as int8 are byte − 128, so
Σ_j signed_j = bsum − 512, and

    Σ_k v_k·bsum_k = Σ_k Σ_j v_k·signed_{k,j} + 512·Σ_k v_k,

an int8 dot of B' = the 4 bytes of each p as 4 consecutive K entries (K' = 4K) with A' = v repeated 4x along K',
exact in int32. Per slice z = q·(k_inv·D + (1536·k_inv + k_bias)·Σ v), 1536·k_inv + k_bias = 3/256 exactly: the
same quantity as exllamav3's, only the fp32 combination differs (below fp32 rounding).

The point of the study is the decode's cost: whether the compiler puts the 4 bytes of one 32-bit p straight into the
int8 matrix operand's register (an int8 mma B fragment and Xe2's DPAS int8 B operand both hold 4 consecutive K bytes
per 32-bit register), leaving state extraction, one multiply and one xor per weight. bench/int8_study.py counts it:
on sm_90 (Triton 3.9) it does (6.7 instructions per weight against the exact kernel's 10.9); Intel's backend (3.3)
compiles it to int8 DPAS but stages both operands through shared local memory, B' at 4 bytes per weight.

Layouts: the trellis as triton_decode reads it, 4 and 8 bits only (G = 1: a lane's 8 positions sit in whole words;
the ring positions of a lane are an mma B fragment, triton_decode.fragment_operand). The activations arrive as
A' int8 [M, 4K] already in the operand's K' order (activation_operand), so the kernel loads them contiguously and
never permutes them, and fs = q·k_inv per (row, slice) fp32. A slice is SLICE_STEPS K steps of 16·KT inputs; the int32
dot result is scaled once per slice. Output columns are in natural order; the split partials are summed and the
Hadamard/svh applied by the caller (torch here: the study is the K loop).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exl3local.kernels.triton_decode import fragment_cols, rate_constants, ring_state, ring_tiles, words

K_INV = 887 / 131072  # fp16 0x1EEE, exact
K_BIAS = -1329 / 128  # fp16 0xC931, exact
SIGNED_OFFSET = 1536 * K_INV + K_BIAS  # 3/256: 1024 from the fp16 bias plus 512 from the flipped top bits
# Per program 16·BNT columns over 4 warps (each warp's B fragments: fragment_operand's layout), KT tile rows per K step.
# sm_90 (Triton 3.9, bench/int8_study.py), K loop: BNT 8 / KT 2 80 registers, 6.4 instructions per weight; BNT 16 / KT 1
# 112, 5.8; BNT 8 / KT 1 62, 7.2. The default keeps registers nearer the served exact kernel's 56.
BLOCK_N_TILES = 8
STEP_TILE_ROWS = 2
# k' per lane of the int8 B operand (KW): 4 with Triton 3.9 (its mma v2 int8 operand; the other order costs 32 SHFL and
# 64 SEL per step, 9.4 against 6.4 instructions per weight: bench/int8_study.py); 8 for Triton before 3.8 is a guess by
# analogy with triton_decode.FRAGMENT_KWIDTH (its fp16 operand is twice as wide there): the H200's 3.6 can tell
# (bench/int8_study.py prints both). Sums agree (tests).
KWIDTH = 8 if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 8) else 4
WARPS = 4
# exllamav3's slice at k = 512 on an H200 (spec §5: at least 256 inputs); finer slices only lower the error.
SLICE = 256


@triton.jit
def _hashed(row_base, tile_off, s, j: tl.constexpr, KA: tl.constexpr, HALF: tl.constexpr, W32: tl.constexpr,
            KT: tl.constexpr, BNT: tl.constexpr):
    """p ^ 0x80808080 (uint32) of positions j and j + 4 of every lane: [KT, BNT, 32, j2]."""
    WPS: tl.constexpr = W32 // 32
    a = ring_state(row_base, tile_off, s, None, 0, j, KA, HALF, WPS, W32, KT, BNT)
    b = ring_state(row_base, tile_off, s, None, 0, j + 4, KA, HALF, WPS, W32, KT, BNT)
    return (tl.join(a, b) * 0x83DCD12D) ^ 0x80808080


@triton.jit
def _byte(p, i: tl.constexpr):
    return (p >> (8 * i)).to(tl.int8)


@triton.jit
def signed_operand(row_base, tile_off, s, KT: tl.constexpr, BNT: tl.constexpr, KA: tl.constexpr, HALF: tl.constexpr,
                   W32: tl.constexpr, KW: tl.constexpr):
    """B' int8 [64·KT, 16·BNT] of KT×BNT tiles: row 4·r' + i is signed byte i of position row r' (r' in K' order: see
    activation_operand), columns in fragment order (fragment_cols)."""
    # [KT, 8, 32, j2, j1, j0] as triton_decode._ring_positions joins them
    p = tl.join(tl.join(_hashed(row_base, tile_off, s, 0, KA, HALF, W32, KT, BNT),
                        _hashed(row_base, tile_off, s, 2, KA, HALF, W32, KT, BNT)),
                tl.join(_hashed(row_base, tile_off, s, 1, KA, HALF, W32, KT, BNT),
                        _hashed(row_base, tile_off, s, 3, KA, HALF, W32, KT, BNT)))
    x = tl.join(tl.join(_byte(p, 0), _byte(p, 2)), tl.join(_byte(p, 1), _byte(p, 3)))
    # [KT, tile>>2, tile&3, t>>2, t&3, j2, j1, j0, i1, i0] -> [KT, (j1, j0, t&3) or (j1, t&3, j0), i1, i0 | tile>>2, j2,
    # tile&3, t>>2]: a lane's k' within a 32-wide k block are 4·(t&3) + byte and 16 + 4·(t&3) + byte (the int8 mma B
    # fragment) when the operand holds 4 consecutive k' per lane (KW 4), 8·(t&3) + 4·j0 + byte when it holds 8 (KW 8)
    x = tl.reshape(x, (KT, BNT // 4, 4, 8, 4, 2, 2, 2, 2, 2))
    if KW == 4:
        x = tl.permute(x, (0, 6, 7, 4, 8, 9, 1, 5, 2, 3))
    else:
        x = tl.permute(x, (0, 6, 4, 7, 8, 9, 1, 5, 2, 3))
    return tl.reshape(x, (64 * KT, 16 * BNT))


# w_ptr unaligned to the compiler: with a 16-byte aligned w_ptr (what a launch proves) the word loads vectorize 4 lanes
# per thread, the B' operand no longer sits in the mma fragment's registers and goes through shared memory (sm_90, KT 2:
# 6.84 against 6.41 instructions per weight; bench/int8_study.py --aligned).
@triton.jit(do_not_specialize=["M"], do_not_specialize_on_alignment=["w_ptr"])
def mul1_int8_kernel(a_ptr, fs_ptr, w_ptr, z_ptr, M, size_k, tiles_n, slices, slices_per_split, stride_zs,
                     KA: tl.constexpr, HALF: tl.constexpr, W32: tl.constexpr, KT: tl.constexpr, BNT: tl.constexpr,
                     SLICE_STEPS: tl.constexpr, BM: tl.constexpr, KW: tl.constexpr):
    """z partial [split, M, 16·BNT columns of block pid 0] fp32 = Σ over the split's slices of fs · (A' · B')."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    tile_off, s = ring_tiles(pid_n * BNT, tiles_n, KT, BNT, W32, 1)
    rm = tl.arange(0, BM)
    mask_m = rm < M
    slice0 = pid_s * slices_per_split
    tk0 = slice0 * SLICE_STEPS * KT
    row_base = w_ptr + tk0.to(tl.int64) * tiles_n * W32
    kk = tl.arange(0, 64 * KT)
    a_ptrs = a_ptr + tk0 * 64 + kk
    acc = tl.zeros((BM, 16 * BNT), dtype=tl.float32)
    for sl in range(slice0, tl.minimum(slice0 + slices_per_split, slices)):
        exact = tl.zeros((BM, 16 * BNT), dtype=tl.int32)
        for _ in range(SLICE_STEPS):
            b = signed_operand(row_base, tile_off, s, KT, BNT, KA, HALF, W32, KW)
            # the two rows as vectors and the 16-row tile built in registers: a [BM, 64·KT] load masked by row
            # was byte loads and byte stores to shared memory (sm_90, KT 1: 8.6 against 7.2 instructions per weight)
            a0 = tl.load(a_ptrs)
            a1 = tl.load(a_ptrs + 4 * size_k, mask=(kk * 0 + M) > 1, other=0)  # a tensor mask: the interpreter's too
            a = tl.where(rm[:, None] == 0, a0[None, :], tl.where(rm[:, None] == 1, a1[None, :], 0)).to(tl.int8)
            exact = tl.dot(a, b, exact)
            row_base += KT * tiles_n * W32
            a_ptrs += 64 * KT
        fs = tl.load(fs_ptr + rm * slices + sl, mask=mask_m, other=0.0)
        acc += exact.to(tl.float32) * fs[:, None]
    cols = pid_n * (16 * BNT) + fragment_cols(tl.arange(0, 16 * BNT))
    tl.store(z_ptr + pid_s * stride_zs + rm[:, None] * (tiles_n * 16) + cols[None, :], acc, mask=mask_m[:, None])


# ---- Host side: activation quantization, operand order, launch, emulation ----------------------------------


def quantize(u: torch.Tensor, slice_size: int = SLICE) -> tuple[torch.Tensor, torch.Tensor]:
    """(v int8 [M, K], q fp32 [M, K/slice]): per slice q = max|u|/127 (fp32), v = RNE(u·(1/q)) clamped to ±127, as
    exllamav3's int8 GEMV (spec §5); an all-zero slice gets q = 0 and v = 0 (1/q would be inf)."""
    rows, size_k = u.shape
    x = u.float().reshape(rows, size_k // slice_size, slice_size)
    q = x.abs().amax(-1) / 127
    inv = torch.where(q > 0, 1 / q, torch.zeros_like(q))
    v = torch.round(x * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return v.reshape(rows, size_k), q


def operand_rows(size_k: int, kwidth: int = KWIDTH) -> torch.Tensor:
    """Natural k of each of the 4K operand columns (int64 [4K]): per tile row the K' axes of signed_operand
    ((j1, j0, t&3) or (j1, t&3, j0), then the byte), position row 8·j1 + 2(t&3) + j0 (triton_decode's ring placement),
    each k 4 times."""
    if kwidth == 4:
        j1, j0, a = torch.meshgrid(torch.arange(2), torch.arange(2), torch.arange(4), indexing="ij")
    else:
        j1, a, j0 = torch.meshgrid(torch.arange(2), torch.arange(4), torch.arange(2), indexing="ij")
    row = (8 * j1 + 2 * a + j0).reshape(16, 1).expand(16, 4).reshape(64)
    tiles = torch.arange(size_k // 16).reshape(-1, 1) * 16
    return (tiles + row.reshape(1, 64)).reshape(-1)


def activation_operand(v: torch.Tensor, kwidth: int = KWIDTH) -> torch.Tensor:
    """A' int8 [M, 4K]: v in the kernel's K' order, each value 4 times (one per byte of p)."""
    return v[:, operand_rows(v.shape[1], kwidth).to(v.device)].contiguous()


def mul1_int8_partials(a_op: torch.Tensor, fs: torch.Tensor, trellis: torch.Tensor, bits: float, z: torch.Tensor,
                       slice_size: int = SLICE, kt: int = STEP_TILE_ROWS, bnt: int = BLOCK_N_TILES,
                       kwidth: int = KWIDTH) -> None:
    """The kernel alone: z [splits, M, n] fp32 = each split's Σ fs · (A' · B'), from A' (activation_operand) and fs
    [M, K/slice] (fp32); what a timing run measures."""
    splits, rows, size_n = z.shape
    size_k, tiles_n = trellis.shape[0] * 16, trellis.shape[1]
    rate = rate_constants(bits, "mul1")
    if rate["G"] != 1 or rows > 2 or slice_size % (16 * kt) or tiles_n % bnt:
        raise ValueError(f"the int8 study serves 4 and 8 bits at <= 2 rows, slices of whole steps (bits {bits})")
    slices = size_k // slice_size
    mul1_int8_kernel[(tiles_n // bnt, splits)](
        a_op, fs, words(trellis), z, rows, size_k, tiles_n, slices, -(-slices // splits), z.stride(0),
        KA=rate["KA"], HALF=rate["HALF"], W32=rate["W32"], KT=kt, BNT=bnt, SLICE_STEPS=slice_size // (16 * kt), BM=16,
        KW=kwidth, num_warps=WARPS,
    )


def mul1_int8_z(u: torch.Tensor, trellis: torch.Tensor, bits: float, slice_size: int = SLICE,
                kt: int = STEP_TILE_ROWS, bnt: int = BLOCK_N_TILES, splits: int = 1,
                scale: torch.Tensor | None = None, kwidth: int = KWIDTH) -> torch.Tensor:
    """z fp32 [M, n] = u_q · Ŵ_affine (before the output Hadamard) through the Triton kernel. scale: fs instead of
    q·k_inv (the tests pass ones to read the exact integer sums)."""
    rows, size_k = u.shape
    v, q = quantize(u, slice_size)
    fs = (q * K_INV if scale is None else scale).float().contiguous()
    z = torch.empty(splits, rows, trellis.shape[1] * 16, dtype=torch.float32, device=u.device)
    mul1_int8_partials(activation_operand(v, kwidth), fs, trellis, bits, z, slice_size, kt, bnt, kwidth)
    z = z.sum(0)
    if scale is None:  # the bytes' offset: q·(3/256)·Σ v per slice, the same for every column
        z += (q * (SIGNED_OFFSET * v.float().reshape(rows, size_k // slice_size, -1).sum(-1))).sum(-1, keepdim=True)
    return z


def byte_sums(w_hat: torch.Tensor) -> torch.Tensor:
    """bsum int64 [K, n] read back from mul1's decoded Ŵ (fp16): one fp16 step of ŵ is <= 2^-8 where the byte sums
    are k_inv = 0.0068 apart, so rounding (ŵ - k_bias)/k_inv recovers them (test_triton_int8 checks it)."""
    return torch.round((w_hat.double() - K_BIAS) / K_INV).to(torch.int64) - 1024


def emulate_z(u: torch.Tensor, w_hat: torch.Tensor, slice_size: int = SLICE) -> torch.Tensor:
    """fp64 z of exllamav3's int8 numerics in its own form, Σ_s q·(k_inv·Σ v·bsum + (1024·k_inv + k_bias)·Σ v), from
    the reference decoder's Ŵ (fp16 [K, n]): independent of the kernel's hashing and operand order."""
    v, q = quantize(u, slice_size)
    rows, size_k = v.shape
    vs = v.to(torch.int64).reshape(rows, size_k // slice_size, slice_size)
    s1 = torch.einsum("msk,skn->msn", vs, byte_sums(w_hat).reshape(size_k // slice_size, slice_size, -1))
    s0 = vs.sum(-1, keepdim=True)
    return (q.double()[..., None] * (K_INV * s1.double() + (1024 * K_INV + K_BIAS) * s0.double())).sum(1)
