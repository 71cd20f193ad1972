/* GGUF IQ3_S encoder and decoder: byte for byte llama.cpp's quantize_iq3_s (with and without
 * quant_weights) and dequantize_row_iq3_s (ggml/src/ggml-quants.c, llama.cpp
 * 0c1e57098bba43ac29e6e3b677cdceebdd22334f; tests/test_native_gguf_iq3.py and the fixture made by
 * tests/fixtures/gguf_kquants/make_reference.py hold the proof).
 *
 * IQ3_S stores each group of 4 magnitudes as one of 512 grid points (iq3_grids.h), signs apart,
 * with a 4-bit scale per 32 values. The search (per block of 32, iq_grid.c's) tries 19 scales;
 * each group's rounded 3-bit coordinates are looked up in the grid, and a point off the grid is
 * replaced by the best of its neighbours: the grid points at the three smallest squared
 * distances from it, in (distance, index) order, as iq3xs_init_impl lists them.
 *
 * Two things llama.cpp does that we keep for the bytes' sake:
 * - a block of 32 whose largest |x| is 0 leaves its codes unwritten *and the next block's codes
 *   are written in its place* (the code and sign pointers only move for non-zero blocks), so a
 *   super-block with a zero block ends with zero codes;
 * - the super-block scale is stored as d * 1.033.
 * Where llama.cpp aborts (a neighbour search in which no distance compares below FLT_MAX: NaN or
 * inf values or weights), we take the first neighbour: such rows have no reference bytes.
 */
#include "qtool_native.h"

#include <pthread.h>

#include "iq3_grids.h"
#include "iq_grid.h"

#ifdef __FAST_MATH__
#error "iq3_encode.c must be built without -ffast-math: its bytes depend on IEEE float32 rounding"
#endif

/* -- the grids (iq3xs_init_impl), built once each ---------------------------------------------- */

static QtIqGrid grid_s = {.size = 512, .nwant = 3, .dim = 4, .bits = 3, .map_size = 4096};
static QtIqGrid grid_xxs = {.size = 256, .nwant = 2, .dim = 4, .bits = 3, .map_size = 4096};
static pthread_once_t grid_s_once = PTHREAD_ONCE_INIT, grid_xxs_once = PTHREAD_ONCE_INIT;
static int grid_s_built, grid_xxs_built;

static void build_grid_s(void) {
    for (int k = 0; k < 512; k++) memcpy(grid_s.points[k], iq3s_grid[k], 4);
    grid_s_built = qt_iq_grid_build(&grid_s);
}

/* IQ3_XXS's quantizer uses 2l + 1 where the stored grid holds grid_map[l] (4, 12, ..., 62) */
static void build_grid_xxs(void) {
    static const uint8_t map[8] = {4, 12, 20, 28, 36, 44, 52, 62};
    for (int k = 0; k < 256; k++)
        for (int i = 0; i < 4; i++) {
            int l = 0;
            while (l < 7 && map[l] != iq3xxs_grid[k][i]) l++;
            grid_xxs.points[k][i] = (uint8_t)(2 * l + 1);
        }
    grid_xxs_built = qt_iq_grid_build(&grid_xxs);
}

/* quantize_row_iq3_s_impl(32, ...) on one super-block: [d f16][64 B qs][8 B qh][32 B signs][4 B scales] */
static void iq3_s_block(const float *xbl, const float *qw, uint8_t *y) {
    enum { KMAXQ = 8 };
    float scales[8], weight[32], waux[32], xval[32];
    int8_t L[32];
    uint8_t block_signs[4];
    memset(y, 0, 110);
    uint8_t *qs = y + 2, *qh = y + 66, *signs = y + 74;
    float max_scale = 0.0f, sumx2 = 0.0f;
    for (int i = 0; i < 256; i++) sumx2 += xbl[i] * xbl[i];
    const float sigma2 = 2.0f * sumx2 / 256.0f;
    for (int ib = 0; ib < 8; ib++) {
        const float *xb = xbl + 32 * ib;
        if (qw)
            for (int i = 0; i < 32; i++) weight[i] = qw[32 * ib + i] * __builtin_sqrtf(sigma2 + xb[i] * xb[i]);
        else
            for (int i = 0; i < 32; i++) weight[i] = xb[i] * xb[i];
        for (int i = 0; i < 32; i++) waux[i] = __builtin_sqrtf(weight[i]);
        for (int k = 0; k < 4; k++) block_signs[k] = qt_iq_signs(xb + 8 * k, xval + 8 * k);
        float max = xval[0];
        for (int i = 1; i < 32; i++) max = max > xval[i] ? max : xval[i];
        memset(L, 0, 32);
        if (max == 0.0f) { /* llama.cpp's `continue` before the pointers move */
            scales[ib] = 0.0f;
            continue;
        }
        const float scale0 = max / (float)(2 * KMAXQ - 1);
        float scale = qt_iq_search(&grid_s, 32, KMAXQ, xval, weight, waux, scale0, max, 9, 0.2f, QT_IQ_REDO_ALL_IF_OFF, L);
        if (scale < 0.0f) { /* "should never happen" (llama.cpp): flip the scale and the signs */
            scale = -scale;
            for (int k = 0; k < 4; k++) block_signs[k] = (uint8_t)~block_signs[k];
        }
        for (int k = 0; k < 8; k++) {
            const int u = qt_iq_word(&grid_s, L + 4 * k);
            const int g = grid_s.at[u] >= 0 ? grid_s.at[u] : 0; /* always on the grid by now (llama.cpp aborts otherwise) */
            qs[k] = (uint8_t)(g & 255);
            qh[ib] |= (uint8_t)((g >> 8) << k);
        }
        qs += 8;
        memcpy(signs, block_signs, 4);
        signs += 4;
        scales[ib] = scale;
        max_scale = max_scale > scale ? max_scale : scale;
    }
    if (max_scale == 0.0f) return;
    const float d = max_scale / 31.0f, id = 1.0f / d;
    const uint16_t h = qt_f32_to_f16(d * 1.033f);
    memcpy(y, &h, 2);
    for (int ib = 0; ib < 8; ib += 2) {
        int l1 = qt_iq_nearest(0.5f * (id * scales[ib] - 1.0f)), l2 = qt_iq_nearest(0.5f * (id * scales[ib + 1] - 1.0f));
        l1 = l1 < 0 ? 0 : l1 > 15 ? 15 : l1;
        l2 = l2 < 0 ? 0 : l2 > 15 ? 15 : l2;
        y[106 + ib / 2] = (uint8_t)(l1 | (l2 << 4));
    }
}

/* dequantize_row_iq3_s on one super-block: x = (d * (1 + 2 scale)) * grid value, signed */
void qt_iq3_s_decode(const uint8_t *y, float *out, Py_ssize_t blocks) {
    for (Py_ssize_t b = 0; b < blocks; b++, y += 110) {
        uint16_t h;
        memcpy(&h, y, 2);
        const float d = qt_f16_to_f32(h);
        const uint8_t *qs = y + 2, *qh = y + 66, *signs = y + 74, *sc = y + 106;
        for (int ib = 0; ib < 8; ib++, out += 32) {
            const float db = d * (float)(1 + 2 * ((sc[ib / 2] >> (4 * (ib % 2))) & 0xF));
            for (int k = 0; k < 8; k++) {
                const uint8_t *pg = iq3s_grid[qs[8 * ib + k] | (((qh[ib] >> k) & 1) << 8)];
                for (int j = 0; j < 4; j++) {
                    const int v = 4 * k + j;
                    out[v] = db * (float)pg[j] * ((signs[4 * ib + v / 8] >> (v % 8)) & 1 ? -1.0f : 1.0f);
                }
            }
        }
    }
}

int qt_iq3_s_ready(void) {
    pthread_once(&grid_s_once, build_grid_s);
    return grid_s_built;
}
int qt_iq3_xxs_ready(void) {
    pthread_once(&grid_xxs_once, build_grid_xxs);
    return grid_xxs_built;
}

/* the caller has seen qt_iq3_s_ready() */
void qt_iq3_s_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec) {
    for (Py_ssize_t b = 0; b < blocks; b++) iq3_s_block(x + 256 * b, qw ? qw + 256 * b : NULL, out + 110 * b);
    qt_iq3_s_decode(out, rec, blocks);
}

/* -- IQ3_XXS -------------------------------------------------------------------------------------- */

/* quantize_row_iq3_xxs_impl(256, ...) on one super-block: [d f16][64 B grid indexes][8 x u32: per
 * block of 32, four 7-bit sign masks (the eighth sign is the parity) and the 4-bit scale at bit
 * 28]. As IQ3_S but for: 256 points with neighbours at 2 distances, 31 trial scales, an odd
 * count of negatives fixed by flipping the least important value's sign, d times 1.0125. */
static void iq3_xxs_block(const float *xbl, const float *qw, uint8_t *y) {
    enum { KMAXQ = 8 };
    float scales[8], weight[32], waux[32], xval[32];
    int8_t L[32];
    uint8_t block_signs[4], q3[64];
    uint32_t scales_and_signs[8];
    memset(y, 0, 98);
    memset(q3, 0, sizeof q3);
    memset(scales_and_signs, 0, sizeof scales_and_signs);
    float max_scale = 0.0f, sumx2 = 0.0f;
    for (int i = 0; i < 256; i++) sumx2 += xbl[i] * xbl[i];
    const float sigma2 = 2.0f * sumx2 / 256.0f;
    for (int ib = 0; ib < 8; ib++) {
        const float *xb = xbl + 32 * ib;
        if (qw)
            for (int i = 0; i < 32; i++) weight[i] = qw[32 * ib + i] * __builtin_sqrtf(sigma2 + xb[i] * xb[i]);
        else
            for (int i = 0; i < 32; i++) weight[i] = xb[i] * xb[i];
        for (int i = 0; i < 32; i++) waux[i] = __builtin_sqrtf(weight[i]);
        for (int k = 0; k < 4; k++) block_signs[k] = qt_iq_even_signs(xb + 8 * k, weight + 8 * k, xval + 8 * k);
        float max = xval[0];
        for (int i = 1; i < 32; i++) max = max > xval[i] ? max : xval[i];
        memset(L, 0, 32);
        if (max < 1e-8f) { /* GROUP_MAX_EPS_IQ3_XXS */
            scales[ib] = 0.0f;
            continue;
        }
        const float scale0 = max / (float)(2 * KMAXQ - 1);
        float scale = qt_iq_search(&grid_xxs, 32, KMAXQ, xval, weight, waux, scale0, max, 15, 0.2f, QT_IQ_REDO_OFF_GRID, L);
        if (scale < 0.0f) {
            scale = -scale;
            for (int k = 0; k < 4; k++) block_signs[k] = (uint8_t)(~block_signs[k] & 127);
        }
        for (int k = 0; k < 8; k++) {
            const int u = qt_iq_word(&grid_xxs, L + 4 * k);
            q3[8 * ib + k] = (uint8_t)(grid_xxs.at[u] >= 0 ? grid_xxs.at[u] : 0); /* llama.cpp aborts otherwise */
        }
        scales_and_signs[ib] = block_signs[0] | ((uint32_t)block_signs[1] << 7) | ((uint32_t)block_signs[2] << 14) | ((uint32_t)block_signs[3] << 21);
        scales[ib] = scale;
        max_scale = max_scale > scale ? max_scale : scale;
    }
    if (max_scale == 0.0f) return; /* all zeros, d 0 */
    const float d = max_scale / 31.0f, id = 1.0f / d;
    const uint16_t h = qt_f32_to_f16(d * 1.0125f);
    memcpy(y, &h, 2);
    for (int ib = 0; ib < 8; ib++) {
        int l = qt_iq_nearest(0.5f * (id * scales[ib] - 1.0f));
        l = l < 0 ? 0 : l > 15 ? 15 : l;
        scales_and_signs[ib] |= (uint32_t)l << 28;
    }
    memcpy(y + 2, q3, 64);
    memcpy(y + 66, scales_and_signs, 32);
}

/* dequantize_row_iq3_xxs: x = (d * (0.5 + scale) * 0.5) * grid value, signed (the eighth sign of
 * each 8 is the parity of the other seven) */
void qt_iq3_xxs_decode(const uint8_t *y, float *out, Py_ssize_t blocks) {
    for (Py_ssize_t b = 0; b < blocks; b++, y += 98) {
        uint16_t h;
        memcpy(&h, y, 2);
        const float d = qt_f16_to_f32(h);
        const uint8_t *qs = y + 2;
        for (int ib = 0; ib < 8; ib++, out += 32) {
            uint32_t aux;
            memcpy(&aux, y + 66 + 4 * ib, 4);
            const float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
            for (int l = 0; l < 4; l++) {
                const uint32_t s7 = (aux >> (7 * l)) & 127;
                const uint32_t signs = s7 | ((uint32_t)__builtin_parity(s7) << 7);
                for (int half = 0; half < 2; half++) {
                    const uint8_t *pg = iq3xxs_grid[qs[8 * ib + 2 * l + half]];
                    for (int j = 0; j < 4; j++)
                        out[8 * l + 4 * half + j] = db * (float)pg[j] * ((signs >> (4 * half + j)) & 1 ? -1.0f : 1.0f);
                }
            }
        }
    }
}

/* the caller has seen qt_iq3_xxs_ready() */
void qt_iq3_xxs_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec) {
    for (Py_ssize_t b = 0; b < blocks; b++) iq3_xxs_block(x + 256 * b, qw ? qw + 256 * b : NULL, out + 98 * b);
    qt_iq3_xxs_decode(out, rec, blocks);
}
