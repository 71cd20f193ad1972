/* Symmetric integer codes in compressed-tensors' pack-quantized layout, fused.
 *
 * encode_int_sym mirrors qtool.kernels.affine (choose_qparams + quantize) and the pack of
 * qtool.conventions.compressed_tensors_encode.encode for symmetric int b-bit weights whose scale is
 * stored in the weight's own dtype, then reconstructs each value as qtool's decoder does and
 * sums the error measures of qtool.metrics.ErrorStats, all in one pass over each row:
 *
 *     amax  = max |x| over the group (0 included), exact in any dtype
 *     scale = dt(amax / ((qmax - qmin) / 2)), or eps(dt) where that is 0
 *     q     = rne(clamp(dt(x / scale), qmin, qmax))       stored as q + 2^(b-1), LSB first
 *     x^    = dt(q * scale)                               the decoded value
 *
 * where dt(.) rounds a float32 result to the weight's dtype, as torch does after each op.
 * decode_int_sym is the reverse: out = out_dtype(logical_dtype(q * scale)).
 */
#include "qtool_native.h"

#include <stdlib.h>

#define LANES 16 /* independent partial sums: a vector of them, no reassociation needed */

/* |v| < 2^22: adding and removing 1.5 * 2^23 rounds to an integer, half to even (the
 * default rounding mode), as torch.round does; a plain C expression that vectorizes. */
static inline float round_half_even(float v) { return (v + 12582912.0f) - 12582912.0f; }

typedef struct {
    double xx, xe, ee;
    uint32_t max_err_bits; /* |x - x^| as float bits: the integer order is the float order */
    int finite;
} Sums;

static QT_HOT uint32_t abs_max_bits(const uint32_t *x, Py_ssize_t n) {
    uint32_t m = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        uint32_t u = x[j] & 0x7FFFFFFFu;
        m = u > m ? u : m;
    }
    return m;
}

/* Rounding a float32 result to a dtype, written per dtype so each loop below vectorizes. The
 * encode loops see finite values only (the caller checked), so bf16 needs no NaN select. */
static inline float round_bf16_finite(float f) {
    uint32_t u = qt_bits(f);
    return qt_float((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
}
static inline float round_f16(float f) { return qt_f16_to_f32(qt_f32_to_f16(f)); }
static inline float round_f32(float f) { return f; }

/* One group: codes into q, error sums into sums. */
#define QUANTIZE_GROUP(NAME, ROUND)                                                                          \
    static QT_HOT void NAME(const float *x, Py_ssize_t n, float scale, float qmin, float qmax, int8_t *q,   \
                            Sums *sums) {                                                                    \
        float xx[LANES] = {0}, xe[LANES] = {0}, ee[LANES] = {0};                                             \
        uint32_t me[LANES] = {0};                                                                            \
        Py_ssize_t j = 0;                                                                                    \
        for (; j + LANES <= n; j += LANES) {                                                                 \
            for (int k = 0; k < LANES; k++) {                                                                \
                float xv = x[j + k];                                                                         \
                float v = ROUND(xv / scale);                                                                 \
                v = v < qmin ? qmin : v;                                                                     \
                v = v > qmax ? qmax : v;                                                                     \
                v = round_half_even(v);                                                                      \
                q[j + k] = (int8_t)(int32_t)v;                                                               \
                float e = xv - ROUND(v * scale);                                                             \
                xx[k] += xv * xv;                                                                            \
                xe[k] += xv * e;                                                                             \
                ee[k] += e * e;                                                                              \
                uint32_t eb = qt_bits(e) & 0x7FFFFFFFu;                                                      \
                me[k] = eb > me[k] ? eb : me[k];                                                             \
            }                                                                                                \
        }                                                                                                    \
        for (; j < n; j++) {                                                                                 \
            float xv = x[j];                                                                                 \
            float v = ROUND(xv / scale);                                                                     \
            v = v < qmin ? qmin : v;                                                                         \
            v = v > qmax ? qmax : v;                                                                         \
            v = round_half_even(v);                                                                          \
            q[j] = (int8_t)(int32_t)v;                                                                       \
            float e = xv - ROUND(v * scale);                                                                 \
            xx[0] += xv * xv;                                                                                \
            xe[0] += xv * e;                                                                                 \
            ee[0] += e * e;                                                                                  \
            uint32_t eb = qt_bits(e) & 0x7FFFFFFFu;                                                          \
            me[0] = eb > me[0] ? eb : me[0];                                                                 \
        }                                                                                                    \
        for (int k = 0; k < LANES; k++) {                                                                    \
            sums->xx += xx[k];                                                                               \
            sums->xe += xe[k];                                                                               \
            sums->ee += ee[k];                                                                               \
            sums->max_err_bits = me[k] > sums->max_err_bits ? me[k] : sums->max_err_bits;                    \
        }                                                                                                    \
    }

QUANTIZE_GROUP(quantize_group_bf16, round_bf16_finite)
QUANTIZE_GROUP(quantize_group_f16, round_f16)
QUANTIZE_GROUP(quantize_group_f32, round_f32)

static void quantize_group(const float *x, Py_ssize_t n, float scale, float qmin, float qmax, int dt, int8_t *q, Sums *sums) {
    if (dt == QT_BF16) quantize_group_bf16(x, n, scale, qmin, qmax, q, sums);
    else if (dt == QT_F16) quantize_group_f16(x, n, scale, qmin, qmax, q, sums);
    else quantize_group_f32(x, n, scale, qmin, qmax, q, sums);
}

/* LSB-first b-bit fields of little-endian int32 words == this byte stream on a little-endian host */
static QT_HOT void pack_row(const int8_t *q, Py_ssize_t n, int bits, uint8_t *out) {
    if (bits == 8) {
        for (Py_ssize_t j = 0; j < n; j++) out[j] = (uint8_t)q[j] ^ 0x80u;
    } else if (bits == 4) {
        for (Py_ssize_t i = 0; i < n / 2; i++)
            out[i] = (uint8_t)(((q[2 * i] + 8) & 0xF) | (((q[2 * i + 1] + 8) & 0xF) << 4));
    } else { /* 2 */
        for (Py_ssize_t i = 0; i < n / 4; i++)
            out[i] = (uint8_t)(((q[4 * i] + 2) & 3) | (((q[4 * i + 1] + 2) & 3) << 2) | (((q[4 * i + 2] + 2) & 3) << 4) |
                               (((q[4 * i + 3] + 2) & 3) << 6));
    }
}

static QT_HOT void unpack_row(const uint8_t *in, Py_ssize_t n, int bits, float *out) {
    if (bits == 8) {
        for (Py_ssize_t j = 0; j < n; j++) out[j] = (float)(int8_t)(in[j] ^ 0x80u);
    } else if (bits == 4) {
        for (Py_ssize_t i = 0; i < n / 2; i++) {
            out[2 * i] = (float)((int)(in[i] & 0xF) - 8);
            out[2 * i + 1] = (float)((int)(in[i] >> 4) - 8);
        }
    } else {
        for (Py_ssize_t i = 0; i < n / 4; i++)
            for (int k = 0; k < 4; k++) out[4 * i + k] = (float)((int)((in[i] >> (2 * k)) & 3) - 2);
    }
}

static inline float round_bf16(float f) { return qt_bf16_to_f32(qt_f32_to_bf16(f)); }

#define SCALE_GROUP(NAME, ROUND)                                                   \
    static QT_HOT void NAME(float *values, Py_ssize_t n, float scale) {            \
        for (Py_ssize_t j = 0; j < n; j++) values[j] = ROUND(values[j] * scale);   \
    }
SCALE_GROUP(scale_group_bf16, round_bf16)
SCALE_GROUP(scale_group_f16, round_f16)
SCALE_GROUP(scale_group_f32, round_f32)

static void scale_group(float *values, Py_ssize_t n, float scale, int dt) {
    if (dt == QT_BF16) scale_group_bf16(values, n, scale);
    else if (dt == QT_F16) scale_group_f16(values, n, scale);
    else scale_group_f32(values, n, scale);
}

static QT_HOT void narrow_row(const float *x, void *out, int dt, Py_ssize_t at, Py_ssize_t n) {
    if (dt == QT_BF16) qt_narrow(x, out, QT_BF16, at, n);
    else if (dt == QT_F16) qt_narrow(x, out, QT_F16, at, n);
    else qt_narrow(x, out, QT_F32, at, n);
}

static int check_layout(Py_ssize_t cols, Py_ssize_t group, int bits, Py_ssize_t row0, Py_ssize_t row1) {
    if (bits != 2 && bits != 4 && bits != 8) {
        PyErr_Format(PyExc_ValueError, "native int codes are 2, 4 or 8 bits, not %d", bits);
        return 0;
    }
    if (cols <= 0 || group <= 0 || cols % group || (cols * bits) % 32 || row0 < 0 || row1 < row0) {
        PyErr_Format(PyExc_ValueError, "bad layout: cols %zd, group %zd, bits %d, rows [%zd, %zd)", cols, group, bits, row0, row1);
        return 0;
    }
    return 1;
}

static const float EPS[3] = {0x1.0p-23f, 0x1.0p-10f, 0x1.0p-7f}; /* torch.finfo(dtype).eps, by dtype code */

PyObject *qt_py_encode_int_sym(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer src, packed, scale;
    int dt, bits;
    Py_ssize_t cols, group, row0, row1;
    if (!PyArg_ParseTuple(args, "y*innw*w*inn", &src, &dt, &cols, &group, &packed, &scale, &bits, &row0, &row1)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t groups = group > 0 ? cols / group : 0;
    if (!qt_check_dtype(dt, "encode_int_sym") || !check_layout(cols, group, bits, row0, row1) ||
        !qt_check_size(&src, row1 * cols * qt_itemsize(dt), "src") || !qt_check_size(&packed, row1 * cols * bits / 8, "packed") ||
        !qt_check_size(&scale, row1 * groups * qt_itemsize(dt), "scale"))
        goto done;
    float *x = malloc((size_t)cols * sizeof(float));
    int8_t *q = malloc((size_t)cols);
    if (!x || !q) {
        free(x);
        free(q);
        PyErr_NoMemory();
        goto done;
    }
    Sums sums = {0, 0, 0, 0, 1};
    const float qmax = (float)((1 << (bits - 1)) - 1), qmin = -qmax - 1.0f;
    const float half = (qmax - qmin) / 2.0f; /* 127.5, 7.5, 1.5: exact in every dtype */
    const char *in = (const char *)src.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = row0; r < row1 && sums.finite; r++) {
        qt_widen(in + r * cols * qt_itemsize(dt), dt, x, cols);
        for (Py_ssize_t g = 0; g < groups; g++) {
            const float *xg = x + g * group;
            uint32_t amax_bits = abs_max_bits((const uint32_t *)xg, group);
            if (amax_bits >= 0x7F800000u) { /* inf or NaN: the caller falls back to torch */
                sums.finite = 0;
                break;
            }
            float s = qt_round_to(qt_float(amax_bits) / half, dt);
            if (s == 0.0f) s = EPS[dt];
            qt_store(scale.buf, r * groups + g, dt, s);
            quantize_group(xg, group, s, qmin, qmax, dt, q + g * group, &sums);
        }
        pack_row(q, cols, bits, (uint8_t *)packed.buf + r * cols * bits / 8);
    }
    Py_END_ALLOW_THREADS
    free(x);
    free(q);
    result = Py_BuildValue("dddfO", sums.xx, sums.xe, sums.ee, qt_float(sums.max_err_bits), sums.finite ? Py_True : Py_False);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&packed);
    PyBuffer_Release(&scale);
    return result;
}

PyObject *qt_py_decode_int_sym(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer packed, scale, out;
    int scale_dt, logical_dt, out_dt, bits;
    Py_ssize_t cols, group, row0, row1;
    if (!PyArg_ParseTuple(args, "y*y*iiw*inninn", &packed, &scale, &scale_dt, &logical_dt, &out, &out_dt, &cols, &group, &bits, &row0, &row1))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t groups = group > 0 ? cols / group : 0;
    if (!qt_check_dtype(scale_dt, "scale") || !qt_check_dtype(logical_dt, "logical") || !qt_check_dtype(out_dt, "out") ||
        !check_layout(cols, group, bits, row0, row1) || !qt_check_size(&packed, row1 * cols * bits / 8, "packed") ||
        !qt_check_size(&scale, row1 * groups * qt_itemsize(scale_dt), "scale") ||
        !qt_check_size(&out, row1 * cols * qt_itemsize(out_dt), "out"))
        goto done;
    float *x = malloc((size_t)cols * sizeof(float));
    if (!x) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = row0; r < row1; r++) {
        unpack_row((const uint8_t *)packed.buf + r * cols * bits / 8, cols, bits, x);
        for (Py_ssize_t g = 0; g < groups; g++) scale_group(x + g * group, group, qt_load(scale.buf, r * groups + g, scale_dt), logical_dt);
        narrow_row(x, out.buf, out_dt, r * cols, cols);
    }
    Py_END_ALLOW_THREADS
    free(x);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&packed);
    PyBuffer_Release(&scale);
    PyBuffer_Release(&out);
    return result;
}
