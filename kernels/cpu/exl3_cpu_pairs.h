// The one-row GEMV of the avx512 tier without AVX512-FP16 (Zen 4, Ice Lake; any codebook): the states of two groups
// (2pi, 2pi + 1: ring positions 32pi .. 32pi + 31) of a tile come out of one load, one vpermb and one vpmultishiftqb,
// as the two 16-bit halves of each 32-bit lane, split by an and and a shift: half the permutes per weight of the
// group-at-a-time loop (the permute ports were a share of its bound: -4 % per weight on Zen 4).
// Included inside exl3_cpu_avx512.h's namespace, after decode16 and prefetch_rows.

// Qword q of pair pi holds positions a = 32pi + 2q, a + 1 (group 2pi's lanes 2q, 2q + 1) and b = a + 16, b + 1
// (group 2pi + 1's): its top 4 bytes are the stream from a's state's first byte on, its low 4 bytes the stream from
// b's (each most significant first). Two states 1..8 bits apart (K <= 8) span at most 7 + 8 + 16 = 31 bits: each
// pair fits its 4 bytes. Lane 2q's halves are (a, b), lane 2q + 1's (a + 1, b + 1).
struct Pairs {
    __m512i bytes[8], ctrl[8];
    __mmask16 load_mask[8];
    int base[8];
};

void make_pairs(const Rate& r, Pairs& g) {
    for (int pi = 0; pi < 8; ++pi) {
        int lo = 1 << 30, hi = 0;
        for (int p = 32 * pi; p < 32 * pi + 32; ++p) {
            lo = r.i0[p] < lo ? r.i0[p] : lo;
            hi = r.i0[p] > hi ? r.i0[p] : hi;
        }
        alignas(64) uint8_t bytes[64], ctrl[64];
        for (int q = 0; q < 8; ++q)
            for (int half = 0; half < 2; ++half) {  // half 1: positions a (top 4 bytes), half 0: b (low 4 bytes)
                const int p0 = 32 * pi + 2 * q + (half ? 0 : 16), first = (32 * r.i0[p0] + r.off[p0]) >> 3;
                for (int t = 0; t < 4; ++t) {  // qword byte 4 half + t holds stream byte first + 3 - t
                    const int j = first + 3 - t;  // in buf word j / 4 at little-endian byte 3 - j % 4 (MSB first)
                    bytes[8 * q + 4 * half + t] = (uint8_t)((4 * ((j >> 2) - lo) + 3 - (j & 3)) & 63);
                }
                for (int h = 0; h < 2; ++h) {  // the state's low bit: 32 half + 16 - rel (rel: its first bit)
                    const int rel = 32 * r.i0[p0 + h] + r.off[p0 + h] - 8 * first, at = 8 * q + 4 * h + 2 * (1 - half);
                    ctrl[at] = (uint8_t)(32 * half + 16 - rel);
                    ctrl[at + 1] = (uint8_t)(32 * half + 24 - rel);
                }
            }
        g.bytes[pi] = _mm512_load_si512(bytes);
        g.ctrl[pi] = _mm512_load_si512(ctrl);
        g.base[pi] = lo;
        const int last = hi + 1 < r.words32 ? hi + 1 : r.words32, count = last - lo + 1;  // as group_tables
        g.load_mask[pi] = (__mmask16)((1u << count) - 1);
    }
}

// Pair pi of the tile at U: group 2pi's 16 weights into w[0], group 2pi + 1's into w[1].
template <int CB, bool Head>
inline void pair_weights(const uint32_t* U, int words32, __m512i bytes, __m512i ctrl, __mmask16 mask, int base,
                         __m512 w[2]) {
    const __m512i v = Head ? _mm512_alignr_epi32(_mm512_maskz_loadu_epi32(mask, U), _mm512_set1_epi32((int)U[words32 - 1]), 15)
                           : _mm512_maskz_loadu_epi32(mask, U + base - 1);
    const __m512i s = _mm512_multishift_epi64_epi8(ctrl, _mm512_permutexvar_epi8(bytes, v));
    w[0] = decode16<CB>(_mm512_and_si512(s, _mm512_set1_epi32(0xFFFF)));
    w[1] = decode16<CB>(_mm512_srli_epi32(s, 16));
}

template <int CB, bool Head>
inline void pair_rows2(const Pairs& g, int pi, const int16_t* row0, const int16_t* row1, int words16, int words32,
                       const __m512 ug[4], float* a) {
    const __m512i bytes = g.bytes[pi], ctrl = g.ctrl[pi];
    const __mmask16 mask = Head ? g.load_mask[pi] >> 1 : g.load_mask[pi];
    const int base = g.base[pi];
#pragma GCC unroll 8
    for (int ct = 0; ct < CHUNK_TILES; ++ct, a += POSITIONS) {
        __m512 w0[2], w1[2];
        pair_weights<CB, Head>((const uint32_t*)(row0 + (size_t)ct * words16), words32, bytes, ctrl, mask, base, w0);
        pair_weights<CB, Head>((const uint32_t*)(row1 + (size_t)ct * words16), words32, bytes, ctrl, mask, base, w1);
        _mm512_store_ps(a, _mm512_fmadd_ps(ug[1], w1[0], _mm512_fmadd_ps(ug[0], w0[0], _mm512_load_ps(a))));
        _mm512_store_ps(a + 16, _mm512_fmadd_ps(ug[3], w1[1], _mm512_fmadd_ps(ug[2], w0[1], _mm512_load_ps(a + 16))));
    }
}

// gemv_chunk's one-row loop (its accumulators, zeroed by it; rows, prefetch and output transform as there).
template <int CB>
void gemv1_pairs(const int16_t* trellis, int tiles_k, int tiles_n, const Rate& r, const __m512i* urow, const float* u,
                 int c, float* acc, const float* svh, float* y) {
    const Pairs& g = tables_for<Pairs, make_pairs>(r);
    const int words16 = 2 * r.words32, chunk_bytes = CHUNK_TILES * words16 * 2;
    const size_t row_words = (size_t)tiles_n * words16;
    const int16_t* col0 = trellis + (size_t)c * CHUNK_TILES * words16;
    for (int tk = 0; tk < tiles_k; tk += 2) {
        prefetch_rows(col0, row_words, chunk_bytes, tk + 4, tk + 6 < tiles_k ? tk + 6 : tiles_k);
        const __m512 u0 = _mm512_loadu_ps(u + 16 * tk), u1 = _mm512_loadu_ps(u + 16 * tk + 16);
        const int16_t* row0 = col0 + (size_t)tk * row_words;
        const int16_t* row1 = row0 + row_words;
        for (int pi = 0; pi < 8; ++pi) {
            const __m512 ug[4] = {_mm512_permutexvar_ps(urow[2 * pi], u0), _mm512_permutexvar_ps(urow[2 * pi], u1),
                                  _mm512_permutexvar_ps(urow[2 * pi + 1], u0), _mm512_permutexvar_ps(urow[2 * pi + 1], u1)};
            if (pi == 0) pair_rows2<CB, true>(g, pi, row0, row1, words16, r.words32, ug, acc);
            else pair_rows2<CB, false>(g, pi, row0, row1, words16, r.words32, ug, acc + 32 * pi);
        }
    }
    finish_block(acc, svh + c * 128, y + c * 128);
}
