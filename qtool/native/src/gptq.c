/* GPTQ's column sweep inside one block of columns (qtool.calibration.gptq), row by row.
 *
 * Why: the sweep is sequential in the columns (each column's rounding error is spread over the
 * columns after it before they are rounded), so in torch it is ~12 small ops per column, and
 * their dispatch, not the arithmetic, was most of a layer's GPTQ time (0.1 s per 576 columns
 * whatever the row count). Each row is independent of the others, so here a row's whole block
 * is swept in one loop, rows split over threads by the caller.
 *
 * Bit for bit qtool.calibration.gptq's torch sweep: for column i of the block, with s and z the
 * row's scale and zero point of the column's group (float32),
 *
 *     q = round_half_even(clamp(w[i] / s + z, qmin, qmax));  v = (q - z) * s   (z absent: q * s)
 *     e = (w[i] - v) / u[i][i];  w[j] = w[j] - e * u[i][j] for j > i   (no FMA: two roundings)
 *
 * the same float32 operations in the same order as the torch ops.
 */
#include "qtool_native.h"

#include <math.h>

static QT_HOT void sweep_row(float *w, const float *u, Py_ssize_t b, const float *scale, const float *zero_point, const int32_t *gidx,
                             float qmin, float qmax, int8_t *codes, float *errors, Py_ssize_t col0, Py_ssize_t col1) {
    for (Py_ssize_t i = col0; i < col1; i++) {
        const float s = scale[gidx[i]];
        float x = w[i] / s;
        if (zero_point) x = x + zero_point[gidx[i]];
        x = x < qmin ? qmin : (x > qmax ? qmax : x);
        const float q = nearbyintf(x);
        const float v = zero_point ? (q - zero_point[gidx[i]]) * s : q * s;
        const float e = (w[i] - v) / u[i * b + i];
        codes[i] = q == q ? (int8_t)q : 0; /* NaN: no code (an int cast of NaN is undefined) */
        errors[i] = e;
        const float *ui = u + i * b;
        for (Py_ssize_t j = i + 1; j < b; j++) w[j] = w[j] - e * ui[j];
    }
}

/* gptq_sweep(w, u, b, scale, zero_point|None, gidx, groups, bits, codes, errors, col0, col1, row0, row1)
 * w float32 [rows, b] (updated in place), u float32 [b, b], scale and zero_point float32
 * [rows, groups], gidx int32 [b] (each column's index into the row's groups), codes int8
 * [rows, b], errors float32 [rows, b]; columns [col0, col1) of rows [row0, row1). */
PyObject *qt_py_gptq_sweep(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer w, u, scale, zp = {0}, gidx, codes, errors;
    PyObject *zp_obj;
    Py_ssize_t b, groups, col0, col1, row0, row1;
    int bits;
    if (!PyArg_ParseTuple(args, "w*y*ny*Oy*niw*w*nnnn", &w, &u, &b, &scale, &zp_obj, &gidx, &groups, &bits, &codes, &errors, &col0, &col1, &row0, &row1))
        return NULL;
    PyObject *result = NULL;
    int have_zp = 0;
    if (zp_obj != Py_None) {
        if (PyObject_GetBuffer(zp_obj, &zp, PyBUF_SIMPLE) < 0) goto done;
        have_zp = 1;
    }
    if (bits < 2 || bits > 8 || b < 1 || groups < 1 || col0 < 0 || col1 < col0 || col1 > b || row0 < 0 || row1 < row0) {
        PyErr_Format(PyExc_ValueError, "gptq_sweep: bad arguments (bits %d, block %zd, groups %zd, columns [%zd, %zd), rows [%zd, %zd))", bits, b, groups, col0, col1, row0, row1);
        goto done;
    }
    if (row1 > PY_SSIZE_T_MAX / 4 / b || row1 > PY_SSIZE_T_MAX / 4 / groups || b > PY_SSIZE_T_MAX / 4 / b) {
        PyErr_SetString(PyExc_ValueError, "gptq_sweep: the sizes overflow");
        goto done;
    }
    if (!qt_check_size(&w, row1 * b * 4, "gptq_sweep w") || !qt_check_size(&u, b * b * 4, "gptq_sweep u") ||
        !qt_check_size(&scale, row1 * groups * 4, "gptq_sweep scale") || (have_zp && !qt_check_size(&zp, row1 * groups * 4, "gptq_sweep zero_point")) ||
        !qt_check_size(&gidx, b * 4, "gptq_sweep gidx") || !qt_check_size(&codes, row1 * b, "gptq_sweep codes") ||
        !qt_check_size(&errors, row1 * b * 4, "gptq_sweep errors"))
        goto done;
    {
        const int32_t *g = (const int32_t *)gidx.buf;
        for (Py_ssize_t i = col0; i < col1; i++)
            if (g[i] < 0 || g[i] >= groups) {
                PyErr_Format(PyExc_ValueError, "gptq_sweep: column %zd's group %d is outside [0, %zd)", i, (int)g[i], groups);
                goto done;
            }
        const float qmin = (float)-(1 << (bits - 1)), qmax = (float)((1 << (bits - 1)) - 1);
        float *wb = (float *)w.buf, *eb = (float *)errors.buf;
        const float *ub = (const float *)u.buf, *sb = (const float *)scale.buf, *zb = have_zp ? (const float *)zp.buf : NULL;
        int8_t *cb = (int8_t *)codes.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t r = row0; r < row1; r++)
            sweep_row(wb + r * b, ub, b, sb + r * groups, zb ? zb + r * groups : NULL, g, qmin, qmax, cb + r * b, eb + r * b, col0, col1);
        Py_END_ALLOW_THREADS
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&w);
    PyBuffer_Release(&u);
    PyBuffer_Release(&scale);
    if (have_zp) PyBuffer_Release(&zp);
    PyBuffer_Release(&gidx);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&errors);
    return result;
}
