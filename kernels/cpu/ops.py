"""The CPU EXL3 library through ctypes: loading (building on first use if needed) and the two paths.

    lin = CpuLinear(trellis, suh, svh, bits, codebook)   # once per layer part
    y = lin(x2d)                                          # (m, k) -> (m, n) fp32; path_for(m) says which path

    layer = CpuFusedLinear([lin_q, lin_k, lin_v], [n_q, n_k, n_v], in_features)   # a fused vLLM layer
    y = layer(x)                                          # (..., in_features) -> (..., Σ n), one library call

GEMV (m <= gemv_max_rows): one pass over the trellis, Ŵ decoded in registers, both Hadamard transforms in
the library; opt-in (EXL3LOCAL_CPU_INT8, mul1 only) with int8 activations at one row, not exact (int8_active).
GEMM (more rows): bf16 activations on AMX where the CPU has it (amx_active: exact, W' in three bf16 planes), else in
fp32: the library's own GEMM with Ŵ decoded into its B panels (own_gemm_serves: the avx512 tier, not on Intel CPUs),
or Ŵ decoded once per strip of columns and multiplied by torch's BLAS.
Both use torch's intra-op thread count (the engine's threads) and, since the library links the same
OpenMP runtime torch loaded (libgomp.so.1), the same worker threads.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from exl3local import env
from exl3local.kernels.codebook import CODEBOOKS, lut
from exl3local.kernels.cpu import build, heap

# Rows up to which the one-pass GEMV serves where the GEMM path runs on AMX (its u split wins from 9-12 rows: Emerald
# Rapids, session 17).
GEMV_MAX_ROWS = 8
# The same on the portable tier (the codebook as a table, no SIMD): its GEMV beat decode-strip + BLAS 1.15-1.74x at
# 1-2 rows, 0.93-1.37x at 3, and lost from 4 (0.75-0.82x; 0.43-0.53x at 8) on Zen 4 at 1 thread (session 17).
GEMV_MAX_ROWS_PORTABLE = 3
# The same on the AVX-512 and AVX2 tiers without AMX where the GEMM path is decode-strip + torch's BLAS (the AVX2 tiers;
# the avx512 tier on Intel CPUs, own_gemm_serves): their GEMV (8 rows per pass, each group's accumulators in
# registers) beat it up to 24-28 rows on Zen 4 (session 16) and the avx2vnni tier's up to 24-32 on Emerald Rapids
# (1-16 threads, session 17). MoE experts with as many rows run as units.
GEMV_MAX_ROWS_SIMD = 24
# The same before the library's own GEMM (own_gemm_serves): on Zen 4 its time over the GEMV's was 1.12-1.20 at 5 rows,
# 0.89-1.04 at 6, 0.62-0.85 at 7, at 1 and 2 threads (session 19: its panel decode 3x cheaper; 15 rows in session 18).
GEMV_MAX_ROWS_OWN_GEMM = 5
# Rows up to which an int8 layer's GEMV takes int8 activations: its loop for more rows keeps the accumulators in memory
# (as the exact loop did before session 16) and took 1.2-2.8x the exact GEMV's time at 4-8 rows (Emerald Rapids, 1-16
# threads; slower at 2 rows on Zen 4 too), so from 2 rows an int8 layer runs the exact GEMV, up to gemv_max_rows.
INT8_MAX_ROWS = 1
# fp32 elements of one decoded strip (8 MiB): large enough for an efficient GEMM, small beside the weights.
STRIP_ELEMENTS = 2 << 20
# Rows per pass of the GEMM path (a chunked prefill sends up to max_num_batched_tokens): each strip is decoded once
# per pass, and the workspace stays bounded (u: GEMM_ROWS x k fp32).
GEMM_ROWS = 512
# bf16 planes of W' = diag(suh)·H·Ŵ in the AMX GEMM (exl3_cpu_amx.h): three hold W' exactly, so with bf16 x every
# product is exact and AMX sums in fp32 (two would round W' to 16 significand bits: not exact).
AMX_PLANES = 3
# Rows up to which the AMX GEMM takes the other exact split (u = H(x ⊙ suh) in three bf16 planes, Ŵ in two): its pack
# (no Hadamard, one split) costs ~0.6 of the W' pack, which costs as much at 9 rows as at 512, and its six passes
# cost little at few rows; above ~32-48 rows the W' form's three passes win (docs/PERF.md, CPU: per row count).
AMX_U_MAX_ROWS = 32

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}
_local = threading.local()  # the GEMM path's fp32 workspace, per calling thread
_workspaces: list[dict] = []  # every thread's


def _workspace(name: str, numel: int) -> torch.Tensor:
    """This thread's fp32 buffer `name` with at least numel elements (grown within a forward, never shrunk: a
    bounded, reused workspace instead of per-call allocations; dropped when the forward ends, _drop_workspaces)."""
    buffers = _local.__dict__.get("buffers")
    if buffers is None:
        buffers = _local.buffers = {}
        with _lock:
            _workspaces.append(buffers)
    buf = buffers.get(name)
    if buf is None or buf.numel() < numel:
        buf = buffers[name] = torch.empty(numel, dtype=torch.float32)
    return buf[:numel]


def _drop_workspaces() -> None:
    """Every thread's GEMM workspace (21 MiB at hidden 2048 / intermediate 5632), released when a forward that used it
    ends (heap.trim_after_forward): an idle engine keeps none of it, and the next prefill maps it again once."""
    for buffers in _workspaces:
        buffers.clear()

_P = ctypes.c_void_p
_I = ctypes.c_int
# The own GEMM's element types (exl3_cpu_gemm.h, Element): it reads x and writes the output in these directly.
ELEMENT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_SIGNATURES = {
    "exl3_cpu_tier": ((), _I),
    "exl3_cpu_gemv": ((_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I), None),
    "exl3_cpu_gemv_parts": ((_I, _P, _I, _P, _P, _I, _P, _P, _P, _P, _P, _P, _P, _I, _I), None),
    "exl3_cpu_moe": ((_P, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P, _P, _P, _P, _I), None),
    "exl3_cpu_moe_grouped": ((_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _I, _I, _P, _P, _P, _P, _I), None),
    "exl3_cpu_decode": ((_P, _I, _I, _I, _I, _P, _I, _I, _P, _I), None),
    "exl3_cpu_output_transform": ((_P, _P, _P, _I, _I, _I), None),
    "exl3_cpu_input_transform": ((_P, _P, _P, _I, _I, _I), None),
    "exl3_cpu_gemm_f32": ((_P, _I, _I, _I, _I, _P, _I, _P, _P, _P, _P, _I, _I, _P, _I, _I), None),
    "exl3_cpu_amx": ((), _I),
    "exl3_cpu_fp16": ((_I,), _I),
    "exl3_cpu_gemm_amx": ((_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I), None),
    "exl3_cpu_gemm_amx_u": ((_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _I, _I, _I), None),
}


def library(tier: str | None = None) -> ctypes.CDLL:
    """The loaded library of `tier` (default: build.build_chosen's), built first if missing.
    Raises build.BuildError saying why it cannot be had."""
    with _lock:
        lib = _loaded.get(tier)
        if lib is None:
            path = build.build(tier) if tier else build.build_chosen()[1]
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as exc:
                raise build.BuildError(f"{path} does not load: {exc}") from exc
            for name, (args, res) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, res
            _loaded[tier] = lib
    return lib


@functools.cache
def refusal() -> str | None:
    """Why the CPU kernel cannot run in this process (cached), or None."""
    try:
        library()
    except build.BuildError as exc:
        return str(exc)
    return None


def int8_active(codebook: str, lib: ctypes.CDLL | None = None, requested: bool | None = None) -> bool:
    """Whether one-row calls (INT8_MAX_ROWS) of a `codebook` layer run with int8 activations: asked for
    (`requested`, default EXL3LOCAL_CPU_INT8), a mul1 layer (its codebook is a byte sum: one vpdpbusd per 16
    weights) and the AVX-512 tier. Not exact (activations rounded to int8 per row, Ŵ's fp16 rounding skipped), so
    an opt-in; the GEMM path (prefill) stays exact."""
    if requested is None:
        requested = env.CPU_INT8.get_bool()
    return bool(requested) and codebook == "mul1" and (lib or library()).exl3_cpu_tier() == 512


@functools.cache
def int8_serves(int8: bool, rows: int) -> bool:
    """Whether a call of `rows` rows on a layer with int8 on (int8_active) takes int8 activations: one row only."""
    return int8 and rows <= INT8_MAX_ROWS


def amx_active(lib: ctypes.CDLL) -> bool:
    """Whether the GEMM path runs bf16 activations on AMX: the avx512 library, a CPU with AMX-BF16 and AVX512-BF16,
    and the OS granting AMX state. Exact like the fp32 path (AMX_PLANES); elsewhere the GEMM path is fp32 BLAS."""
    flags = build.cpu_flags()
    return (lib.exl3_cpu_tier() == 512 and "amx_bf16" in flags and "avx512_bf16" in flags
            and bool(lib.exl3_cpu_amx()))


def own_gemm_serves(lib: ctypes.CDLL) -> bool:
    """Whether the fp32 GEMM path runs the library's own GEMM (exl3_cpu_gemm.h: Ŵ decoded into its B panels) rather
    than decode-strip + torch's BLAS: the avx512 tier, on a CPU that is not Intel's. torch's BLAS is MKL, which ran this
    product at 72-82 % of Zen 4's fp32 peak, where the own GEMM took 0.77-0.91x the path's time at 32-512 rows (1
    thread); on Emerald Rapids MKL beat it at 1 thread (it took 1.07-1.33x MKL's time; docs/PERF.md, CPU, session 18)."""
    return lib.exl3_cpu_tier() == 512 and build.cpu_vendor() != "GenuineIntel"


def gemv_max_rows(lib: ctypes.CDLL) -> int:
    """Rows up to which a call on `lib` runs the one-pass GEMV: where it beats the GEMM path that serves past it
    (GEMV_MAX_ROWS with AMX, _PORTABLE, _OWN_GEMM, _SIMD)."""
    if lib.exl3_cpu_tier() == 0:
        return GEMV_MAX_ROWS_PORTABLE
    if amx_active(lib):
        return GEMV_MAX_ROWS
    return GEMV_MAX_ROWS_OWN_GEMM if own_gemm_serves(lib) else GEMV_MAX_ROWS_SIMD


def _bits2(bits: float) -> int:
    return int(round(2 * bits))


def bind_operands(op, lib: ctypes.CDLL, trellis: torch.Tensor, tiles_k: int, tiles_n: int, suh: torch.Tensor,
                   svh: torch.Tensor, bits: float, codebook: str) -> None:
    """The library calls' operands, set on `op` (a linear or an expert stack: they differ in tile dims only)."""
    heap.release_large_frees()
    op.lib, op.trellis = lib, trellis
    op.tiles_k, op.tiles_n = tiles_k, tiles_n
    op.size_k, op.size_n = 16 * tiles_k, 16 * tiles_n
    op.bits, op.codebook_name, op.bits2 = bits, codebook, _bits2(bits)
    op.codebook = CODEBOOKS.index(codebook)
    op.suh = suh.float().contiguous()
    op.svh = svh.float().contiguous()
    # The portable tiers decode through the codebook table (exact: every entry is an fp16 value).
    op.lut = lut(codebook).float() if lib.exl3_cpu_tier() == 0 else None
    op.lut_ptr = op.lut.data_ptr() if op.lut is not None else None


class CpuLinear:
    """One EXL3 projection bound to the library: trellis (k/16, n/16, w) int16, suh (k,), svh (n,).
    int8: int8 activations in the GEMV path where int8_active allows (None: as EXL3LOCAL_CPU_INT8 says)."""

    def __init__(self, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: float, codebook: str,
                 tier: str | None = None, int8: bool | None = None) -> None:
        if not trellis.is_contiguous():
            raise ValueError("the CPU kernel reads the trellis as stored: it must be contiguous")
        bind_operands(self, library(tier), trellis, trellis.shape[0], trellis.shape[1], suh, svh, bits, codebook)
        self.int8 = int8_active(codebook, self.lib, int8)
        self.amx = amx_active(self.lib)
        self.gemv_rows = gemv_max_rows(self.lib)
        self.own_gemm = own_gemm_serves(self.lib)  # the fp32 GEMM path's form

    @staticmethod
    def amx_rows(dtype: torch.dtype, rows: int) -> bool:
        """Whether a GEMM of `rows` rows in `dtype` runs on AMX (where amx_active): bf16 rows always (the W' planes
        take x as it is), fp32 and fp16 rows up to AMX_U_MAX_ROWS (the u split computes u in fp32 from any x; fp32
        serves the MoE path's busier experts). fp32/fp16 rows past that keep the fp32 BLAS path: the W' planes need
        x exact in one bf16 plane."""
        return dtype == torch.bfloat16 or (dtype in (torch.float32, torch.float16) and rows <= AMX_U_MAX_ROWS)

    def path_for(self, rows: int) -> str:
        if rows > self.gemv_rows:
            return "gemm"
        return "gemv_int8" if int8_serves(self.int8, rows) else "gemv"

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (m, k) -> y (m, n) in out_dtype (computed in fp32, + bias, then cast)."""
        m = x.shape[0]
        threads = torch.get_num_threads()
        if m > self.gemv_rows:
            heap.trim_after_forward(_drop_workspaces)
            return self._gemm(x, out_dtype, bias, threads)
        x = x.float().contiguous() if x.dtype != torch.float32 or not x.is_contiguous() else x
        y = torch.empty(m, self.size_n, dtype=torch.float32)
        if m:
            u = torch.empty(m, self.size_k, dtype=torch.float32)
            self.lib.exl3_cpu_gemv(self.trellis.data_ptr(), self.tiles_k, self.tiles_n, self.bits2, self.codebook,
                                   self.lut_ptr, x.data_ptr(), self.suh.data_ptr(), self.svh.data_ptr(), u.data_ptr(),
                                   y.data_ptr(), m, threads, int(int8_serves(self.int8, m)))
        if bias is not None:
            y += bias.float()
        return y if out_dtype == torch.float32 else y.to(out_dtype)

    def _gemm(self, x: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None, threads: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """Up to GEMM_ROWS rows per pass: the library's own GEMM (own_gemm: x in, out written, u packed in the workspace)
        or u = H(x ⊙ suh), then per strip of columns Ŵ decoded once, a BLAS matmul, the output transform and the cast.
        fp32 intermediates live in this thread's workspace (no large freed buffers for the heap to keep). out: (m, n)
        in out_dtype with contiguous rows (a fused layer's column slice: the own GEMM writes it in place)."""
        if self.amx and self.amx_rows(x.dtype, x.shape[0]):
            y = self._gemm_amx(x, out_dtype, bias, threads)
            return y if out is None else out.copy_(y)
        k, n = self.size_k, self.size_n
        out = torch.empty(x.shape[0], n, dtype=out_dtype) if out is None else out
        bias = bias.float().contiguous() if bias is not None else None
        if self.own_gemm and x.dtype in ELEMENT_CODES and out.dtype in ELEMENT_CODES and out.stride(1) == 1:
            # x read as it is (cast, input transform, packing: one pass); output transform, bias and cast into out.
            x = x.contiguous()
            for r0 in range(0, x.shape[0], GEMM_ROWS):
                rows = min(GEMM_ROWS, x.shape[0] - r0)
                packed = _workspace("a", (rows + 15) * k)  # u in blocks of up to 16 rows, k-major
                self.lib.exl3_cpu_gemm_f32(self.trellis.data_ptr(), self.tiles_k, self.tiles_n, self.bits2,
                                           self.codebook, x[r0].data_ptr(), ELEMENT_CODES[x.dtype],
                                           self.suh.data_ptr(), self.svh.data_ptr(),
                                           bias.data_ptr() if bias is not None else None, out[r0].data_ptr(),
                                           ELEMENT_CODES[out.dtype], out.stride(0), packed.data_ptr(), rows, threads)
            return out
        strip_tiles = max(8, (STRIP_ELEMENTS // k) // 128 * 8)
        cols = 16 * min(self.tiles_n, strip_tiles)
        for r0 in range(0, x.shape[0], GEMM_ROWS):
            rows = min(GEMM_ROWS, x.shape[0] - r0)
            u = self._input_transform(x[r0 : r0 + rows], threads)
            w_all = _workspace("strip", k * cols)
            y_all = _workspace("y", rows * cols)
            for tn0 in range(0, self.tiles_n, strip_tiles):
                tn1 = min(self.tiles_n, tn0 + strip_tiles)
                width = 16 * (tn1 - tn0)
                w = w_all[: k * width].view(k, width)
                self.decode_into(w, tn0, tn1, threads)
                y = y_all[: rows * width].view(rows, width)
                torch.mm(u, w, out=y)
                self.lib.exl3_cpu_output_transform(y.data_ptr(), self.svh[16 * tn0 :].data_ptr(), y.data_ptr(), rows,
                                                   width, threads)
                if bias is not None:
                    y += bias[16 * tn0 : 16 * tn1]
                out[r0 : r0 + rows, 16 * tn0 : 16 * tn1] = y
        return out

    def _input_transform(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        """u = H(x ⊙ suh) in fp32, in this thread's workspace."""
        u = _workspace("u", x.numel()).view(x.shape)
        u.copy_(x)
        self.lib.exl3_cpu_input_transform(u.data_ptr(), self.suh.data_ptr(), u.data_ptr(), x.shape[0], x.shape[1],
                                          threads)
        return u

    def _gemm_amx(self, x: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None,
                  threads: int) -> torch.Tensor:
        """x on AMX (amx_rows): y = H(x · W') ⊙ svh (+ bias) per 128-column panel, W' decoded, transformed and split
        into bf16 planes inside the library (no workspace here); the fp32 sums are rounded once into a bf16 output. Up
        to AMX_U_MAX_ROWS rows (bf16, fp16 or fp32 x): H(u · Ŵ) ⊙ svh (+ bias), u = H(x ⊙ suh) in three bf16 planes,
        Ŵ in two (exact too)."""
        y_dtype = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
        y = torch.empty(x.shape[0], self.size_n, dtype=y_dtype)
        bias = bias.float().contiguous() if bias is not None else None
        if x.shape[0] <= AMX_U_MAX_ROWS:
            xf = x.float().contiguous()
            self.lib.exl3_cpu_gemm_amx_u(self.trellis.data_ptr(), self.tiles_k, self.tiles_n, self.bits2,
                                         self.codebook, xf.data_ptr(), self.suh.data_ptr(), self.svh.data_ptr(),
                                         bias.data_ptr() if bias is not None else None, y.data_ptr(),
                                         int(y.dtype == torch.bfloat16), x.shape[0], threads)
            return y if y.dtype == out_dtype else y.to(out_dtype)
        x = x.contiguous()
        self.lib.exl3_cpu_gemm_amx(self.trellis.data_ptr(), self.tiles_k, self.tiles_n, self.bits2, self.codebook,
                                   x.data_ptr(), self.suh.data_ptr(), self.svh.data_ptr(),
                                   bias.data_ptr() if bias is not None else None, y.data_ptr(),
                                   int(y.dtype == torch.bfloat16), x.shape[0], AMX_PLANES, threads)
        return y if y.dtype == out_dtype else y.to(out_dtype)

    def decode_into(self, out: torch.Tensor, tn0: int, tn1: int, threads: int | None = None) -> None:
        """Ŵ[:, 16*tn0 : 16*tn1] into `out` (k, 16*(tn1-tn0)) fp32, contiguous."""
        self.lib.exl3_cpu_decode(self.trellis.data_ptr(), self.tiles_k, self.tiles_n, self.bits2, self.codebook,
                                 self.lut_ptr, tn0, tn1, out.data_ptr(), threads or torch.get_num_threads())

    def decode(self) -> torch.Tensor:
        """The whole Ŵ (k, n) fp32 (tests and the self-test)."""
        out = torch.empty(self.size_k, self.size_n, dtype=torch.float32)
        self.decode_into(out, 0, self.tiles_n)
        return out


class CpuFusedLinear:
    """A fused vLLM layer's parts (q/k/v, gate/up: one input, each part its own trellis, suh, svh and bits) bound
    as one: up to gemv_max_rows rows run as one library call (one parallel region for the input transforms and
    every part's chunks: per token that is 4 regions per Llama layer instead of 7, and one Python call per layer);
    more rows go part by part through the GEMM path. Parts must share the codebook and the int8 choice (make())."""

    def __init__(self, parts: list[CpuLinear], out_features: list[int], in_features: int) -> None:
        self.parts = parts
        first = parts[0]
        self.lib, self.size_k, self.tiles_k = first.lib, first.size_k, first.tiles_k
        self.codebook, self.lut_ptr, self.int8 = first.codebook, first.lut_ptr, first.int8
        self.gemv_rows = first.gemv_rows
        self.in_features = in_features
        self.out_features = out_features
        self.width = sum(p.size_n for p in parts)
        self.count = len(parts)
        array = lambda kind, values: (kind * len(values))(*values)  # noqa: E731  (ctypes arrays, kept alive here)
        self.trellis_ptrs = array(ctypes.c_void_p, [p.trellis.data_ptr() for p in parts])
        self.suh_ptrs = array(ctypes.c_void_p, [p.suh.data_ptr() for p in parts])
        self.svh_ptrs = array(ctypes.c_void_p, [p.svh.data_ptr() for p in parts])
        self.tiles_n = array(ctypes.c_int, [p.tiles_n for p in parts])
        self.bits2 = array(ctypes.c_int, [p.bits2 for p in parts])
        # Columns kept when a part is padded past its out_features (None: all of them, in order).
        keep = [torch.arange(sum(p.size_n for p in parts[:i]), sum(p.size_n for p in parts[:i]) + out)
                for i, (p, out) in enumerate(zip(parts, out_features))]
        self.keep = None if self.width == sum(out_features) else torch.cat(keep)

    @staticmethod
    def make(parts: list[CpuLinear], out_features: list[int], in_features: int) -> "CpuFusedLinear | None":
        """The fused layer, or None where its parts cannot share one call (another codebook, tier or int8 choice)."""
        first = parts[0]
        same = all((p.lib, p.codebook, p.int8, p.size_k) == (first.lib, first.codebook, first.int8, first.size_k)
                   for p in parts)
        return CpuFusedLinear(parts, out_features, in_features) if same else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2d = x.reshape(-1, x.shape[-1])
        m = x2d.shape[0]
        pad = self.size_k - x2d.shape[-1]
        if not 0 < m <= self.gemv_rows:
            xp = torch.nn.functional.pad(x2d, (0, pad)) if pad else x2d
            if m == 0:
                return x.new_empty(*lead, sum(self.out_features))
            heap.trim_after_forward(_drop_workspaces)
            # Each part into its columns of y (no concatenation pass); a part padded past its out_features via a copy.
            y = torch.empty(m, sum(self.out_features), dtype=x.dtype)
            col = 0
            for p, out in zip(self.parts, self.out_features):
                if out == p.size_n:
                    p._gemm(xp, x.dtype, None, torch.get_num_threads(), y[:, col : col + out])
                else:
                    y[:, col : col + out] = p(xp, x.dtype)[:, :out]
                col += out
            return y.view(*lead, y.shape[-1])
        xf = x2d.float()
        xf = torch.nn.functional.pad(xf, (0, pad)) if pad else xf.contiguous()
        u = torch.empty(self.count * m * self.size_k, dtype=torch.float32)
        qab = torch.empty(self.count * m * 2, dtype=torch.float32) if int8_serves(self.int8, m) else None
        y = torch.empty(m, self.width, dtype=torch.float32)
        self.lib.exl3_cpu_gemv_parts(self.count, self.trellis_ptrs, self.tiles_k, self.tiles_n, self.bits2,
                                     self.codebook, self.lut_ptr, xf.data_ptr(), self.suh_ptrs, self.svh_ptrs,
                                     u.data_ptr(), qab.data_ptr() if qab is not None else None, y.data_ptr(), m,
                                     torch.get_num_threads())
        if self.keep is not None:
            y = y[:, self.keep]
        y = y if x.dtype == torch.float32 else y.to(x.dtype)
        return y.view(*lead, y.shape[-1])

