// The AVX-512 tier (F/BW/VL/DQ + VBMI + VNNI + F16C): the codebook computed in vector registers.
#pragma once
#include <immintrin.h>

#include "exl3_cpu_core.h"

namespace {

struct Groups {
    // Lanes 2q and 2q+1 (positions p, p+1) share qword q: its 8 bytes are the stream bytes from p's state's first
    // byte on, most significant first, so the qword's value is the stream read big-endian (vpermb indices).
    __m512i bytes[16];
    // vpmultishiftqb controls: each lane's bytes 0 and 1 take the 16 state bits out of its qword (bytes 2 and 3 are
    // zeroed by the mask), so the state lands in the lane's low half with no shifts on port 0.
    __m512i ctrl[16];
    __m512i urow[16];  // the tile row each lane's weight multiplies
    __mmask16 load_mask[16];
    int base[16];  // first buf word a group reads
};

// The tables of group gi, ring positions LANES·gi .. LANES·gi + LANES - 1 (LANES / 8 states per qword, each in a
// lane of 64 / (LANES / 8) bits): 16 for the 32-bit loop (Groups), 32 for the AVX512-FP16 loop (Groups32).
template <int LANES>
void group_tables(const Rate& r, int gi, __m512i& bytes_out, __m512i& ctrl_out, __mmask16& load_mask, int& base) {
    constexpr int per_qword = LANES / 8, lane_bytes = 8 / per_qword;
    int lo = 1 << 30, hi = 0;
    for (int l = 0; l < LANES; ++l) {
        lo = r.i0[LANES * gi + l] < lo ? r.i0[LANES * gi + l] : lo;
        hi = r.i0[LANES * gi + l] > hi ? r.i0[LANES * gi + l] : hi;
    }
    alignas(64) uint8_t bytes[64], ctrl[64] = {};  // a 32-bit lane's bytes 2 and 3 stay zero
    for (int q = 0; q < 8; ++q) {
        const int p0 = LANES * gi + per_qword * q, first = (32 * r.i0[p0] + r.off[p0]) >> 3;
        // Stream byte j sits in buf word j/4 at little-endian byte 3 - j%4 (MSB-first words); qword byte t holds
        // stream byte first + 7 - t. Bytes past the loaded words only fill bits below the states (don't care).
        for (int t = 0; t < 8; ++t) {
            const int j = first + 7 - t;
            bytes[8 * q + t] = (uint8_t)((4 * ((j >> 2) - lo) + 3 - (j & 3)) & 63);
        }
        for (int h = 0; h < per_qword; ++h) {
            const int p = p0 + h, rel = 32 * r.i0[p] + r.off[p] - 8 * first;  // state's first bit, MSB-first
            ctrl[8 * q + lane_bytes * h] = (uint8_t)(48 - rel);
            ctrl[8 * q + lane_bytes * h + 1] = (uint8_t)(56 - rel);
        }
    }
    bytes_out = _mm512_load_si512(bytes);
    ctrl_out = _mm512_load_si512(ctrl);
    base = lo;
    // buf words [lo, hi+1], clipped to the ring (buf index words32 is U's last word); masked-off words read
    // as zero and only ever fill bits below a state.
    const int last = hi + 1 < r.words32 ? hi + 1 : r.words32, count = last - lo + 1;
    load_mask = (__mmask16)((1u << count) - 1);
}

void make_groups(const Rate& r, Groups& g) {
    for (int gi = 0; gi < 16; ++gi) {
        group_tables<16>(r, gi, g.bytes[gi], g.ctrl[gi], g.load_mask[gi], g.base[gi]);
        alignas(64) int urow[16];
        for (int l = 0; l < 16; ++l) urow[l] = row_of(16 * gi + l);
        g.urow[gi] = _mm512_load_si512(urow);
    }
}

const Groups& groups_for(const Rate& r) { return tables_for<Groups, make_groups>(r); }

// The tile rows [from, to) of a chunk (rows are row_words apart, n·K bytes), into L2 ahead of their decode: on Zen 4
// the one-row GEMV from DRAM took 5 % less time than with the rows fetched into L1 (T0), at 2 to 8 rows ahead.
inline void prefetch_rows(const int16_t* col0, size_t row_words, int chunk_bytes, int from, int to) {
    for (int ahead = from; ahead < to; ++ahead) {
        const char* pf = (const char*)(col0 + (size_t)ahead * row_words);
        for (int b = 0; b < chunk_bytes; b += 64) _mm_prefetch(pf + b, _MM_HINT_T1);
    }
}

// s: 16-bit states (upper bits zero) -> fp32 weights, each exactly its fp16 value.
template <int CB>
inline __m512 decode16(__m512i s) {
    __m512 f;
    if constexpr (CB == CB_MUL1) {
        const __m512i x = _mm512_mullo_epi32(s, _mm512_set1_epi32((int)MUL1_HASH));
        // The byte sum lands in the mantissa of 2^23 (float bits 0x4B000000 + sum = 2^23 + sum), and the affine
        // constant absorbs the 2^23 - 1024: the fma's one rounding of an exactly representable value is exact.
        const __m512i sum = _mm512_dpbusd_epi32(_mm512_set1_epi32(0x4B000000), x, _mm512_set1_epi32(0x01010101));
        constexpr double k_inv = MUL1_SCALE;  // exact in fp32
        constexpr float bias = (float)(-1329.0 / 128.0 + (1024.0 - 8388608.0) * k_inv);
        f = _mm512_fmadd_ps(_mm512_castsi512_ps(sum), _mm512_set1_ps((float)k_inv), _mm512_set1_ps(bias));
        // fp16 rounding as a split: t = 2^13 f exactly (an integer add to the exponent), c = RN(f + t) lies on the
        // grid of t's ulp, which is fp16's step at f's binade, so c - t is f rounded to 11 bits (exact: f takes only
        // 1021 values, the byte sums, and each rounds as vcvtps2ph does; tests/kernels/test_cpu.py checks all of
        // them). Two adds and an integer op instead of the Veltkamp split's multiply: one op less on the FMA pipes,
        // which this loop saturates on Zen 4 (-3 % per weight there).
        const __m512 t = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(f), _mm512_set1_epi32(13 << 23)));
        return _mm512_sub_ps(_mm512_add_ps(f, t), t);
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

// One group's permute controls and load window, held in registers while the group runs over a chunk's tiles: read
// from Groups once per group and tile row instead of once per 16 weights (the load ports were the bound).
struct GroupView {
    __m512i bytes, ctrl;
    __mmask16 mask;
    int base, head;  // head: group 0, whose window starts with the ring's last word (tail-biting)

    GroupView(const Groups& g, int gi)
        : bytes(g.bytes[gi]), ctrl(g.ctrl[gi]), mask(gi ? g.load_mask[gi] : g.load_mask[0] >> 1), base(g.base[gi]),
          head(gi == 0) {}

    // The 16 states of this group of the tile at U (words32 uint32 words), in position order, one per 32-bit lane.
    inline __m512i states(const uint32_t* U, int words32) const {
        return head ? states<true>(U, words32) : states<false>(U, words32);
    }
    template <bool Head>
    inline __m512i states(const uint32_t* U, int words32) const {
        const __m512i v = Head ? _mm512_alignr_epi32(_mm512_maskz_loadu_epi32(mask, U),
                                                     _mm512_set1_epi32((int)U[words32 - 1]), 15)
                               : _mm512_maskz_loadu_epi32(mask, U + base - 1);
        // Eight stream bytes per lane pair, then each lane's 16 state bits into its low half (both on port 5).
        return _mm512_maskz_multishift_epi64_epi8(0x3333333333333333ull, ctrl, _mm512_permutexvar_epi8(bytes, v));
    }
};

// The 16 weights of group gi of the tile at U, in position order.
template <int CB>
inline __m512 decode_group(const uint32_t* U, int words32, const Groups& g, int gi) {
    return decode16<CB>(GroupView(g, gi).states(U, words32));
}

#include "exl3_cpu_fp16.h"
#include "exl3_cpu_pairs.h"

// 2..8 rows of a work item (gemv_chunk): per block of ROW_BLOCK tile rows, each group's accumulators (one per row)
// stay in registers across the block's tiles. Loaded and stored per 16 weights instead, the m * 8 KiB of them left L1
// from 4 rows on (Zen 4, 1 thread, 2048 x 11264: 4 rows cost 4x one row, 8 rows 14x, more than the GEMM path's 16).
// Each accumulator takes its fmas in the same order (tile rows ascending): the sums are unchanged.
constexpr int ROW_BLOCK = 4;

template <int CB, int M>
void gemv_rows(const int16_t* col0, size_t row_words, int chunk_bytes, int tiles_k, int words32, const Groups& g,
               const float* u, int k, float* acc, __m512* ue) {
    const int words16 = 2 * words32;
    for (int tk0 = 0; tk0 < tiles_k; tk0 += ROW_BLOCK) {
        const int tb = tiles_k - tk0 < ROW_BLOCK ? tiles_k - tk0 : ROW_BLOCK;
        prefetch_rows(col0, row_words, chunk_bytes, tk0 + 4 < tiles_k ? tk0 + 4 : tiles_k,
                      tk0 + 4 + ROW_BLOCK < tiles_k ? tk0 + 4 + ROW_BLOCK : tiles_k);
        for (int t = 0; t < tb; ++t)
            for (int mi = 0; mi < M; ++mi) {
                const __m512 ut = _mm512_loadu_ps(u + (size_t)mi * k + 16 * (tk0 + t));
                for (int gi = 0; gi < 16; ++gi) ue[(t * 16 + gi) * M + mi] = _mm512_permutexvar_ps(g.urow[gi], ut);
            }
        for (int gi = 0; gi < 16; ++gi) {
            const GroupView view(g, gi);
            for (int ct = 0; ct < CHUNK_TILES; ++ct) {
                float* a = acc + ct * POSITIONS + 16 * gi;
                __m512 s[M];
                for (int mi = 0; mi < M; ++mi) s[mi] = _mm512_load_ps(a + (size_t)mi * CHUNK_TILES * POSITIONS);
                for (int t = 0; t < tb; ++t) {
                    const uint32_t* U = (const uint32_t*)(col0 + (size_t)(tk0 + t) * row_words + (size_t)ct * words16);
                    const __m512 w = decode16<CB>(view.states(U, words32));
                    for (int mi = 0; mi < M; ++mi) s[mi] = _mm512_fmadd_ps(ue[(t * 16 + gi) * M + mi], w, s[mi]);
                }
                for (int mi = 0; mi < M; ++mi) _mm512_store_ps(a + (size_t)mi * CHUNK_TILES * POSITIONS, s[mi]);
            }
        }
    }
}

// One work item: the 128 output columns of chunk c for m rows of u, over every k tile of one trellis.
// acc: m * CHUNK_TILES * POSITIONS floats (64-byte aligned), ue: ROW_BLOCK * 16 * m vectors.
template <int CB>
void gemv_chunk(const int16_t* trellis, int tiles_k, int tiles_n, const Rate& r, const Groups& g, const float* u,
                int m, int c, float* acc, __m512* ue, const float* svh, float* y, size_t y_stride) {
    const int k = tiles_k * 16, words16 = 2 * r.words32;
    const size_t row_words = (size_t)tiles_n * words16;
    std::memset(acc, 0, sizeof(float) * m * CHUNK_TILES * POSITIONS);
    const int16_t* col0 = trellis + (size_t)c * CHUNK_TILES * words16;
    const int chunk_bytes = CHUNK_TILES * words16 * 2;
#if defined(EXL3_HAVE_FP16)
    if constexpr (CB == CB_MUL1)
        if (m == 1 && fp16_active()) return gemv1_mul1_fp16(trellis, tiles_k, tiles_n, r, g.urow, u, c, acc, svh, y);
#endif
    // decode: two tile rows per accumulator load/store (tiles_k is a multiple of 8), two groups per state extraction
    if (m == 1) return gemv1_pairs<CB>(trellis, tiles_k, tiles_n, r, g.urow, u, c, acc, svh, y);
    using Rows = void (*)(const int16_t*, size_t, int, int, int, const Groups&, const float*, int, float*, __m512*);
    static constexpr Rows rows[9] = {nullptr, gemv_rows<CB, 1>, gemv_rows<CB, 2>, gemv_rows<CB, 3>, gemv_rows<CB, 4>,
                                     gemv_rows<CB, 5>, gemv_rows<CB, 6>, gemv_rows<CB, 7>, gemv_rows<CB, 8>};
    for (int m0 = 0; m0 < m; m0 += 8)  // 8 rows at a time (a grouped unit or a GEMV has at most GEMV_MAX_ROWS)
        rows[m - m0 < 8 ? m - m0 : 8](col0, row_words, chunk_bytes, tiles_k, r.words32, g, u + (size_t)m0 * k, k,
                                      acc + (size_t)m0 * CHUNK_TILES * POSITIONS, ue);
    for (int mi = 0; mi < m; ++mi)
        finish_block(acc + (size_t)mi * CHUNK_TILES * POSITIONS, svh + c * 128, y + (size_t)mi * y_stride + c * 128);
}

// gemv_chunk for int8 activations (mul1 only, one row: ops.INT8_MAX_ROWS; more rows run the exact loop, which was
// faster from 2 rows): per 16 weights the state hash and one vpdpbusd, which multiplies the hash's 4 bytes by the
// row's int8 activation and adds them, i.e. bytesum * q, into int32 lanes. The codebook's scale and offset (and Ŵ's
// fp16 rounding, skipped here) leave the loop: per column, scale * (MUL1_SCALE * sum of bytesum * q + MUL1_OFFSET *
// sum of q), from quantize_rows' qab. acc: CHUNK_TILES * POSITIONS int32 (64-byte aligned).
void gemv1_q8(const int16_t* trellis, int tiles_k, int tiles_n, const Rate& r, const Groups& g, const int32_t* q4,
              const float* qab, int c, int32_t* acc, const float* svh, float* y) {
    const int words16 = 2 * r.words32;
    const size_t row_words = (size_t)tiles_n * words16;
    std::memset(acc, 0, sizeof(int32_t) * CHUNK_TILES * POSITIONS);
    const int16_t* col0 = trellis + (size_t)c * CHUNK_TILES * words16;
    const int chunk_bytes = CHUNK_TILES * words16 * 2;
    const __m512i hash = _mm512_set1_epi32((int)MUL1_HASH);
    // two tile rows per accumulator load/store, as gemv_chunk (integer sums: the same result)
    for (int tk = 0; tk < tiles_k; tk += 2) {
        prefetch_rows(col0, row_words, chunk_bytes, tk + 4, tk + 6 < tiles_k ? tk + 6 : tiles_k);
        const __m512i q0 = _mm512_loadu_si512(q4 + 16 * tk), q1 = _mm512_loadu_si512(q4 + 16 * tk + 16);
        const int16_t* row0 = col0 + (size_t)tk * row_words;
        const int16_t* row1 = row0 + row_words;
        for (int gi = 0; gi < 16; ++gi) {
            const GroupView view(g, gi);
            const __m512i qg0 = _mm512_permutexvar_epi32(g.urow[gi], q0), qg1 = _mm512_permutexvar_epi32(g.urow[gi], q1);
#pragma GCC unroll 8
            for (int ct = 0; ct < CHUNK_TILES; ++ct) {
                int32_t* a = acc + ct * POSITIONS + 16 * gi;
                const __m512i x0 = _mm512_mullo_epi32(view.states((const uint32_t*)(row0 + (size_t)ct * words16),
                                                                  r.words32), hash);
                const __m512i x1 = _mm512_mullo_epi32(view.states((const uint32_t*)(row1 + (size_t)ct * words16),
                                                                  r.words32), hash);
                _mm512_store_si512(a, _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_load_si512(a), x0, qg0), x1, qg1));
            }
        }
    }
    // Integer sums to fp32 position sums in place, then the exact path's reduction and output transform.
    float* af = (float*)acc;
    const __m512 qa = _mm512_set1_ps(qab[0]), qb = _mm512_set1_ps(qab[1]);
    for (int i = 0; i < CHUNK_TILES * POSITIONS; i += 16)
        _mm512_store_ps(af + i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(acc + i)), qa, qb));
    finish_block(af, svh + c * 128, y + c * 128);
}

// A worker's buffers for work items of up to `rows` rows: acc (rows * CHUNK_TILES * POSITIONS floats, or int32 in
// int8 mode) and the permuted inputs ue (ROW_BLOCK * 16 * rows vectors).
struct Scratch {
    float* acc;
    __m512* ue;
    explicit Scratch(int rows)
        : acc((float*)_mm_malloc(sizeof(float) * rows * CHUNK_TILES * POSITIONS, 64)),
          ue((__m512*)_mm_malloc(sizeof(__m512) * ROW_BLOCK * 16 * rows, 64)) {}
    ~Scratch() {
        _mm_free(ue);
        _mm_free(acc);
    }
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
};

// One work item: chunk c (128 output columns) of one trellis for m rows of u (qab: u holds int8 rows, mul1 only).
inline void run_chunk(int codebook, const Rate& r, const float*, const int16_t* trellis, int tiles_k, int tiles_n,
                      const float* u, const float* qab, int m, int c, const float* svh, float* y, size_t y_stride,
                      Scratch& s) {
    const Groups& g = groups_for(r);
    if (qab) {  // acc holds as many int32 lanes as fp32 ones
        if (m != 1) __builtin_trap();  // int8 serves one row (ops.INT8_MAX_ROWS): a call with more is a bug
        gemv1_q8(trellis, tiles_k, tiles_n, r, g, (const int32_t*)u, qab, c, (int32_t*)s.acc, svh, y);
    }
    else if (codebook == CB_MUL1)
        gemv_chunk<CB_MUL1>(trellis, tiles_k, tiles_n, r, g, u, m, c, s.acc, s.ue, svh, y, y_stride);
    else if (codebook == CB_MCG)
        gemv_chunk<CB_MCG>(trellis, tiles_k, tiles_n, r, g, u, m, c, s.acc, s.ue, svh, y, y_stride);
    else
        gemv_chunk<CB_3INST>(trellis, tiles_k, tiles_n, r, g, u, m, c, s.acc, s.ue, svh, y, y_stride);
}

// Group gi's lane l is position p = 16 gi + l, at row (l1, g0, l3, l0) and column (l2, g3, g2, g1) of its tile (bits of
// gi and l, high to low; row_of / col_of). So 16 group vectors become the tile's 16 rows by swapping three register
// bits with three lane bits (g1<->l0, g2<->l1, g3<->l3), one vpermt2ps per output vector and stage (48 per tile,
// instead of 16 gathers of 16 lanes from a stored tile), the columns' order folded into the last stage's indices.
struct RowShuffle {
    __m512i lo[3], hi[3];  // per stage: the indices of a pair's output with the register bit 0, and with it 1
    int row[16];           // the tile row that register i holds after the last stage
};

inline RowShuffle make_row_shuffle() {
    RowShuffle t;
    int cur[16][16];  // position held by (register, lane)
    for (int i = 0; i < 16; ++i)
        for (int l = 0; l < 16; ++l) cur[i][l] = 16 * i + l;
    const int rbit[3] = {1, 2, 3}, lbit[3] = {0, 1, 3};
    alignas(64) int lo[3][16], hi[3][16];
    for (int st = 0; st < 3; ++st) {
        const int rb = 1 << rbit[st], lb = 1 << lbit[st];
        for (int l = 0; l < 16; ++l) {  // the same indices for every register pair: x (bit 0), y = x | rb
            lo[st][l] = l & lb ? 16 + (l ^ lb) : l;
            hi[st][l] = l & lb ? 16 + l : l | lb;
        }
        int next[16][16];
        for (int x = 0; x < 16; ++x) {
            if (x & rb) continue;
            for (int l = 0; l < 16; ++l) {
                next[x][l] = lo[st][l] < 16 ? cur[x][lo[st][l]] : cur[x | rb][lo[st][l] - 16];
                next[x | rb][l] = hi[st][l] < 16 ? cur[x][hi[st][l]] : cur[x | rb][hi[st][l] - 16];
            }
        }
        std::memcpy(cur, next, sizeof(cur));
    }
    // Each register now holds one row, its lanes a fixed permutation of the columns: order them in the last stage.
    int lane_of_col[16];
    for (int l = 0; l < 16; ++l) lane_of_col[col_of(cur[0][l])] = l;
    alignas(64) int lo2[16], hi2[16];
    for (int c = 0; c < 16; ++c) lo2[c] = lo[2][lane_of_col[c]], hi2[c] = hi[2][lane_of_col[c]];
    std::memcpy(lo[2], lo2, sizeof(lo2));
    std::memcpy(hi[2], hi2, sizeof(hi2));
    for (int i = 0; i < 16; ++i) t.row[i] = row_of(cur[i][0]);
    for (int st = 0; st < 3; ++st) {
        t.lo[st] = _mm512_load_si512(lo[st]);
        t.hi[st] = _mm512_load_si512(hi[st]);
    }
    return t;
}

const RowShuffle& row_shuffle() {
    static const RowShuffle sh = make_row_shuffle();
    return sh;
}

// A decoded tile's 16 group vectors -> its 16 rows (register i holds tile row sh.row[i], columns in order).
inline void shuffle_rows(const RowShuffle& sh, __m512* v) {
    for (int st = 0; st < 3; ++st) {
        const int rb = 2 << st;  // register bits 1, 2, 3
        for (int x = 0; x < 16; ++x) {
            if (x & rb) continue;
            const __m512 a = v[x], b = v[x | rb];
            v[x] = _mm512_permutex2var_ps(a, sh.lo[st], b);
            v[x | rb] = _mm512_permutex2var_ps(a, sh.hi[st], b);
        }
    }
}

template <int CB>
void decode_impl(const int16_t* trellis, int tiles_k, int tiles_n, const Rate& r, int tn0, int tn1, float* out,
                 int threads) {
    const Groups& g = groups_for(r);
    const RowShuffle& sh = row_shuffle();
    const int words16 = 2 * r.words32, width = (tn1 - tn0) * 16;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int tk = 0; tk < tiles_k; ++tk)
        for (int tn = tn0; tn < tn1; ++tn) {
            const uint32_t* U = (const uint32_t*)(trellis + ((size_t)tk * tiles_n + tn) * words16);
            __m512 v[16];
            for (int gi = 0; gi < 16; ++gi) v[gi] = decode_group<CB>(U, r.words32, g, gi);
            shuffle_rows(sh, v);
            float* o = out + (size_t)tk * 16 * width + (tn - tn0) * 16;
            for (int i = 0; i < 16; ++i) _mm512_storeu_ps(o + (size_t)sh.row[i] * width, v[i]);
        }
}

// Ŵ[:, 16*tn0 : 16*tn1] as fp32 rows of width 16*(tn1-tn0).
inline void decode_range(int codebook, const Rate& r, const float*, const int16_t* trellis, int tiles_k, int tiles_n,
                         int tn0, int tn1, float* out, int threads) {
    if (codebook == CB_MUL1) decode_impl<CB_MUL1>(trellis, tiles_k, tiles_n, r, tn0, tn1, out, threads);
    else if (codebook == CB_MCG) decode_impl<CB_MCG>(trellis, tiles_k, tiles_n, r, tn0, tn1, out, threads);
    else decode_impl<CB_3INST>(trellis, tiles_k, tiles_n, r, tn0, tn1, out, threads);
}

}  // namespace

#include "exl3_cpu_gemm.h"
