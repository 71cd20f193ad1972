/* GGUF block decoders: decode_gguf(type_name, src, out, out_dtype, block0, block1).
 *
 * Each decoder mirrors its torch twin in qtool/conventions/gguf.py (itself gguf.quants'
 * arithmetic): the same float32 operations in the same order, so `q * (d*sc) - (dmin*mn)` is
 * three separately rounded operations, and integer offsets (q - 8) are taken on integers,
 * which is exact either way. A block is decoded into float32, then narrowed once to the output
 * dtype (round to nearest even), as torch's `.to(dtype)` after decoding in float32.
 * (Every product here is exact in float32 — at most 11 + 7 + 6 significant bits — so only the
 * `+ m` / `- dmin*mn` steps round; the order is kept anyway.)
 *
 * Block b of the tensor starts at byte b*type_size of `src` and its values at element
 * b*block_size of `out` (the whole tensor's output), so threads may decode disjoint block
 * ranges of one tensor at once; the GIL is released while decoding.
 */
#include "qtool_native.h"

#define QT_INLINE static inline __attribute__((always_inline))
/* keeps a 16-step loop for the loop vectorizer: unrolled first, GCC 12 packs its bytes one by one */
#define QT_NO_UNROLL _Pragma("GCC unroll 1")

QT_INLINE float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return qt_f16_to_f32_hw(h);
}

/* -- one block into float32 ------------------------------------------------------------------- */

QT_INLINE void dq_q8_0(const uint8_t *restrict x, float *restrict y) {
    const float d = f16_at(x);
    const int8_t *q = (const int8_t *)(x + 2);
    for (int j = 0; j < 32; j++) y[j] = (float)q[j] * d;
}

QT_INLINE void dq_q4_0(const uint8_t *restrict x, float *restrict y) {
    const float d = f16_at(x);
    const uint8_t *q = x + 2;
    QT_NO_UNROLL
    for (int j = 0; j < 16; j++) {
        y[j] = ((float)(q[j] & 0x0F) - 8.0f) * d; /* exact subtraction, as torch's sub_(8) */
        y[j + 16] = ((float)(q[j] >> 4) - 8.0f) * d;
    }
}

QT_INLINE void dq_q4_1(const uint8_t *restrict x, float *restrict y) {
    const float d = f16_at(x), m = f16_at(x + 2);
    const uint8_t *q = x + 4;
    QT_NO_UNROLL
    for (int j = 0; j < 16; j++) {
        y[j] = (float)(q[j] & 0x0F) * d + m;
        y[j + 16] = (float)(q[j] >> 4) * d + m;
    }
}

QT_INLINE void dq_q5_0(const uint8_t *restrict x, float *restrict y) {
    const float d = f16_at(x);
    uint32_t qh;
    memcpy(&qh, x + 2, 4);
    const uint8_t *q = x + 6;
    for (int j = 0; j < 16; j++) {
        const int lo = (q[j] & 0x0F) | (int)(((qh >> j) & 1u) << 4);
        const int hi = (q[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
        y[j] = (float)(lo - 16) * d;
        y[j + 16] = (float)(hi - 16) * d;
    }
}

QT_INLINE void dq_q5_1(const uint8_t *restrict x, float *restrict y) {
    const float d = f16_at(x), m = f16_at(x + 2);
    uint32_t qh;
    memcpy(&qh, x + 4, 4);
    const uint8_t *q = x + 8;
    for (int j = 0; j < 16; j++) {
        const int lo = (q[j] & 0x0F) | (int)(((qh >> j) & 1u) << 4);
        const int hi = (q[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
        y[j] = (float)lo * d + m;
        y[j + 16] = (float)hi * d + m;
    }
}

/* ggml get_scale_min_k4: the 6-bit scale and min of sub-block i from 12 bytes */
QT_INLINE void scale_min_k4(const uint8_t *s, int i, int *sc, int *mn) {
    if (i < 4) {
        *sc = s[i] & 0x3F;
        *mn = s[i + 4] & 0x3F;
    } else {
        *sc = (s[i + 4] & 0x0F) | ((s[i - 4] >> 2) & 0x30);
        *mn = (s[i + 4] >> 4) | ((s[i] >> 2) & 0x30);
    }
}

/* Q2_K: [16 B scales][64 B 2-bit][d][dmin]; value e: byte (e/128)*32 + e%32, shift 2*((e/32)%4) */
QT_INLINE void dq_q2_k(const uint8_t *restrict x, float *restrict y) {
    const float d = f16_at(x + 80), dmin = f16_at(x + 82);
    const uint8_t *sc = x, *qs = x + 16;
    for (int s = 0; s < 16; s++) {
        const float ds = d * (float)(sc[s] & 0x0F);
        const float dm = dmin * (float)(sc[s] >> 4);
        const int e0 = s * 16;
        const uint8_t *q = qs + (e0 / 128) * 32 + e0 % 32;
        const int shift = 2 * ((e0 / 32) % 4);
        float *o = y + e0;
        for (int j = 0; j < 16; j++) o[j] = (float)((q[j] >> shift) & 3) * ds - dm;
    }
}

/* Q3_K: [32 B hmask][64 B 2-bit][12 B scales][d] */
QT_INLINE void dq_q3_k(const uint8_t *restrict x, float *restrict y) {
    const float d = f16_at(x + 108);
    const uint8_t *hm = x, *qs = x + 32, *s = x + 96;
    for (int i = 0; i < 16; i++) {
        const int low = i < 8 ? s[i] : s[i - 8] >> 4;
        const int high = s[8 + i % 4] >> (2 * (i / 4));
        const float dl = d * (float)(((low & 0x0F) | ((high & 3) << 4)) - 32);
        const int e0 = i * 16;
        const uint8_t *q = qs + (e0 / 128) * 32 + e0 % 32;
        const int shift = 2 * ((e0 / 32) % 4);
        const int plane = e0 / 32; /* hmask bit */
        const uint8_t *h = hm + e0 % 32;
        float *o = y + e0;
        for (int j = 0; j < 16; j++) {
            const int v = ((q[j] >> shift) & 3) - (((h[j] >> plane) & 1) ? 0 : 4);
            o[j] = (float)v * dl;
        }
    }
}

/* Q4_K / Q5_K: sub-blocks 2r and 2r+1 take d*sc and dmin*mn, each product rounded once */
QT_INLINE void k4_pair(const uint8_t *s, int r, float d, float dmin, float *ds0, float *dm0, float *ds1, float *dm1) {
    int sc0, mn0, sc1, mn1;
    scale_min_k4(s, 2 * r, &sc0, &mn0);
    scale_min_k4(s, 2 * r + 1, &sc1, &mn1);
    *ds0 = d * (float)sc0, *dm0 = dmin * (float)mn0;
    *ds1 = d * (float)sc1, *dm1 = dmin * (float)mn1;
}

/* Q4_K: [d][dmin][12 B scales][128 B: per 32 bytes, 32 low nibbles then 32 high] */
QT_INLINE void dq_q4_k(const uint8_t *restrict x, float *restrict y) {
    const float d = f16_at(x), dmin = f16_at(x + 2);
    const uint8_t *s = x + 4, *qs = x + 16;
    for (int r = 0; r < 4; r++) {
        float ds0, dm0, ds1, dm1;
        k4_pair(s, r, d, dmin, &ds0, &dm0, &ds1, &dm1);
        const uint8_t *q = qs + 32 * r;
        float *o = y + 64 * r;
        for (int j = 0; j < 32; j++) {
            o[j] = (float)(q[j] & 0x0F) * ds0 - dm0;
            o[j + 32] = (float)(q[j] >> 4) * ds1 - dm1;
        }
    }
}

/* Q5_K: [d][dmin][12 B scales][32 B high bits: bit plane = sub-block][128 B as Q4_K] */
QT_INLINE void dq_q5_k(const uint8_t *restrict x, float *restrict y) {
    const float d = f16_at(x), dmin = f16_at(x + 2);
    const uint8_t *s = x + 4, *qh = x + 16, *qs = x + 48;
    for (int r = 0; r < 4; r++) {
        float ds0, dm0, ds1, dm1;
        k4_pair(s, r, d, dmin, &ds0, &dm0, &ds1, &dm1);
        const uint8_t *q = qs + 32 * r;
        const int p0 = 2 * r, p1 = 2 * r + 1;
        float *o = y + 64 * r;
        for (int j = 0; j < 32; j++) {
            const int lo = (q[j] & 0x0F) | (((qh[j] >> p0) & 1) << 4);
            const int hi = (q[j] >> 4) | (((qh[j] >> p1) & 1) << 4);
            o[j] = (float)lo * ds0 - dm0;
            o[j + 32] = (float)hi * ds1 - dm1;
        }
    }
}

/* Q6_K: [128 B low 4 bits: per 64 bytes, 64 low nibbles then 64 high][64 B 2-bit][16 × i8][d]
 * value e = 128r + 64h + j (j < 64): nibble h of ql[64r + j], 2 bits at shift 2*(e%128/32) of
 * qh[32r + j%32] */
QT_INLINE void dq_q6_k(const uint8_t *restrict x, float *restrict y) {
    const float d = f16_at(x + 208);
    const uint8_t *ql = x, *qh = x + 128;
    const int8_t *sc = (const int8_t *)(x + 192);
    for (int r = 0; r < 2; r++) {
        for (int h = 0; h < 2; h++) {
            for (int k = 0; k < 2; k++) { /* 32 values: j = 32k .. 32k+31 */
                const int e0 = 128 * r + 64 * h + 32 * k;
                const float ds0 = d * (float)sc[e0 / 16], ds1 = d * (float)sc[e0 / 16 + 1];
                const uint8_t *l = ql + 64 * r + 32 * k;
                const uint8_t *hb = qh + 32 * r;
                const int lshift = 4 * h, hshift = 2 * ((e0 % 128) / 32);
                float *o = y + e0;
                for (int j = 0; j < 16; j++) {
                    const int q = ((l[j] >> lshift) & 0x0F) | (((hb[j] >> hshift) & 3) << 4);
                    o[j] = (float)(q - 32) * ds0;
                }
                for (int j = 16; j < 32; j++) {
                    const int q = ((l[j] >> lshift) & 0x0F) | (((hb[j] >> hshift) & 3) << 4);
                    o[j] = (float)(q - 32) * ds1;
                }
            }
        }
    }
}

/* IQ4_NL: [d f16][16 B: value j low nibble, j + 16 high], each code an index into
 * kvalues_iq4nl; d * value is exact (11 by 7 significant bits) */
static const int8_t iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
QT_INLINE void dq_iq4_nl(const uint8_t *restrict x, float *restrict y) {
    const float d = f16_at(x);
    const uint8_t *q = x + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)iq4nl_values[q[j] & 0x0F];
        y[j + 16] = d * (float)iq4nl_values[q[j] >> 4];
    }
}

/* IQ4_XS: [d f16][scales_h u16][4 B scales_l][128 B]; sub-block j of 32: 6-bit scale ls (low
 * nibble from scales_l, high two bits from scales_h), x = (d * (ls - 32)) * value, per 32 the
 * low nibbles of 16 bytes are values 0..15, their high nibbles 16..31 (dequantize_row_iq4_xs) */
QT_INLINE void dq_iq4_xs(const uint8_t *restrict x, float *restrict y) {
    const float d = f16_at(x);
    const uint16_t scales_h = (uint16_t)(x[2] | (x[3] << 8));
    const uint8_t *scales_l = x + 4, *q = x + 8;
    for (int ib = 0; ib < 8; ib++, q += 16, y += 32) {
        const int ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4);
        const float dl = d * (float)(ls - 32);
        for (int j = 0; j < 16; j++) {
            y[j] = dl * (float)iq4nl_values[q[j] & 0x0F];
            y[j + 16] = dl * (float)iq4nl_values[q[j] >> 4];
        }
    }
}

/* IQ3_S: iq3_encode.c decodes it (the grid lives there) */
QT_INLINE void dq_iq3_s(const uint8_t *restrict x, float *restrict y) { qt_iq3_s_decode(x, y, 1); }
QT_INLINE void dq_iq3_xxs(const uint8_t *restrict x, float *restrict y) { qt_iq3_xxs_decode(x, y, 1); }
QT_INLINE void dq_iq2_xxs(const uint8_t *restrict x, float *restrict y) { qt_iq2_xxs_decode(x, y, 1); }
QT_INLINE void dq_iq2_xs(const uint8_t *restrict x, float *restrict y) { qt_iq2_xs_decode(x, y, 1); }
QT_INLINE void dq_iq2_s(const uint8_t *restrict x, float *restrict y) { qt_iq2_s_decode(x, y, 1); }

/* e2m1 values doubled, as ggml's kvalues_mxfp4; the e8m0 and ue4m3 scales are halved to match */
static const int8_t e2m1_x2_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

QT_INLINE float e8m0_half(uint8_t e) { /* ggml_e8m0_to_fp32_half: 2^(e-127) / 2, exact, e = 0 and 1 too */
    const uint32_t bits = e < 2 ? (uint32_t)(e + 1) * 0x00200000u : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* MXFP4: [e8m0][16 B e2m1 codes: value j low nibble, j + 16 high]; every product is exact */
QT_INLINE void dq_mxfp4(const uint8_t *restrict x, float *restrict y) {
    const float d = e8m0_half(x[0]);
    const uint8_t *q = x + 1;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)e2m1_x2_values[q[j] & 0x0F] * d;
        y[j + 16] = (float)e2m1_x2_values[q[j] >> 4] * d;
    }
}

QT_INLINE float ue4m3_half(uint8_t x) { /* ggml's ue4m3 scale times 0.5 (the doubled table); 0 and 0x7F read 0 */
    if (x == 0 || x == 0x7F) return 0.0f;
    const int exp = (x >> 3) & 0x0F;
    const float man = (float)(x & 0x07);
    float raw;
    if (exp == 0) {
        raw = man * 0x1p-9f;
    } else {
        const uint32_t bits = (uint32_t)(exp - 7 + 127) << 23;
        float power;
        memcpy(&power, &bits, 4);
        raw = (1.0f + man / 8.0f) * power;
    }
    return raw * 0.5f;
}

/* NVFP4: [4 ue4m3 scales, one per 16][32 B: per 8 bytes, 8 low nibbles then their 8 high ones] */
QT_INLINE void dq_nvfp4(const uint8_t *restrict x, float *restrict y) {
    const uint8_t *q = x + 4;
    for (int s = 0; s < 4; s++) {
        const float d = ue4m3_half(x[s]);
        for (int j = 0; j < 8; j++) {
            y[16 * s + j] = (float)e2m1_x2_values[q[8 * s + j] & 0x0F] * d;
            y[16 * s + 8 + j] = (float)e2m1_x2_values[q[8 * s + j] >> 4] * d;
        }
    }
}

/* -- block loops ------------------------------------------------------------------------------ */

/* Decodes blocks [b0, b1): float32 straight into out, else 256 values at a time through a
 * float32 buffer then narrowed. */
#define QT_GGUF_LOOP(NAME, BS, TS)                                                                  \
    QT_INLINE void NAME##_loop(const uint8_t *src, void *out, int dt, Py_ssize_t b0, Py_ssize_t b1) { \
        enum { PER = 256 / (BS) };                                                                  \
        if (dt == QT_F32) {                                                                         \
            float *o = (float *)out;                                                                \
            for (Py_ssize_t b = b0; b < b1; b++) dq_##NAME(src + b * (TS), o + b * (BS));           \
            return;                                                                                 \
        }                                                                                           \
        float buf[256] __attribute__((aligned(64)));                                                \
        for (Py_ssize_t b = b0; b < b1; b += PER) {                                                 \
            const int nb = b1 - b < PER ? (int)(b1 - b) : PER;                                      \
            for (int k = 0; k < nb; k++) dq_##NAME(src + (b + k) * (TS), buf + k * (BS));           \
            qt_narrow(buf, out, dt, b * (BS), nb * (BS));                                         \
        }                                                                                           \
    }                                                                                               \
    static QT_HOT_WIDE void NAME##_run(const uint8_t *src, void *out, int dt, Py_ssize_t b0, Py_ssize_t b1) { \
        if (dt == QT_BF16) NAME##_loop(src, out, QT_BF16, b0, b1);                                  \
        else if (dt == QT_F16) NAME##_loop(src, out, QT_F16, b0, b1);                               \
        else NAME##_loop(src, out, QT_F32, b0, b1);                                                 \
    }

QT_GGUF_LOOP(q8_0, 32, 34)
QT_GGUF_LOOP(q4_0, 32, 18)
QT_GGUF_LOOP(q4_1, 32, 20)
QT_GGUF_LOOP(q5_0, 32, 22)
QT_GGUF_LOOP(q5_1, 32, 24)
QT_GGUF_LOOP(q2_k, 256, 84)
QT_GGUF_LOOP(q3_k, 256, 110)
QT_GGUF_LOOP(q4_k, 256, 144)
QT_GGUF_LOOP(q5_k, 256, 176)
QT_GGUF_LOOP(q6_k, 256, 210)
QT_GGUF_LOOP(iq4_nl, 32, 18)
QT_GGUF_LOOP(iq4_xs, 256, 136)
QT_GGUF_LOOP(iq3_s, 256, 110)
QT_GGUF_LOOP(iq3_xxs, 256, 98)
QT_GGUF_LOOP(iq2_xxs, 256, 66)
QT_GGUF_LOOP(iq2_xs, 256, 74)
QT_GGUF_LOOP(iq2_s, 256, 82)
QT_GGUF_LOOP(mxfp4, 32, 17)
QT_GGUF_LOOP(nvfp4, 64, 36)

static const struct {
    const char *name;
    Py_ssize_t block_size, type_size;
    qt_gguf_run run;
} qt_gguf_types[] = {
    {"Q8_0", 32, 34, q8_0_run},
    {"Q4_0", 32, 18, q4_0_run},
    {"Q4_1", 32, 20, q4_1_run},
    {"Q5_0", 32, 22, q5_0_run},
    {"Q5_1", 32, 24, q5_1_run},
    {"Q2_K", 256, 84, q2_k_run},
    {"Q3_K", 256, 110, q3_k_run},
    {"Q4_K", 256, 144, q4_k_run},
    {"Q5_K", 256, 176, q5_k_run},
    {"Q6_K", 256, 210, q6_k_run},
    {"IQ4_NL", 32, 18, iq4_nl_run},
    {"IQ4_XS", 256, 136, iq4_xs_run},
    {"IQ3_S", 256, 110, iq3_s_run},
    {"IQ3_XXS", 256, 98, iq3_xxs_run},
    {"IQ2_XXS", 256, 66, iq2_xxs_run},
    {"IQ2_XS", 256, 74, iq2_xs_run},
    {"IQ2_S", 256, 82, iq2_s_run},
    {"MXFP4", 32, 17, mxfp4_run},
    {"NVFP4", 64, 36, nvfp4_run},
};
#define QT_GGUF_TYPES ((int)(sizeof qt_gguf_types / sizeof qt_gguf_types[0]))

qt_gguf_run qt_gguf_decoder(const char *type_name, Py_ssize_t *block_size, Py_ssize_t *type_size) {
    for (int i = 0; i < QT_GGUF_TYPES; i++) {
        if (strcmp(type_name, qt_gguf_types[i].name) == 0) {
            *block_size = qt_gguf_types[i].block_size, *type_size = qt_gguf_types[i].type_size;
            return qt_gguf_types[i].run;
        }
    }
    return NULL;
}

int qt_gguf_decode_f32(const char *type_name, const uint8_t *src, float *out, Py_ssize_t blocks) {
    for (int i = 0; i < QT_GGUF_TYPES; i++) {
        if (strcmp(type_name, qt_gguf_types[i].name) == 0) {
            qt_gguf_types[i].run(src, out, QT_F32, 0, blocks);
            return 1;
        }
    }
    return 0;
}

PyObject *qt_py_decode_gguf(PyObject *self, PyObject *args) {
    (void)self;
    const char *type_name;
    Py_buffer src, out;
    int out_dtype;
    Py_ssize_t block0, block1;
    if (!PyArg_ParseTuple(args, "sy*w*inn", &type_name, &src, &out, &out_dtype, &block0, &block1)) return NULL;

    PyObject *result = NULL;
    int found = -1;
    for (int i = 0; i < QT_GGUF_TYPES; i++) {
        if (strcmp(type_name, qt_gguf_types[i].name) == 0) {
            found = i;
            break;
        }
    }
    if (found < 0) {
        PyErr_Format(PyExc_ValueError, "no native decoder for GGUF %s", type_name);
        goto done;
    }
    if (!qt_check_dtype(out_dtype, "decode_gguf out")) goto done;
    const Py_ssize_t bs = qt_gguf_types[found].block_size, ts = qt_gguf_types[found].type_size;
    const Py_ssize_t item = qt_itemsize(out_dtype);
    if (block0 < 0 || block1 < block0 || block1 > PY_SSIZE_T_MAX / (bs * item) || block1 > PY_SSIZE_T_MAX / ts) {
        PyErr_Format(PyExc_ValueError, "decode_gguf: bad block range [%zd, %zd)", block0, block1);
        goto done;
    }
    if (!qt_check_size(&src, block1 * ts, "decode_gguf src")) goto done;
    if (!qt_check_size(&out, block1 * bs * item, "decode_gguf out")) goto done;
    if ((uintptr_t)out.buf % (uintptr_t)item != 0) {
        PyErr_SetString(PyExc_ValueError, "decode_gguf: out is not aligned to its dtype");
        goto done;
    }
    {
        const qt_gguf_run run = qt_gguf_types[found].run;
        const uint8_t *s = (const uint8_t *)src.buf;
        void *o = out.buf;
        Py_BEGIN_ALLOW_THREADS
        run(s, o, out_dtype, block0, block1);
        Py_END_ALLOW_THREADS
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

/* gguf_decoders() -> {type name: (values, bytes) per block}, the table above */
PyObject *qt_py_gguf_decoders(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    PyObject *table = PyDict_New();
    for (int i = 0; table && i < QT_GGUF_TYPES; i++) {
        PyObject *size = Py_BuildValue("nn", qt_gguf_types[i].block_size, qt_gguf_types[i].type_size);
        if (!size || PyDict_SetItemString(table, qt_gguf_types[i].name, size) < 0) Py_CLEAR(table);
        Py_XDECREF(size);
    }
    return table;
}
