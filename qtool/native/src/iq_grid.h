/* The grid search that llama.cpp's IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S encoders share
 * (iq_grid.c): a grid of points, each `dim` magnitudes 2l + 1 with l a `bits`-bit coordinate;
 * every point off the grid has a list of its nearest grid points; a block's scale is chosen by
 * trying scales around its maximum, each group of `dim` magnitudes rounded and moved onto the
 * grid, then refitted by weighted least squares. The five types differ in the grid, the trial
 * scales and which groups the final pass redoes; iq2_encode.c and iq3_encode.c hold the rest
 * (signs, weights, packing), each block function one of ggml-quants.c's row functions.
 */
#ifndef QTOOL_IQ_GRID_H
#define QTOOL_IQ_GRID_H

#include "qtool_native.h"

/* ggml's nearest_int: round half to even through the float mantissa (|f| < 2^22) */
static inline int32_t qt_iq_nearest(float f) { return (int32_t)(qt_bits(f + 12582912.0f) & 0x007FFFFFu) - 0x00400000; }

typedef struct {
    int size, nwant;         /* points; how many distinct distances a neighbour list spans (1-3) */
    int dim, bits, map_size; /* magnitudes per point, bits per coordinate, coordinate words kept */
    uint8_t points[1024][8]; /* each point's magnitudes 2l + 1, filled before qt_iq_grid_build */
    int16_t *at;             /* grid index of coordinate word u, or -1 */
    uint32_t *neighbour_at;  /* off-grid u: its list starts at neighbours[neighbour_at[u]] */
    uint16_t *neighbour_count;
    uint16_t *neighbours;
} QtIqGrid;

/* Which groups the pass after the trials redoes at the chosen scale */
typedef enum {
    QT_IQ_REDO_ALL,         /* IQ2_XXS: every group, always */
    QT_IQ_REDO_ALL_IF_OFF,  /* IQ3_S: every group, if one is off the grid or no trial was taken */
    QT_IQ_REDO_OFF_GRID,    /* IQ2_XS, IQ2_S, IQ3_XXS: only the groups off the grid */
} QtIqRedo;

/* the index and neighbour lists of a grid whose points are filled in (iq2xs_init_impl,
 * iq3xs_init_impl); 0 when out of memory */
int qt_iq_grid_build(QtIqGrid *grid);

/* the coordinate word of `dim` coordinates */
int qt_iq_word(const QtIqGrid *grid, const int8_t *L);

/* iq2_find_best_neighbour / iq3_find_best_neighbour: of off-grid word u's neighbours, the one
 * with the least weighted squared error at `scale`; its coordinates into L, its index returned */
int qt_iq_best_neighbour(const QtIqGrid *grid, int u, const float *xval, const float *w, float scale, int8_t *L);

/* The trial-scale search of one block of n magnitudes xval (weights `weight`, their square roots
 * `waux`): trial scales 1 / (((2 kmax - 1) + is step) / max) for is in -trials..trials, the
 * best by weighted least squares, then the `redo` pass and a last refit. L holds the codes kept
 * if no trial is taken; returns the block's scale (may be negative: the caller flips signs). */
float qt_iq_search(const QtIqGrid *grid, int n, int kmax, const float *xval, const float *weight, const float *waux, float scale, float max, int trials, float step, QtIqRedo redo, int8_t *L);

/* The magnitudes of 8 values into xval and their signs as a 7-bit mask: an odd count of
 * negatives has the least important value's sign flipped (the eighth sign is the parity of the
 * other seven: IQ2_XXS, IQ2_XS, IQ3_XXS) */
uint8_t qt_iq_even_signs(const float *xb, const float *weight, float *xval);

/* The magnitudes of 8 values into xval and their 8 signs (IQ2_S, IQ3_S) */
uint8_t qt_iq_signs(const float *xb, float *xval);

#endif
