/* Integer codes in compressed-tensors' pack-quantized layout, fused.
 *
 * encode_int mirrors qtool.kernels.affine (choose_qparams + quantize) and the pack of
 * qtool.conventions.compressed_tensors_encode.encode for int b-bit weights whose scale is
 * stored in the weight's own dtype, symmetric or with a zero point, then reconstructs each
 * value as qtool's decoder does and sums the error measures of qtool.error_measures.ErrorStats, all
 * in one pass over each row. The measures follow ErrorStats' one definition: against x^ as
 * decoded (rounded to the weight's dtype), each term and every sum in double, so quantize and
 * compare report the same digits. With dt(.) rounding a float32 result to the weight's dtype, as
 * torch does after each op:
 *
 *   symmetric     scale = dt(amax / ((qmax - qmin) / 2))                        zp = 0
 *   asymmetric    scale = dt(dt(max - min) / (qmax - qmin)),  zp = rne(clamp(dt(qmin - dt(min / scale))))
 *                 (IEEE: a scale that rounds to 0 makes zp qmax; the 0/0 NaN of an all-zero
 *                 group becomes 0, as torch's nan_to_num makes it)
 *   then          scale = eps(dt) where it is 0
 *                 q  = rne(clamp(dt(dt(x / scale) + zp), qmin, qmax))   stored as q + 2^(b-1), LSB first
 *                 x^ = dt((q - zp) * scale)                              the decoded value
 *
 * min and max include 0. Symmetric codes take the same arithmetic with zp = 0 (adding and
 * subtracting 0 is exact), so one kernel serves both. With `mse` set, each group's scale and
 * zero point come from the search of mse.c instead, in the same pass. decode_int is the reverse:
 * out = out_dtype(logical_dtype((q - zp) * scale)). Zero points are stored as compressed-
 * tensors does: zp + 2^(b-1) in int32 words packed along the rows (pack_zero_points).
 */
#include "qtool_native.h"

#include <stdlib.h>

#define LANES 16 /* independent partial sums: a vector of them, no reassociation needed */

/* |v| < 2^22: adding and removing 1.5 * 2^23 rounds to an integer, half to even (the
 * default rounding mode), as torch.round does; a plain C expression that vectorizes. */
static inline float round_half_even(float v) { return (v + 12582912.0f) - 12582912.0f; }

typedef struct {
    double xx, xe, ee;
    double max_err; /* max |x - x^|, x - x^ taken in double */
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

/* One group: codes into q, and each value as decoded (x^, in the weight's dtype) into r. */
#define QUANTIZE_GROUP(NAME, ROUND)                                                                \
    static QT_HOT void NAME(const float *x, Py_ssize_t n, float scale, float zp, float qmin, float qmax, \
                            int8_t *q, float *r) {                                                 \
        for (Py_ssize_t j = 0; j < n; j++) {                                                       \
            float v = ROUND(ROUND(x[j] / scale) + zp);                                             \
            v = v < qmin ? qmin : v;                                                               \
            v = v > qmax ? qmax : v;                                                               \
            v = round_half_even(v);                                                                \
            q[j] = (int8_t)(int32_t)v;                                                             \
            r[j] = ROUND((v - zp) * scale);                                                        \
        }                                                                                          \
    }

QUANTIZE_GROUP(quantize_group_bf16, round_bf16_finite)
QUANTIZE_GROUP(quantize_group_f16, round_f16)
QUANTIZE_GROUP(quantize_group_f32, round_f32)

static void quantize_group(const float *x, Py_ssize_t n, float scale, float zp, float qmin, float qmax, int dt, int8_t *q, float *r) {
    if (dt == QT_BF16) quantize_group_bf16(x, n, scale, zp, qmin, qmax, q, r);
    else if (dt == QT_F16) quantize_group_f16(x, n, scale, zp, qmin, qmax, q, r);
    else quantize_group_f32(x, n, scale, zp, qmin, qmax, q, r);
}

/* The error sums of one row, x against its decoded x^, as qtool.error_measures.ErrorStats defines
 * them: every term and sum in double (x^2 is exact; e = x - x^ is exact whenever x^ is within
 * a factor 2 of x, where float32 would round it), in independent lanes over the whole row,
 * so a small group size costs no extra reductions. */
static QT_HOT void error_sums(const float *x, const float *r, Py_ssize_t n, Sums *sums) {
    double xx[LANES] = {0}, xe[LANES] = {0}, ee[LANES] = {0}, me[LANES] = {0};
    Py_ssize_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int k = 0; k < LANES; k++) {
            double xd = (double)x[j + k], e = xd - (double)r[j + k], ae = __builtin_fabs(e);
            xx[k] += xd * xd;
            xe[k] += xd * e;
            ee[k] += e * e;
            me[k] = ae > me[k] ? ae : me[k];
        }
    for (; j < n; j++) {
        double xd = (double)x[j], e = xd - (double)r[j], ae = __builtin_fabs(e);
        xx[0] += xd * xd;
        xe[0] += xd * e;
        ee[0] += e * e;
        me[0] = ae > me[0] ? ae : me[0];
    }
    for (int k = 0; k < LANES; k++) {
        sums->xx += xx[k];
        sums->xe += xe[k];
        sums->ee += ee[k];
        sums->max_err = me[k] > sums->max_err ? me[k] : sums->max_err;
    }
}

/* min and max of a group, 0 included (compressed-tensors' observer), in independent lanes */
static QT_HOT void min_max(const float *x, Py_ssize_t n, float *lo, float *hi) {
    float mn[LANES] = {0}, mx[LANES] = {0};
    Py_ssize_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int k = 0; k < LANES; k++) {
            mn[k] = x[j + k] < mn[k] ? x[j + k] : mn[k];
            mx[k] = x[j + k] > mx[k] ? x[j + k] : mx[k];
        }
    for (; j < n; j++) {
        mn[0] = x[j] < mn[0] ? x[j] : mn[0];
        mx[0] = x[j] > mx[0] ? x[j] : mx[0];
    }
    for (int k = 1; k < LANES; k++) {
        mn[0] = mn[k] < mn[0] ? mn[k] : mn[0];
        mx[0] = mx[k] > mx[0] ? mx[k] : mx[0];
    }
    *lo = mn[0];
    *hi = mx[0];
}

/* LSB-first b-bit fields of little-endian int32 words == this byte stream on a little-endian host */
static QT_HOT void pack_row(const int8_t *q, Py_ssize_t n, int bits, uint8_t *out) {
    if (bits == 8) {
        for (Py_ssize_t j = 0; j < n; j++) out[j] = (uint8_t)q[j] ^ 0x80u;
    } else if (bits == 4) {
        for (Py_ssize_t i = 0; i < n / 2; i++)
            out[i] = (uint8_t)(((q[2 * i] + 8) & 0xF) | (((q[2 * i + 1] + 8) & 0xF) << 4));
    } else if (bits == 3) { /* a dense stream: 8 codes in 3 bytes, fields crossing word bounds */
        for (Py_ssize_t i = 0; i < n / 8; i++) {
            uint32_t u = 0;
            for (int k = 0; k < 8; k++) u |= (uint32_t)((q[8 * i + k] + 4) & 7) << (3 * k);
            out[3 * i] = (uint8_t)u;
            out[3 * i + 1] = (uint8_t)(u >> 8);
            out[3 * i + 2] = (uint8_t)(u >> 16);
        }
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

#define SCALE_GROUP(NAME, ROUND)                                                           \
    static QT_HOT void NAME(float *values, Py_ssize_t n, float scale, float zp) {          \
        for (Py_ssize_t j = 0; j < n; j++) values[j] = ROUND((values[j] - zp) * scale);    \
    }
SCALE_GROUP(scale_group_bf16, round_bf16)
SCALE_GROUP(scale_group_f16, round_f16)
SCALE_GROUP(scale_group_f32, round_f32)

static void scale_group(float *values, Py_ssize_t n, float scale, float zp, int dt) {
    if (dt == QT_BF16) scale_group_bf16(values, n, scale, zp);
    else if (dt == QT_F16) scale_group_f16(values, n, scale, zp);
    else scale_group_f32(values, n, scale, zp);
}

static QT_HOT void narrow_row(const float *x, void *out, int dt, Py_ssize_t at, Py_ssize_t n) {
    if (dt == QT_BF16) qt_narrow(x, out, QT_BF16, at, n);
    else if (dt == QT_F16) qt_narrow(x, out, QT_F16, at, n);
    else qt_narrow(x, out, QT_F32, at, n);
}

/* bytes of `rows` rows of `cols` b-bit codes, or -1 when that overflows */
static Py_ssize_t packed_bytes(Py_ssize_t rows, Py_ssize_t cols, int bits) {
    const Py_ssize_t bit_count = qt_mul(qt_mul(rows, cols), bits);
    return bit_count < 0 ? -1 : bit_count / 8;
}

/* int32 words holding `rows` b-bit fields each (32 / b to a word), without overflowing */
static Py_ssize_t words_for(Py_ssize_t rows, int per) { return rows / per + (rows % per != 0); }

static int check_layout(Py_ssize_t cols, Py_ssize_t group, int bits, Py_ssize_t row0, Py_ssize_t row1, int encoding) {
    if (bits != 2 && bits != 4 && bits != 8 && !(encoding && bits == 3)) {
        PyErr_Format(PyExc_ValueError, "native int codes are %s bits, not %d", encoding ? "2, 3, 4 or 8" : "2, 4 or 8", bits);
        return 0;
    }
    if (cols <= 0 || group <= 0 || cols % group || qt_mul(cols, bits) < 0 || qt_mul(cols, bits) % 32 || row0 < 0 || row1 < row0) {
        PyErr_Format(PyExc_ValueError, "bad layout: cols %zd, group %zd, bits %d, rows [%zd, %zd)", cols, group, bits, row0, row1);
        return 0;
    }
    return 1;
}

static const float EPS[3] = {0x1.0p-23f, 0x1.0p-10f, 0x1.0p-7f}; /* torch.finfo(dtype).eps, by dtype code */

/* An optional writable buffer argument: None, or at least `need` bytes. */
static int optional_buffer(PyObject *object, Py_buffer *view, int writable, Py_ssize_t need, const char *what) {
    view->obj = NULL;
    view->buf = NULL;
    if (object == Py_None) return 1;
    if (PyObject_GetBuffer(object, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return 0;
    if (!qt_check_size(view, need, what)) {
        PyBuffer_Release(view);
        view->obj = NULL;
        return 0;
    }
    return 1;
}

static void release_optional(Py_buffer *view) {
    if (view->obj) PyBuffer_Release(view);
}

PyObject *qt_py_encode_int(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer src, packed, scale, zp = {0};
    PyObject *zp_object;
    int dt, bits, mse = 0;
    Py_ssize_t cols, group, row0, row1;
    if (!PyArg_ParseTuple(args, "y*innw*w*Oinn|p", &src, &dt, &cols, &group, &packed, &scale, &zp_object, &bits, &row0, &row1, &mse)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t groups = group > 0 ? cols / group : 0;
    if (!qt_check_dtype(dt, "encode_int") || !check_layout(cols, group, bits, row0, row1, 1) ||
        !qt_check_size(&src, qt_mul(qt_mul(row1, cols), qt_itemsize(dt)), "src") ||
        !qt_check_size(&packed, packed_bytes(row1, cols, bits), "packed") ||
        !qt_check_size(&scale, qt_mul(qt_mul(row1, groups), qt_itemsize(dt)), "scale") ||
        !optional_buffer(zp_object, &zp, 1, qt_mul(row1, groups), "zero_point"))
        goto done;
    float *x = malloc((size_t)cols * sizeof(float));
    float *decoded = malloc((size_t)cols * sizeof(float));
    int8_t *q = malloc((size_t)cols);
    if (!x || !decoded || !q) {
        free(x);
        free(decoded);
        free(q);
        PyErr_NoMemory();
        goto done;
    }
    Sums sums = {0, 0, 0, 0, 1};
    const float qmax = (float)((1 << (bits - 1)) - 1), qmin = -qmax - 1.0f;
    const float half = (qmax - qmin) / 2.0f; /* 127.5, 7.5, 1.5: exact in every dtype */
    const char *in = (const char *)src.buf;
    int8_t *zps = (int8_t *)zp.buf; /* NULL: symmetric */
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
            float s, z = 0.0f;
            if (mse) {
                float lo, hi;
                min_max(xg, group, &lo, &hi);
                qt_mse_group(xg, group, dt, qmin, qmax, zps == NULL, lo, hi, &s, &z);
                if (zps) zps[r * groups + g] = (int8_t)(int32_t)z;
            } else if (zps) {
                float lo, hi;
                min_max(xg, group, &lo, &hi);
                s = qt_round_to(qt_round_to(hi - lo, dt) / (qmax - qmin), dt);
                /* IEEE as torch: a scale that rounded to 0 gives min / 0 = -inf, so zp = qmax;
                 * only an all-zero group gives 0 / 0 = NaN, which torch turns into 0 */
                z = qt_round_to(qmin - qt_round_to(lo / s, dt), dt);
                z = z != z ? 0.0f : round_half_even(z < qmin ? qmin : z > qmax ? qmax : z);
                zps[r * groups + g] = (int8_t)(int32_t)z;
            } else {
                s = qt_round_to(qt_float(amax_bits) / half, dt);
            }
            if (s == 0.0f) s = EPS[dt];
            qt_store(scale.buf, r * groups + g, dt, s);
            quantize_group(xg, group, s, z, qmin, qmax, dt, q + g * group, decoded + g * group);
        }
        if (!sums.finite) break;
        error_sums(x, decoded, cols, &sums);
        pack_row(q, cols, bits, (uint8_t *)packed.buf + r * cols * bits / 8);
    }
    Py_END_ALLOW_THREADS
    free(x);
    free(decoded);
    free(q);
    result = Py_BuildValue("ddddO", sums.xx, sums.xe, sums.ee, sums.max_err, sums.finite ? Py_True : Py_False);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&packed);
    PyBuffer_Release(&scale);
    release_optional(&zp);
    return result;
}

/* pack_zero_points(zp, rows, groups, bits, out): int8 zero points [rows, groups] as
 * compressed-tensors stores them, zp + 2^(b-1) as a dense LSB-first stream of b-bit fields
 * along the rows (a 3-bit field may cross into the next word): out [ceil(rows * b / 32),
 * groups], the bits past the last row 0. */
PyObject *qt_py_pack_zero_points(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer zp, out;
    Py_ssize_t rows, groups;
    int bits;
    if (!PyArg_ParseTuple(args, "y*nniw*", &zp, &rows, &groups, &bits, &out)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t bit_count = rows >= 0 ? qt_mul(rows, bits) : -1;
    const Py_ssize_t words = bit_count >= 0 ? bit_count / 32 + (bit_count % 32 != 0) : 0;
    if ((bits != 2 && bits != 3 && bits != 4 && bits != 8) || rows < 0 || groups < 0) {
        PyErr_Format(PyExc_ValueError, "pack_zero_points: bad layout (rows %zd, groups %zd, bits %d)", rows, groups, bits);
        goto done;
    }
    if (!qt_check_size(&zp, qt_mul(rows, groups), "zero_point") ||
        !qt_check_size(&out, bit_count < 0 ? -1 : qt_mul(qt_mul(words, groups), 4), "out"))
        goto done;
    {
        const int8_t *z = (const int8_t *)zp.buf;
        uint32_t *o = (uint32_t *)out.buf;
        const uint32_t mask = (1u << bits) - 1u, offset = 1u << (bits - 1);
        memset(o, 0, (size_t)(words * groups) * 4);
        for (Py_ssize_t r = 0; r < rows; r++) {
            const Py_ssize_t word = r * bits / 32;
            const int shift = (int)(r * bits % 32);
            for (Py_ssize_t g = 0; g < groups; g++) {
                const uint32_t v = ((uint32_t)(int32_t)z[r * groups + g] + offset) & mask;
                o[word * groups + g] |= v << shift;
                if (shift + bits > 32) o[(word + 1) * groups + g] |= v >> (32 - shift);
            }
        }
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&zp);
    PyBuffer_Release(&out);
    return result;
}

PyObject *qt_py_decode_int(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer packed, scale, out, zp = {0};
    PyObject *zp_object;
    int scale_dt, logical_dt, out_dt, bits;
    Py_ssize_t rows, cols, group, row0, row1;
    if (!PyArg_ParseTuple(args, "y*y*iOiw*inninnn", &packed, &scale, &scale_dt, &zp_object, &logical_dt, &out, &out_dt, &cols, &group,
                          &bits, &rows, &row0, &row1))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t groups = group > 0 ? cols / group : 0;
    const int per = (bits == 2 || bits == 4 || bits == 8) ? 32 / bits : 1;
    if (!qt_check_dtype(scale_dt, "scale") || !qt_check_dtype(logical_dt, "logical") || !qt_check_dtype(out_dt, "out") ||
        !check_layout(cols, group, bits, row0, row1, 0) || !qt_check_size(&packed, packed_bytes(row1, cols, bits), "packed") ||
        !qt_check_size(&scale, qt_mul(qt_mul(row1, groups), qt_itemsize(scale_dt)), "scale") ||
        !qt_check_size(&out, qt_mul(qt_mul(row1, cols), qt_itemsize(out_dt)), "out") ||
        !optional_buffer(zp_object, &zp, 0, rows < 0 ? -1 : qt_mul(qt_mul(words_for(rows, per), groups), 4), "zero_point"))
        goto done;
    if (row1 > rows) {
        PyErr_Format(PyExc_ValueError, "rows [%zd, %zd) past the weight's %zd", row0, row1, rows);
        goto done;
    }
    float *x = malloc((size_t)cols * sizeof(float));
    if (!x) {
        PyErr_NoMemory();
        goto done;
    }
    const uint32_t *zps = (const uint32_t *)zp.buf; /* NULL: symmetric */
    const int offset = 1 << (bits - 1);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = row0; r < row1; r++) {
        unpack_row((const uint8_t *)packed.buf + r * cols * bits / 8, cols, bits, x);
        for (Py_ssize_t g = 0; g < groups; g++) {
            float z = 0.0f;
            if (zps) z = (float)((int)((zps[(r / per) * groups + g] >> ((r % per) * bits)) & ((1u << bits) - 1u)) - offset);
            scale_group(x + g * group, group, qt_load(scale.buf, r * groups + g, scale_dt), z, logical_dt);
        }
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
    release_optional(&zp);
    return result;
}
