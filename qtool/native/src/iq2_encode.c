/* GGUF IQ2_XXS, IQ2_XS and IQ2_S encoders and decoders: byte for byte llama.cpp's
 * quantize_iq2_xxs, quantize_iq2_xs (both need quant_weights: llama-quantize refuses them
 * without an imatrix) and quantize_iq2_s, and dequantize_row_iq2_xxs / _xs / _s
 * (ggml/src/ggml-quants.c, llama.cpp 0c1e57098bba43ac29e6e3b677cdceebdd22334f;
 * tests/test_native_gguf_iq2.py and the kquant fixture hold the proof).
 *
 * The grid search is iq_grid.c's, with groups of 8 magnitudes, each a point of a 256-point
 * (IQ2_XS: 512, IQ2_S: 1024) grid of 2-bit coordinates (iq2_grids.h), neighbour lists at the 2
 * (IQ2_S: 1) smallest distances over all 43692 coordinate words (iq2xs_init_impl). IQ2_XXS seeds
 * the scale search with make_qp_quants and tries 13 scales around it, sigma2 the plain mean square.
 */
#include "qtool_native.h"

#include <pthread.h>

#include "iq2_grids.h"
#include "iq_grid.h"

#ifdef __FAST_MATH__
#error "iq2_encode.c must be built without -ffast-math: its bytes depend on IEEE float32 rounding"
#endif

enum { MAP_SIZE = 43692 }; /* coordinate words up to 0xAAAA (every coordinate 2) */

static QtIqGrid grid_xxs = {.size = 256, .nwant = 2, .dim = 8, .bits = 2, .map_size = MAP_SIZE};
static QtIqGrid grid_xs = {.size = 512, .nwant = 2, .dim = 8, .bits = 2, .map_size = MAP_SIZE};
static QtIqGrid grid_s = {.size = 1024, .nwant = 1, .dim = 8, .bits = 2, .map_size = MAP_SIZE};
static pthread_once_t xxs_once = PTHREAD_ONCE_INIT, xs_once = PTHREAD_ONCE_INIT, s_once = PTHREAD_ONCE_INIT;
static int xxs_built, xs_built, s_built;

/* the stored grid holds 8, 25 or 43 where the quantizer's magnitude is 2l + 1 */
static int build(QtIqGrid *grid, const uint8_t (*values)[8]) {
    for (int k = 0; k < grid->size; k++)
        for (int i = 0; i < 8; i++) grid->points[k][i] = (uint8_t)(2 * (values[k][i] == 8 ? 0 : values[k][i] == 25 ? 1 : 2) + 1);
    return qt_iq_grid_build(grid);
}

static void build_xxs(void) { xxs_built = build(&grid_xxs, iq2xxs_grid); }
static void build_xs(void) { xs_built = build(&grid_xs, iq2xs_grid); }
static void build_s(void) { s_built = build(&grid_s, iq2s_grid); }

int qt_iq2_xxs_ready(void) {
    pthread_once(&xxs_once, build_xxs);
    return xxs_built;
}
int qt_iq2_xs_ready(void) {
    pthread_once(&xs_once, build_xs);
    return xs_built;
}
int qt_iq2_s_ready(void) {
    pthread_once(&s_once, build_s);
    return s_built;
}

/* quantize_row_iq2_xxs_impl on one super-block: [d f16][8 x (u32 four grid indexes, u32 four
 * 7-bit sign masks and the 4-bit scale at bit 28)] */
static void iq2_xxs_block(const float *xbl, const float *qw, uint8_t *y) {
    enum { KMAXQ = 3 };
    float scales[8], weight[32], waux[32], xval[32];
    int8_t L[32];
    uint8_t block_signs[4];
    uint32_t q2[16];
    memset(y, 0, 66);
    memset(q2, 0, sizeof q2);
    float max_scale = 0.0f, sumx2 = 0.0f;
    for (int i = 0; i < 256; i++) sumx2 += xbl[i] * xbl[i];
    const float sigma2 = sumx2 / 256.0f;
    for (int ib = 0; ib < 8; ib++) {
        const float *xb = xbl + 32 * ib;
        for (int i = 0; i < 32; i++) weight[i] = qw[32 * ib + i] * __builtin_sqrtf(sigma2 + xb[i] * xb[i]);
        for (int i = 0; i < 32; i++) waux[i] = __builtin_sqrtf(weight[i]);
        for (int k = 0; k < 4; k++) block_signs[k] = qt_iq_even_signs(xb + 8 * k, weight + 8 * k, xval + 8 * k);
        float max = xval[0];
        for (int i = 1; i < 32; i++) max = max > xval[i] ? max : xval[i];
        if (max < 1e-15f) { /* GROUP_MAX_EPS */
            scales[ib] = 0.0f;
            memset(L, 0, 32);
            continue;
        }
        float scale = qt_qp_quants(32, KMAXQ + 1, xval, (uint8_t *)L, weight); /* L as ggml holds it: uint8 read as int8 */
        const float eff_max = scale * (float)KMAXQ;
        if (eff_max <= 0.0f) {
            scales[ib] = 0.0f;
            memset(L, 0, 32);
            continue;
        }
        scale = qt_iq_search(&grid_xxs, 32, KMAXQ, xval, weight, waux, scale, eff_max, 6, 0.1f, QT_IQ_REDO_ALL, L);
        if (scale < 0.0f) {
            scale = -scale;
            for (int k = 0; k < 4; k++) block_signs[k] = (uint8_t)(~block_signs[k] & 127);
        }
        for (int k = 0; k < 4; k++) {
            const int u = qt_iq_word(&grid_xxs, L + 8 * k);
            const int g = u >= 0 && u < MAP_SIZE && grid_xxs.at[u] >= 0 ? grid_xxs.at[u] : 0; /* llama.cpp aborts otherwise */
            q2[2 * ib] |= (uint32_t)g << (8 * k);
            q2[2 * ib + 1] |= (uint32_t)block_signs[k] << (7 * k);
        }
        scales[ib] = scale;
        max_scale = max_scale > scale ? max_scale : scale;
    }
    if (max_scale == 0.0f) return; /* all zeros, d 0 */
    const float d = max_scale / 31.0f, id = 1.0f / d;
    const uint16_t h = qt_f32_to_f16(d);
    memcpy(y, &h, 2);
    for (int ib = 0; ib < 8; ib++) {
        int l = qt_iq_nearest(0.5f * (id * scales[ib] - 1.0f));
        l = l < 0 ? 0 : l > 15 ? 15 : l;
        q2[2 * ib + 1] |= (uint32_t)l << 28;
    }
    memcpy(y + 2, q2, 64);
}

/* dequantize_row_iq2_xxs: x = (d * (0.5 + scale) * 0.25) * grid value, signed */
void qt_iq2_xxs_decode(const uint8_t *y, float *out, Py_ssize_t blocks) {
    for (Py_ssize_t b = 0; b < blocks; b++, y += 66) {
        uint16_t h;
        memcpy(&h, y, 2);
        const float d = qt_f16_to_f32(h);
        for (int ib = 0; ib < 8; ib++) {
            uint32_t aux[2];
            memcpy(aux, y + 2 + 8 * ib, 8);
            const float db = d * (0.5f + (float)(aux[1] >> 28)) * 0.25f;
            for (int l = 0; l < 4; l++, out += 8) {
                const uint8_t *pg = iq2xxs_grid[(aux[0] >> (8 * l)) & 255];
                const uint32_t s7 = (aux[1] >> (7 * l)) & 127, signs = s7 | ((uint32_t)__builtin_parity(s7) << 7);
                for (int j = 0; j < 8; j++) out[j] = db * (float)pg[j] * ((signs >> j) & 1 ? -1.0f : 1.0f);
            }
        }
    }
}

/* the caller has seen qt_iq2_xxs_ready() and gives weights (llama.cpp asserts it has them) */
void qt_iq2_xxs_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec) {
    for (Py_ssize_t b = 0; b < blocks; b++) iq2_xxs_block(x + 256 * b, qw + 256 * b, out + 66 * b);
    qt_iq2_xxs_decode(out, rec, blocks);
}

/* -- IQ2_XS ---------------------------------------------------------------------------------------- */

/* quantize_row_iq2_xs_impl on one super-block: [d f16][32 x u16: grid index (9 bits) | 7-bit sign
 * mask << 9][8 B: two 4-bit scales per 32]. Blocks of 16 (two groups of 8), 512 grid points, 19
 * trial scales around max / 5, only the off-grid groups redone. */
static void iq2_xs_block(const float *xbl, const float *qw, uint8_t *y) {
    enum { KMAXQ = 3 };
    float scales[16], weight[16], waux[16], xval[16];
    int8_t L[16];
    uint8_t block_signs[2];
    uint16_t q2[32];
    memset(y, 0, 74);
    memset(q2, 0, sizeof q2);
    float max_scale = 0.0f, sumx2 = 0.0f;
    for (int i = 0; i < 256; i++) sumx2 += xbl[i] * xbl[i];
    const float sigma2 = sumx2 / 256.0f;
    for (int ib = 0; ib < 16; ib++) {
        const float *xb = xbl + 16 * ib;
        for (int i = 0; i < 16; i++) weight[i] = qw[16 * ib + i] * __builtin_sqrtf(sigma2 + xb[i] * xb[i]);
        for (int i = 0; i < 16; i++) waux[i] = __builtin_sqrtf(weight[i]);
        for (int k = 0; k < 2; k++) block_signs[k] = qt_iq_even_signs(xb + 8 * k, weight + 8 * k, xval + 8 * k);
        float max = xval[0];
        for (int i = 1; i < 16; i++) max = max > xval[i] ? max : xval[i];
        memset(L, 0, 16);
        if (max < 1e-15f) { /* GROUP_MAX_EPS */
            scales[ib] = 0.0f;
            continue;
        }
        const float scale0 = max / (float)(2 * KMAXQ - 1);
        float scale = qt_iq_search(&grid_xs, 16, KMAXQ, xval, weight, waux, scale0, max, 9, 0.1f, QT_IQ_REDO_OFF_GRID, L);
        if (scale < 0.0f) {
            scale = -scale;
            for (int k = 0; k < 2; k++) block_signs[k] = (uint8_t)(~block_signs[k] & 127);
        }
        for (int k = 0; k < 2; k++) {
            const int u = qt_iq_word(&grid_xs, L + 8 * k);
            const int g = grid_xs.at[u] >= 0 ? grid_xs.at[u] : 0; /* llama.cpp aborts otherwise */
            q2[2 * ib + k] = (uint16_t)(g | (block_signs[k] << 9));
        }
        scales[ib] = scale;
        max_scale = max_scale > scale ? max_scale : scale;
    }
    if (max_scale == 0.0f) return; /* all zeros, d 0 */
    const float d = max_scale / 31.0f, id = 1.0f / d;
    const uint16_t h = qt_f32_to_f16(d);
    memcpy(y, &h, 2);
    for (int ib = 0; ib < 16; ib++) {
        int l = qt_iq_nearest(0.5f * (id * scales[ib] - 1.0f));
        l = l < 0 ? 0 : l > 15 ? 15 : l;
        if (ib % 2 == 0) y[66 + ib / 2] = (uint8_t)l;
        else y[66 + ib / 2] |= (uint8_t)(l << 4);
    }
    memcpy(y + 2, q2, 64);
}

/* dequantize_row_iq2_xs: x = (d * (0.5 + scale) * 0.25) * grid value, signed, a scale per 16 */
void qt_iq2_xs_decode(const uint8_t *y, float *out, Py_ssize_t blocks) {
    for (Py_ssize_t b = 0; b < blocks; b++, y += 74) {
        uint16_t h;
        memcpy(&h, y, 2);
        const float d = qt_f16_to_f32(h);
        for (int ib = 0; ib < 8; ib++) {
            const float db[2] = {d * (0.5f + (float)(y[66 + ib] & 0xF)) * 0.25f, d * (0.5f + (float)(y[66 + ib] >> 4)) * 0.25f};
            for (int l = 0; l < 4; l++, out += 8) {
                uint16_t q;
                memcpy(&q, y + 2 + 2 * (4 * ib + l), 2);
                const uint8_t *pg = iq2xs_grid[q & 511];
                const uint32_t s7 = q >> 9, signs = s7 | ((uint32_t)__builtin_parity(s7) << 7);
                for (int j = 0; j < 8; j++) out[j] = db[l / 2] * (float)pg[j] * ((signs >> j) & 1 ? -1.0f : 1.0f);
            }
        }
    }
}

/* the caller has seen qt_iq2_xs_ready() and gives weights (llama.cpp asserts it has them) */
void qt_iq2_xs_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec) {
    for (Py_ssize_t b = 0; b < blocks; b++) iq2_xs_block(x + 256 * b, qw + 256 * b, out + 74 * b);
    qt_iq2_xs_decode(out, rec, blocks);
}

/* -- IQ2_S ----------------------------------------------------------------------------------------- */

/* quantize_row_iq2_s_impl on one super-block: [d f16][32 B grid index low bytes][32 B sign bytes]
 * [8 B: the indexes' high 2 bits, 4 a byte][8 B: two 4-bit scales per 32]. As IQ2_XS but for: a
 * 1024-point grid with neighbours at the smallest distance only, full 8-bit signs, sigma2 twice
 * the mean square, weights 0.25 sigma2 + x^2 without quant_weights, d times 0.9875. */
static void iq2_s_block(const float *xbl, const float *qw, uint8_t *y) {
    enum { KMAXQ = 3 };
    float scales[16], weight[16], waux[16], xval[16];
    int8_t L[16];
    uint8_t block_signs[2];
    uint8_t *qs = y + 2, *qh = y + 66, *sc = y + 74;
    memset(y, 0, 82);
    float max_scale = 0.0f, sumx2 = 0.0f;
    for (int i = 0; i < 256; i++) sumx2 += xbl[i] * xbl[i];
    const float sigma2 = 2.0f * sumx2 / 256.0f;
    for (int ib = 0; ib < 16; ib++) {
        const float *xb = xbl + 16 * ib;
        if (qw)
            for (int i = 0; i < 16; i++) weight[i] = qw[16 * ib + i] * __builtin_sqrtf(sigma2 + xb[i] * xb[i]);
        else
            for (int i = 0; i < 16; i++) weight[i] = 0.25f * sigma2 + xb[i] * xb[i];
        for (int i = 0; i < 16; i++) waux[i] = __builtin_sqrtf(weight[i]);
        for (int k = 0; k < 2; k++) block_signs[k] = qt_iq_signs(xb + 8 * k, xval + 8 * k);
        float max = xval[0];
        for (int i = 1; i < 16; i++) max = max > xval[i] ? max : xval[i];
        memset(L, 0, 16);
        if (max < 1e-8f) { /* GROUP_MAX_EPS_IQ2_S */
            scales[ib] = 0.0f;
            continue;
        }
        const float scale0 = max / (float)(2 * KMAXQ - 1);
        float scale = qt_iq_search(&grid_s, 16, KMAXQ, xval, weight, waux, scale0, max, 9, 0.1f, QT_IQ_REDO_OFF_GRID, L);
        if (scale < 0.0f) {
            scale = -scale;
            for (int k = 0; k < 2; k++) block_signs[k] = (uint8_t)~block_signs[k];
        }
        for (int k = 0; k < 2; k++) {
            const int u = qt_iq_word(&grid_s, L + 8 * k);
            const int g = grid_s.at[u] >= 0 ? grid_s.at[u] : 0; /* llama.cpp aborts otherwise */
            const int i8 = 2 * ib + k;
            qs[i8] = (uint8_t)(g & 255);
            qh[i8 / 4] |= (uint8_t)((g >> 8) << (2 * (i8 % 4)));
            qs[32 + i8] = block_signs[k];
        }
        scales[ib] = scale;
        max_scale = max_scale > scale ? max_scale : scale;
    }
    if (max_scale == 0.0f) return; /* d stays 0, the codes as written */
    const float d = max_scale / 31.0f, id = 1.0f / d;
    const uint16_t h = qt_f32_to_f16(d * 0.9875f);
    memcpy(y, &h, 2);
    for (int ib = 0; ib < 16; ib++) {
        int l = qt_iq_nearest(0.5f * (id * scales[ib] - 1.0f));
        l = l < 0 ? 0 : l > 15 ? 15 : l;
        if (ib % 2 == 0) sc[ib / 2] = (uint8_t)l;
        else sc[ib / 2] |= (uint8_t)(l << 4);
    }
}

/* dequantize_row_iq2_s: x = (d * (0.5 + scale) * 0.25) * grid value, signed, a scale per 16 */
void qt_iq2_s_decode(const uint8_t *y, float *out, Py_ssize_t blocks) {
    for (Py_ssize_t b = 0; b < blocks; b++, y += 82) {
        uint16_t h;
        memcpy(&h, y, 2);
        const float d = qt_f16_to_f32(h);
        const uint8_t *qs = y + 2, *signs = y + 34, *qh = y + 66, *sc = y + 74;
        for (int ib = 0; ib < 8; ib++) {
            const float db[2] = {d * (0.5f + (float)(sc[ib] & 0xF)) * 0.25f, d * (0.5f + (float)(sc[ib] >> 4)) * 0.25f};
            for (int l = 0; l < 4; l++, out += 8) {
                const uint8_t *pg = iq2s_grid[qs[4 * ib + l] | ((qh[ib] << (8 - 2 * l)) & 0x300)];
                const uint8_t s = signs[4 * ib + l];
                for (int j = 0; j < 8; j++) out[j] = db[l / 2] * (float)pg[j] * ((s >> j) & 1 ? -1.0f : 1.0f);
            }
        }
    }
}

/* the caller has seen qt_iq2_s_ready() */
void qt_iq2_s_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec) {
    for (Py_ssize_t b = 0; b < blocks; b++) iq2_s_block(x + 256 * b, qw ? qw + 256 * b : NULL, out + 82 * b);
    qt_iq2_s_decode(out, rec, blocks);
}
