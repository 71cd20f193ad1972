/* Shared by the fused CPU kernels of qtool.native._kernels.
 *
 * Every kernel reproduces qtool's torch kernels bit for bit: the same float32 operations in
 * the same order, each result rounded to the tensor's dtype where torch rounds it. So the
 * build must not contract a*b+c into an FMA (-ffp-contract=off) nor assume finite math, and
 * conversions round to nearest even exactly as c10::BFloat16 / c10::Half do.
 */
#ifndef QTOOL_NATIVE_H
#define QTOOL_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* dtype codes shared with qtool/native/__init__.py */
enum { QT_F32 = 0, QT_F16 = 1, QT_BF16 = 2 };

/* Hot loops get an AVX2 clone where the compiler and loader support ifunc dispatch. QT_HOT_WIDE
 * loops get an AVX-512 (x86-64-v4) one and an x86-64-v3 (AVX2 + FMA + F16C) one, with GCC 12 or
 * later: the legacy GGUF block encoders, decoders and error sums, a requantize's whole work,
 * ~0.75x the AVX2 clone's time there (F16C for their block scales: qt_f32_to_f16_hw). The
 * same IEEE operations in the same order at any width (no FMA contraction, no reassociation),
 * so the same bits: only the vectors are wider. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define QT_HOT __attribute__((target_clones("avx2", "default")))
#if __GNUC__ >= 12
#define QT_HOT_WIDE __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define QT_HOT_WIDE QT_HOT
#endif
#else
#define QT_HOT
#define QT_HOT_WIDE
#endif

static inline uint32_t qt_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float qt_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float qt_bf16_to_f32(uint16_t h) { return qt_float((uint32_t)h << 16); }

/* c10::BFloat16's round_to_nearest_even, NaN -> 0x7FC0 */
static inline uint16_t qt_f32_to_bf16(float f) {
    uint32_t u = qt_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* c10::detail::fp16_ieee_to_fp32_value (FP16 library): exact for every half */
static inline float qt_f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = qt_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = qt_float((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t result = sign | (two_w < (1u << 27) ? qt_bits(denormalized) : qt_bits(normalized));
    return qt_float(result);
}

/* c10::detail::fp16_ieee_from_fp32_value (round to nearest even, NaN -> 0x7E00), written
 * without control flow so that GCC vectorizes it; checked against the branchy original on
 * all 2^32 float32 inputs. */
static inline uint16_t qt_f32_to_f16(float f) {
    const uint32_t w = qt_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    bias = bias > 0x71000000u ? bias : 0x71000000u;
    float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    base = qt_float((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = qt_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    const uint32_t nan = 0u - (uint32_t)(shl1_w > 0xFF000000u);
    return (uint16_t)((sign >> 16) | (nan & 0x7E00u) | (~nan & nonsign));
}

/* The same two conversions by the CPU's own instructions where the clone has them: GCC 12's
 * _Float16 casts are vcvtps2ph / vcvtph2ps (F16C) in the x86-64-v3 and v4 clones, one
 * instruction instead of ~15, and libgcc's IEEE routines in the default one. Both round to
 * nearest even with subnormals kept and overflow to inf, so the bits are the portable ones'
 * for every input; float -> half NaN is made 0x7E00 (sign kept) as above. Half -> float
 * quiets a signalling NaN, as the portable one's multiply does. For the per-block scales of
 * the GGUF block codecs: tests/test_native_gguf.py widens all 65,536 halves,
 * tests/test_native_gguf_encode.py checks the stored halves against gguf-py's astype. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && defined(__x86_64__)
static inline float qt_f16_to_f32_hw(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}
static inline uint16_t qt_f32_to_f16_hw(float f) {
    const _Float16 v = (_Float16)f;
    uint16_t h;
    memcpy(&h, &v, 2);
    const uint32_t nan = 0u - (uint32_t)((qt_bits(f) & 0x7FFFFFFFu) > 0x7F800000u);
    return (uint16_t)((nan & ((qt_bits(f) >> 16 & 0x8000u) | 0x7E00u)) | (~nan & h));
}
#else
#define qt_f16_to_f32_hw qt_f16_to_f32
#define qt_f32_to_f16_hw qt_f32_to_f16
#endif

/* a float32 value rounded to dtype `dt` and widened back: what torch stores for an op in dt */
static inline float qt_round_to(float f, int dt) {
    if (dt == QT_BF16) return qt_bf16_to_f32(qt_f32_to_bf16(f));
    if (dt == QT_F16) return qt_f16_to_f32(qt_f32_to_f16(f));
    return f;
}

static inline float qt_load(const void *p, Py_ssize_t i, int dt) {
    if (dt == QT_BF16) return qt_bf16_to_f32(((const uint16_t *)p)[i]);
    if (dt == QT_F16) return qt_f16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

static inline void qt_store(void *p, Py_ssize_t i, int dt, float f) {
    if (dt == QT_BF16) ((uint16_t *)p)[i] = qt_f32_to_bf16(f);
    else if (dt == QT_F16) ((uint16_t *)p)[i] = qt_f32_to_f16(f);
    else ((float *)p)[i] = f;
}

static inline Py_ssize_t qt_itemsize(int dt) { return dt == QT_F32 ? 4 : 2; }

/* Widen n values of dtype dt at src into float32 dst (hot: one per row or block run; common.c). */
void qt_widen(const void *src, int dt, float *dst, Py_ssize_t n);
/* n float32 values into elements [at, at + n) of out, of dtype dt, rounding to nearest even
 * as torch's .to(dtype) does. Inlined, so a constant dt leaves one vectorized loop. */
static inline __attribute__((always_inline)) void qt_narrow(const float *src, void *out, int dt, Py_ssize_t at, Py_ssize_t n) {
    if (dt == QT_BF16) {
        const uint32_t *s = (const uint32_t *)src;
        uint16_t *o = (uint16_t *)out + at;
        for (Py_ssize_t i = 0; i < n; i++) {
            const uint32_t u = s[i];
            const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
            o[i] = (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
        }
    } else if (dt == QT_F16) {
        uint16_t *o = (uint16_t *)out + at;
        for (Py_ssize_t i = 0; i < n; i++) o[i] = qt_f32_to_f16(src[i]);
    } else {
        memcpy((float *)out + at, src, (size_t)n * 4);
    }
}

/* Python entry points, one file each: affine.c, gguf.c, gguf_encode.c (kquant_encode.c adds rows) */
PyObject *qt_py_encode_int(PyObject *self, PyObject *args);
PyObject *qt_py_pack_zero_points(PyObject *self, PyObject *args);
PyObject *qt_py_decode_int(PyObject *self, PyObject *args);
PyObject *qt_py_decode_gguf(PyObject *self, PyObject *args);
PyObject *qt_py_encode_gguf(PyObject *self, PyObject *args);
PyObject *qt_py_transcode_gguf(PyObject *self, PyObject *args);
PyObject *qt_py_gguf_decoders(PyObject *self, PyObject *args);
PyObject *qt_py_gguf_encoders(PyObject *self, PyObject *args);
PyObject *qt_py_sum_squares(PyObject *self, PyObject *args);
PyObject *qt_py_gptq_sweep(PyObject *self, PyObject *args);

/* The mse observer's scale and zero point of one group (mse.c): x holds n values of dtype dt
 * widened, lo <= 0 <= hi its min and max. */
void qt_mse_group(const float *x, Py_ssize_t n, int dt, float qmin, float qmax, int symmetric, float lo, float hi, float *scale_out,
                  float *zp_out);

/* Blocks [0, blocks) of GGUF `type_name` into float32 `out` (gguf.c's decoders); 0 if the type
 * has no decoder. No GIL needed. */
int qt_gguf_decode_f32(const char *type_name, const uint8_t *src, float *out, Py_ssize_t blocks);
/* The decoder of GGUF `type_name` (NULL if none), with its values and bytes per block: run(src,
 * out, QT_F32, b0, b1) decodes blocks [b0, b1) of src into float32 out + b0 * block_size. */
typedef void (*qt_gguf_run)(const uint8_t *, void *, int, Py_ssize_t, Py_ssize_t);
qt_gguf_run qt_gguf_decoder(const char *type_name, Py_ssize_t *block_size, Py_ssize_t *type_size);

/* One row's encoder: `blocks` blocks from the float32 values at x into out, and the values those
 * blocks decode to into rec. The K-quants and IQ4_NL/IQ4_XS are in kquant_encode.c and take qw,
 * the row's importance weights (llama.cpp's quant_weights, one per value; NULL: none). */
typedef void (*qt_encode_row)(const float *, Py_ssize_t, uint8_t *, float *);
typedef void (*qt_encode_row_w)(const float *, const float *, Py_ssize_t, uint8_t *, float *);
void qt_q2_k_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec);
void qt_q3_k_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec);
void qt_q4_k_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec);
void qt_q5_k_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec);
void qt_q6_k_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec);
void qt_iq4_nl_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec);
void qt_iq4_xs_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec);
/* IQ3_S and IQ3_XXS (iq3_encode.c): qt_iq3_*_ready() builds the grid's neighbour lists once (0:
 * out of memory), before any qt_iq3_*_row */
int qt_iq3_s_ready(void);
void qt_iq3_s_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec);
void qt_iq3_s_decode(const uint8_t *src, float *out, Py_ssize_t blocks);
int qt_iq3_xxs_ready(void);
void qt_iq3_xxs_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec);
void qt_iq3_xxs_decode(const uint8_t *src, float *out, Py_ssize_t blocks);
/* IQ2_XXS, IQ2_XS and IQ2_S (iq2_encode.c), as IQ3 */
int qt_iq2_xxs_ready(void);
void qt_iq2_xxs_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec);
void qt_iq2_xxs_decode(const uint8_t *src, float *out, Py_ssize_t blocks);
int qt_iq2_xs_ready(void);
void qt_iq2_xs_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec);
void qt_iq2_xs_decode(const uint8_t *src, float *out, Py_ssize_t blocks);
int qt_iq2_s_ready(void);
void qt_iq2_s_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec);
void qt_iq2_s_decode(const uint8_t *src, float *out, Py_ssize_t blocks);
/* llama.cpp's make_qp_quants (kquant_common.c: below kquant_encode.c and iq2_encode.c, which both call it) */
float qt_qp_quants(int n, int nmax, const float *x, uint8_t *L, const float *w);
/* Q4_0, Q4_1, Q5_0, Q5_1 with importance weights (qw not NULL): llama.cpp's _impl path */
void qt_legacy_w_row(const char *type_name, const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec);
/* The K-quant searches use no build wider than `lanes` (8 or 4) even where the CPU has it:
 * tests compare the builds */
void qt_kquant_set_lanes(int lanes);
PyObject *qt_py_kquant_set_lanes(PyObject *self, PyObject *args);
PyObject *qt_py_mse_set_x86(PyObject *self, PyObject *args);
PyObject *qt_py_gguf_set_avx512(PyObject *self, PyObject *args);

/* a * b, or -1 when either is negative or the product overflows: sizes from callers are never
 * trusted, and qt_check_size refuses -1 */
static inline Py_ssize_t qt_mul(Py_ssize_t a, Py_ssize_t b) {
    Py_ssize_t product;
    if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &product)) return -1;
    return product;
}

/* (common.c) Checks a buffer holds at least `need` bytes; sets ValueError naming `what` if not, or if
 * `need` is negative (a size that overflowed). */
int qt_check_size(const Py_buffer *buffer, Py_ssize_t need, const char *what);
int qt_check_dtype(int dt, const char *what);

#endif
