// Prefill on AMX (the avx512 tier, on CPUs with AMX-BF16; ops.amx_active decides): bf16 activations x times
// W' = diag(suh) · H · Ŵ, one 128-column panel at a time, then the output transform (H, ⊙ svh) on the fp32 sums.
// The input transform is folded into the weight, so x enters the GEMM as it is (bf16, exact). W' is computed in fp32
// and split exactly into bf16 planes (W' = p0 + p1 + p2, 8 significand bits each: fp32's 24), so with three planes
// every AMX product is exact and the sums stay in fp32: an fp32 GEMM's accuracy at bf16's speed per plane. Few rows
// (bf16 or fp32 x) take a second exact split instead, whose pack is cheaper: gemm_amx_u_impl below.
#pragma once
#if defined(EXL3_AVX512) && defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) \
    && __has_include(<amxbf16intrin.h>)
#define EXL3_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

#define EXL3_AMX __attribute__((target("avx512bf16,amx-tile,amx-bf16")))

namespace {

constexpr int AMX_PANEL = 128;   // output columns per work item: one Hadamard block
constexpr int AMX_KCHUNK = 1024;  // k rows of W' packed at a time (3 planes: 768 KiB, L2-resident; 1024 measured best)
constexpr int AMX_MAX_PLANES = 3;

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Linux hands out the AMX register state only on request, once per process (every thread then has it).
bool amx_permitted() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return ok;
}

// The in-register pack. A decoded group gi (16 consecutive ring positions, lane l) holds tile row
// r = 4(gi&1) + 2(l>>3) + (l&1) + 8((l>>1)&1) and column (gi>>1) + 8((l>>2)&1) (core.h's row_of/col_of); qword d of
// a group is its lanes (2d, 2d+1): rows r, r+1 of one column, the k pair AMX's B layout keeps together. An 8 x 8
// qword transpose of a parity class's groups (gi = 2g + p) gives T_d = [qword d of groups p, 2+p, ..., 14+p]:
// columns g + 8((d>>1)&1), rows 4p + 2(d>>2) + 8(d&1) + {0, 1}. The Hadamard transform down a column then is one
// lane butterfly (r's bit 0), butterflies between the T_d (bits 1-3: d^4, p, d^1) and across the 8 tiles (bits 4-6).
inline void transpose_qwords(__m512i* v) {
    __m512i l[8], m[8];
    for (int j = 0; j < 4; ++j) {
        l[2 * j] = _mm512_unpacklo_epi64(v[2 * j], v[2 * j + 1]);  // qwords 0, 2, 4, 6 of the pair
        l[2 * j + 1] = _mm512_unpackhi_epi64(v[2 * j], v[2 * j + 1]);
    }
    for (int h = 0; h < 2; ++h)  // groups 0-3, then 4-7
        for (int j = 0; j < 2; ++j) {
            m[4 * h + 2 * j] = _mm512_shuffle_i64x2(l[4 * h + j], l[4 * h + 2 + j], 0x88);      // qwords 0/4 (j: 1/5)
            m[4 * h + 2 * j + 1] = _mm512_shuffle_i64x2(l[4 * h + j], l[4 * h + 2 + j], 0xDD);  // qwords 2/6 (3/7)
        }
    // m[0]: q0/q4, m[1]: q2/q6, m[2]: q1/q5, m[3]: q3/q7 of groups 0-3; m[4..7] the same of groups 4-7.
    const int first[4] = {0, 2, 1, 3};
    for (int i = 0; i < 4; ++i) {
        v[first[i]] = _mm512_shuffle_i64x2(m[i], m[4 + i], 0x88);
        v[first[i] + 4] = _mm512_shuffle_i64x2(m[i], m[4 + i], 0xDD);
    }
}

// Byte indices of the upper halves of 32 dwords (a's 16, then b's): fp32 pairs truncated to bf16 by one vpermt2b.
alignas(64) constexpr uint8_t UPPER_HALVES[64] = {
    2,  3,  6,  7,  10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31, 34,  35,  38,  39,  42,  43,
    46, 47, 50, 51, 54, 55, 58, 59, 62, 63, 66, 67, 70, 71, 74, 75, 78,  79,  82,  83,  86,  87,
    90, 91, 94, 95, 98, 99, 102, 103, 106, 107, 110, 111, 114, 115, 118, 119, 122, 123, 126, 127};

inline void butterfly(__m512& a, __m512& b) {
    const __m512 s = _mm512_add_ps(a, b);
    b = _mm512_sub_ps(a, b);
    a = s;
}

// Tile row tk of the block: its 16 decoded groups (w[p][gg]: group 2gg + p) transformed down the columns' first 4 row
// bits (lane butterfly, T_d butterflies, parity classes) into s, in T order.
EXL3_AMX inline void strip_rows(__m512 (&w)[2][8], int tk, float* s) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi64((long long)0xBF8000003F800000ull));  // +1, -1
    __m512 t[2][8];
    for (int p = 0; p < 2; ++p) {
        __m512i v[8];
        for (int gg = 0; gg < 8; ++gg)  // rows r, r+1 (adjacent lanes): r's lane gets w + partner, r+1's partner - w
            v[gg] = _mm512_castps_si512(_mm512_fmadd_ps(w[p][gg], sign, _mm512_permute_ps(w[p][gg], 0xB1)));
        transpose_qwords(v);
        for (int d = 0; d < 8; ++d) t[p][d] = _mm512_castsi512_ps(v[d]);
        for (int d = 0; d < 4; ++d) butterfly(t[p][d], t[p][d + 4]);               // row bit 1
        for (int d = 0; d < 8; d += 2) butterfly(t[p][d], t[p][d + 1]);            // row bit 3
    }
    for (int d = 0; d < 8; ++d) butterfly(t[0][d], t[1][d]);                       // row bit 2
    for (int p = 0; p < 2; ++p)
        for (int d = 0; d < 8; ++d) _mm512_store_ps(s + tk * 256 + 16 * (8 * p + d), t[p][d]);
}

// The block's transform across its 8 tile rows (row bits 4-6), ⊙ suh, and the split into planes, stored.
EXL3_AMX inline void strip_planes(const float* s, const float* suh, int planes, uint16_t* bp, size_t plane_stride) {
    const __m512i pick = _mm512_load_si512(UPPER_HALVES);
    const __m512i keep = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int p = 0; p < 2; ++p)
        for (int d = 0; d < 8; ++d) {
            if (d & 2) continue;  // T_d holds columns 0-7 of a B row, T_{d+2} columns 8-15
            __m512 lo[8], hi[8];
            for (int tk = 0; tk < 8; ++tk) {
                lo[tk] = _mm512_load_ps(s + tk * 256 + 16 * (8 * p + d));
                hi[tk] = _mm512_load_ps(s + tk * 256 + 16 * (8 * p + d + 2));
            }
            for (int h = 1; h < 8; h <<= 1)  // across tiles
                for (int i = 0; i < 8; i += 2 * h)
                    for (int j = i; j < i + h; ++j) {
                        butterfly(lo[j], lo[j + h]);
                        butterfly(hi[j], hi[j + h]);
                    }
            const int row = 4 * p + 2 * (d >> 2) + 8 * (d & 1), pair = (d >> 2) + 2 * p + 4 * (d & 1);
            for (int tk = 0; tk < 8; ++tk) {
                double pair_suh;  // suh[row], suh[row + 1] in every qword
                std::memcpy(&pair_suh, suh + 16 * tk + row, sizeof(pair_suh));
                const __m512 sv = _mm512_castpd_ps(_mm512_set1_pd(pair_suh));
                __m512 a = _mm512_mul_ps(lo[tk], sv), b = _mm512_mul_ps(hi[tk], sv);
                uint16_t* dst = bp + (size_t)(8 * tk + pair) * 32;
                for (int pl = 0; pl < planes; ++pl) {
                    const __m512i ta = _mm512_and_si512(_mm512_castps_si512(a), keep);
                    const __m512i tb = _mm512_and_si512(_mm512_castps_si512(b), keep);
                    _mm512_storeu_si512(dst + pl * plane_stride, _mm512_permutex2var_epi8(ta, pick, tb));
                    a = _mm512_sub_ps(a, _mm512_castsi512_ps(ta));
                    b = _mm512_sub_ps(b, _mm512_castsi512_ps(tb));
                }
            }
        }
}


// W' = diag(suh) · H · Ŵ for tile column tn over 8 tile rows from tk0 (128 x 16), split into planes (truncation:
// w = p0 + p1 + p2 exactly), stored in AMX's B layout: per plane (plane_stride apart) rows of 16 columns x one k pair,
// bp at the block's first pair. suh: this block's 128 values, already times 1/sqrt(128). s: 2048 floats.
template <int CB>
EXL3_AMX void pack_strip(const int16_t* trellis, int tiles_n, const Rate& r, const Groups& g, int tk0, int tn,
                         const float* suh, int planes, uint16_t* bp, size_t plane_stride, float* s) {
    const int words16 = 2 * r.words32;
    for (int tk = 0; tk < 8; ++tk) {
        const uint32_t* U = (const uint32_t*)(trellis + ((size_t)(tk0 + tk) * tiles_n + tn) * words16);
        __m512 w[2][8];
        for (int p = 0; p < 2; ++p)
            for (int gg = 0; gg < 8; ++gg) w[p][gg] = decode_group<CB>(U, r.words32, g, 2 * gg + p);
        strip_rows(w, tk, s);
    }
    strip_planes(s, suh, planes, bp, plane_stride);
}

#if defined(EXL3_HAVE_FP16)
// pack_strip for mul1 with exl3_cpu_fp16.h's decode (32 weights per fp16 fma: groups 2gg and 2gg + 1 at once), where
// the CPU has AVX512-FP16 (every AMX CPU so far does); the same weights, so the same planes.
__attribute__((target("avx512fp16,avx512bf16,amx-tile,amx-bf16"))) void pack_strip_mul1_fp16(
    const int16_t* trellis, int tiles_n, const Rate& r, const Groups32& g, int tk0, int tn, const float* suh,
    int planes, uint16_t* bp, size_t plane_stride, float* s) {
    const int words16 = 2 * r.words32;
    for (int tk = 0; tk < 8; ++tk) {
        const uint32_t* U = (const uint32_t*)(trellis + ((size_t)(tk0 + tk) * tiles_n + tn) * words16);
        __m512 w[2][8];
        for (int gg = 0; gg < 8; ++gg) {
            __m512 pair[2];
            if (gg == 0)
                weights32<true>(U, r.words32, g.bytes[0], g.ctrl[0], g.load_mask[0] >> 1, g.base[0], pair);
            else
                weights32<false>(U, r.words32, g.bytes[gg], g.ctrl[gg], g.load_mask[gg], g.base[gg], pair);
            w[0][gg] = pair[0];
            w[1][gg] = pair[1];
        }
        strip_rows(w, tk, s);
    }
    strip_planes(s, suh, planes, bp, plane_stride);
}
#endif

// One panel's GEMM over a k chunk: acc (m rounded up to 32, x 128, fp32) += x[:, k0 : k0 + kc] · (Σ planes), in
// 32 x 32 output blocks (tiles 0-3); x's rows in tiles 4-5 (the last, partial row block from `tail`: 32 rows,
// zero-padded); a column pair's plane in tiles 6-7. (Measured: packing x into contiguous A tiles first, or walking
// column pairs outermost, was no faster.)
EXL3_AMX void panel_gemm(const uint16_t* x, const uint16_t* tail, int m, int k, int k0, int kc, const uint16_t* bp,
                         int planes, float* acc) {
    const int pairs = kc / 2;
    const size_t xs = (size_t)k * 2, cs = AMX_PANEL * 4;
    for (int rb = 0; rb < m; rb += 32)
        for (int cp = 0; cp < AMX_PANEL; cp += 32) {
            float* c = acc + (size_t)rb * AMX_PANEL + cp;
            const uint16_t* rows = rb + 32 <= m ? x + (size_t)rb * k : tail;
            _tile_loadd(0, c, cs);
            _tile_loadd(1, c + 16, cs);
            _tile_loadd(2, c + 16 * AMX_PANEL, cs);
            _tile_loadd(3, c + 16 * AMX_PANEL + 16, cs);
            for (int kb = 0; kb < kc; kb += 32) {
                const uint16_t* a = rows + k0 + kb;
                _tile_loadd(4, a, xs);
                _tile_loadd(5, a + 16 * (size_t)k, xs);
                for (int pl = 0; pl < planes; ++pl) {
                    const uint16_t* b = bp + (((size_t)pl * 8 + cp / 16) * pairs + kb / 2) * 32;
                    _tile_loadd(6, b, 64);
                    _tile_loadd(7, b + (size_t)pairs * 32, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c, cs);
            _tile_stored(1, c + 16, cs);
            _tile_stored(2, c + 16 * AMX_PANEL, cs);
            _tile_stored(3, c + 16 * AMX_PANEL + 16, cs);
        }
}

// y[:m, panel] = H(acc) ⊙ svh (+ bias), as bf16 (round to nearest even) or fp32.
EXL3_AMX void panel_out(float* acc, int m, const float* svh, const float* bias, void* y, int y_bf16, int n, int col) {
    for (int row = 0; row < m; ++row) {
        float* a = acc + (size_t)row * AMX_PANEL;
        fwht128(a);
        for (int c = 0; c < AMX_PANEL; c += 16) {
            __m512 v = _mm512_mul_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(svh + col + c));
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + col + c));
            const size_t at = (size_t)row * n + col + c;
            if (y_bf16)
                _mm256_storeu_si256((__m256i*)((uint16_t*)y + at), (__m256i)_mm512_cvtneps_pbh(v));
            else
                _mm512_storeu_ps((float*)y + at, v);
        }
    }
}

template <int CB>
EXL3_AMX void gemm_amx_impl(const int16_t* trellis, int tiles_k, int tiles_n, const Rate& r, const uint16_t* x,
                            const float* suh, const float* svh, const float* bias, void* y, int y_bf16, int m,
                            int planes, int threads) {
    const Groups& g = groups_for(r);
    const int k = tiles_k * 16, n = tiles_n * 16, kmax = k < AMX_KCHUNK ? k : AMX_KCHUNK;
#if defined(EXL3_HAVE_FP16)
    const Groups32* g32 = CB == CB_MUL1 && fp16_active() ? &tables_for<Groups32, make_groups32>(r) : nullptr;
#endif
    std::vector<float> suh_h(k);
    for (int i = 0; i < k; ++i) suh_h[i] = suh[i] * HAD_SCALE;
    const int m_pad = (m + 31) / 32 * 32, full = m / 32 * 32;
    std::vector<uint16_t> tail((size_t)32 * k, 0);
    std::memcpy(tail.data(), x + (size_t)full * k, sizeof(uint16_t) * (m - full) * k);
#pragma omp parallel num_threads(threads)
    {
        TileConfig cfg;
        for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
        _tile_loadconfig(&cfg);
        float* s = (float*)_mm_malloc(sizeof(float) * 8 * POSITIONS, 64);
        uint16_t* bp = (uint16_t*)_mm_malloc(sizeof(uint16_t) * planes * kmax * AMX_PANEL, 64);
        float* acc = (float*)_mm_malloc(sizeof(float) * m_pad * AMX_PANEL, 64);
#pragma omp for schedule(dynamic)
        for (int panel = 0; panel < n / AMX_PANEL; ++panel) {
            std::memset(acc, 0, sizeof(float) * m_pad * AMX_PANEL);
            for (int k0 = 0; k0 < k; k0 += AMX_KCHUNK) {
                const int kc = k - k0 < AMX_KCHUNK ? k - k0 : AMX_KCHUNK;
                for (int kb = 0; kb < kc; kb += 128)
                    for (int tn = 0; tn < 8; ++tn) {
                        uint16_t* at = bp + ((size_t)tn * (kc / 2) + kb / 2) * 32;
                        const size_t plane_stride = (size_t)8 * (kc / 2) * 32;
#if defined(EXL3_HAVE_FP16)
                        if (g32) {
                            pack_strip_mul1_fp16(trellis, tiles_n, r, *g32, (k0 + kb) / 16, panel * 8 + tn,
                                                 suh_h.data() + k0 + kb, planes, at, plane_stride, s);
                            continue;
                        }
#endif
                        pack_strip<CB>(trellis, tiles_n, r, g, (k0 + kb) / 16, panel * 8 + tn, suh_h.data() + k0 + kb,
                                       planes, at, plane_stride, s);
                    }
                panel_gemm(x, tail.data(), m, k, k0, kc, bp, planes, acc);
            }
            panel_out(acc, m, svh, bias, y, y_bf16, n, panel * AMX_PANEL);
        }
        _mm_free(acc);
        _mm_free(bp);
        _mm_free(s);
        _tile_release();
    }
}

#include "exl3_cpu_amx_u.h"

}  // namespace
#endif
