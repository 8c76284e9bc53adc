// The fp32 GEMM path on the AVX-512 tier (no AMX): Ŵ decoded tile by tile straight into the B panel of a
// register-blocked fp32 GEMM, instead of a decoded strip in memory multiplied by torch's BLAS (MKL, which on Zen 4
// ran this product at 70-82 % of the core's fp32 peak, docs/PERF.md, CPU, session 18).
//
// One decoded tile column (16 output columns) is a GEMM B panel: its k rows of 16 fp32 weights, one vector per row
// (the columns in a lane order undone on the sums, rows_any_column_order). x is read once into u = H(x ⊙ suh), packed
// k-major. Each work item is one 128-column chunk (the output Hadamard block): per pass of GEMM_KC k rows, its 8 tile
// columns' panels decoded, then per block of 16 u rows 16 accumulators (one per row) take one fma per (k, row) with u
// broadcast; the chunk's output transform, bias and cast run on its sums while they are in cache, written once into
// the output (session 19: with the casts and transforms in torch, those passes took ~5 % of a 512-row call).
#pragma once

namespace {

constexpr int GEMM_MR = 16;   // u rows per register block: 16 accumulators, one B load per 16 fmas
// k rows per pass over the chunk's B panels (each u block's part then takes 32 KiB, read once for 8 panels): 512 to
// 2048 ran at 85-93 GFLOP/s at 512 rows on Zen 4, 128 at 77-80 (1 thread, session 18).
constexpr int GEMM_KC = 512;

// Activation and output element types of the own GEMM's call (ops.ELEMENT_CODES).
enum Element { EL_F32 = 0, EL_BF16 = 1, EL_F16 = 2 };

// 16 elements of x as fp32 (exact for all three types).
inline __m512 load16(const void* x, int el, size_t i) {
    if (el == EL_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)x + i))), 16));
    if (el == EL_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)x + i)));
    return _mm512_loadu_ps((const float*)x + i);
}

// 16 fp32 values stored as el, rounded to nearest even as torch's vectorized casts round them (bf16: the integer
// rounding of ATen's cvtfp32_bf16, NaN -> 0xFFFF; fp16: vcvtps2ph), so an output written here equals the fp32 result
// cast by torch, bit for bit.
inline void store16(void* out, int el, size_t i, __m512 v) {
    if (el == EL_F32) return _mm512_storeu_ps((float*)out + i, v);
    __m256i h;
    if (el == EL_BF16) {
        const __m512i b = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
        const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
        h = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q),
                                                          _mm512_set1_epi32(0xFFFF), r));
    } else {
        h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_storeu_si256((__m256i*)((uint16_t*)out + i), h);
}

// x (m, k) as el -> a: u = H(x ⊙ suh) (the input transform's arithmetic, transform_block) in row blocks of GEMM_MR,
// k-major inside a block: a[(b·k + kk)·MR + i] = u[b·MR + i][kk]; rows past m are zero (their sums are never stored).
// One pass instead of a cast, the transform and a packing pass over u.
inline void pack_x(const void* x, int el, const float* suh, int m, int k, float* a, int threads) {
    const int blocks = (m + GEMM_MR - 1) / GEMM_MR;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int b = 0; b < blocks; ++b)
        for (int k0 = 0; k0 < k; k0 += 128) {
            alignas(64) float u[GEMM_MR][128];
            for (int i = 0; i < GEMM_MR; ++i) {
                const int row = b * GEMM_MR + i;
                for (int j = 0; j < 128; j += 16)
                    _mm512_store_ps(u[i] + j, row < m ? _mm512_mul_ps(load16(x, el, (size_t)row * k + k0 + j),
                                                                      _mm512_loadu_ps(suh + k0 + j))
                                                      : _mm512_setzero_ps());
                if (row < m) fwht128(u[i]);
            }
            float* dst = a + ((size_t)b * k + k0) * GEMM_MR;
            for (int kk = 0; kk < 128; ++kk)
                for (int i = 0; i < GEMM_MR; ++i) dst[kk * GEMM_MR + i] = u[i][kk];
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

// A decoded tile's 16 group vectors -> 16 vectors of one tile row each, the columns in one lane order shared by all
// rows (PanelOrder). A B panel needs rows, not columns in a fixed order: their order is undone on the 16x fewer sums.
// Group gi's lane l is at row (l1, g0, l3, l0) and column (l2, g3, g2, g1) of its tile (bits of gi and l, high to low;
// row_of / col_of), so three stages that each exchange one lane bit with one register bit move l3, l1, l0 into the
// register index: vshuff32x4 (l3 <-> g1), vunpck*ps (g2 -> l1 -> l0 -> g2), vunpck*pd (l1 <-> g3). Immediate-operand
// shuffles with no index tables: the 48 vpermt2ps of shuffle_rows made a panel's decode 2.6-3x slower on Zen 4.
inline void rows_any_column_order(__m512* v) {
    for (int x = 0; x < 16; ++x) {
        if (x & 2) continue;
        const __m512 a = v[x], b = v[x | 2];
        v[x] = _mm512_shuffle_f32x4(a, b, 0x44);
        v[x | 2] = _mm512_shuffle_f32x4(a, b, 0xEE);
    }
    for (int x = 0; x < 16; ++x) {
        if (x & 4) continue;
        const __m512 a = v[x], b = v[x | 4];
        v[x] = _mm512_unpacklo_ps(a, b);
        v[x | 4] = _mm512_unpackhi_ps(a, b);
    }
    for (int x = 0; x < 16; ++x) {
        if (x & 8) continue;
        const __m512d a = _mm512_castps_pd(v[x]), b = _mm512_castps_pd(v[x | 8]);
        v[x] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        v[x | 8] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
}

// Where rows_any_column_order leaves things, found by running it on position numbers: the tile row register i holds,
// and per column the lane holding it (the same in every register; a violated assumption traps at first use).
struct PanelOrder {
    int row[16];
    __m512i lane_of_col;
};

inline PanelOrder make_panel_order() {
    __m512 v[16];
    for (int gi = 0; gi < 16; ++gi) {
        alignas(64) float pos[16];
        for (int l = 0; l < 16; ++l) pos[l] = (float)(16 * gi + l);
        v[gi] = _mm512_load_ps(pos);
    }
    rows_any_column_order(v);
    PanelOrder o;
    alignas(64) int lane_of_col[16];
    for (int i = 0; i < 16; ++i) {
        alignas(64) float pos[16];
        _mm512_store_ps(pos, v[i]);
        o.row[i] = row_of((int)pos[0]);
        for (int l = 0; l < 16; ++l) {
            if (row_of((int)pos[l]) != o.row[i] || (i && lane_of_col[col_of((int)pos[l])] != l)) __builtin_trap();
            lane_of_col[col_of((int)pos[l])] = l;
        }
    }
    o.lane_of_col = _mm512_load_si512(lane_of_col);
    return o;
}

const PanelOrder& panel_order() {
    static const PanelOrder o = make_panel_order();
    return o;
}

// Tile rows [tk0, tk1) of chunk c's 8 tile columns of Ŵ as B panels (panel ct at panels + ct·16·GEMM_KC: 16 k rows of
// 16 fp32 per tile row, columns in PanelOrder's lanes). Tile row by tile row: a row's 8 tiles are adjacent in the
// trellis, and the rows ahead are prefetched (they come from DRAM: a layer's trellis is read once per pass).
template <int CB>
inline void decode_panels(const int16_t* trellis, int tiles_n, const Rate& r, const Pairs& pg, const PanelOrder& o,
                          int c, int tk0, int tk1, float* panels) {
    const int words16 = 2 * r.words32, chunk_bytes = CHUNK_TILES * words16 * 2;
    const size_t row_words = (size_t)tiles_n * words16;
    const int16_t* col0 = trellis + (size_t)c * CHUNK_TILES * words16;
    for (int tk = tk0; tk < tk1; ++tk) {
        prefetch_rows(col0, row_words, chunk_bytes, tk + 2, tk + 3 < tk1 ? tk + 3 : tk1);
        for (int ct = 0; ct < CHUNK_TILES; ++ct) {
            const uint32_t* U = (const uint32_t*)(col0 + (size_t)tk * row_words + ct * words16);
            __m512 v[16];
            pair_weights<CB, true>(U, r.words32, pg.bytes[0], pg.ctrl[0], pg.load_mask[0] >> 1, pg.base[0], v);
            for (int pi = 1; pi < 8; ++pi)
                pair_weights<CB, false>(U, r.words32, pg.bytes[pi], pg.ctrl[pi], pg.load_mask[pi], pg.base[pi], v + 2 * pi);
            rows_any_column_order(v);
            float* panel = panels + (size_t)ct * 16 * GEMM_KC + (size_t)(tk - tk0) * 256;
            for (int i = 0; i < 16; ++i) _mm512_store_ps(panel + 16 * o.row[i], v[i]);
        }
    }
}

// out (m rows, ldo apart) as el = H(a · Ŵ) ⊙ svh (+ bias) per 128-column block, a = pack_x(x).
template <int CB>
void gemm_f32_impl(const int16_t* trellis, int tiles_k, int tiles_n, const Rate& r, const float* a, const float* svh,
                   const float* bias, void* out, int el, size_t ldo, int m, int threads) {
    const Pairs& pg = tables_for<Pairs, make_pairs>(r);
    const PanelOrder& order = panel_order();
    const int k = tiles_k * 16, blocks = (m + GEMM_MR - 1) / GEMM_MR;
#pragma omp parallel num_threads(threads)
    {
        // One pass's panels (256 KiB whatever k). Sized by k (2.9 MiB at k = 5632, mapped anew per call and thread), a
        // 5632 x 2048 call at 16 threads took ~3 ms at 8 to 32 rows alike on Emerald Rapids (page faults, probably).
        float* panels = (float*)_mm_malloc(sizeof(float) * CHUNK_TILES * 16 * GEMM_KC, 64);
        // The chunk's sums, 16 rows x 16 columns contiguous per (row block, tile column): as rows of the output (n
        // floats apart, a multiple of 4 KiB at these shapes) the blocks' accumulators fell into few cache sets.
        float* sums = (float*)_mm_malloc(sizeof(float) * blocks * CHUNK_TILES * 256, 64);
#pragma omp for schedule(dynamic)
        for (int c = 0; c < tiles_n / CHUNK_TILES; ++c) {
            for (int k0 = 0; k0 < k; k0 += GEMM_KC) {
                const int kc = k - k0 < GEMM_KC ? k - k0 : GEMM_KC;
                decode_panels<CB>(trellis, tiles_n, r, pg, order, c, k0 / 16, (k0 + kc) / 16, panels);
                // Each u block's kc rows are read once for the chunk's 8 panels (per panel, u was 10-25 % slower).
                for (int b = 0; b < blocks; ++b) {
                    const int rows = m - b * GEMM_MR < GEMM_MR ? m - b * GEMM_MR : GEMM_MR;
                    const auto block = rows > 8 ? gemm_block<GEMM_MR> : gemm_block<8>;
                    for (int ct = 0; ct < CHUNK_TILES; ++ct)
                        block(a + ((size_t)b * k + k0) * GEMM_MR, panels + (size_t)ct * 16 * GEMM_KC, kc,
                              sums + ((size_t)b * CHUNK_TILES + ct) * 256, 16, rows, k0 == 0);
                }
            }
            // The output transform while the chunk's sums are in cache, written once in the output's type.
            for (int row = 0; row < m; ++row) {
                alignas(64) float z[128];
                const float* s = sums + (size_t)(row / GEMM_MR) * CHUNK_TILES * 256 + (row % GEMM_MR) * 16;
                for (int ct = 0; ct < CHUNK_TILES; ++ct)  // the columns back in order
                    _mm512_store_ps(z + 16 * ct, _mm512_permutexvar_ps(order.lane_of_col, _mm512_load_ps(s + 256 * ct)));
                fwht128(z);
                for (int i = 0; i < 128; i += 16) {
                    const int col = c * 128 + i;
                    __m512 v = _mm512_mul_ps(_mm512_load_ps(z + i), _mm512_loadu_ps(svh + col));
                    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + col));
                    store16(out, el, row * ldo + col, v);
                }
            }
        }
        _mm_free(sums);
        _mm_free(panels);
    }
}

inline void gemm_f32(int codebook, const Rate& r, const int16_t* trellis, int tiles_k, int tiles_n, const float* a,
                     const float* svh, const float* bias, void* out, int el, size_t ldo, int m, int threads) {
    if (codebook == CB_MUL1) gemm_f32_impl<CB_MUL1>(trellis, tiles_k, tiles_n, r, a, svh, bias, out, el, ldo, m, threads);
    else if (codebook == CB_MCG) gemm_f32_impl<CB_MCG>(trellis, tiles_k, tiles_n, r, a, svh, bias, out, el, ldo, m, threads);
    else gemm_f32_impl<CB_3INST>(trellis, tiles_k, tiles_n, r, a, svh, bias, out, el, ldo, m, threads);
}

}  // namespace
