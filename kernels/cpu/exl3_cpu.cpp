// EXL3 linear on the CPU: a one-pass decode GEMV for few rows and a strip decoder for the GEMM path.
// Built by kernels/cpu/build.py into one shared library per ISA tier, called through ctypes (kernels/cpu/ops.py).
//
// Layout facts used here (format spec §2-§4): a tile is 256 ring positions over 16K int16 words, read as 8K
// little-endian uint32 words U holding the bitstream MSB-first; the 16-bit state of position p is stream bits
// [S(p)-16, S(p)) modulo the ring. Prefixing U with its last word ("buf": buf[0] = U[W-1], buf[j] = U[j-1])
// removes the modulo: the state starts at buf bit S(p)+16 for every p.
//
// GEMV: a group of 16 consecutive ring positions always lands on the same 8 rows x 2 columns of its tile,
// so one 16-lane accumulator per group (16 per tile column) collects u[row]*w over every k tile, and the
// 16 -> 2 column reduction happens once per output tile, not once per weight.
#if defined(EXL3_AVX512)
#include "exl3_cpu_avx512.h"
#include "exl3_cpu_amx.h"
#elif defined(EXL3_AVX2)
#include "exl3_cpu_avx2.h"
#else
#include "exl3_cpu_portable.h"
#endif
#include <vector>

// Each tier header gives: Scratch (a worker's buffers for up to N rows), run_chunk (one work item: 128 output
// columns of one trellis for a few rows) and decode_range (Ŵ's columns into fp32 rows); the loops below are shared.
namespace {

#if defined(EXL3_AVX512)
constexpr int TIER = 512;
#elif defined(EXL3_AVX2)
constexpr int TIER = 256;
#else
constexpr int TIER = 0;
#endif

void run_units(const Units& w, int tiles_k, int tiles_n, int bits2, int codebook, const float* lut, int threads) {
    // int8 activations: mul1 on the AVX-512 tier only (ops.int8_active decides; a library call elsewhere is a bug)
    if (w.qab && (codebook != CB_MUL1 || TIER != 512)) __builtin_trap();
    const Rate& r = rate_for(bits2);
    const int k = tiles_k * 16, n = tiles_n * 16, chunks = tiles_n / CHUNK_TILES;
#pragma omp parallel num_threads(threads)
    {
        Scratch s(w.m);
#pragma omp for schedule(dynamic)  // units of a grouped call differ in rows
        for (int item = 0; item < w.units * chunks; ++item) {
            const int unit = item / chunks, c = item % chunks;
            const int e = w.ids ? w.ids[unit] : unit;
            if (e < 0) continue;
            const size_t row = w.first_row(unit);
            run_chunk(codebook, r, lut, w.trellis + (size_t)e * w.trellis_stride, tiles_k, tiles_n, w.u + row * k,
                      w.qab ? w.qab + 2 * row : nullptr, w.rows(unit), c, w.svh + (size_t)e * w.svh_stride,
                      w.y + row * n, n, s);
        }
    }
}

}  // namespace

extern "C" {

// Which tier this library is (checked by the loader against its file name): 512, 256 (AVX2) or 0 (portable).
int exl3_cpu_tier() { return TIER; }

// y (m, n) fp32 = H(H(x ⊙ suh) · Ŵ) ⊙ svh, x (m, k) fp32; u (m, k) fp32 scratch. lut: the codebook as fp32
// (read by the portable tier only). k, n multiples of 128. int8: activations as int8 (mul1, AVX-512; not exact).
void exl3_cpu_gemv(const int16_t* trellis, int tiles_k, int tiles_n, int bits2, int codebook, const float* lut,
                   const float* x, const float* suh, const float* svh, float* u, float* y, int m, int threads,
                   int int8) {
    input_transform(x, suh, u, m, tiles_k * 16, threads);
    std::vector<float> qab(int8 ? 2 * m : 0);
    if (int8) quantize_rows(u, m, tiles_k * 16, qab.data(), threads);
    Units w{trellis, 0, nullptr, nullptr, u, svh, 0, y, 1, m};
    w.qab = int8 ? qab.data() : nullptr;
    run_units(w, tiles_k, tiles_n, bits2, codebook, lut, threads);
}

// A fused layer (vLLM's q/k/v or gate/up: parts sharing x, each with its own trellis, suh, svh, rate and width) in one
// parallel region: every part's input transform, then every part's chunks as one pool of work items. y (m, Σ n) holds
// the parts' columns side by side; u (parts, m, k) fp32 scratch; qab (parts, m, 2) in int8 mode (mul1, AVX-512).
void exl3_cpu_gemv_parts(int parts, const int16_t* const* trellis, int tiles_k, const int* tiles_n, const int* bits2,
                         int codebook, const float* lut, const float* x, const float* const* suh,
                         const float* const* svh, float* u, float* qab, float* y, int m, int threads) {
    if (qab && (codebook != CB_MUL1 || TIER != 512)) __builtin_trap();
    const int k = tiles_k * 16, blocks = k / 128;
    std::vector<int> first(parts + 1, 0), col(parts + 1, 0);  // per part: its first work item, its first y column
    for (int i = 0; i < parts; ++i) {
        first[i + 1] = first[i] + tiles_n[i] / CHUNK_TILES;
        col[i + 1] = col[i] + 16 * tiles_n[i];
        rate_for(bits2[i]);  // tables built before the workers read them
    }
    const size_t width = col[parts];
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int b = 0; b < parts * m * blocks; ++b) {
            const int i = b / (m * blocks), row = b / blocks % m;
            transform_block(x + (size_t)row * k, suh[i], u + ((size_t)i * m + row) * k, b % blocks * 128);
        }
        if (qab) {
#pragma omp for schedule(static)
            for (int r = 0; r < parts * m; ++r) quantize_row(u + (size_t)r * k, k, qab + 2 * r);
        }
        Scratch s(m);
#pragma omp for schedule(dynamic)
        for (int item = 0; item < first[parts]; ++item) {
            int i = 0;
            while (item >= first[i + 1]) ++i;
            run_chunk(codebook, rate_for(bits2[i]), lut, trellis[i], tiles_k, tiles_n[i], u + (size_t)i * m * k,
                      qab ? qab + 2 * (size_t)i * m : nullptr, m, item - first[i], svh[i], y + col[i], width, s);
        }
    }
}

// MoE units: unit i is one row x[i / x_div] through expert ids[i] (< 0: skipped, y row left as is) of stacked
// trellises (E, k/16, n/16, w), suh (E, k) and svh (E, n) fp32: y (units, n) = H(H(x ⊙ suh_e) · Ŵ_e) ⊙ svh_e.
void exl3_cpu_moe(const int16_t* trellis, int tiles_k, int tiles_n, int bits2, int codebook, const float* lut,
                  const float* x, int x_div, const int* ids, int units, const float* suh, const float* svh, float* u,
                  float* y, int threads) {
    const int k = tiles_k * 16, n = tiles_n * 16;
#pragma omp parallel for num_threads(threads) schedule(static) if (units * k >= 16384)
    for (int i = 0; i < units; ++i) {
        if (ids[i] < 0) continue;
        input_transform(x + (size_t)(i / x_div) * k, suh + (size_t)ids[i] * k, u + (size_t)i * k, 1, k, 1);
    }
    const Units w{trellis, (size_t)tiles_k * tiles_n * 8 * bits2, ids, nullptr, u, svh, (size_t)n, y, units, 1};
    run_units(w, tiles_k, tiles_n, bits2, codebook, lut, threads);
}

// Grouped MoE units (a few to a few hundred tokens, binned by expert): unit i is rows [start[i], start[i+1]) of u
// and y through expert ids[i] (>= 0), row r's input being x[xrow[r]]; at most max_rows rows per unit (the GEMV's
// accumulators grow with them). y rows of no unit are left as they are.
void exl3_cpu_moe_grouped(const int16_t* trellis, int tiles_k, int tiles_n, int bits2, int codebook, const float* lut,
                          const float* x, const int* xrow, const int* ids, const int* start, int units, int max_rows,
                          const float* suh, const float* svh, float* u, float* y, int threads) {
    const int k = tiles_k * 16, n = tiles_n * 16;
#pragma omp parallel for num_threads(threads) schedule(static) if (start[units] * k >= 16384)
    for (int i = 0; i < units; ++i)
        for (int row = start[i]; row < start[i + 1]; ++row)
            input_transform(x + (size_t)xrow[row] * k, suh + (size_t)ids[i] * k, u + (size_t)row * k, 1, k, 1);
    const Units w{trellis, (size_t)tiles_k * tiles_n * 8 * bits2, ids, start, u, svh, (size_t)n, y, units, max_rows};
    run_units(w, tiles_k, tiles_n, bits2, codebook, lut, threads);
}

// Ŵ[:, 16*tn0 : 16*tn1] as fp32 into out (k, 16*(tn1-tn0)), row-major.
void exl3_cpu_decode(const int16_t* trellis, int tiles_k, int tiles_n, int bits2, int codebook, const float* lut,
                     int tn0, int tn1, float* out, int threads) {
    decode_range(codebook, rate_for(bits2), lut, trellis, tiles_k, tiles_n, tn0, tn1, out, threads);
}

// The fp32 GEMM path on the AVX-512 tier (exl3_cpu_gemm.h): out (m rows, ldo elements apart) = H(u · Ŵ) ⊙ svh
// (+ bias, fp32 or null), u = H(x ⊙ suh); x (m, k) and out in x_el / out_el (fp32, bf16, fp16: Element); a: scratch
// for u packed, (m + 15)·k floats. Other tiers multiply a decoded strip by BLAS.
void exl3_cpu_gemm_f32(const int16_t* trellis, int tiles_k, int tiles_n, int bits2, int codebook, const void* x,
                       int x_el, const float* suh, const float* svh, const float* bias, void* out, int out_el, int ldo,
                       float* a, int m, int threads) {
#if defined(EXL3_AVX512)
    pack_x(x, x_el, suh, m, tiles_k * 16, a, threads);
    gemm_f32(codebook, rate_for(bits2), trellis, tiles_k, tiles_n, a, svh, bias, out, out_el, ldo, m, threads);
#else
    (void)trellis, (void)tiles_k, (void)tiles_n, (void)bits2, (void)codebook, (void)x, (void)x_el, (void)suh,
        (void)svh, (void)bias, (void)out, (void)out_el, (void)ldo, (void)a, (void)m, (void)threads;
    __builtin_trap();  // ops calls it on the avx512 tier only
#endif
}

// y (m, n) = H(z) ⊙ svh per 128-block of each row (the GEMM path's output transform), in place allowed.
void exl3_cpu_output_transform(const float* z, const float* svh, float* y, int m, int n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (m * n >= 16384)
    for (int b = 0; b < m * (n / 128); ++b) {
        const int row = b / (n / 128), col = (b % (n / 128)) * 128;
        float t[128];
        std::memcpy(t, z + (size_t)row * n + col, sizeof(t));
        fwht128(t);
        for (int i = 0; i < 128; ++i) y[(size_t)row * n + col + i] = t[i] * svh[col + i];
    }
}

// 1 where this library has the AMX prefill and the OS grants this process AMX state (the caller checks the CPU's
// AMX-BF16 and AVX512-BF16 flags), else 0.
int exl3_cpu_amx() {
#ifdef EXL3_HAVE_AMX
    return amx_permitted() ? 1 : 0;
#else
    return 0;
#endif
}

// y (m, n) = H(x · W') ⊙ svh (+ bias), x (m, k) bf16, W' = diag(suh) · H · Ŵ split into `planes` bf16 planes (3:
// W' exactly, every product exact; fewer: W' rounded, only for measuring what the third plane costs); y bf16 or fp32.
void exl3_cpu_gemm_amx(const int16_t* trellis, int tiles_k, int tiles_n, int bits2, int codebook, const uint16_t* x,
                       const float* suh, const float* svh, const float* bias, void* y, int y_bf16, int m, int planes,
                       int threads) {
#ifdef EXL3_HAVE_AMX
    if (!amx_permitted() || planes < 1 || planes > AMX_MAX_PLANES || m < 1) __builtin_trap();
    const Rate& r = rate_for(bits2);
    if (codebook == CB_MUL1)
        gemm_amx_impl<CB_MUL1>(trellis, tiles_k, tiles_n, r, x, suh, svh, bias, y, y_bf16, m, planes, threads);
    else if (codebook == CB_MCG)
        gemm_amx_impl<CB_MCG>(trellis, tiles_k, tiles_n, r, x, suh, svh, bias, y, y_bf16, m, planes, threads);
    else
        gemm_amx_impl<CB_3INST>(trellis, tiles_k, tiles_n, r, x, suh, svh, bias, y, y_bf16, m, planes, threads);
#else
    __builtin_trap();  // ops.amx_active never calls it where exl3_cpu_amx() is 0
#endif
}

// The same y for few rows through the other exact split (exl3_cpu_amx.h, gemm_amx_u_impl): u = H(x ⊙ suh) in three
// bf16 planes times Ŵ in two; x (m, k) fp32 (the engine's bf16 or fp16 rows, widened exactly).
void exl3_cpu_gemm_amx_u(const int16_t* trellis, int tiles_k, int tiles_n, int bits2, int codebook, const float* x,
                         const float* suh, const float* svh, const float* bias, void* y, int y_bf16, int m,
                         int threads) {
#ifdef EXL3_HAVE_AMX
    if (!amx_permitted() || m < 1) __builtin_trap();
    const Rate& r = rate_for(bits2);
    if (codebook == CB_MUL1)
        gemm_amx_u_impl<CB_MUL1>(trellis, tiles_k, tiles_n, r, x, suh, svh, bias, y, y_bf16, m, threads);
    else if (codebook == CB_MCG)
        gemm_amx_u_impl<CB_MCG>(trellis, tiles_k, tiles_n, r, x, suh, svh, bias, y, y_bf16, m, threads);
    else
        gemm_amx_u_impl<CB_3INST>(trellis, tiles_k, tiles_n, r, x, suh, svh, bias, y, y_bf16, m, threads);
#else
    __builtin_trap();  // ops.amx_active never calls it where exl3_cpu_amx() is 0
#endif
}

// The one-row mul1 GEMV on AVX512-FP16 (exl3_cpu_fp16.h): enable 0 turns it off, 1 on (the default), -1 asks.
// Returns whether it now serves. Its outputs equal the 32-bit loop's bit for bit (same weights, same sums).
int exl3_cpu_fp16(int enable) {
#ifdef EXL3_HAVE_FP16
    if (enable >= 0) fp16_on.store(enable != 0);
    return fp16_active() ? 1 : 0;
#else
    (void)enable;
    return 0;
#endif
}

void exl3_cpu_input_transform(const float* x, const float* suh, float* u, int m, int k, int threads) {
    input_transform(x, suh, u, m, k, threads);
}

}  // extern "C"
