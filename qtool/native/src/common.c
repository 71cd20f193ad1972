/* What every kernel file shares, below all of them: widening a row to float32 and checking the
 * buffers and dtype codes Python hands in. It calls no other file (tests/test_native_layers.py). */
#include "qtool_native.h"

QT_HOT void qt_widen(const void *src, int dt, float *dst, Py_ssize_t n) {
    if (dt == QT_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        uint32_t *d = (uint32_t *)dst;
        for (Py_ssize_t i = 0; i < n; i++) d[i] = (uint32_t)s[i] << 16;
    } else if (dt == QT_F16) {
        const uint16_t *s = (const uint16_t *)src;
        for (Py_ssize_t i = 0; i < n; i++) dst[i] = qt_f16_to_f32(s[i]);
    } else {
        memcpy(dst, src, (size_t)n * 4);
    }
}

int qt_check_size(const Py_buffer *buffer, Py_ssize_t need, const char *what) {
    if (need < 0) {
        PyErr_Format(PyExc_ValueError, "%s: the size asked for overflows", what);
        return 0;
    }
    if (buffer->len < need) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, needs %zd", what, buffer->len, need);
        return 0;
    }
    return 1;
}

int qt_check_dtype(int dt, const char *what) {
    if (dt != QT_F32 && dt != QT_F16 && dt != QT_BF16) {
        PyErr_Format(PyExc_ValueError, "%s: unknown dtype code %d", what, dt);
        return 0;
    }
    return 1;
}
