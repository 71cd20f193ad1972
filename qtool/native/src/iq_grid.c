/* The grid search of llama.cpp's IQ2 and IQ3 encoders (see iq_grid.h), byte for byte
 * ggml-quants.c's (llama.cpp 0c1e57098bba43ac29e6e3b677cdceebdd22334f): every float step is
 * ggml's, in its order (kquant_encode.c says why that is exact), so the five types' bytes stay
 * llama.cpp's (tests/test_native_gguf_iq2.py, tests/test_native_gguf_iq3.py). Scalar, like
 * llama.cpp's: the neighbour lists differ from group to group.
 */
#include "iq_grid.h"

#include <float.h>
#include <stdlib.h>

#ifdef __FAST_MATH__
#error "iq_grid.c must be built without -ffast-math: its bytes depend on IEEE float32 rounding"
#endif

int qt_iq_word(const QtIqGrid *grid, const int8_t *L) {
    int u = 0;
    for (int i = 0; i < grid->dim; i++) u |= L[i] << (grid->bits * i);
    return u;
}

/* every off-grid word's neighbours: the points at its `nwant` smallest distinct squared
 * distances, by distance then index (iq2xs_init_impl's and iq3xs_init_impl's qsort order,
 * without the qsort) */
int qt_iq_grid_build(QtIqGrid *grid) {
    const int dim = grid->dim, bits = grid->bits, mask = (1 << bits) - 1;
    grid->at = malloc((size_t)grid->map_size * sizeof *grid->at);
    grid->neighbour_at = malloc((size_t)grid->map_size * sizeof *grid->neighbour_at);
    grid->neighbour_count = malloc((size_t)grid->map_size * sizeof *grid->neighbour_count);
    if (!grid->at || !grid->neighbour_at || !grid->neighbour_count) return 0;
    for (int u = 0; u < grid->map_size; u++) grid->at[u] = -1;
    for (int k = 0; k < grid->size; k++) {
        int u = 0;
        for (int i = 0; i < dim; i++) u |= ((grid->points[k][i] - 1) / 2) << (bits * i);
        grid->at[u] = (int16_t)k;
    }
    int d2[1024];
    size_t total = 0;
    for (int pass = 0; pass < 2; pass++) { /* count, then fill */
        if (pass == 1 && !(grid->neighbours = malloc(total * sizeof(uint16_t)))) return 0;
        total = 0;
        for (int u = 0; u < grid->map_size; u++) {
            if (grid->at[u] >= 0) continue;
            int smallest[3] = {INT32_MAX, INT32_MAX, INT32_MAX}; /* the smallest distinct distances */
            for (int j = 0; j < grid->size; j++) {
                int d = 0;
                for (int i = 0; i < dim; i++) {
                    const int delta = grid->points[j][i] - (2 * ((u >> (bits * i)) & mask) + 1);
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
    return 1;
}

int qt_iq_best_neighbour(const QtIqGrid *grid, int u, const float *xval, const float *w, float scale, int8_t *L) {
    const uint16_t *list = grid->neighbours + grid->neighbour_at[u];
    float best_d2 = FLT_MAX;
    int best = -1;
    for (int n = 0; n < grid->neighbour_count[u]; n++) {
        const uint8_t *pg = grid->points[list[n]];
        float d2 = 0.0f;
        for (int i = 0; i < grid->dim; i++) {
            const float diff = scale * (float)pg[i] - xval[i];
            d2 += w[i] * diff * diff;
        }
        if (d2 < best_d2) best_d2 = d2, best = list[n];
    }
    if (best < 0) best = list[0]; /* llama.cpp aborts here (NaN or inf) */
    for (int i = 0; i < grid->dim; i++) L[i] = (int8_t)((grid->points[best][i] - 1) / 2);
    return best;
}

/* the coordinates of one group at inverse scale id, clamped to the grid's range, into L; its word */
static int rounded_group(const QtIqGrid *grid, int kmax, const float *xval, float id, int8_t *L) {
    int u = 0;
    for (int i = 0; i < grid->dim; i++) {
        int l = qt_iq_nearest(0.5f * (id * xval[i] - 1.0f));
        l = l < 0 ? 0 : l > kmax - 1 ? kmax - 1 : l;
        L[i] = (int8_t)l;
        u |= l << (grid->bits * i);
    }
    return u;
}

/* sum w x q and sum w q^2 over the block, q = 2l + 1 */
static void odd_code_sums(int n, const float *weight, const float *xval, const int8_t *L, float *sumqx, float *sumq2) {
    float qx = 0.0f, q2 = 0.0f;
    for (int i = 0; i < n; i++) {
        const float q = (float)(2 * L[i] + 1);
        qx += weight[i] * xval[i] * q;
        q2 += weight[i] * q * q;
    }
    *sumqx = qx;
    *sumq2 = q2;
}

float qt_iq_search(const QtIqGrid *grid, int n, int kmax, const float *xval, const float *weight, const float *waux, float scale, float max, int trials, float step, QtIqRedo redo, int8_t *L) {
    const int dim = grid->dim, groups = n / dim;
    int8_t Laux[32];
    /* IQ3_S starts its groups off the grid: a block none of whose trials is taken is redone */
    uint8_t on_grid[8], on_grid_aux[8];
    memset(on_grid, redo != QT_IQ_REDO_ALL_IF_OFF, sizeof on_grid);
    float best = 0.0f, sumqx, sumq2;
    for (int is = -trials; is <= trials; is++) {
        const float id = ((float)(2 * kmax - 1) + (float)is * step) / max, this_scale = 1.0f / id;
        for (int k = 0; k < groups; k++) {
            const int u = rounded_group(grid, kmax, xval + dim * k, id, Laux + dim * k);
            on_grid_aux[k] = grid->at[u] >= 0;
            if (!on_grid_aux[k]) qt_iq_best_neighbour(grid, u, xval + dim * k, waux + dim * k, this_scale, Laux + dim * k);
        }
        odd_code_sums(n, weight, xval, Laux, &sumqx, &sumq2);
        if (sumq2 > 0.0f && sumqx * sumqx > best * sumq2) {
            scale = sumqx / sumq2;
            best = scale * sumqx;
            memcpy(L, Laux, (size_t)n);
            memcpy(on_grid, on_grid_aux, (size_t)groups);
        }
    }
    int off_grid = 0;
    for (int k = 0; k < groups; k++) off_grid += !on_grid[k];
    if ((redo == QT_IQ_REDO_ALL || off_grid > 0) && scale > 0.0f) {
        const float id = 1.0f / scale;
        for (int k = 0; k < groups; k++) {
            if (redo == QT_IQ_REDO_OFF_GRID && on_grid[k]) continue;
            const int u = rounded_group(grid, kmax, xval + dim * k, id, L + dim * k);
            if (grid->at[u] < 0) qt_iq_best_neighbour(grid, u, xval + dim * k, waux + dim * k, scale, L + dim * k);
        }
        odd_code_sums(n, weight, xval, L, &sumqx, &sumq2);
        if (sumq2 > 0.0f) scale = sumqx / sumq2;
    }
    return scale;
}

uint8_t qt_iq_even_signs(const float *xb, const float *weight, float *xval) {
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

uint8_t qt_iq_signs(const float *xb, float *xval) {
    uint8_t s = 0;
    for (int i = 0; i < 8; i++) {
        if (xb[i] >= 0) xval[i] = xb[i];
        else xval[i] = -xb[i], s |= (uint8_t)(1 << i);
    }
    return s;
}
