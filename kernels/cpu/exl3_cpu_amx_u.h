// The AMX GEMM for few rows (bf16 or fp32 x), included by exl3_cpu_amx.h inside its namespace (its tile config,
// UPPER_HALVES, transpose_qwords and panel_out serve both forms).
#pragma once

// Few rows (ops.AMX_U_MAX_ROWS): the pack above costs as much at 9 rows as at 512 (a Hadamard and three planes per
// weight), so short prompts take another exact split. u = H(x ⊙ suh) in fp32 (the GEMV's input transform) splits
// into three bf16 planes (u = u0 + u1 + u2 exactly, by truncation), and Ŵ, whose values are fp16 (11 significand
// bits), into two: h (its top 8 bits, the upper half of the fp32) and l = w - h (the other 3 bits, exact in bf16).
// All six products u_i·w_j are exact and AMX sums them in fp32: six passes instead of three, but the pack is a
// decode, the qword transpose and one split. Same B layout as pack_strip (two planes, plane_stride apart).

// h and l of one parity class's 8 decoded groups (v: group 2gg + p at gg), stored as B rows of tile row tk.
EXL3_AMX inline void split_store(__m512i* v, int p, int tk, uint16_t* bp, size_t plane_stride) {
    const __m512i pick = _mm512_load_si512(UPPER_HALVES);
    const __m512i keep = _mm512_set1_epi32((int)0xFFFF0000u);
    transpose_qwords(v);
    for (int d = 0; d < 8; ++d) {
        if (d & 2) continue;  // T_d: columns 0-7 of a B row, T_{d+2}: columns 8-15
        const __m512i lo = v[d], hi = v[d + 2];
        const __m512 llo = _mm512_sub_ps(_mm512_castsi512_ps(lo), _mm512_castsi512_ps(_mm512_and_si512(lo, keep)));
        const __m512 lhi = _mm512_sub_ps(_mm512_castsi512_ps(hi), _mm512_castsi512_ps(_mm512_and_si512(hi, keep)));
        uint16_t* dst = bp + (size_t)(8 * tk + (d >> 2) + 2 * p + 4 * (d & 1)) * 32;
        _mm512_storeu_si512(dst, _mm512_permutex2var_epi8(lo, pick, hi));
        _mm512_storeu_si512(dst + plane_stride,
                            _mm512_permutex2var_epi8(_mm512_castps_si512(llo), pick, _mm512_castps_si512(lhi)));
    }
}

template <int CB>
EXL3_AMX void pack_plain(const int16_t* trellis, int tiles_n, const Rate& r, const Groups& g, int tk0, int tn,
                         uint16_t* bp, size_t plane_stride) {
    const int words16 = 2 * r.words32;
    for (int tk = 0; tk < 8; ++tk) {
        const uint32_t* U = (const uint32_t*)(trellis + ((size_t)(tk0 + tk) * tiles_n + tn) * words16);
        for (int p = 0; p < 2; ++p) {
            __m512i v[8];
            for (int gg = 0; gg < 8; ++gg) v[gg] = _mm512_castps_si512(decode_group<CB>(U, r.words32, g, 2 * gg + p));
            split_store(v, p, tk, bp, plane_stride);
        }
    }
}

#if defined(EXL3_HAVE_FP16)
// pack_plain for mul1 with exl3_cpu_fp16.h's decode (32 weights per fp16 fma: groups 2gg and 2gg + 1 at once), where
// the CPU has AVX512-FP16 (every AMX CPU so far does); the same weights, so the same planes.
__attribute__((target("avx512fp16,avx512bf16,amx-tile,amx-bf16"))) void pack_plain_mul1_fp16(
    const int16_t* trellis, int tiles_n, const Rate& r, const Groups32& g, int tk0, int tn, uint16_t* bp,
    size_t plane_stride) {
    const int words16 = 2 * r.words32;
    for (int tk = 0; tk < 8; ++tk) {
        const uint32_t* U = (const uint32_t*)(trellis + ((size_t)(tk0 + tk) * tiles_n + tn) * words16);
        __m512i v[2][8];
        for (int gg = 0; gg < 8; ++gg) {
            __m512 w[2];
            if (gg == 0)
                weights32<true>(U, r.words32, g.bytes[0], g.ctrl[0], g.load_mask[0] >> 1, g.base[0], w);
            else
                weights32<false>(U, r.words32, g.bytes[gg], g.ctrl[gg], g.load_mask[gg], g.base[gg], w);
            v[0][gg] = _mm512_castps_si512(w[0]);
            v[1][gg] = _mm512_castps_si512(w[1]);
        }
        split_store(v[0], 0, tk, bp, plane_stride);
        split_store(v[1], 1, tk, bp, plane_stride);
    }
}
#endif

// acc (m16 x 128 fp32) += u[:, k0 : k0 + kc] · (h + l), per 16-row block and pair of column tiles: C in tiles 0-1,
// u's three planes (ups apart, zero rows past m) in tiles 2-4, h and l of one column tile in tiles 5-6.
EXL3_AMX void panel_gemm_u(const uint16_t* up, size_t ups, int m16, int k, int k0, int kc, const uint16_t* bp,
                           size_t plane_stride, float* acc) {
    const int pairs = kc / 2;
    const size_t xs = (size_t)k * 2, cs = AMX_PANEL * 4;
    for (int rb = 0; rb < m16; rb += 16)
        for (int ct = 0; ct < 8; ct += 2) {
            float* c = acc + (size_t)rb * AMX_PANEL + 16 * ct;
            _tile_loadd(0, c, cs);
            _tile_loadd(1, c + 16, cs);
            for (int kb = 0; kb < kc; kb += 32) {
                const uint16_t* a = up + (size_t)rb * k + k0 + kb;
                _tile_loadd(2, a, xs);
                _tile_loadd(3, a + ups, xs);
                _tile_loadd(4, a + 2 * ups, xs);
                const uint16_t* b = bp + ((size_t)ct * pairs + kb / 2) * 32;
                _tile_loadd(5, b, 64);
                _tile_loadd(6, b + plane_stride, 64);
                _tile_dpbf16ps(0, 2, 5);
                _tile_dpbf16ps(0, 3, 5);
                _tile_dpbf16ps(0, 4, 5);
                _tile_dpbf16ps(0, 2, 6);
                _tile_dpbf16ps(0, 3, 6);
                _tile_dpbf16ps(0, 4, 6);
                b += (size_t)pairs * 32;  // the next column tile
                _tile_loadd(5, b, 64);
                _tile_loadd(6, b + plane_stride, 64);
                _tile_dpbf16ps(1, 2, 5);
                _tile_dpbf16ps(1, 3, 5);
                _tile_dpbf16ps(1, 4, 5);
                _tile_dpbf16ps(1, 2, 6);
                _tile_dpbf16ps(1, 3, 6);
                _tile_dpbf16ps(1, 4, 6);
            }
            _tile_stored(0, c, cs);
            _tile_stored(1, c + 16, cs);
        }
}

template <int CB>
EXL3_AMX void gemm_amx_u_impl(const int16_t* trellis, int tiles_k, int tiles_n, const Rate& r, const float* x,
                              const float* suh, const float* svh, const float* bias, void* y, int y_bf16, int m,
                              int threads) {
    const Groups& g = groups_for(r);
    const int k = tiles_k * 16, n = tiles_n * 16, kmax = k < AMX_KCHUNK ? k : AMX_KCHUNK, m16 = (m + 15) / 16 * 16;
#if defined(EXL3_HAVE_FP16)
    const Groups32* g32 = CB == CB_MUL1 && fp16_active() ? &tables_for<Groups32, make_groups32>(r) : nullptr;
#endif
    std::vector<float> u((size_t)m * k);
    input_transform(x, suh, u.data(), m, k, threads);
    const size_t ups = (size_t)m16 * k;
    std::vector<uint16_t> up(3 * ups, 0);
#pragma omp parallel for num_threads(threads) schedule(static) if (m * k >= 65536)
    for (size_t i = 0; i < (size_t)m * k; ++i) {  // u = u0 + u1 + u2: each the upper half of what is left
        float rest = u[i];
        for (int pl = 0; pl < 3; ++pl) {
            uint32_t b;
            std::memcpy(&b, &rest, 4);
            b &= 0xFFFF0000u;
            up[pl * ups + i] = (uint16_t)(b >> 16);
            float top;
            std::memcpy(&top, &b, 4);
            rest -= top;
        }
    }
#pragma omp parallel num_threads(threads)
    {
        TileConfig cfg;
        for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
        _tile_loadconfig(&cfg);
        uint16_t* bp = (uint16_t*)_mm_malloc(sizeof(uint16_t) * 2 * kmax * AMX_PANEL, 64);
        float* acc = (float*)_mm_malloc(sizeof(float) * m16 * AMX_PANEL, 64);
#pragma omp for schedule(dynamic)
        for (int panel = 0; panel < n / AMX_PANEL; ++panel) {
            std::memset(acc, 0, sizeof(float) * m16 * AMX_PANEL);
            for (int k0 = 0; k0 < k; k0 += AMX_KCHUNK) {
                const int kc = k - k0 < AMX_KCHUNK ? k - k0 : AMX_KCHUNK;
                const size_t plane_stride = (size_t)8 * (kc / 2) * 32;
                for (int kb = 0; kb < kc; kb += 128)
                    for (int tn = 0; tn < 8; ++tn) {
                        uint16_t* at = bp + ((size_t)tn * (kc / 2) + kb / 2) * 32;
#if defined(EXL3_HAVE_FP16)
                        if (g32) {
                            pack_plain_mul1_fp16(trellis, tiles_n, r, *g32, (k0 + kb) / 16, panel * 8 + tn, at,
                                                 plane_stride);
                            continue;
                        }
#endif
                        pack_plain<CB>(trellis, tiles_n, r, g, (k0 + kb) / 16, panel * 8 + tn, at, plane_stride);
                    }
                panel_gemm_u(up.data(), ups, m16, k, k0, kc, bp, plane_stride, acc);
            }
            panel_out(acc, m, svh, bias, y, y_bf16, n, panel * AMX_PANEL);
        }
        _mm_free(acc);
        _mm_free(bp);
        _tile_release();
    }
}
