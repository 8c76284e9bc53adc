// The one-row mul1 GEMV with AVX512-FP16 (the avx512 tier, on CPUs that have it: Sapphire Rapids and later; others
// keep exl3_cpu_avx512.h's loop). 32 ring positions per vector in 16-bit lanes instead of 16 in 32-bit lanes, and
// mul1's weight is one fp16 fma: s · (887/2^17) + (-442/128) with s, both constants and 1024 + s exact in fp16, so its
// one rounding is the reference's fp16 rounding of the exact value (no Veltkamp split). Per 32 weights: 2 permutes,
// 4 multiplies/adds for the hash, 4 for the byte sum, the fma, 2 widenings to fp32 and the row's 2 fmas: about 18
// vector µops against the 32-bit loop's 22.
#pragma once
#if defined(EXL3_AVX512) && defined(__GNUC__) && __GNUC__ >= 12 && __has_include(<avx512fp16intrin.h>)
#define EXL3_HAVE_FP16 1

#define EXL3_FP16 __attribute__((target("avx512fp16")))

// Included inside exl3_cpu_avx512.h's namespace, after its Groups (the urow tables) and before gemv_chunk.

// Where the CPU has AVX512-FP16; exl3_cpu_fp16(0) turns it off (tests check both loops on one machine).
bool fp16_supported() {
    static const bool ok = __builtin_cpu_supports("avx512fp16");
    return ok;
}
std::atomic<bool> fp16_on{true};
inline bool fp16_active() { return fp16_on.load(std::memory_order_relaxed) && fp16_supported(); }

// Group gi (0..7) is ring positions 32gi..32gi+31, i.e. the 32-bit loop's groups 2gi and 2gi+1: lane j of its 16-bit
// states is position 32gi+j. Qword q holds positions 32gi+4q..+3: its 8 bytes are the stream bytes from the first
// state's first byte on (most significant first), and lane h takes its 16 state bits at 48 - rel (rel: the state's
// first bit in the qword, at most 7 + 3 * 8 + 1 = 32).
struct Groups32 {
    __m512i bytes[8], ctrl[8];
    __mmask16 load_mask[8];
    int base[8];
};

void make_groups32(const Rate& r, Groups32& g) {
    for (int gi = 0; gi < 8; ++gi) group_tables<32>(r, gi, g.bytes[gi], g.ctrl[gi], g.load_mask[gi], g.base[gi]);
}

// The 32 weights of one group of the tile at U: lanes 0-15 in w[0], 16-31 in w[1], each exactly its fp16 value.
template <bool Head>
EXL3_FP16 inline void weights32(const uint32_t* U, int words32, __m512i bytes, __m512i ctrl, __mmask16 mask, int base,
                                __m512 w[2]) {
    const __m512i v = Head ? _mm512_alignr_epi32(_mm512_maskz_loadu_epi32(mask, U), _mm512_set1_epi32((int)U[words32 - 1]), 15)
                           : _mm512_maskz_loadu_epi32(mask, U + base - 1);
    const __m512i s = _mm512_multishift_epi64_epi8(ctrl, _mm512_permutexvar_epi8(bytes, v));
    // state * MUL1_HASH mod 2^32 in 16-bit halves: lo = s * hash_lo, hi = s * hash_hi + the high half of s * hash_lo
    const __m512i hash_lo = _mm512_set1_epi16((short)(MUL1_HASH & 0xFFFF));
    const __m512i lo = _mm512_mullo_epi16(s, hash_lo);
    const __m512i hi = _mm512_add_epi16(_mm512_mulhi_epu16(s, hash_lo), _mm512_mullo_epi16(s, _mm512_set1_epi16((short)(MUL1_HASH >> 16))));
    // The byte sum lands in fp16's 1024 + s (bits 0x6400 + s, s <= 1020); the fma's constant absorbs the 1024.
    const __m512i ones = _mm512_set1_epi8(1);
    const __m512i sum = _mm512_add_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(lo, ones), _mm512_maddubs_epi16(hi, ones)),
                                         _mm512_set1_epi16(0x6400));
    const __m512h f = _mm512_fmadd_ph(_mm512_castsi512_ph(sum), _mm512_set1_ph((_Float16)(887.0 / 131072.0)),
                                      _mm512_set1_ph((_Float16)(-1329.0 / 128.0)));
    const __m512i fi = _mm512_castph_si512(f);
    w[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(fi));
    w[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(fi, 1));
}

template <bool Head>
EXL3_FP16 inline void group32_rows2(const Groups32& g, int gi, const int16_t* row0, const int16_t* row1, int words16,
                                    int words32, const __m512 ug[4], float* a) {
    const __m512i bytes = g.bytes[gi], ctrl = g.ctrl[gi];
    const __mmask16 mask = Head ? g.load_mask[gi] >> 1 : g.load_mask[gi];
    const int base = g.base[gi];
#pragma GCC unroll 8
    for (int ct = 0; ct < CHUNK_TILES; ++ct, a += POSITIONS) {
        __m512 w0[2], w1[2];
        weights32<Head>((const uint32_t*)(row0 + (size_t)ct * words16), words32, bytes, ctrl, mask, base, w0);
        weights32<Head>((const uint32_t*)(row1 + (size_t)ct * words16), words32, bytes, ctrl, mask, base, w1);
        _mm512_store_ps(a, _mm512_fmadd_ps(ug[1], w1[0], _mm512_fmadd_ps(ug[0], w0[0], _mm512_load_ps(a))));
        _mm512_store_ps(a + 16, _mm512_fmadd_ps(ug[3], w1[1], _mm512_fmadd_ps(ug[2], w0[1], _mm512_load_ps(a + 16))));
    }
}

// gemv_chunk's one-row mul1 loop (same accumulators, zeroed by it; rows, prefetch and output transform), on
// AVX512-FP16.
EXL3_FP16 void gemv1_mul1_fp16(const int16_t* trellis, int tiles_k, int tiles_n, const Rate& r, const __m512i* urow,
                               const float* u, int c, float* acc, const float* svh, float* y) {
    const Groups32& g = tables_for<Groups32, make_groups32>(r);
    const int words16 = 2 * r.words32, chunk_bytes = CHUNK_TILES * words16 * 2;
    const size_t row_words = (size_t)tiles_n * words16;
    const int16_t* col0 = trellis + (size_t)c * CHUNK_TILES * words16;
    for (int tk = 0; tk < tiles_k; tk += 2) {
        prefetch_rows(col0, row_words, chunk_bytes, tk + 4, tk + 6 < tiles_k ? tk + 6 : tiles_k);
        const __m512 u0 = _mm512_loadu_ps(u + 16 * tk), u1 = _mm512_loadu_ps(u + 16 * tk + 16);
        const int16_t* row0 = col0 + (size_t)tk * row_words;
        const int16_t* row1 = row0 + row_words;
        for (int gi = 0; gi < 8; ++gi) {
            const __m512 ug[4] = {_mm512_permutexvar_ps(urow[2 * gi], u0), _mm512_permutexvar_ps(urow[2 * gi], u1),
                                  _mm512_permutexvar_ps(urow[2 * gi + 1], u0), _mm512_permutexvar_ps(urow[2 * gi + 1], u1)};
            if (gi == 0) group32_rows2<true>(g, gi, row0, row1, words16, r.words32, ug, acc);
            else group32_rows2<false>(g, gi, row0, row1, words16, r.words32, ug, acc + 32 * gi);
        }
    }
    finish_block(acc, svh + c * 128, y + c * 128);
}

#endif
