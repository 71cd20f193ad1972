/* The signal of a weight copied unchanged: sum x^2 in double, per slice of `slice` values.
 *
 * Why: a copy has no error, so the report needs only its sum x^2 (the "all weights" SQNR's
 * signal). numpy made that figure after a float32 copy of every copied tensor, and importing
 * numpy for it was a fifth of a small GGUF requantize. Each term is exact (a float32 squared
 * fits a double); the slice sums are added in order by the caller, as ErrorStats.update_numpy
 * adds its slices, so the figure does not depend on how many threads ran.
 */
#include "qtool_native.h"

#define SUM_LANES 8

/* sum_squares(src, dtype, count, slice, out, slice0, slice1): out[s] (doubles) for every slice
 * s in [slice0, slice1) of the `count` values of `dtype` in src (the last slice may be short) */
static QT_HOT double slice_sum(const uint8_t *src, int dt, Py_ssize_t begin, Py_ssize_t end) {
    double lanes[SUM_LANES] = {0};
    const Py_ssize_t item = qt_itemsize(dt);
    Py_ssize_t i = begin;
    for (; i + SUM_LANES <= end; i += SUM_LANES)
        for (int k = 0; k < SUM_LANES; k++) {
            float f;
            if (dt == QT_F32) memcpy(&f, src + (i + k) * 4, 4);
            else {
                uint16_t h;
                memcpy(&h, src + (i + k) * item, 2);
                f = dt == QT_BF16 ? qt_bf16_to_f32(h) : qt_f16_to_f32(h);
            }
            const double v = (double)f;
            lanes[k] += v * v;
        }
    for (int k = 0; i < end; i++, k++) {
        float f;
        if (dt == QT_F32) memcpy(&f, src + i * 4, 4);
        else {
            uint16_t h;
            memcpy(&h, src + i * item, 2);
            f = dt == QT_BF16 ? qt_bf16_to_f32(h) : qt_f16_to_f32(h);
        }
        const double v = (double)f;
        lanes[k] += v * v;
    }
    double total = 0.0;
    for (int k = 0; k < SUM_LANES; k++) total += lanes[k];
    return total;
}

PyObject *qt_py_sum_squares(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer src, out;
    int dt;
    Py_ssize_t count, slice, slice0, slice1;
    if (!PyArg_ParseTuple(args, "y*innw*nn", &src, &dt, &count, &slice, &out, &slice0, &slice1)) return NULL;
    PyObject *result = NULL;
    if (!qt_check_dtype(dt, "sum_squares")) goto done;
    const Py_ssize_t item = qt_itemsize(dt);
    if (count < 0 || slice < 1 || slice0 < 0 || slice1 < slice0 || slice1 > count / slice + (count % slice != 0)) {
        PyErr_Format(PyExc_ValueError, "sum_squares: bad slice range [%zd, %zd) of %zd values by %zd", slice0, slice1, count, slice);
        goto done;
    }
    if (count > PY_SSIZE_T_MAX / item || !qt_check_size(&src, count * item, "sum_squares src")) goto done;
    if (!qt_check_size(&out, slice1 * (Py_ssize_t)sizeof(double), "sum_squares out")) goto done;
    {
        const uint8_t *s = (const uint8_t *)src.buf;
        uint8_t *o = (uint8_t *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t k = slice0; k < slice1; k++) {
            const Py_ssize_t begin = k * slice, end = begin + slice < count ? begin + slice : count;
            const double sum = slice_sum(s, dt, begin, end);
            memcpy(o + k * sizeof(double), &sum, sizeof(double));
        }
        Py_END_ALLOW_THREADS
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}
