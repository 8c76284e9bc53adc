// The AVX2 tier (AVX2 + FMA + F16C; AVX-VNNI where the "avx2vnni" build has it): the avx512 tier's design on 256-bit
// vectors, for laptops (Lunar Lake and most others have no AVX-512). A group is 8 consecutive ring positions (4 tile
// rows x 2 columns); AVX2 has no byte permute or multishift, so each lane's state comes from the two buf words
// around it: vpermd picks them out of the group's window, variable shifts join them.
#pragma once
#include <immintrin.h>

#include "exl3_cpu_core.h"

namespace {

constexpr int GROUPS8 = POSITIONS / 8;

struct Groups8 {
    __m256i hi[GROUPS8];     // per lane: window index of buf[i0] (the state's first bit)
    __m256i shift[GROUPS8];  // per lane: the state's bit offset in buf[i0]
    __m256i load_mask[GROUPS8];
    int base[GROUPS8];  // the window's first buf word
};

void make_groups8(const Rate& r, Groups8& g) {
    for (int gi = 0; gi < GROUPS8; ++gi) {
        int lo = 1 << 30, hi = 0;
        for (int l = 0; l < 8; ++l) {
            lo = r.i0[8 * gi + l] < lo ? r.i0[8 * gi + l] : lo;
            hi = r.i0[8 * gi + l] > hi ? r.i0[8 * gi + l] : hi;
        }
        alignas(32) int idx[8], sh[8], mask[8];
        for (int l = 0; l < 8; ++l) {
            idx[l] = r.i0[8 * gi + l] - lo;
            sh[l] = r.off[8 * gi + l];
            // buf words [lo, hi+1] clipped to the ring (buf index words32 is U's last word); masked-off words read as
            // zero and only ever fill bits below a state (core's state_of). buf[0] (U's last word) is put in apart.
            const int j = lo + l;
            mask[l] = (j >= 1 && j <= hi + 1 && j <= r.words32) ? -1 : 0;
        }
        g.hi[gi] = _mm256_load_si256((const __m256i*)idx);
        g.shift[gi] = _mm256_load_si256((const __m256i*)sh);
        g.load_mask[gi] = _mm256_load_si256((const __m256i*)mask);
        g.base[gi] = lo;
    }
}

const Groups8& groups8_for(const Rate& r) { return tables_for<Groups8, make_groups8>(r); }

// fp16 bits (low 16 of each lane; exponent field never 0 or 31, as 3INST's and MCG's masks make it) -> fp32, exact.
inline __m256 half_bits_to_float(__m256i h) {
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x8000)), 16);
    const __m256i rest = _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x7FFF)), 13),
                                          _mm256_set1_epi32(112 << 23));
    return _mm256_castsi256_ps(_mm256_or_si256(sign, rest));
}

// s: 16-bit states (upper bits zero) -> fp32 weights, each exactly its fp16 value.
template <int CB>
inline __m256 decode8(__m256i s) {
    if constexpr (CB == CB_MUL1) {
        const __m256i x = _mm256_mullo_epi32(s, _mm256_set1_epi32((int)MUL1_HASH));
        // Byte sum into the mantissa of 2^23, as in the avx512 tier (the fma then rounds an exact value: exact).
#if defined(__AVXVNNI__)
        const __m256i sum = _mm256_dpbusd_avx_epi32(_mm256_set1_epi32(0x4B000000), x, _mm256_set1_epi32(0x01010101));
#else
        const __m256i pairs = _mm256_maddubs_epi16(x, _mm256_set1_epi8(1));  // unsigned bytes: pair sums <= 510
        const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)),
                                             _mm256_set1_epi32(0x4B000000));
#endif
        constexpr double k_inv = MUL1_SCALE;
        constexpr float bias = (float)(-1329.0 / 128.0 + (1024.0 - 8388608.0) * k_inv);
        const __m256 f = _mm256_fmadd_ps(_mm256_castsi256_ps(sum), _mm256_set1_ps((float)k_inv), _mm256_set1_ps(bias));
        // fp16 rounding by the Veltkamp split (exact for mul1's 1021 values: tests/kernels/test_cpu.py).
        const __m256 c = _mm256_mul_ps(f, _mm256_set1_ps(8193.0f));
        return _mm256_sub_ps(c, _mm256_sub_ps(c, f));
    } else {
        __m256i x = _mm256_mullo_epi32(s, _mm256_set1_epi32(CB == CB_MCG ? (int)0xCBAC1FEDu : 0x05517C72));
        if constexpr (CB == CB_3INST) x = _mm256_add_epi32(x, _mm256_set1_epi32(0x03D45AA4));
        const __m256i y = _mm256_xor_si256(_mm256_and_si256(x, _mm256_set1_epi32((int)0x8FFF8FFFu)),
                                           _mm256_set1_epi32(0x3B603B60));
        const __m256 f = _mm256_add_ps(half_bits_to_float(y), half_bits_to_float(_mm256_srli_epi32(y, 16)));
        return _mm256_cvtph_ps(_mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
}

// One group's window controls, in registers while the group runs over a chunk's tiles.
struct GroupView8 {
    __m256i hi, lo, shift, back, mask;
    int base;

    GroupView8(const Groups8& g, int gi)
        : hi(g.hi[gi]), lo(_mm256_add_epi32(g.hi[gi], _mm256_set1_epi32(1))), shift(g.shift[gi]),
          back(_mm256_sub_epi32(_mm256_set1_epi32(32), g.shift[gi])), mask(g.load_mask[gi]), base(g.base[gi]) {}

    // The 8 states of this group of the tile at U (words32 uint32 words), in position order, one per 32-bit lane.
    inline __m256i states(const uint32_t* U, int words32) const {
        // Window word l is buf[base + l] = U[base + l - 1]; buf[0] is U's last word (tail-biting), only group 0's.
        __m256i v = _mm256_maskload_epi32((const int*)(U + base - 1), mask);
        if (base == 0) v = _mm256_blend_epi32(v, _mm256_set1_epi32((int)U[words32 - 1]), 1);
        const __m256i h = _mm256_permutevar8x32_epi32(v, hi), l = _mm256_permutevar8x32_epi32(v, lo);
        // The 16 bits from `shift` on of the 64-bit h:l (a shift by 32 gives zero: off = 0 takes h alone).
        return _mm256_srli_epi32(_mm256_or_si256(_mm256_sllv_epi32(h, shift), _mm256_srlv_epi32(l, back)), 16);
    }
};

// Tile rows per block of the 2..8-row loop (gemv_rows8).
constexpr int ROW_BLOCK = 4;

// A worker's buffers for work items of up to `rows` rows: acc and the permuted inputs (4 vectors per row and k tile:
// group g's lanes multiply tile rows 2(g&3) + {0, 1, 8, 9}; ROW_BLOCK k tiles).
struct Scratch {
    float* acc;
    __m256* ue;
    explicit Scratch(int rows)
        : acc((float*)_mm_malloc(sizeof(float) * rows * CHUNK_TILES * POSITIONS, 32)),
          ue((__m256*)_mm_malloc(sizeof(__m256) * ROW_BLOCK * 4 * rows, 32)) {}
    ~Scratch() {
        _mm_free(ue);
        _mm_free(acc);
    }
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
};

// Row mi's input of k tile tk as the 4 vectors the groups multiply, at ue[q * stride].
inline void permute_row(const float* ut, __m256* ue, int stride) {
    const __m256 top = _mm256_loadu_ps(ut), bottom = _mm256_loadu_ps(ut + 8);
    for (int q = 0; q < 4; ++q) {
        const __m256i idx = _mm256_setr_epi32(2 * q, 2 * q + 1, 2 * q, 2 * q + 1, 2 * q, 2 * q + 1, 2 * q, 2 * q + 1);
        ue[q * stride] =
            _mm256_blend_ps(_mm256_permutevar8x32_ps(top, idx), _mm256_permutevar8x32_ps(bottom, idx), 0xCC);
    }
}

inline void prefetch_row(const int16_t* col0, size_t row_words, int chunk_bytes, int tk) {
    const char* pf = (const char*)(col0 + (size_t)tk * row_words);
    for (int b = 0; b < chunk_bytes; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
}

// 2..8 rows of a work item: per block of ROW_BLOCK tile rows, each group's accumulators (one per row) stay in
// registers across the block's tiles, as the avx512 tier's gemv_rows (loaded and stored per 8 weights, m * 8 KiB of
// them left L1). The same fma order per accumulator: the sums are unchanged.
template <int CB, int M>
void gemv_rows8(const int16_t* col0, size_t row_words, int chunk_bytes, int tiles_k, int words32, const Groups8& g,
                const float* u, int k, float* acc, __m256* ue) {
    const int words16 = 2 * words32;
    for (int tk0 = 0; tk0 < tiles_k; tk0 += ROW_BLOCK) {
        const int tb = tiles_k - tk0 < ROW_BLOCK ? tiles_k - tk0 : ROW_BLOCK;
        for (int t = 0; t < tb; ++t) {
            if (tk0 + t + 4 < tiles_k) prefetch_row(col0, row_words, chunk_bytes, tk0 + t + 4);
            for (int mi = 0; mi < M; ++mi) permute_row(u + (size_t)mi * k + 16 * (tk0 + t), ue + t * 4 * M + mi, M);
        }
        for (int gi = 0; gi < GROUPS8; ++gi) {
            const GroupView8 view(g, gi);
            for (int ct = 0; ct < CHUNK_TILES; ++ct) {
                float* a = acc + ct * POSITIONS + 8 * gi;
                __m256 s[M];
                for (int mi = 0; mi < M; ++mi) s[mi] = _mm256_load_ps(a + (size_t)mi * CHUNK_TILES * POSITIONS);
                for (int t = 0; t < tb; ++t) {
                    const uint32_t* U = (const uint32_t*)(col0 + (size_t)(tk0 + t) * row_words + (size_t)ct * words16);
                    const __m256 w = decode8<CB>(view.states(U, words32));
                    const __m256* ug = ue + (t * 4 + (gi & 3)) * M;
                    for (int mi = 0; mi < M; ++mi) s[mi] = _mm256_fmadd_ps(ug[mi], w, s[mi]);
                }
                for (int mi = 0; mi < M; ++mi) _mm256_store_ps(a + (size_t)mi * CHUNK_TILES * POSITIONS, s[mi]);
            }
        }
    }
}

// One work item: the 128 output columns of chunk c for m rows of u, over every k tile of one trellis; one row group
// by group, each over the chunk's tiles (its controls stay in registers), more rows by gemv_rows8.
template <int CB>
void gemv_chunk8(const int16_t* trellis, int tiles_k, int tiles_n, const Rate& r, const Groups8& g, const float* u,
                 int m, int c, Scratch& s, const float* svh, float* y, size_t y_stride) {
    const int k = tiles_k * 16, words16 = 2 * r.words32;
    const size_t row_words = (size_t)tiles_n * words16;
    float* acc = s.acc;
    std::memset(acc, 0, sizeof(float) * m * CHUNK_TILES * POSITIONS);
    const int16_t* col0 = trellis + (size_t)c * CHUNK_TILES * words16;
    const int chunk_bytes = CHUNK_TILES * words16 * 2;
    using Rows = void (*)(const int16_t*, size_t, int, int, int, const Groups8&, const float*, int, float*, __m256*);
    static constexpr Rows rows[9] = {nullptr, gemv_rows8<CB, 1>, gemv_rows8<CB, 2>, gemv_rows8<CB, 3>,
                                     gemv_rows8<CB, 4>, gemv_rows8<CB, 5>, gemv_rows8<CB, 6>, gemv_rows8<CB, 7>,
                                     gemv_rows8<CB, 8>};
    for (int m0 = 0; m0 < m && m > 1; m0 += 8)  // 8 rows at a time (a GEMV or grouped unit has at most 8)
        rows[m - m0 < 8 ? m - m0 : 8](col0, row_words, chunk_bytes, tiles_k, r.words32, g, u + (size_t)m0 * k, k,
                                      acc + (size_t)m0 * CHUNK_TILES * POSITIONS, s.ue);
    for (int tk = 0; tk < tiles_k && m == 1; ++tk) {
        if (tk + 4 < tiles_k) prefetch_row(col0, row_words, chunk_bytes, tk + 4);
        permute_row(u + 16 * tk, s.ue, 1);
        const int16_t* row = col0 + (size_t)tk * row_words;
        for (int gi = 0; gi < GROUPS8; ++gi) {
            const GroupView8 view(g, gi);
            const __m256 ug = s.ue[gi & 3];
#pragma GCC unroll 8
            for (int ct = 0; ct < CHUNK_TILES; ++ct) {
                float* a = acc + ct * POSITIONS + 8 * gi;
                const __m256 w = decode8<CB>(view.states((const uint32_t*)(row + (size_t)ct * words16), r.words32));
                _mm256_store_ps(a, _mm256_fmadd_ps(ug, w, _mm256_load_ps(a)));
            }
        }
    }
    for (int mi = 0; mi < m; ++mi)
        finish_block(acc + (size_t)mi * CHUNK_TILES * POSITIONS, svh + c * 128, y + (size_t)mi * y_stride + c * 128);
}

// One work item (exact activations only: int8 is the avx512 tier's).
inline void run_chunk(int codebook, const Rate& r, const float*, const int16_t* trellis, int tiles_k, int tiles_n,
                      const float* u, const float*, int m, int c, const float* svh, float* y, size_t y_stride,
                      Scratch& s) {
    const Groups8& g = groups8_for(r);
    if (codebook == CB_MUL1) gemv_chunk8<CB_MUL1>(trellis, tiles_k, tiles_n, r, g, u, m, c, s, svh, y, y_stride);
    else if (codebook == CB_MCG) gemv_chunk8<CB_MCG>(trellis, tiles_k, tiles_n, r, g, u, m, c, s, svh, y, y_stride);
    else gemv_chunk8<CB_3INST>(trellis, tiles_k, tiles_n, r, g, u, m, c, s, svh, y, y_stride);
}

// Lane l of group g (position 8 g + l) is the tile's row (l1 g1 g0 l0), column (l2 g4 g3 g2) (bits high to low; row_of,
// col_of): swapping lane bits 0, 1, 2 with register bits 2, 3, 4 (blend of movdups, shuffle_ps, permute2f128) leaves
// register x holding 8 consecutive columns of one row, in order. 128 register ops per tile instead of 32 gathers.
struct RowPlace {
    int row[GROUPS8], col[GROUPS8];  // where register x's 8 columns go
};

inline RowPlace make_row_place() {
    int cur[GROUPS8][8];  // position held by (register, lane), the network run on position numbers
    for (int x = 0; x < GROUPS8; ++x)
        for (int l = 0; l < 8; ++l) cur[x][l] = 8 * x + l;
    for (int st = 0; st < 3; ++st) {
        const int rb = 4 << st, lb = 1 << st;
        for (int x = 0; x < GROUPS8; ++x) {
            if (x & rb) continue;
            for (int l = 0; l < 8; ++l) {
                if (l & lb) continue;
                const int a = cur[x][l | lb];  // swap (x, lane bit 1) with (x | rb, lane bit 0)
                cur[x][l | lb] = cur[x | rb][l];
                cur[x | rb][l] = a;
            }
        }
    }
    RowPlace t;
    for (int x = 0; x < GROUPS8; ++x) t.row[x] = row_of(cur[x][0]), t.col[x] = col_of(cur[x][0]);
    return t;
}

template <int CB>
void decode8_impl(const int16_t* trellis, int tiles_k, int tiles_n, const Rate& r, int tn0, int tn1, float* out,
                  int threads) {
    const Groups8& g = groups8_for(r);
    static const RowPlace place = make_row_place();
    const int words16 = 2 * r.words32, width = (tn1 - tn0) * 16;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int tk = 0; tk < tiles_k; ++tk)
        for (int tn = tn0; tn < tn1; ++tn) {
            const uint32_t* U = (const uint32_t*)(trellis + ((size_t)tk * tiles_n + tn) * words16);
            float* o = out + (size_t)tk * 16 * width + (tn - tn0) * 16;
            // the swaps touch register bits 2-4 only: the 4 sets {x0 + 4 i} go through them apart (8 vectors each)
            for (int x0 = 0; x0 < 4; ++x0) {
                __m256 v[8];
                for (int i = 0; i < 8; ++i) v[i] = decode8<CB>(GroupView8(g, x0 + 4 * i).states(U, r.words32));
                for (int i = 0; i < 8; i += 2) {  // lane bit 0 <-> register bit 2
                    const __m256 a = v[i], b = v[i + 1];
                    v[i] = _mm256_blend_ps(a, _mm256_moveldup_ps(b), 0xAA);
                    v[i + 1] = _mm256_blend_ps(_mm256_movehdup_ps(a), b, 0xAA);
                }
                for (int i = 0; i < 8; i += (i & 1) ? 3 : 1) {  // lane bit 1 <-> register bit 3: i = 0, 1, 4, 5
                    const __m256 a = v[i], b = v[i + 2];
                    v[i] = _mm256_shuffle_ps(a, b, 0x44);
                    v[i + 2] = _mm256_shuffle_ps(a, b, 0xEE);
                }
                for (int i = 0; i < 4; ++i) {  // lane bit 2 <-> register bit 4
                    const __m256 a = v[i], b = v[i + 4];
                    v[i] = _mm256_permute2f128_ps(a, b, 0x20);
                    v[i + 4] = _mm256_permute2f128_ps(a, b, 0x31);
                }
                for (int i = 0; i < 8; ++i) {
                    const int x = x0 + 4 * i;
                    _mm256_storeu_ps(o + (size_t)place.row[x] * width + place.col[x], v[i]);
                }
            }
        }
}

inline void decode_range(int codebook, const Rate& r, const float*, const int16_t* trellis, int tiles_k, int tiles_n,
                         int tn0, int tn1, float* out, int threads) {
    if (codebook == CB_MUL1) decode8_impl<CB_MUL1>(trellis, tiles_k, tiles_n, r, tn0, tn1, out, threads);
    else if (codebook == CB_MCG) decode8_impl<CB_MCG>(trellis, tiles_k, tiles_n, r, tn0, tn1, out, threads);
    else decode8_impl<CB_3INST>(trellis, tiles_k, tiles_n, r, tn0, tn1, out, threads);
}

}  // namespace
