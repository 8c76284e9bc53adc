// The portable tier: the codebook as a 65536-entry fp32 table (exact: every entry is an fp16 value), loops left to
// the compiler's vectorizer.
#pragma once
#include "exl3_cpu_core.h"

namespace {

struct Scratch {
    float* acc;
    explicit Scratch(int rows) : acc(new float[(size_t)rows * CHUNK_TILES * POSITIONS]) {}
    ~Scratch() { delete[] acc; }
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
};

// One work item: chunk c (128 output columns) of one trellis for m rows of u (exact activations only).
inline void run_chunk(int, const Rate& r, const float* lut, const int16_t* trellis, int tiles_k, int tiles_n,
                      const float* u, const float*, int m, int c, const float* svh, float* y, size_t y_stride,
                      Scratch& s) {
    const int k = tiles_k * 16, words16 = 2 * r.words32;
    int urow[POSITIONS];
    for (int p = 0; p < POSITIONS; ++p) urow[p] = row_of(p);
    float wt[POSITIONS];
    float* acc = s.acc;
    std::memset(acc, 0, sizeof(float) * m * CHUNK_TILES * POSITIONS);
    for (int tk = 0; tk < tiles_k; ++tk)
        for (int ct = 0; ct < CHUNK_TILES; ++ct) {
            const int tn = c * CHUNK_TILES + ct;
            const uint32_t* U = (const uint32_t*)(trellis + ((size_t)tk * tiles_n + tn) * words16);
            for (int p = 0; p < POSITIONS; ++p) wt[p] = lut[state_of(U, r, p)];
            for (int mi = 0; mi < m; ++mi) {
                const float* us = u + (size_t)mi * k + 16 * tk;
                float* a = acc + ((size_t)mi * CHUNK_TILES + ct) * POSITIONS;
                for (int p = 0; p < POSITIONS; ++p) a[p] += us[urow[p]] * wt[p];
            }
        }
    for (int mi = 0; mi < m; ++mi)
        finish_block(acc + (size_t)mi * CHUNK_TILES * POSITIONS, svh + c * 128, y + (size_t)mi * y_stride + c * 128);
}

inline void decode_range(int, const Rate& r, const float* lut, const int16_t* trellis, int tiles_k, int tiles_n,
                         int tn0, int tn1, float* out, int threads) {
    const int words16 = 2 * r.words32, width = (tn1 - tn0) * 16;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int tk = 0; tk < tiles_k; ++tk)
        for (int tn = tn0; tn < tn1; ++tn) {
            const uint32_t* U = (const uint32_t*)(trellis + ((size_t)tk * tiles_n + tn) * words16);
            for (int p = 0; p < POSITIONS; ++p)
                out[(size_t)(16 * tk + row_of(p)) * width + (tn - tn0) * 16 + col_of(p)] = lut[state_of(U, r, p)];
        }
}

}  // namespace
