"""The CPU EXL3 kernel (kernels/cpu): Ŵ bit-exact with the reference for every codebook and rate on every ISA tier
this machine runs, outputs of both paths within fp32 tolerance of the reference, and the fallback when the
library cannot be built."""

from __future__ import annotations

import pytest
import torch

from exl3local.kernels import KernelPath, KernelSpec, choose_kernel, prepare, reference
from exl3local.kernels.cpu import build, ops
from exl3local.kernels.dispatch import CpuLinearKernel, DeviceInfo, TorchReferenceKernel

RATES = [(cb, bits) for cb in ("3inst", "mcg", "mul1") for bits in (1, 2, 3, 4, 5, 6, 7, 8)]
RATES += [("mul1", bits) for bits in (1.5, 2.5, 3.5)]
# Every tier this CPU runs (on an AVX-512 machine: all four, the AVX2 laptop tiers included).
TIERS = build.runnable_tiers()


def _layer(size_k, size_n, bits, codebook, seed=0):
    g = torch.Generator().manual_seed(seed)
    trellis = torch.randint(-32768, 32768, (size_k // 16, size_n // 16, reference.words_per_tile(bits)),
                            generator=g, dtype=torch.int16)
    suh = (torch.randn(size_k, generator=g) * 0.1).half()
    svh = (torch.randn(size_n, generator=g) * 0.1).half()
    return trellis, suh, svh


# Every tier inside one test against one reference result: the reference decoder is most of these tests' time.
@pytest.mark.parametrize("codebook,bits", RATES)
def test_decode_is_bit_exact(codebook, bits):
    trellis, suh, svh = _layer(256, 384, bits, codebook, seed=int(2 * bits))
    expected = reference.decode_trellis(trellis, bits, codebook).float()
    for tier in TIERS:
        got = ops.CpuLinear(trellis, suh, svh, bits, codebook, tier=tier).decode()
        assert torch.equal(got, expected), f"{tier}: {(got != expected).sum().item()} weights differ"


def test_one_row_gemv_matches_the_gemm_path_at_every_rate():
    """The one-row loop's per-rate state tables (the avx512 tier reads two groups per extraction) against the GEMM
    path, which decodes Ŵ separately (bit-exact: test_decode_is_bit_exact), for every codebook and rate and tier."""
    for codebook, bits in RATES:
        trellis, suh, svh = _layer(256, 256, bits, codebook, seed=int(4 * bits))
        x = torch.randn(1, 256, generator=torch.Generator().manual_seed(2))
        for tier in TIERS:
            lin = ops.CpuLinear(trellis, suh, svh, bits, codebook, tier=tier)
            many = x.expand(lin.gemv_rows + 1, -1).contiguous()
            torch.testing.assert_close(lin(x)[0], lin(many)[0], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, t=tier, c=codebook, b=bits: f"{t} {c} {b}: {m}")


def test_multi_row_gemv_equals_the_one_row_loop_row_by_row():
    """The GEMV's 2-24-row loop (8 rows per pass, accumulators in registers; exl3_cpu_avx512.h / _avx2.h gemv_rows)
    keeps each output's fma order, so every row equals a one-row call bit for bit, on every tier this CPU runs (the
    one-row loop is another code: pairs of groups, AVX512-FP16's 16-bit lanes). Forced to 24 rows where the tier's
    crossover is lower (AMX CPUs, the portable tier)."""
    for codebook, bits in (("mul1", 4), ("3inst", 3), ("mcg", 2), ("mul1", 3.5)):
        trellis, suh, svh = _layer(256, 384, bits, codebook, seed=int(3 * bits))
        x = torch.randn(24, 256, generator=torch.Generator().manual_seed(3))
        for tier in TIERS:
            lin = ops.CpuLinear(trellis, suh, svh, bits, codebook, tier=tier, int8=False)
            lin.gemv_rows = ops.GEMV_MAX_ROWS_SIMD
            one = torch.cat([lin(x[i : i + 1]) for i in range(24)])
            for m in (2, 3, 5, 8, 9, 13, 24):
                got = lin(x[:m])
                assert torch.equal(got, one[:m]), f"{tier} {codebook} {bits} m={m}: {(got - one[:m]).abs().max()}"


@pytest.mark.parametrize("codebook,bits", [("mul1", 4), ("3inst", 3), ("mcg", 8), ("mul1", 2.5)])
@pytest.mark.parametrize("rows", [1, ops.GEMV_MAX_ROWS_PORTABLE, ops.GEMV_MAX_ROWS, ops.GEMV_MAX_ROWS + 1,
                                  ops.GEMV_MAX_ROWS_SIMD + 1])
def test_both_paths_match_the_reference(codebook, bits, rows):
    trellis, suh, svh = _layer(384, 256, bits, codebook, seed=rows)
    x = torch.randn(rows, 384, generator=torch.Generator().manual_seed(1))
    expected = x.double() @ reference.reconstruct(trellis, suh, svh, bits, codebook).double()
    same_steps = reference.linear(x, trellis, suh, svh, bits, codebook)
    for tier in TIERS:
        lin = ops.CpuLinear(trellis, suh, svh, bits, codebook, tier=tier)
        got = lin(x)
        assert lin.path_for(rows) == ("gemv" if rows <= lin.gemv_rows else "gemm")
        # fp32 accumulation over k = 384 terms vs an fp64 product with the fp16-rounded W: W's rounding dominates.
        torch.testing.assert_close(got.double(), expected, rtol=2e-3, atol=2e-3 * expected.abs().max().item(),
                                   msg=lambda m, tier=tier: f"{tier}: {m}")
        torch.testing.assert_close(got, same_steps, rtol=1e-5, atol=1e-5, msg=lambda m, tier=tier: f"{tier}: {m}")


@pytest.mark.parametrize("own_gemm", [True, False])
def test_gemm_path_in_row_passes_and_strips_with_bias(own_gemm, monkeypatch):
    """More rows than one pass (GEMM_ROWS) and more columns than one strip: every piece lands in its place, the
    bias is added in fp32 and a bf16 or fp16 output is the fp32 result cast once; both fp32 GEMMs (the avx512 tier's own,
    decode-strip + BLAS)."""
    monkeypatch.setattr(ops, "GEMM_ROWS", 16)
    monkeypatch.setattr(ops, "STRIP_ELEMENTS", 384 * 128)  # 128-column strips: two of them
    trellis, suh, svh = _layer(384, 256, 4, "mul1")
    lin = ops.CpuLinear(trellis, suh, svh, 4, "mul1")
    if own_gemm and lin.lib.exl3_cpu_tier() != 512:
        pytest.skip("the library's own fp32 GEMM is the avx512 tier's")
    lin.own_gemm, lin.amx = own_gemm, False
    x = torch.randn(40, 384, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(256).half()
    got = lin(x, torch.float32, bias)
    torch.testing.assert_close(got, reference.linear(x, trellis, suh, svh, 4, "mul1", bias), rtol=1e-5, atol=1e-5)
    # The own GEMM reads bf16/fp16 x and writes bf16/fp16 outputs itself: rounded as torch rounds the fp32 result.
    for dtype in (torch.bfloat16, torch.float16):
        xl = x.to(dtype)
        assert torch.equal(lin(xl, dtype, bias), lin(xl, torch.float32, bias).to(dtype)), dtype


@pytest.mark.parametrize("codebook,bits", [("mul1", 4), ("3inst", 3), ("mcg", 2), ("mul1", 3.5)])
def test_own_fp32_gemm_equals_the_blas_path(codebook, bits):
    """The avx512 tier's own GEMM (exl3_cpu_gemm.h: Ŵ decoded into B panels, 16- and 8-row register blocks, k in
    passes of GEMM_KC = 512) against decode-strip + BLAS: k = 640 (a pass and a part), row counts that fill the
    16-row block, leave 1-8 rows (the 8-row block) or 9-15 (a partial 16-row block), 1 and 2 threads."""
    trellis, suh, svh = _layer(640, 256, bits, codebook, seed=7)
    if "avx512" not in TIERS:
        pytest.skip("the library's own fp32 GEMM is the avx512 tier's")
    lin = ops.CpuLinear(trellis, suh, svh, bits, codebook, tier="avx512")
    lin.amx = False  # checked where it does not serve too (Intel CPUs, AMX): the kernel is in the library
    x = torch.randn(45, 640, generator=torch.Generator().manual_seed(5))
    for rows in (1, 5, 16, 20, 25, 45):
        for threads in (1, 2):
            lin.own_gemm = True
            got = lin._gemm(x[:rows], torch.float32, None, threads)
            lin.own_gemm = False
            want = lin._gemm(x[:rows], torch.float32, None, threads)
            torch.testing.assert_close(
                got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(),
                msg=lambda m, r=rows, t=threads: f"{codebook} {bits} rows {r} threads {t}: {m}")


def test_the_crossover_follows_the_gemm_path_past_it():
    """The GEMV serves up to the row count where the GEMM path that takes over wins (ops.gemv_max_rows): 5 rows before
    the avx512 tier's own GEMM (CPUs other than Intel's, without AMX), 24 before decode-strip + BLAS, 8 before AMX,
    3 on the portable tier; a layer hands the next row count to the GEMM path."""
    trellis, suh, svh = _layer(256, 128, 4, "mul1")
    for tier in TIERS:
        lin = ops.CpuLinear(trellis, suh, svh, 4, "mul1", tier=tier)
        want = (ops.GEMV_MAX_ROWS_PORTABLE if tier == "portable" else ops.GEMV_MAX_ROWS if lin.amx
                else ops.GEMV_MAX_ROWS_OWN_GEMM if lin.own_gemm else ops.GEMV_MAX_ROWS_SIMD)
        assert lin.gemv_rows == ops.gemv_max_rows(lin.lib) == want, tier
        assert lin.own_gemm == (tier == "avx512" and build.cpu_vendor() != "GenuineIntel"), tier
        assert (lin.path_for(want), lin.path_for(want + 1)) == ("gemv", "gemm"), tier


def test_kernel_through_dispatch_handles_dtype_lead_dims_bias_and_strides():
    trellis, suh, svh = _layer(256, 128, 4, "mul1")
    kernel = prepare(KernelSpec(256, 128, 4, "mul1", torch.bfloat16, has_bias=True), "cpu")
    assert isinstance(kernel, CpuLinearKernel)
    gemm = KernelPath.CPU_GEMM_AMX if ops.amx_active(ops.library()) else KernelPath.CPU_GEMM  # bf16 rows
    assert kernel.path_for(1) is KernelPath.CPU_GEMV and kernel.path_for(64) is gemm
    wide = torch.randn(2, 3, 512).bfloat16()
    x = wide[..., ::2]  # not contiguous
    bias = torch.randn(128).half()
    got = kernel.apply(x, trellis, suh, svh, bias)
    assert got.shape == (2, 3, 128) and got.dtype == torch.bfloat16
    expected = reference.linear(x, trellis, suh, svh, 4, "mul1", bias)
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2)
    assert len(kernel.bound) == 1  # bound once per tensor set
    kernel.apply(x, trellis, suh, svh, bias)
    assert len(kernel.bound) == 1


def test_no_compiler_is_a_reason_not_a_failure(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(build, "build_dirs", lambda: [tmp_path])
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(build.BuildError, match="no C.. compiler"):
        build.build("portable")
    assert build.main(["portable"]) == 0  # scripts/setup goes on
    assert "slow reference decoder" in capsys.readouterr().err


def test_dispatch_falls_back_to_the_reference_when_the_library_is_missing(monkeypatch):
    monkeypatch.setattr(ops, "refusal", lambda: "no C++ compiler found")
    spec = KernelSpec(128, 256, 4, "mul1")
    assert choose_kernel(spec, DeviceInfo("cpu")) is TorchReferenceKernel
    assert CpuLinearKernel.refuse(spec, DeviceInfo("cpu")) == "no C++ compiler found"


def test_tier_choice_follows_cpu_flags_and_the_override(monkeypatch):
    assert build.best_tier(frozenset(build.TIERS["avx512"][1])) == "avx512"
    assert build.best_tier(frozenset({"avx2", "fma", "f16c", "avx_vnni", "avx512f"})) == "avx2vnni"
    assert build.best_tier(frozenset({"avx2", "fma", "f16c", "avx512f"})) == "avx2"
    assert build.best_tier(frozenset()) == "portable"
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setenv("EXL3LOCAL_CPU_TIER", "portable")
    assert build.chosen_tier() == "portable"
    monkeypatch.setenv("EXL3LOCAL_CPU_TIER", "avx512")  # one this CPU cannot run: a reason, the reference serves
    with pytest.raises(build.BuildError, match="lacks avx512f"):
        build.chosen_tier()
    monkeypatch.delenv("EXL3LOCAL_CPU_TIER")
    assert build.chosen_tier() == "avx2"


def test_a_tier_the_compiler_rejects_falls_back_to_the_next(monkeypatch):
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "avx_vnni"}))
    monkeypatch.delenv("EXL3LOCAL_CPU_TIER", raising=False)
    tried = []

    def fake_build(tier):
        tried.append(tier)
        if tier == "avx2vnni":
            raise build.BuildError("g++: error: unrecognized command-line option '-mavxvnni'")
        return f"lib-{tier}.so"

    monkeypatch.setattr(build, "build", fake_build)
    assert build.build_chosen() == ("avx2", "lib-avx2.so") and tried == ["avx2vnni", "avx2"]


class _Proj:
    """The fields kernels/cpu/moe.py reads from plugin.moe.Projection."""

    def __init__(self, size_k, size_n, bits=4, codebook="mul1"):
        self.size_k, self.size_n, self.bits, self.codebook = size_k, size_n, bits, codebook
        self.trellis_shape = (size_k // 16, size_n // 16, reference.words_per_tile(bits))
        self.words = size_k * size_n * bits // 16


def test_moe_units_match_a_per_expert_loop():
    """Every (token, expert) unit of a verify step in two library calls, against the reference per expert."""
    from exl3local.kernels.cpu.moe import CpuExperts

    E, hidden, inter, top_k, tokens = 6, 256, 384, 3, 3
    g = torch.Generator().manual_seed(3)
    gate, up, down = (_layer(hidden, inter, 4, "mul1", seed=s) for s in (1, 2, 3))
    w13 = torch.randint(-32768, 32768, (E, 2 * _Proj(hidden, inter).words), generator=g, dtype=torch.int16)
    w13_suh = (torch.randn(E, 2, hidden, generator=g) * 0.1).half()
    w13_svh = (torch.randn(E, 2, inter, generator=g) * 0.1).half()
    w2 = torch.randint(-32768, 32768, (E, inter // 16, hidden // 16, 64), generator=g, dtype=torch.int16)
    w2_suh, w2_svh = (torch.randn(E, inter, generator=g) * 0.1).half(), (torch.randn(E, hidden, generator=g) * 0.1).half()
    proj = {"gate": _Proj(hidden, inter), "up": _Proj(hidden, inter), "down": _Proj(inter, hidden)}
    experts = CpuExperts(w13, w13_suh, w13_svh, w2, w2_suh, w2_svh, proj)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.tensor([[0, 5, 2], [3, -1, 5], [1, 1, 4]])[:, :top_k]  # -1: another rank's expert
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    got = experts.units(x, weights, ids)
    half = w13.shape[1] // 2
    want = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            if e < 0:
                continue
            row = x[t : t + 1]
            gt = reference.linear(row, w13[e, :half].view(proj["gate"].trellis_shape), w13_suh[e, 0], w13_svh[e, 0], 4, "mul1")
            ut = reference.linear(row, w13[e, half:].view(proj["up"].trellis_shape), w13_suh[e, 1], w13_svh[e, 1], 4, "mul1")
            h = torch.nn.functional.silu(gt) * ut
            want[t] += weights[t, j] * reference.linear(h, w2[e], w2_suh[e], w2_svh[e], 4, "mul1")[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# experts with up to 8 rows (units), 9-24 (units where the tier's GEMV serves 24 rows, else CpuLinear), busier (GEMM)
@pytest.mark.parametrize("tokens", [5, 16, 40])
def test_moe_grouped_matches_the_units(tokens):
    """The grouped path (rows binned by expert; experts with up to unit_rows rows as units, busier ones through the
    GEMM path) against the one-row units, with remote experts (-1)."""
    from exl3local.kernels.cpu.moe import CpuExperts

    E, hidden, inter, top_k = 4, 256, 384, 3
    g = torch.Generator().manual_seed(5)
    w13 = torch.randint(-32768, 32768, (E, 2 * _Proj(hidden, inter).words), generator=g, dtype=torch.int16)
    w2 = torch.randint(-32768, 32768, (E, inter // 16, hidden // 16, 64), generator=g, dtype=torch.int16)
    scales = [(torch.randn(*shape, generator=g) * 0.1).half() for shape in ((E, 2, hidden), (E, 2, inter), (E, inter), (E, hidden))]
    proj = {"gate": _Proj(hidden, inter), "up": _Proj(hidden, inter), "down": _Proj(inter, hidden)}
    experts = CpuExperts(w13, scales[0], scales[1], w2, scales[2], scales[3], proj)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.randint(-1, E, (tokens, top_k), generator=g)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    counts = torch.bincount(ids[ids >= 0], minlength=E)
    assert tokens != 16 or ((counts > 8) & (counts <= 24)).any(), counts  # the 9-24-row case is in the draw
    got = experts.grouped(x, weights, ids)
    torch.testing.assert_close(got, experts.units(x, weights, ids), rtol=1e-5, atol=1e-6)


def test_mul1_fp16_rounding_splits_are_exact_for_every_byte_sum():
    """mul1's affine value f rounded to fp16 in fp32 arithmetic (built with -ffp-contract=off), for each of the 1021
    byte sums equal to the fp16 cast the reference applies: the avx512 tier's (f + t) - t with t = 2^13 f made by
    adding 13 to the exponent bits, and the AVX2 tiers' Veltkamp split c - (c - f), c = f * (2^13 + 1)."""
    import numpy as np

    from exl3local.kernels.codebook import MUL1_K_BIAS, MUL1_K_INV

    sums = np.arange(1021, dtype=np.float64)
    f = (sums * MUL1_K_INV + MUL1_K_BIAS).astype(np.float32)  # exact in fp32 (codebook.py)
    expected = f.astype(np.float16).astype(np.float32)
    t = (f.view(np.int32) + np.int32(13 << 23)).view(np.float32)
    assert np.array_equal(t, f * np.float32(8192.0))
    assert np.array_equal((f + t) - t, expected)
    assert not np.array_equal(f, expected)  # the rounding is needed: f itself is not fp16 everywhere
    c = f * np.float32(8193.0)
    assert np.array_equal(c - (c - f), expected)
    assert "-ffp-contract=off" in build.COMMON_FLAGS


@pytest.mark.parametrize("rows", [1, ops.GEMV_MAX_ROWS, ops.GEMV_MAX_ROWS + 1, ops.GEMV_MAX_ROWS_SIMD + 1])
def test_fused_layer_is_one_call_equal_to_its_parts(rows, monkeypatch):
    """A fused layer (parts of other bits and widths, the last one padded past its out_features, x narrower than the
    padded k) through BoundLinear: up to gemv_max_rows rows one library call, more rows part by part into the output's
    columns; equal to the parts run one by one."""
    from exl3local.kernels.bound import BoundLinear

    shapes = [(4, 256, 256), (3, 128, 128), (2.5, 384, 300)]  # bits, padded n, out_features
    parts = []
    for i, (bits, n, out) in enumerate(shapes):
        kernel = prepare(KernelSpec(256, n, bits, "mul1", torch.bfloat16), "cpu")
        parts.append((kernel, *_layer(256, n, bits, "mul1", seed=10 + i), out))
    layer = BoundLinear(parts, 250)
    assert isinstance(layer.whole, ops.CpuFusedLinear)
    x = torch.randn(rows, 250, generator=torch.Generator().manual_seed(4)).bfloat16()
    calls = []
    monkeypatch.setattr(ops.CpuFusedLinear, "lib", property(lambda s: _Spy(s.parts[0].lib, calls)), raising=False)
    got = layer(x)
    want = BoundLinear.unfused(layer, x)
    assert got.shape == (rows, 256 + 128 + 300) and got.dtype == torch.bfloat16
    one_call = rows <= layer.whole.gemv_rows
    assert calls == (["exl3_cpu_gemv_parts"] if one_call else [])
    # The same fp32 sums, cast once: equal, not only close (past gemv_rows each part's GEMM writes into its columns).
    assert torch.equal(got, want)


class _Spy:
    """A library whose calls are recorded by name."""

    def __init__(self, lib, calls):
        self.lib, self.calls = lib, calls

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.lib, name)


@pytest.mark.parametrize("bits", [1, 1.5, 2.5, 4, 8])
def test_mul1_gemv_on_avx512_fp16_equals_the_32_bit_loop(bits):
    """The one-row mul1 GEMV in 16-bit lanes (exl3_cpu_fp16.h, one fp16 fma per weight) gives the 32-bit loop's
    outputs bit for bit (same fp16 weights, same sums), on every rate's state layout, with the head group's ring
    wrap; it serves wherever the CPU has AVX512-FP16."""
    lib = ops.library("avx512") if "avx512" in TIERS else None
    if lib is None or not lib.exl3_cpu_fp16(-1):
        pytest.skip("no AVX512-FP16 on this CPU (or no compiler support)")
    trellis, suh, svh = _layer(256, 256, bits, "mul1", seed=int(4 * bits))
    lin = ops.CpuLinear(trellis, suh, svh, bits, "mul1", tier="avx512")
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(5))
    fp16 = lin(x)
    try:
        assert lib.exl3_cpu_fp16(0) == 0
        wide = lin(x)
    finally:
        assert lib.exl3_cpu_fp16(1) == 1
    assert torch.equal(fp16, wide)
    torch.testing.assert_close(fp16, reference.linear(x, trellis, suh, svh, bits, "mul1"), rtol=1e-5, atol=1e-5)
