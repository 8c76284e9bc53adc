// The portable tier (built as "avx2" and "portable"): the codebook as a 65536-entry fp32 table (exact: every entry
// is an fp16 value), loops left to the compiler's vectorizer.
#pragma once
#include "exl3_cpu_core.h"

namespace {

void gemv_units_portable(const Units& w, int tiles_k, int tiles_n, const Rate& r, const float* lut, int threads) {
    const int k = tiles_k * 16, n = tiles_n * 16, words16 = 2 * r.words32, chunks = tiles_n / CHUNK_TILES;
    int urow[POSITIONS];
    for (int p = 0; p < POSITIONS; ++p) urow[p] = row_of(p);
#pragma omp parallel num_threads(threads)
    {
        float* acc = new float[(size_t)w.m * CHUNK_TILES * POSITIONS];
        float wt[POSITIONS];
#pragma omp for schedule(dynamic)
        for (int item = 0; item < w.units * chunks; ++item) {
            const int unit = item / chunks, c = item % chunks;
            const int e = w.ids ? w.ids[unit] : unit;
            if (e < 0) continue;
            const int16_t* trellis = w.trellis + (size_t)e * w.trellis_stride;
            const size_t row = w.first_row(unit);
            const int m = w.rows(unit);
            const float* u = w.u + row * k;
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
                finish_block(acc + (size_t)mi * CHUNK_TILES * POSITIONS, w.svh + (size_t)e * w.svh_stride + c * 128,
                             w.y + (row + mi) * n + c * 128);
        }
        delete[] acc;
    }
}

}  // namespace
