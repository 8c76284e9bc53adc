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
#else
#include "exl3_cpu_portable.h"
#endif
#include <vector>

extern "C" {

// Which tier this library is (checked by the loader against its file name).
int exl3_cpu_tier() {
#if defined(EXL3_AVX512)
    return 512;
#else
    return 0;
#endif
}

static void run_units(const Units& w, int tiles_k, int tiles_n, int bits2, int codebook, const float* lut, int threads) {
    // int8 activations: mul1 on the AVX-512 tier only (ops.int8_active decides; a library call elsewhere is a bug)
    if (w.qab && (codebook != CB_MUL1 || exl3_cpu_tier() == 0)) __builtin_trap();
    const Rate& r = rate_for(bits2);
#if defined(EXL3_AVX512)
    (void)lut;
    if (codebook == CB_MUL1) gemv_units<CB_MUL1>(w, tiles_k, tiles_n, r, threads);
    else if (codebook == CB_MCG) gemv_units<CB_MCG>(w, tiles_k, tiles_n, r, threads);
    else gemv_units<CB_3INST>(w, tiles_k, tiles_n, r, threads);
#else
    (void)codebook;
    gemv_units_portable(w, tiles_k, tiles_n, r, lut, threads);
#endif
}

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
    const Rate& r = rate_for(bits2);
#if defined(EXL3_AVX512)
    (void)lut;
    if (codebook == CB_MUL1) decode_impl<CB_MUL1>(trellis, tiles_k, tiles_n, r, tn0, tn1, out, threads);
    else if (codebook == CB_MCG) decode_impl<CB_MCG>(trellis, tiles_k, tiles_n, r, tn0, tn1, out, threads);
    else decode_impl<CB_3INST>(trellis, tiles_k, tiles_n, r, tn0, tn1, out, threads);
#else
    (void)codebook;
    const int words16 = 2 * r.words32, width = (tn1 - tn0) * 16;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int tk = 0; tk < tiles_k; ++tk)
        for (int tn = tn0; tn < tn1; ++tn) {
            const uint32_t* U = (const uint32_t*)(trellis + ((size_t)tk * tiles_n + tn) * words16);
            for (int p = 0; p < POSITIONS; ++p)
                out[(size_t)(16 * tk + row_of(p)) * width + (tn - tn0) * 16 + col_of(p)] = lut[state_of(U, r, p)];
        }
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

void exl3_cpu_input_transform(const float* x, const float* suh, float* u, int m, int k, int threads) {
    input_transform(x, suh, u, m, k, threads);
}

}  // extern "C"
