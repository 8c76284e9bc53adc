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
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <omp.h>
#if defined(EXL3_AVX512)
#include <immintrin.h>
#endif

namespace {

constexpr int POSITIONS = 256;
constexpr int CHUNK_TILES = 8;  // 128 output columns per work item: one Hadamard block
constexpr float HAD_SCALE = 0.088388347648f;
enum { CB_3INST = 0, CB_MCG = 1, CB_MUL1 = 2 };

struct Rate {
    int words32;
    int i0[POSITIONS];   // buf word holding the state's first bit
    int off[POSITIONS];  // bit offset of the state inside buf[i0]:buf[i0+1]
};

// bits2 = 2K (K = 1..8 or 1.5/2.5/3.5): odd positions take one extra bit at half rates (mask 0xAAAA).
void make_rate(int bits2, Rate& r) {
    const int ka = bits2 / 2, half = bits2 & 1;
    r.words32 = 4 * bits2;
    for (int p = 0; p < POSITIONS; ++p) {
        const int s = (p + 1) * ka + (half ? (p + 1) >> 1 : 0);
        r.i0[p] = (s + 16) >> 5;
        r.off[p] = (s + 16) & 31;
    }
}

inline int row_of(int p) {
    const int lane = p >> 3, j = p & 7;
    return 2 * (lane & 3) + (j & 1) + 8 * ((j >> 1) & 1);
}
inline int col_of(int p) { return (p >> 5) + 8 * ((p & 7) >> 2); }

inline uint32_t state_of(const uint32_t* U, const Rate& r, int p) {
    const int i0 = r.i0[p], off = r.off[p];
    const uint64_t hi = i0 ? U[i0 - 1] : U[r.words32 - 1];
    const uint64_t lo = i0 + 1 <= r.words32 ? U[i0] : 0;  // past the ring only when off <= 16: unused bits
    return (uint32_t)((((hi << 32) | lo) << off) >> 48) & 0xFFFF;
}

// In-place natural-order 128-point Walsh-Hadamard transform, scaled to orthonormal.
void fwht128(float* v) {
    for (int h = 1; h < 128; h <<= 1)
        for (int i = 0; i < 128; i += 2 * h)
            for (int j = i; j < i + h; ++j) {
                const float a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
    for (int i = 0; i < 128; ++i) v[i] *= HAD_SCALE;
}

// u = H(x ⊙ suh) per 128-block, rows in parallel.
void input_transform(const float* x, const float* suh, float* u, int m, int k, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (m * k >= 16384)
    for (int b = 0; b < m * (k / 128); ++b) {
        const int row = b / (k / 128), col = (b % (k / 128)) * 128;
        const float* xs = x + (size_t)row * k + col;
        float* us = u + (size_t)row * k + col;
        for (int i = 0; i < 128; ++i) us[i] = xs[i] * suh[col + i];
        fwht128(us);
    }
}

// z (16 tile columns' 256 position sums) -> y block of 128 columns: reduce, H, ⊙ svh.
void finish_block(const float* acc, const float* svh, float* y) {
    float z[128];
    for (int ct = 0; ct < CHUNK_TILES; ++ct) {
        const float* a = acc + ct * POSITIONS;
        float cols[16] = {0};
        for (int p = 0; p < POSITIONS; ++p) cols[col_of(p)] += a[p];
        for (int c = 0; c < 16; ++c) z[16 * ct + c] = cols[c];
    }
    fwht128(z);
    for (int i = 0; i < 128; ++i) y[i] = z[i] * svh[i];
}

#if defined(EXL3_AVX512)

struct Groups {
    __m512i bytes[16];  // per lane, the 4 stream bytes from the state's first byte on, MSB first (vpermb indices)
    __m512i shift[16];  // the state's bit offset inside its first byte
    __m512i urow[16];   // the tile row each lane's weight multiplies
    __mmask16 load_mask[16];
    int base[16];  // first buf word a group reads
};

void make_groups(const Rate& r, Groups& g) {
    for (int gi = 0; gi < 16; ++gi) {
        int lo = 1 << 30, hi = 0;
        for (int l = 0; l < 16; ++l) {
            lo = r.i0[16 * gi + l] < lo ? r.i0[16 * gi + l] : lo;
            hi = r.i0[16 * gi + l] > hi ? r.i0[16 * gi + l] : hi;
        }
        alignas(64) uint8_t bytes[64];
        alignas(64) int shift[16], urow[16];
        for (int l = 0; l < 16; ++l) {
            const int p = 16 * gi + l, bit = 32 * r.i0[p] + r.off[p], first = bit >> 3;
            // Stream byte j sits in buf word j/4 at little-endian byte 3 - j%4 (MSB-first words).
            for (int t = 0; t < 4; ++t) {
                const int j = first + 3 - t;
                bytes[4 * l + t] = (uint8_t)(4 * ((j >> 2) - lo) + 3 - (j & 3));
            }
            shift[l] = bit & 7;
            urow[l] = row_of(p);
        }
        g.bytes[gi] = _mm512_load_si512(bytes);
        g.shift[gi] = _mm512_load_si512(shift);
        g.urow[gi] = _mm512_load_si512(urow);
        g.base[gi] = lo;
        // buf words [lo, hi+1], clipped to the ring (buf index words32 is U's last word); masked-off words read
        // as zero and only ever fill bits below a state.
        int last = hi + 1 < r.words32 ? hi + 1 : r.words32;
        int count = last - lo + 1;
        g.load_mask[gi] = (__mmask16)((1u << count) - 1);
    }
}

// s: 16-bit states (upper bits zero) -> fp32 weights, each exactly its fp16 value.
template <int CB>
inline __m512 decode16(__m512i s) {
    __m512 f;
    if constexpr (CB == CB_MUL1) {
        const __m512i x = _mm512_mullo_epi32(s, _mm512_set1_epi32((int)0x83DCD12Du));
        // The byte sum lands in the mantissa of 2^23 (float bits 0x4B000000 + sum = 2^23 + sum), and the affine
        // constant absorbs the 2^23 - 1024: the fma's one rounding of an exactly representable value is exact.
        const __m512i sum = _mm512_dpbusd_epi32(_mm512_set1_epi32(0x4B000000), x, _mm512_set1_epi32(0x01010101));
        constexpr double k_inv = 887.0 / 131072.0;
        constexpr float bias = (float)(-1329.0 / 128.0 + (1024.0 - 8388608.0) * k_inv);
        f = _mm512_fmadd_ps(_mm512_castsi512_ps(sum), _mm512_set1_ps((float)k_inv), _mm512_set1_ps(bias));
    } else {
        __m512i x = _mm512_mullo_epi32(s, _mm512_set1_epi32(CB == CB_MCG ? (int)0xCBAC1FEDu : 0x05517C72));
        if constexpr (CB == CB_3INST) x = _mm512_add_epi32(x, _mm512_set1_epi32(0x03D45AA4));
        const __m512i y = _mm512_ternarylogic_epi32(x, _mm512_set1_epi32((int)0x8FFF8FFFu),
                                                    _mm512_set1_epi32(0x3B603B60), 0x6A);  // (a & b) ^ c
        const __m512 lo = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(y));
        const __m512 hi = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(y, 16)));
        f = _mm512_add_ps(lo, hi);  // exact in fp32; the fp16 rounding below is the __hadd's
    }
    return _mm512_cvtph_ps(_mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The 16 weights of group gi of the tile at U (words32 uint32 words), in position order.
template <int CB>
inline __m512 decode_group(const uint32_t* U, int words32, const Groups& g, int gi) {
    __m512i v;
    if (gi == 0) {  // buf[0] is the ring's last word (tail-biting)
        const __m512i head = _mm512_maskz_loadu_epi32(g.load_mask[0] >> 1, U);
        v = _mm512_alignr_epi32(head, _mm512_set1_epi32((int)U[words32 - 1]), 15);
    } else {
        v = _mm512_maskz_loadu_epi32(g.load_mask[gi], U + g.base[gi] - 1);
    }
    // Four stream bytes per lane, MSB first, then the state is the 16 bits at the lane's bit offset.
    const __m512i window = _mm512_permutexvar_epi8(g.bytes[gi], v);
    return decode16<CB>(_mm512_srli_epi32(_mm512_sllv_epi32(window, g.shift[gi]), 16));
}

// One work item: the 128 output columns of chunk c for m rows of u, over every k tile of one trellis.
// acc: m * CHUNK_TILES * POSITIONS floats (64-byte aligned), ue: m * 16 vectors.
template <int CB>
void gemv_chunk(const int16_t* trellis, int tiles_k, int tiles_n, const Rate& r, const Groups& g, const float* u,
                int m, int c, float* acc, __m512* ue, const float* svh, float* y, size_t y_stride) {
    const int k = tiles_k * 16, words16 = 2 * r.words32;
    const size_t row_words = (size_t)tiles_n * words16;
    std::memset(acc, 0, sizeof(float) * m * CHUNK_TILES * POSITIONS);
    const int16_t* col0 = trellis + (size_t)c * CHUNK_TILES * words16;
    const int chunk_bytes = CHUNK_TILES * words16 * 2;
    for (int tk = 0; tk < tiles_k; ++tk) {
        if (tk + 4 < tiles_k) {  // rows of a chunk are n*K bytes apart: prefetch a few rows ahead
            const char* pf = (const char*)(col0 + (size_t)(tk + 4) * row_words);
            for (int b = 0; b < chunk_bytes; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
        }
        for (int mi = 0; mi < m; ++mi) {
            const __m512 ut = _mm512_loadu_ps(u + (size_t)mi * k + 16 * tk);
            for (int gi = 0; gi < 16; ++gi) ue[mi * 16 + gi] = _mm512_permutexvar_ps(g.urow[gi], ut);
        }
        const int16_t* row = col0 + (size_t)tk * row_words;
        for (int ct = 0; ct < CHUNK_TILES; ++ct) {
            const uint32_t* U = (const uint32_t*)(row + (size_t)ct * words16);
            float* a = acc + ct * POSITIONS;
            for (int gi = 0; gi < 16; ++gi) {
                const __m512 w = decode_group<CB>(U, r.words32, g, gi);
                for (int mi = 0; mi < m; ++mi) {
                    float* am = a + (size_t)mi * CHUNK_TILES * POSITIONS + 16 * gi;
                    _mm512_store_ps(am, _mm512_fmadd_ps(ue[mi * 16 + gi], w, _mm512_load_ps(am)));
                }
            }
        }
    }
    for (int mi = 0; mi < m; ++mi)
        finish_block(acc + (size_t)mi * CHUNK_TILES * POSITIONS, svh + c * 128, y + (size_t)mi * y_stride + c * 128);
}

// Work items: `units` (trellis, u rows, svh, y rows) x chunks, spread over the threads.
struct Units {
    const int16_t* trellis;
    size_t trellis_stride;  // int16 words between units' trellises (0: one trellis)
    const int* ids;         // per unit: which trellis/svh (nullptr: unit i uses i * stride; < 0: skip)
    const float* u;
    const float* svh;
    size_t svh_stride;
    float* y;
    int units, m;  // m rows per unit
};

template <int CB>
void gemv_units(const Units& w, int tiles_k, int tiles_n, const Rate& r, int threads) {
    Groups g;
    make_groups(r, g);
    const int k = tiles_k * 16, n = tiles_n * 16, chunks = tiles_n / CHUNK_TILES;
#pragma omp parallel num_threads(threads)
    {
        float* acc = (float*)_mm_malloc(sizeof(float) * w.m * CHUNK_TILES * POSITIONS, 64);
        __m512* ue = (__m512*)_mm_malloc(sizeof(__m512) * w.m * 16, 64);
#pragma omp for schedule(static)
        for (int item = 0; item < w.units * chunks; ++item) {
            const int unit = item / chunks, c = item % chunks;
            const int e = w.ids ? w.ids[unit] : unit;
            if (e < 0) continue;
            gemv_chunk<CB>(w.trellis + (size_t)e * w.trellis_stride, tiles_k, tiles_n, r, g,
                           w.u + (size_t)unit * w.m * k, w.m, c, acc, ue, w.svh + (size_t)e * w.svh_stride,
                           w.y + (size_t)unit * w.m * n, n);
        }
        _mm_free(ue);
        _mm_free(acc);
    }
}

template <int CB>
void decode_impl(const int16_t* trellis, int tiles_k, int tiles_n, const Rate& r, int tn0, int tn1, float* out,
                 int threads) {
    Groups g;
    make_groups(r, g);
    alignas(64) int rowpos[16][16];  // position of (row, col) inside a tile
    for (int p = 0; p < POSITIONS; ++p) rowpos[row_of(p)][col_of(p)] = p;
    const int words16 = 2 * r.words32, width = (tn1 - tn0) * 16;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int tk = 0; tk < tiles_k; ++tk)
        for (int tn = tn0; tn < tn1; ++tn) {
            const uint32_t* U = (const uint32_t*)(trellis + ((size_t)tk * tiles_n + tn) * words16);
            alignas(64) float tile[POSITIONS];
            for (int gi = 0; gi < 16; ++gi) _mm512_store_ps(tile + 16 * gi, decode_group<CB>(U, r.words32, g, gi));
            float* o = out + (size_t)tk * 16 * width + (tn - tn0) * 16;
            for (int rr = 0; rr < 16; ++rr)
                _mm512_storeu_ps(o + (size_t)rr * width,
                                 _mm512_i32gather_ps(_mm512_load_si512(rowpos[rr]), tile, 4));
        }
}

#else  // portable tier: the codebook as a 65536-entry fp32 table (exact: every entry is an fp16 value)

struct Units {
    const int16_t* trellis;
    size_t trellis_stride;
    const int* ids;
    const float* u;
    const float* svh;
    size_t svh_stride;
    float* y;
    int units, m;
};

void gemv_units_portable(const Units& w, int tiles_k, int tiles_n, const Rate& r, const float* lut, int threads) {
    const int k = tiles_k * 16, n = tiles_n * 16, words16 = 2 * r.words32, chunks = tiles_n / CHUNK_TILES;
    int urow[POSITIONS];
    for (int p = 0; p < POSITIONS; ++p) urow[p] = row_of(p);
#pragma omp parallel num_threads(threads)
    {
        float* acc = new float[(size_t)w.m * CHUNK_TILES * POSITIONS];
        float wt[POSITIONS];
#pragma omp for schedule(static)
        for (int item = 0; item < w.units * chunks; ++item) {
            const int unit = item / chunks, c = item % chunks;
            const int e = w.ids ? w.ids[unit] : unit;
            if (e < 0) continue;
            const int16_t* trellis = w.trellis + (size_t)e * w.trellis_stride;
            const float* u = w.u + (size_t)unit * w.m * k;
            std::memset(acc, 0, sizeof(float) * w.m * CHUNK_TILES * POSITIONS);
            for (int tk = 0; tk < tiles_k; ++tk)
                for (int ct = 0; ct < CHUNK_TILES; ++ct) {
                    const int tn = c * CHUNK_TILES + ct;
                    const uint32_t* U = (const uint32_t*)(trellis + ((size_t)tk * tiles_n + tn) * words16);
                    for (int p = 0; p < POSITIONS; ++p) wt[p] = lut[state_of(U, r, p)];
                    for (int mi = 0; mi < w.m; ++mi) {
                        const float* us = u + (size_t)mi * k + 16 * tk;
                        float* a = acc + ((size_t)mi * CHUNK_TILES + ct) * POSITIONS;
                        for (int p = 0; p < POSITIONS; ++p) a[p] += us[urow[p]] * wt[p];
                    }
                }
            for (int mi = 0; mi < w.m; ++mi)
                finish_block(acc + (size_t)mi * CHUNK_TILES * POSITIONS, w.svh + (size_t)e * w.svh_stride + c * 128,
                             w.y + ((size_t)unit * w.m + mi) * n + c * 128);
        }
        delete[] acc;
    }
}

#endif

}  // namespace

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
    Rate r;
    make_rate(bits2, r);
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
// (read by the portable tier only). k, n multiples of 128.
void exl3_cpu_gemv(const int16_t* trellis, int tiles_k, int tiles_n, int bits2, int codebook, const float* lut,
                   const float* x, const float* suh, const float* svh, float* u, float* y, int m, int threads) {
    input_transform(x, suh, u, m, tiles_k * 16, threads);
    const Units w{trellis, 0, nullptr, u, svh, 0, y, 1, m};
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
    const Units w{trellis, (size_t)tiles_k * tiles_n * 8 * bits2, ids, u, svh, (size_t)n, y, units, 1};
    run_units(w, tiles_k, tiles_n, bits2, codebook, lut, threads);
}

// Ŵ[:, 16*tn0 : 16*tn1] as fp32 into out (k, 16*(tn1-tn0)), row-major.
void exl3_cpu_decode(const int16_t* trellis, int tiles_k, int tiles_n, int bits2, int codebook, const float* lut,
                     int tn0, int tn1, float* out, int threads) {
    Rate r;
    make_rate(bits2, r);
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
