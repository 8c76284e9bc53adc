// Shared by every tier of the CPU EXL3 library (exl3_cpu.cpp includes it once): the ring's rate tables, the
// Hadamard transforms and the work-item description.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
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

// Tables are built once per rate (bits2 = 2..16) and shared by every call: building them per call cost about as
// much as a small layer's whole GEMV.
constexpr int MAX_BITS2 = 16;

const Rate& rate_for(int bits2) {
    static Rate rates[MAX_BITS2 + 1];
    static std::once_flag once[MAX_BITS2 + 1];
    std::call_once(once[bits2], [bits2] { make_rate(bits2, rates[bits2]); });
    return rates[bits2];
}

// Each tier's own per-rate tables (its decode's lane layout), made the same way: once per rate, on first use.
template <class Tables, void (*make)(const Rate&, Tables&)>
const Tables& tables_for(const Rate& r) {
    static Tables tables[MAX_BITS2 + 1];
    static std::once_flag once[MAX_BITS2 + 1];
    const int bits2 = r.words32 / 4;
    std::call_once(once[bits2], [&r, bits2] { make(r, tables[bits2]); });
    return tables[bits2];
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
#if defined(EXL3_AVX512)
// The same butterflies in the same order, in registers: stages h = 1..8 pair lanes of one register (a permute, then
// add or subtract by lane mask), h = 16..64 pair whole registers.
inline void fwht128(float* v) {
    __m512 r[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm512_loadu_ps(v + 16 * i);
    for (int h = 1; h < 16; h <<= 1) {
        alignas(64) int idx[16];
        for (int l = 0; l < 16; ++l) idx[l] = l ^ h;
        const __m512i perm = _mm512_load_si512(idx);
        const __mmask16 upper = (__mmask16)(h == 1 ? 0xAAAA : h == 2 ? 0xCCCC : h == 4 ? 0xF0F0 : 0xFF00);
        for (int i = 0; i < 8; ++i) {
            const __m512 y = _mm512_permutexvar_ps(perm, r[i]);
            r[i] = _mm512_mask_sub_ps(_mm512_add_ps(r[i], y), upper, y, r[i]);  // lower: v + partner; upper: partner - v
        }
    }
    for (int h = 1; h < 8; h <<= 1)
        for (int i = 0; i < 8; i += 2 * h)
            for (int j = i; j < i + h; ++j) {
                const __m512 a = r[j], b = r[j + h];
                r[j] = _mm512_add_ps(a, b);
                r[j + h] = _mm512_sub_ps(a, b);
            }
    const __m512 scale = _mm512_set1_ps(HAD_SCALE);
    for (int i = 0; i < 8; ++i) _mm512_storeu_ps(v + 16 * i, _mm512_mul_ps(r[i], scale));
}
#else
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
#endif

// u[col:col+128] = H(x[col:col+128] ⊙ suh[col:col+128]): one 128-block of one row.
inline void transform_block(const float* x, const float* suh, float* u, int col) {
    for (int i = 0; i < 128; ++i) u[col + i] = x[col + i] * suh[col + i];
    fwht128(u + col);
}

// u = H(x ⊙ suh) per 128-block, rows in parallel.
void input_transform(const float* x, const float* suh, float* u, int m, int k, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (m * k >= 16384)
    for (int b = 0; b < m * (k / 128); ++b) {
        const int row = b / (k / 128), col = (b % (k / 128)) * 128;
        transform_block(x + (size_t)row * k, suh, u + (size_t)row * k, col);
    }
}

// z (16 tile columns' 256 position sums) -> y block of 128 columns: reduce, H, ⊙ svh.
void finish_block(const float* acc, const float* svh, float* y) {
    alignas(32) float z[128];
#if defined(EXL3_AVX512) || defined(EXL3_AVX2)
    // In vectors (the scalar loop was 7 % of a one-row GEMV on Zen 4). By col_of, positions 32c .. 32c + 31 (two
    // groups of 16) hold column c at p % 8 < 4 and column c + 8 at p % 8 >= 4: adding their four 8-float quarters
    // leaves [4 sums of column c | 4 of column c + 8], and two rounds of hadd finish four columns' sums at once.
    for (int ct = 0; ct < CHUNK_TILES; ++ct) {
        const float* a = acc + ct * POSITIONS;
        __m256 h[8];
        for (int c = 0; c < 8; ++c) {
            const float* q = a + 32 * c;
            h[c] = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(q + 16)),
                                 _mm256_add_ps(_mm256_loadu_ps(q + 8), _mm256_loadu_ps(q + 24)));
        }
        // lo = [columns 0-3 | 8-11], hi = [4-7 | 12-15]
        const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
        const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
        _mm256_store_ps(z + 16 * ct, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_store_ps(z + 16 * ct + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
#else
    for (int ct = 0; ct < CHUNK_TILES; ++ct) {
        const float* a = acc + ct * POSITIONS;
        float cols[16] = {0};
        for (int p = 0; p < POSITIONS; ++p) cols[col_of(p)] += a[p];
        for (int c = 0; c < 16; ++c) z[16 * ct + c] = cols[c];
    }
#endif
    fwht128(z);
    for (int i = 0; i < 128; ++i) y[i] = z[i] * svh[i];
}

// Work items: `units` (trellis, u rows, svh, y rows) x 128-column chunks, spread over the threads.
struct Units {
    const int16_t* trellis;
    size_t trellis_stride;  // int16 words between units' trellises (0: one trellis)
    const int* ids;         // per unit: which trellis/svh (nullptr: unit i uses i * stride; < 0: skip)
    const int* start;       // per unit: its first row of u and y, start[units] = all rows (nullptr: i * m)
    const float* u;
    const float* svh;
    size_t svh_stride;
    float* y;
    int units, m;  // m rows per unit (with start: the most any unit has)
    // int8 activations (mul1 only, opt-in): u's rows quantized in place (quantize_rows); per row qab[2r] scales the
    // integer sums, qab[2r+1] is the codebook offset's share of one position. nullptr: exact fp32 activations.
    const float* qab = nullptr;

    int first_row(int i) const { return start ? start[i] : i * m; }
    int rows(int i) const { return start ? start[i + 1] - start[i] : m; }
};

// mul1's weight before its fp16 rounding is MUL1_SCALE * bytesum + MUL1_OFFSET (format spec: the byte sum of
// state * MUL1_HASH, centred and scaled).
constexpr uint32_t MUL1_HASH = 0x83DCD12Du;
constexpr float MUL1_SCALE = 887.0f / 131072.0f;
constexpr float MUL1_OFFSET = -442.0f / 128.0f;

// The int8 mode's activations: each row of u (fp32, k wide) becomes int8 with one scale per row (absmax / 127),
// each value repeated in the 4 bytes of its int32 slot (vpdpbusd multiplies all 4 bytes of a lane's state hash by
// it), written over u. Row r's integer sums z then give y = qab[2r] * z + 16 * qab[2r+1] per column (16 positions).
inline void quantize_row(float* ur, int k, float* qab) {
    float amax = 0.0f;
    for (int i = 0; i < k; ++i) amax = ur[i] > amax ? ur[i] : (-ur[i] > amax ? -ur[i] : amax);
    const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t* q4 = (int32_t*)ur;
    long sum = 0;
    for (int i = 0; i < k; ++i) {
        const int q = (int)__builtin_nearbyintf(ur[i] * inv);
        sum += q;
        q4[i] = (int32_t)((uint32_t)(uint8_t)(int8_t)q * 0x01010101u);
    }
    qab[0] = scale * MUL1_SCALE;
    qab[1] = scale * MUL1_OFFSET * (float)sum / 16.0f;
}

void quantize_rows(float* u, int rows, int k, float* qab, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * k >= 16384)
    for (int r = 0; r < rows; ++r) quantize_row(u + (size_t)r * k, k, qab + 2 * r);
}

}  // namespace
