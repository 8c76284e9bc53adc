// The fp32 GEMM path on the AVX-512 tier (no AMX): Ŵ decoded tile by tile straight into the B panel of a
// register-blocked fp32 GEMM, instead of a decoded strip in memory multiplied by torch's BLAS (MKL, which on Zen 4
// ran this product at 70-82 % of the core's fp32 peak, docs/PERF.md, CPU, session 18).
//
// One decoded tile column (16 output columns) is exactly a GEMM B panel: its k rows of 16 fp32 weights, one
// vector per row, the layout the decode's permute network ends in. Each work item is one 128-column chunk (the
// output Hadamard block): per pass of GEMM_KC k rows, its 8 tile columns' panels decoded, then per block of 16 u
// rows 16 accumulators (one per row) take one fma per (k, row) with u broadcast from a k-major packing; the
// chunk's output transform runs while its columns are in cache.
#pragma once

namespace {

constexpr int GEMM_MR = 16;   // u rows per register block: 16 accumulators, one B load per 16 fmas
// k rows per pass over the chunk's B panels (each u block's part then takes 32 KiB, read once for 8 panels): 512 to
// 2048 ran at 85-93 GFLOP/s at 512 rows on Zen 4, 128 at 77-80 (1 thread, session 18).
constexpr int GEMM_KC = 512;

// u (m, k) -> row blocks of GEMM_MR, k-major inside a block: a[(b·k + kk)·MR + i] = u[b·MR + i][kk]; rows past m
// are zero (their sums are never stored).
inline void pack_u(const float* u, int m, int k, float* a, int threads) {
    const int blocks = (m + GEMM_MR - 1) / GEMM_MR;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int b = 0; b < blocks; ++b)
        for (int kk0 = 0; kk0 < k; kk0 += 16) {
            float* dst = a + ((size_t)b * k + kk0) * GEMM_MR;
            for (int i = 0; i < GEMM_MR; ++i) {
                const int row = b * GEMM_MR + i;
                alignas(64) float v[16];
                if (row < m) _mm512_store_ps(v, _mm512_loadu_ps(u + (size_t)row * k + kk0));
                else _mm512_store_ps(v, _mm512_setzero_ps());
                for (int j = 0; j < 16; ++j) dst[j * GEMM_MR + i] = v[j];
            }
        }
}

// c[i][0:16] (+)= Σ_kk a[kk·GEMM_MR + i] · b[kk·16 : kk·16 + 16] for rows i < rows <= MR, kc k rows. MR = 8 serves a
// last block of at most 8 rows (17-24 rows cost 24 rows' fmas, not 32).
template <int MR>
inline void gemm_block(const float* a, const float* b, int kc, float* c, size_t ldc, int rows, bool first) {
    __m512 acc[MR];
    for (int i = 0; i < MR; ++i)
        acc[i] = first || i >= rows ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc);
    for (int kk = 0; kk < kc; ++kk) {
        const __m512 w = _mm512_load_ps(b + 16 * kk);
        const float* ak = a + GEMM_MR * kk;
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(ak[i]), w, acc[i]);
    }
    for (int i = 0; i < rows; ++i) _mm512_storeu_ps(c + i * ldc, acc[i]);
}

// Tile rows [tk0, tk1) of tile column tn of Ŵ as a B panel: 16·(tk1 - tk0) k rows of 16 fp32 (64-byte aligned).
template <int CB>
inline void decode_panel(const int16_t* trellis, int tiles_n, const Rate& r, const Groups& g, const RowShuffle& sh,
                         int tn, int tk0, int tk1, float* panel) {
    const int words16 = 2 * r.words32;
    for (int tk = tk0; tk < tk1; ++tk) {
        const uint32_t* U = (const uint32_t*)(trellis + ((size_t)tk * tiles_n + tn) * words16);
        __m512 v[16];
        for (int gi = 0; gi < 16; ++gi) v[gi] = decode_group<CB>(U, r.words32, g, gi);
        shuffle_rows(sh, v);
        for (int i = 0; i < 16; ++i) _mm512_store_ps(panel + (size_t)((tk - tk0) * 16 + sh.row[i]) * 16, v[i]);
    }
}

// y (m, n) fp32 = H(a · Ŵ) ⊙ svh per 128-column block, a = pack_u(u).
template <int CB>
void gemm_f32_impl(const int16_t* trellis, int tiles_k, int tiles_n, const Rate& r, const float* a, const float* svh,
                   float* y, int m, int threads) {
    const Groups& g = groups_for(r);
    const RowShuffle& sh = row_shuffle();
    const int k = tiles_k * 16, n = tiles_n * 16, blocks = (m + GEMM_MR - 1) / GEMM_MR;
#pragma omp parallel num_threads(threads)
    {
        // One pass's panels (256 KiB whatever k). Sized by k (2.9 MiB at k = 5632, mapped anew per call and thread), a
        // 5632 x 2048 call at 16 threads took ~3 ms at 8 to 32 rows alike on Emerald Rapids (page faults, probably).
        float* panels = (float*)_mm_malloc(sizeof(float) * CHUNK_TILES * 16 * GEMM_KC, 64);
#pragma omp for schedule(dynamic)
        for (int c = 0; c < tiles_n / CHUNK_TILES; ++c) {
            for (int k0 = 0; k0 < k; k0 += GEMM_KC) {
                const int kc = k - k0 < GEMM_KC ? k - k0 : GEMM_KC;
                for (int ct = 0; ct < CHUNK_TILES; ++ct)
                    decode_panel<CB>(trellis, tiles_n, r, g, sh, c * CHUNK_TILES + ct, k0 / 16, (k0 + kc) / 16,
                                     panels + (size_t)ct * 16 * GEMM_KC);
                // Each u block's kc rows are read once for the chunk's 8 panels (per panel, u was 10-25 % slower).
                for (int b = 0; b < blocks; ++b) {
                    const int rows = m - b * GEMM_MR < GEMM_MR ? m - b * GEMM_MR : GEMM_MR;
                    const auto block = rows > 8 ? gemm_block<GEMM_MR> : gemm_block<8>;
                    for (int ct = 0; ct < CHUNK_TILES; ++ct)
                        block(a + ((size_t)b * k + k0) * GEMM_MR, panels + (size_t)ct * 16 * GEMM_KC, kc,
                              y + (size_t)b * GEMM_MR * n + (c * CHUNK_TILES + ct) * 16, n, rows, k0 == 0);
                }
            }
            for (int row = 0; row < m; ++row) {
                float* z = y + (size_t)row * n + c * 128;
                fwht128(z);
                for (int i = 0; i < 128; i += 16)
                    _mm512_storeu_ps(z + i,
                                     _mm512_mul_ps(_mm512_loadu_ps(z + i), _mm512_loadu_ps(svh + c * 128 + i)));
            }
        }
        _mm_free(panels);
    }
}

inline void gemm_f32(int codebook, const Rate& r, const int16_t* trellis, int tiles_k, int tiles_n, const float* a,
                     const float* svh, float* y, int m, int threads) {
    if (codebook == CB_MUL1) gemm_f32_impl<CB_MUL1>(trellis, tiles_k, tiles_n, r, a, svh, y, m, threads);
    else if (codebook == CB_MCG) gemm_f32_impl<CB_MCG>(trellis, tiles_k, tiles_n, r, a, svh, y, m, threads);
    else gemm_f32_impl<CB_3INST>(trellis, tiles_k, tiles_n, r, a, svh, y, m, threads);
}

}  // namespace
