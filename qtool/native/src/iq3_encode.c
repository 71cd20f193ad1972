/* GGUF IQ3_S encoder and decoder: byte for byte llama.cpp's quantize_iq3_s (with and without
 * quant_weights) and dequantize_row_iq3_s (ggml/src/ggml-quants.c, llama.cpp
 * 0c1e57098bba43ac29e6e3b677cdceebdd22334f; tests/test_native_gguf_iq3.py and the fixture made by
 * tests/fixtures/gguf_kquants/make_reference.py hold the proof).
 *
 * IQ3_S stores each group of 4 magnitudes as one of 512 grid points (iq3_grids.h), signs apart,
 * with a 4-bit scale per 32 values. The search (per block of 32) tries 19 scales; each group's
 * rounded 3-bit coordinates are looked up in the grid, and a point off the grid is replaced by
 * the best of its neighbours: the grid points at the three smallest squared distances from it,
 * in (distance, index) order, as iq3xs_init_impl lists them (we build the same lists, without
 * its qsort). Every float step is ggml's, in its order (see kquant_encode.c for why that is
 * exact). The search is scalar, like llama.cpp's: its neighbour lists differ from group to group.
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

#include <float.h>
#include <pthread.h>
#include <stdlib.h>

#include "iq3_grids.h"

#ifdef __FAST_MATH__
#error "iq3_encode.c must be built without -ffast-math: its bytes depend on IEEE float32 rounding"
#endif

#define QT_INLINE static inline __attribute__((always_inline))

QT_INLINE int32_t nearest(float f) { return (int32_t)(qt_bits(f + 12582912.0f) & 0x007FFFFFu) - 0x00400000; }

/* -- the grids' index and neighbour lists (iq3xs_init_impl), built once per grid ---------------- */

typedef struct {
    int size, nwant;                /* points; distinct distances a neighbour list spans */
    uint8_t points[512][4];         /* the quantizer's magnitudes 2l + 1 of each point */
    int16_t at[4096];               /* grid index of the point with 3-bit coordinates u, or -1 */
    uint32_t neighbour_at[4096];    /* off-grid u: its list starts at neighbours[neighbour_at[u]] */
    uint16_t neighbour_count[4096];
    uint16_t *neighbours;
} Grid;

static Grid grid_s = {.size = 512, .nwant = 3}, grid_xxs = {.size = 256, .nwant = 2};
static pthread_once_t grid_s_once = PTHREAD_ONCE_INIT, grid_xxs_once = PTHREAD_ONCE_INIT;

/* the neighbour lists of every off-grid point: the points at its `nwant` smallest squared
 * distances, by distance then index (iq3xs_init_impl's qsort order, without the qsort) */
static void build_grid(Grid *grid) {
    for (int u = 0; u < 4096; u++) grid->at[u] = -1;
    for (int k = 0; k < grid->size; k++) {
        const uint8_t *p = grid->points[k];
        grid->at[((p[0] - 1) / 2) | (((p[1] - 1) / 2) << 3) | (((p[2] - 1) / 2) << 6) | (((p[3] - 1) / 2) << 9)] = (int16_t)k;
    }
    int d2[512];
    size_t total = 0;
    for (int pass = 0; pass < 2; pass++) { /* count, then fill */
        if (pass == 1 && !(grid->neighbours = malloc(total * sizeof(uint16_t)))) return;
        total = 0;
        for (int u = 0; u < 4096; u++) {
            if (grid->at[u] >= 0) continue;
            int smallest[3] = {INT32_MAX, INT32_MAX, INT32_MAX}; /* the smallest distinct distances */
            for (int j = 0; j < grid->size; j++) {
                int d = 0;
                for (int i = 0; i < 4; i++) {
                    const int delta = grid->points[j][i] - (2 * ((u >> (3 * i)) & 7) + 1);
                    d += delta * delta;
                }
                d2[j] = d;
                if (d == smallest[0] || d == smallest[1] || d == smallest[2]) continue;
                if (d < smallest[0]) smallest[2] = smallest[1], smallest[1] = smallest[0], smallest[0] = d;
                else if (d < smallest[1]) smallest[2] = smallest[1], smallest[1] = d;
                else if (d < smallest[2]) smallest[2] = d;
            }
            int n = 0;
            for (int t = 0; t < grid->nwant; t++)
                for (int j = 0; j < grid->size; j++)
                    if (d2[j] == smallest[t]) {
                        if (pass == 1) grid->neighbours[total + (size_t)n] = (uint16_t)j;
                        n++;
                    }
            grid->neighbour_at[u] = (uint32_t)total;
            grid->neighbour_count[u] = (uint16_t)n;
            total += (size_t)n;
        }
    }
}

static void build_grid_s(void) {
    memcpy(grid_s.points, iq3s_grid, sizeof iq3s_grid);
    build_grid(&grid_s);
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
    build_grid(&grid_xxs);
}

/* iq3_find_best_neighbour: of off-grid point u's neighbours, the one with the least weighted
 * squared error at `scale`; its coordinates into L */
static int best_neighbour(const Grid *grid, int u, const float *xval, const float *w, float scale, int8_t *L) {
    const uint16_t *list = grid->neighbours + grid->neighbour_at[u];
    float best_d2 = FLT_MAX;
    int best = -1;
    for (int n = 0; n < grid->neighbour_count[u]; n++) {
        const uint8_t *pg = grid->points[list[n]];
        float d2 = 0.0f;
        for (int i = 0; i < 4; i++) {
            const float diff = scale * (float)pg[i] - xval[i];
            d2 += w[i] * diff * diff;
        }
        if (d2 < best_d2) best_d2 = d2, best = list[n];
    }
    if (best < 0) best = list[0]; /* llama.cpp aborts here (NaN or inf) */
    for (int i = 0; i < 4; i++) L[i] = (int8_t)((grid->points[best][i] - 1) / 2);
    return best;
}

/* quantize_row_iq3_s_impl(32, ...) on one super-block: [d f16][64 B qs][8 B qh][32 B signs][4 B scales] */
static void iq3_s_block(const float *xbl, const float *qw, uint8_t *y) {
    enum { KMAXQ = 8 };
    float scales[8], weight[32], waux[32], xval[32];
    int8_t L[32], Laux[32];
    uint8_t block_signs[4], on_grid[8], on_grid_aux[8];
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
        for (int k = 0; k < 4; k++) {
            uint8_t s = 0;
            for (int i = 0; i < 8; i++) {
                const float v = xb[8 * k + i];
                if (v >= 0) xval[8 * k + i] = v;
                else xval[8 * k + i] = -v, s |= (uint8_t)(1 << i);
            }
            block_signs[k] = s;
        }
        float max = xval[0];
        for (int i = 1; i < 32; i++) max = max > xval[i] ? max : xval[i];
        memset(L, 0, 32);
        if (max == 0.0f) { /* llama.cpp's `continue` before the pointers move */
            scales[ib] = 0.0f;
            continue;
        }
        float best = 0.0f, scale = max / (float)(2 * KMAXQ - 1);
        memset(on_grid, 0, 8);
        for (int is = -9; is <= 9; is++) {
            const float id = ((float)(2 * KMAXQ - 1) + (float)is * 0.2f) / max, this_scale = 1.0f / id;
            for (int k = 0; k < 8; k++) {
                int u = 0;
                for (int i = 0; i < 4; i++) {
                    int l = nearest(0.5f * (id * xval[4 * k + i] - 1.0f));
                    l = l < 0 ? 0 : l > KMAXQ - 1 ? KMAXQ - 1 : l;
                    Laux[4 * k + i] = (int8_t)l;
                    u |= l << (3 * i);
                }
                on_grid_aux[k] = grid_s.at[u] >= 0;
                if (!on_grid_aux[k]) best_neighbour(&grid_s, u, xval + 4 * k, waux + 4 * k, this_scale, Laux + 4 * k);
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
                memcpy(on_grid, on_grid_aux, 8);
            }
        }
        int off_grid = 0;
        for (int k = 0; k < 8; k++) off_grid += !on_grid[k];
        if (off_grid > 0 && scale > 0.0f) {
            const float id = 1.0f / scale;
            for (int k = 0; k < 8; k++) {
                int u = 0;
                for (int i = 0; i < 4; i++) {
                    int l = nearest(0.5f * (id * xval[4 * k + i] - 1.0f));
                    l = l < 0 ? 0 : l > KMAXQ - 1 ? KMAXQ - 1 : l;
                    u |= l << (3 * i);
                }
                int g = grid_s.at[u];
                if (g < 0) g = best_neighbour(&grid_s, u, xval + 4 * k, waux + 4 * k, scale, L + 4 * k);
                for (int i = 0; i < 4; i++) L[4 * k + i] = (int8_t)((iq3s_grid[g][i] - 1) / 2);
            }
            float sumqx = 0.0f, sumq2 = 0.0f;
            for (int i = 0; i < 32; i++) {
                const float q = (float)(2 * L[i] + 1);
                sumqx += weight[i] * xval[i] * q;
                sumq2 += weight[i] * q * q;
            }
            if (sumq2 > 0.0f) scale = sumqx / sumq2;
        }
        if (scale < 0.0f) { /* "should never happen" (llama.cpp): flip the scale and the signs */
            scale = -scale;
            for (int k = 0; k < 4; k++) block_signs[k] = (uint8_t)~block_signs[k];
        }
        for (int k = 0; k < 8; k++) {
            const int u = L[4 * k] | (L[4 * k + 1] << 3) | (L[4 * k + 2] << 6) | (L[4 * k + 3] << 9);
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
        int l1 = nearest(0.5f * (id * scales[ib] - 1.0f)), l2 = nearest(0.5f * (id * scales[ib + 1] - 1.0f));
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
    return grid_s.neighbours != NULL;
}
int qt_iq3_xxs_ready(void) {
    pthread_once(&grid_xxs_once, build_grid_xxs);
    return grid_xxs.neighbours != NULL;
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
    int8_t L[32], Laux[32];
    uint8_t block_signs[4], on_grid[8], on_grid_aux[8], q3[64];
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
        for (int k = 0; k < 4; k++) {
            int nflip = 0;
            uint8_t s = 0;
            for (int i = 0; i < 8; i++) {
                const float v = xb[8 * k + i];
                if (v >= 0) xval[8 * k + i] = v;
                else xval[8 * k + i] = -v, nflip++, s |= (uint8_t)(1 << i);
            }
            if (nflip % 2) { /* 7 sign bits and even parity: flip the value that matters least */
                int imin = 0;
                float min = weight[8 * k] * xb[8 * k] * xb[8 * k];
                for (int i = 1; i < 8; i++) {
                    const float ax = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i];
                    if (ax < min) min = ax, imin = i;
                }
                xval[8 * k + imin] = -xval[8 * k + imin];
                s ^= (uint8_t)(1 << imin);
            }
            block_signs[k] = s & 127;
        }
        float max = xval[0];
        for (int i = 1; i < 32; i++) max = max > xval[i] ? max : xval[i];
        memset(L, 0, 32);
        if (max < 1e-8f) { /* GROUP_MAX_EPS_IQ3_XXS */
            scales[ib] = 0.0f;
            continue;
        }
        float best = 0.0f, scale = max / (float)(2 * KMAXQ - 1);
        memset(on_grid, 1, 8);
        for (int is = -15; is <= 15; is++) {
            const float id = ((float)(2 * KMAXQ - 1) + (float)is * 0.2f) / max, this_scale = 1.0f / id;
            for (int k = 0; k < 8; k++) {
                int u = 0;
                for (int i = 0; i < 4; i++) {
                    int l = nearest(0.5f * (id * xval[4 * k + i] - 1.0f));
                    l = l < 0 ? 0 : l > KMAXQ - 1 ? KMAXQ - 1 : l;
                    Laux[4 * k + i] = (int8_t)l;
                    u |= l << (3 * i);
                }
                on_grid_aux[k] = grid_xxs.at[u] >= 0;
                if (!on_grid_aux[k]) best_neighbour(&grid_xxs, u, xval + 4 * k, waux + 4 * k, this_scale, Laux + 4 * k);
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
                memcpy(on_grid, on_grid_aux, 8);
            }
        }
        int off_grid = 0;
        for (int k = 0; k < 8; k++) off_grid += !on_grid[k];
        if (off_grid > 0 && scale > 0.0f) {
            const float id = 1.0f / scale;
            for (int k = 0; k < 8; k++) {
                if (on_grid[k]) continue; /* unlike IQ3_S: only the groups off the grid */
                int u = 0;
                for (int i = 0; i < 4; i++) {
                    int l = nearest(0.5f * (id * xval[4 * k + i] - 1.0f));
                    l = l < 0 ? 0 : l > KMAXQ - 1 ? KMAXQ - 1 : l;
                    u |= l << (3 * i);
                }
                int g = grid_xxs.at[u];
                if (g < 0) g = best_neighbour(&grid_xxs, u, xval + 4 * k, waux + 4 * k, scale, L + 4 * k);
                for (int i = 0; i < 4; i++) L[4 * k + i] = (int8_t)((grid_xxs.points[g][i] - 1) / 2);
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
        for (int k = 0; k < 8; k++) {
            const int u = L[4 * k] | (L[4 * k + 1] << 3) | (L[4 * k + 2] << 6) | (L[4 * k + 3] << 9);
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
        int l = nearest(0.5f * (id * scales[ib] - 1.0f));
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
