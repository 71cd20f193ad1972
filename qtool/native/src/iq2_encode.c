/* GGUF IQ2_XXS and IQ2_XS encoders and decoders: byte for byte llama.cpp's quantize_iq2_xxs and
 * quantize_iq2_xs (which need quant_weights: llama-quantize refuses them without an imatrix) and
 * dequantize_row_iq2_xxs / _xs
 * (ggml/src/ggml-quants.c, llama.cpp 0c1e57098bba43ac29e6e3b677cdceebdd22334f;
 * tests/test_native_gguf_iq2.py and the kquant fixture hold the proof).
 *
 * As IQ3_XXS (iq3_encode.c, which explains the method) but with groups of 8 magnitudes, each a
 * point of a 256-point (IQ2_XS: 512) grid of 2-bit coordinates (iq2_grids.h), neighbour lists at the 2 smallest
 * distances over all 43692 coordinate words (iq2xs_init_impl), the scale search seeded by
 * make_qp_quants and tried at 13 scales around it, sigma2 the plain mean square.
 */
#include "qtool_native.h"

#include <float.h>
#include <pthread.h>
#include <stdlib.h>

#include "iq2_grids.h"

#ifdef __FAST_MATH__
#error "iq2_encode.c must be built without -ffast-math: its bytes depend on IEEE float32 rounding"
#endif

#define QT_INLINE static inline __attribute__((always_inline))
enum { MAP_SIZE = 43692 }; /* coordinate words up to 0xAAAA (every coordinate 2) */

QT_INLINE int32_t nearest(float f) { return (int32_t)(qt_bits(f + 12582912.0f) & 0x007FFFFFu) - 0x00400000; }

typedef struct {
    int size, nwant;            /* points; distinct distances a neighbour list spans (1 or 2) */
    const uint8_t (*values)[8]; /* the stored grid (8, 25, 43) */
    uint8_t points[1024][8];    /* the quantizer's magnitudes 2l + 1 */
    int16_t at[MAP_SIZE];       /* grid index of coordinate word u, or -1 */
    uint32_t neighbour_at[MAP_SIZE];
    uint16_t neighbour_count[MAP_SIZE];
    uint16_t *neighbours;
} Grid;

static Grid grid_xxs = {.size = 256, .nwant = 2, .values = iq2xxs_grid}, grid_xs = {.size = 512, .nwant = 2, .values = iq2xs_grid};
static Grid grid_s = {.size = 1024, .nwant = 1, .values = iq2s_grid};
static pthread_once_t xxs_once = PTHREAD_ONCE_INIT, xs_once = PTHREAD_ONCE_INIT, s_once = PTHREAD_ONCE_INIT;

/* iq2xs_init_impl: every coordinate word's neighbours at the `nwant` smallest squared distances,
 * by distance then index */
static void build_grid(Grid *g) {
    for (int k = 0; k < g->size; k++)
        for (int i = 0; i < 8; i++) g->points[k][i] = (uint8_t)(2 * (g->values[k][i] == 8 ? 0 : g->values[k][i] == 25 ? 1 : 2) + 1);
    for (int u = 0; u < MAP_SIZE; u++) g->at[u] = -1;
    for (int k = 0; k < g->size; k++) {
        int u = 0;
        for (int i = 0; i < 8; i++) u |= ((g->points[k][i] - 1) / 2) << (2 * i);
        g->at[u] = (int16_t)k;
    }
    int d2[1024];
    size_t total = 0;
    for (int pass = 0; pass < 2; pass++) { /* count, then fill */
        if (pass == 1 && !(g->neighbours = malloc(total * sizeof(uint16_t)))) return;
        total = 0;
        for (int u = 0; u < MAP_SIZE; u++) {
            if (g->at[u] >= 0) continue;
            int first = INT32_MAX, second = INT32_MAX; /* the two smallest distinct distances */
            for (int j = 0; j < g->size; j++) {
                int d = 0;
                for (int i = 0; i < 8; i++) {
                    const int delta = g->points[j][i] - (2 * ((u >> (2 * i)) & 3) + 1);
                    d += delta * delta;
                }
                d2[j] = d;
                if (d == first || d == second) continue;
                if (d < first) second = first, first = d;
                else if (d < second) second = d;
            }
            int n = 0;
            for (int t = 0; t < g->nwant; t++)
                for (int j = 0; j < g->size; j++)
                    if (d2[j] == (t ? second : first)) {
                        if (pass == 1) g->neighbours[total + (size_t)n] = (uint16_t)j;
                        n++;
                    }
            g->neighbour_at[u] = (uint32_t)total;
            g->neighbour_count[u] = (uint16_t)n;
            total += (size_t)n;
        }
    }
}

static void build_xxs(void) { build_grid(&grid_xxs); }
static void build_xs(void) { build_grid(&grid_xs); }
static void build_s(void) { build_grid(&grid_s); }

int qt_iq2_xxs_ready(void) {
    pthread_once(&xxs_once, build_xxs);
    return grid_xxs.neighbours != NULL;
}
int qt_iq2_xs_ready(void) {
    pthread_once(&xs_once, build_xs);
    return grid_xs.neighbours != NULL;
}
int qt_iq2_s_ready(void) {
    pthread_once(&s_once, build_s);
    return grid_s.neighbours != NULL;
}

/* iq2_find_best_neighbour */
static int best_neighbour(const Grid *g, int u, const float *xval, const float *w, float scale, int8_t *L) {
    const uint16_t *list = g->neighbours + g->neighbour_at[u];
    float best_d2 = FLT_MAX;
    int best = -1;
    for (int n = 0; n < g->neighbour_count[u]; n++) {
        const uint8_t *pg = g->points[list[n]];
        float d2 = 0.0f;
        for (int i = 0; i < 8; i++) {
            const float diff = scale * (float)pg[i] - xval[i];
            d2 += w[i] * diff * diff;
        }
        if (d2 < best_d2) best_d2 = d2, best = list[n];
    }
    if (best < 0) best = list[0]; /* llama.cpp aborts here (NaN or inf) */
    for (int i = 0; i < 8; i++) L[i] = (int8_t)((g->points[best][i] - 1) / 2);
    return best;
}

/* the signs of 8 values into xval (magnitudes) and a 7-bit mask: an odd count of negatives has
 * the least important value's sign flipped (the eighth sign is the parity of the other seven) */
QT_INLINE uint8_t signs_of(const float *xb, const float *weight, float *xval) {
    int nflip = 0;
    uint8_t s = 0;
    for (int i = 0; i < 8; i++) {
        if (xb[i] >= 0) xval[i] = xb[i];
        else xval[i] = -xb[i], nflip++, s |= (uint8_t)(1 << i);
    }
    if (nflip % 2) {
        int imin = 0;
        float min = weight[0] * xb[0] * xb[0];
        for (int i = 1; i < 8; i++) {
            const float ax = weight[i] * xb[i] * xb[i];
            if (ax < min) min = ax, imin = i;
        }
        xval[imin] = -xval[imin];
        s ^= (uint8_t)(1 << imin);
    }
    return s & 127;
}

QT_INLINE int word_of(const int8_t *L) {
    int u = 0;
    for (int i = 0; i < 8; i++) u |= L[i] << (2 * i);
    return u;
}

/* quantize_row_iq2_xxs_impl on one super-block: [d f16][8 x (u32 four grid indexes, u32 four
 * 7-bit sign masks and the 4-bit scale at bit 28)] */
static void iq2_xxs_block(const float *xbl, const float *qw, uint8_t *y) {
    enum { KMAXQ = 3 };
    float scales[8], weight[32], waux[32], xval[32];
    int8_t L[32], Laux[32];
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
        for (int k = 0; k < 4; k++) block_signs[k] = signs_of(xb + 8 * k, weight + 8 * k, xval + 8 * k);
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
        float best = 0.0f;
        for (int is = -6; is <= 6; is++) {
            const float id = ((float)(2 * KMAXQ - 1) + (float)is * 0.1f) / eff_max, this_scale = 1.0f / id;
            for (int k = 0; k < 4; k++) {
                for (int i = 0; i < 8; i++) {
                    const int l = nearest(0.5f * (id * xval[8 * k + i] - 1.0f));
                    Laux[8 * k + i] = (int8_t)(l < 0 ? 0 : l > KMAXQ - 1 ? KMAXQ - 1 : l);
                }
                const int u = word_of(Laux + 8 * k);
                if (grid_xxs.at[u] < 0) best_neighbour(&grid_xxs, u, xval + 8 * k, waux + 8 * k, this_scale, Laux + 8 * k);
            }
            float sumqx = 0.0f, sumq2 = 0.0f;
            for (int i = 0; i < 32; i++) {
                const float q = (float)(2 * Laux[i] + 1);
                sumqx += weight[i] * xval[i] * q;
                sumq2 += weight[i] * q * q;
            }
            if (sumq2 > 0.0f && sumqx * sumqx > best * sumq2) {
                scale = sumqx / sumq2;
                best = scale * sumqx;
                memcpy(L, Laux, 32);
            }
        }
        if (scale > 0.0f) {
            const float id = 1.0f / scale;
            for (int k = 0; k < 4; k++) {
                int u = 0;
                for (int i = 0; i < 8; i++) {
                    int l = nearest(0.5f * (id * xval[8 * k + i] - 1.0f));
                    l = l < 0 ? 0 : l > KMAXQ - 1 ? KMAXQ - 1 : l;
                    u |= l << (2 * i);
                }
                int g = grid_xxs.at[u];
                if (g < 0) g = best_neighbour(&grid_xxs, u, xval + 8 * k, waux + 8 * k, scale, L + 8 * k);
                for (int i = 0; i < 8; i++) L[8 * k + i] = (int8_t)((grid_xxs.points[g][i] - 1) / 2);
            }
            float sumqx = 0.0f, sumq2 = 0.0f;
            for (int i = 0; i < 32; i++) {
                const float q = (float)(2 * L[i] + 1);
                sumqx += weight[i] * xval[i] * q;
                sumq2 += weight[i] * q * q;
            }
            if (sumq2 > 0.0f) scale = sumqx / sumq2;
        }
        if (scale < 0.0f) {
            scale = -scale;
            for (int k = 0; k < 4; k++) block_signs[k] = (uint8_t)(~block_signs[k] & 127);
        }
        for (int k = 0; k < 4; k++) {
            const int u = word_of(L + 8 * k);
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
        int l = nearest(0.5f * (id * scales[ib] - 1.0f));
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
    int8_t L[16], Laux[16];
    uint8_t block_signs[2], on_grid[2], on_grid_aux[2];
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
        for (int k = 0; k < 2; k++) block_signs[k] = signs_of(xb + 8 * k, weight + 8 * k, xval + 8 * k);
        float max = xval[0];
        for (int i = 1; i < 16; i++) max = max > xval[i] ? max : xval[i];
        memset(L, 0, 16);
        if (max < 1e-15f) { /* GROUP_MAX_EPS */
            scales[ib] = 0.0f;
            continue;
        }
        float best = 0.0f, scale = max / (float)(2 * KMAXQ - 1);
        on_grid[0] = on_grid[1] = 1;
        for (int is = -9; is <= 9; is++) {
            const float id = ((float)(2 * KMAXQ - 1) + (float)is * 0.1f) / max, this_scale = 1.0f / id;
            for (int k = 0; k < 2; k++) {
                for (int i = 0; i < 8; i++) {
                    const int l = nearest(0.5f * (id * xval[8 * k + i] - 1.0f));
                    Laux[8 * k + i] = (int8_t)(l < 0 ? 0 : l > KMAXQ - 1 ? KMAXQ - 1 : l);
                }
                const int u = word_of(Laux + 8 * k);
                on_grid_aux[k] = grid_xs.at[u] >= 0;
                if (!on_grid_aux[k]) best_neighbour(&grid_xs, u, xval + 8 * k, waux + 8 * k, this_scale, Laux + 8 * k);
            }
            float sumqx = 0.0f, sumq2 = 0.0f;
            for (int i = 0; i < 16; i++) {
                const float q = (float)(2 * Laux[i] + 1);
                sumqx += weight[i] * xval[i] * q;
                sumq2 += weight[i] * q * q;
            }
            if (sumq2 > 0.0f && sumqx * sumqx > best * sumq2) {
                scale = sumqx / sumq2;
                best = scale * sumqx;
                memcpy(L, Laux, 16);
                memcpy(on_grid, on_grid_aux, 2);
            }
        }
        if ((!on_grid[0] || !on_grid[1]) && scale > 0.0f) {
            const float id = 1.0f / scale;
            for (int k = 0; k < 2; k++) {
                if (on_grid[k]) continue;
                int u = 0;
                for (int i = 0; i < 8; i++) {
                    int l = nearest(0.5f * (id * xval[8 * k + i] - 1.0f));
                    l = l < 0 ? 0 : l > KMAXQ - 1 ? KMAXQ - 1 : l;
                    u |= l << (2 * i);
                    L[8 * k + i] = (int8_t)l;
                }
                if (grid_xs.at[u] < 0) best_neighbour(&grid_xs, u, xval + 8 * k, waux + 8 * k, scale, L + 8 * k);
            }
            float sumqx = 0.0f, sumq2 = 0.0f;
            for (int i = 0; i < 16; i++) {
                const float q = (float)(2 * L[i] + 1);
                sumqx += weight[i] * xval[i] * q;
                sumq2 += weight[i] * q * q;
            }
            if (sumq2 > 0.0f) scale = sumqx / sumq2;
        }
        if (scale < 0.0f) {
            scale = -scale;
            for (int k = 0; k < 2; k++) block_signs[k] = (uint8_t)(~block_signs[k] & 127);
        }
        for (int k = 0; k < 2; k++) {
            const int u = word_of(L + 8 * k);
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
        int l = nearest(0.5f * (id * scales[ib] - 1.0f));
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
    int8_t L[16], Laux[16];
    uint8_t block_signs[2], on_grid[2], on_grid_aux[2];
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
        for (int k = 0; k < 2; k++) {
            uint8_t s = 0;
            for (int i = 0; i < 8; i++) {
                if (xb[8 * k + i] >= 0) xval[8 * k + i] = xb[8 * k + i];
                else xval[8 * k + i] = -xb[8 * k + i], s |= (uint8_t)(1 << i);
            }
            block_signs[k] = s;
        }
        float max = xval[0];
        for (int i = 1; i < 16; i++) max = max > xval[i] ? max : xval[i];
        memset(L, 0, 16);
        if (max < 1e-8f) { /* GROUP_MAX_EPS_IQ2_S */
            scales[ib] = 0.0f;
            continue;
        }
        float best = 0.0f, scale = max / (float)(2 * KMAXQ - 1);
        on_grid[0] = on_grid[1] = 1;
        for (int is = -9; is <= 9; is++) {
            const float id = ((float)(2 * KMAXQ - 1) + (float)is * 0.1f) / max, this_scale = 1.0f / id;
            for (int k = 0; k < 2; k++) {
                for (int i = 0; i < 8; i++) {
                    const int l = nearest(0.5f * (id * xval[8 * k + i] - 1.0f));
                    Laux[8 * k + i] = (int8_t)(l < 0 ? 0 : l > KMAXQ - 1 ? KMAXQ - 1 : l);
                }
                const int u = word_of(Laux + 8 * k);
                on_grid_aux[k] = grid_s.at[u] >= 0;
                if (!on_grid_aux[k]) best_neighbour(&grid_s, u, xval + 8 * k, waux + 8 * k, this_scale, Laux + 8 * k);
            }
            float sumqx = 0.0f, sumq2 = 0.0f;
            for (int i = 0; i < 16; i++) {
                const float q = (float)(2 * Laux[i] + 1);
                sumqx += weight[i] * xval[i] * q;
                sumq2 += weight[i] * q * q;
            }
            if (sumq2 > 0.0f && sumqx * sumqx > best * sumq2) {
                scale = sumqx / sumq2;
                best = scale * sumqx;
                memcpy(L, Laux, 16);
                memcpy(on_grid, on_grid_aux, 2);
            }
        }
        if ((!on_grid[0] || !on_grid[1]) && scale > 0.0f) {
            const float id = 1.0f / scale;
            for (int k = 0; k < 2; k++) {
                if (on_grid[k]) continue;
                int u = 0;
                for (int i = 0; i < 8; i++) {
                    int l = nearest(0.5f * (id * xval[8 * k + i] - 1.0f));
                    l = l < 0 ? 0 : l > KMAXQ - 1 ? KMAXQ - 1 : l;
                    u |= l << (2 * i);
                    L[8 * k + i] = (int8_t)l;
                }
                if (grid_s.at[u] < 0) best_neighbour(&grid_s, u, xval + 8 * k, waux + 8 * k, scale, L + 8 * k);
            }
            float sumqx = 0.0f, sumq2 = 0.0f;
            for (int i = 0; i < 16; i++) {
                const float q = (float)(2 * L[i] + 1);
                sumqx += weight[i] * xval[i] * q;
                sumq2 += weight[i] * q * q;
            }
            if (sumq2 > 0.0f) scale = sumqx / sumq2;
        }
        if (scale < 0.0f) {
            scale = -scale;
            for (int k = 0; k < 2; k++) block_signs[k] = (uint8_t)~block_signs[k];
        }
        for (int k = 0; k < 2; k++) {
            const int u = word_of(L + 8 * k);
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
        int l = nearest(0.5f * (id * scales[ib] - 1.0f));
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
