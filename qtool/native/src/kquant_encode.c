/* GGUF K-quant encoders (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and IQ4_NL, byte for byte llama.cpp's
 * reference quantizers without an importance matrix: quantize_row_qN_K_ref and
 * quantize_iq4_nl(..., quant_weights = NULL) of ggml/src/ggml-quants.c, as llama-quantize runs
 * them (llama.cpp 0c1e57098bba43ac29e6e3b677cdceebdd22334f; tests/fixtures/gguf_kquants holds
 * the proof, made by compiling that file).
 *
 * Why this is exact: ggml-base compiles ggml-quants.c for baseline x86-64 (no FMA, no
 * fast-math), so every float expression there is a chain of separately rounded float32 add,
 * sub, mul, div and sqrt, in the order C evaluates it; `w*x*l` is (w*x)*(float)l. We do the same
 * operations in the same order. (A llama.cpp built where the compiler contracts a*b+c into FMA by
 * default, e.g. GCC on aarch64, can write other bytes: the reference is the x86-64 build.) The searches (make_qkx2_quants, make_q3_quants,
 * make_qx_quants, the IQ4_NL scale search) walk each sub-block's values in order and keep
 * running float sums, so they cannot be vectorized along a sub-block without changing the
 * rounding. Instead each vector lane runs one sub-block: lane k does exactly the scalar
 * sequence of sub-block k, and IEEE arithmetic is exact per lane. Branches on a sub-block's
 * data become per-lane selects: both sides are computed, the scalar path's choice kept
 * (a path not taken may compute inf or NaN; it is never kept). Lanes that finished early (the
 * all-zero sub-block, make_q3_quants' converged passes) are left as the scalar code leaves them.
 *
 * nearest_int is ggml's magic-number rounding: f + 1.5*2^23, then the low 23 mantissa bits
 * minus 2^22. It is a float add and integer bit ops, so it vectorizes exactly and is defined
 * for every float (NaN and inf give fixed garbage, as in llama.cpp), so rows holding NaN or
 * inf get llama.cpp's bytes too.
 *
 * The once-per-super-block parts (scale codes, fp16 rounding of d and dmin, the final codes
 * from the rounded scales, the bit packing) are written as plain scalar code on each block.
 */
#include "qtool_native.h"

#ifdef __FAST_MATH__
#error "kquant_encode.c must be built without -ffast-math: its bytes depend on IEEE float32 rounding"
#endif

/* the lane vectors live in registers of always-inline functions; no ABI is crossed */
#pragma GCC diagnostic ignored "-Wpsabi"

#define QT_INLINE static inline __attribute__((always_inline))

QT_INLINE int32_t nearest(float f) { return (int32_t)(qt_bits(f + 12582912.0f) & 0x007FFFFFu) - 0x00400000; }

QT_INLINE void put_f16(uint8_t *p, float f) {
    const uint16_t h = qt_f32_to_f16(f);
    memcpy(p, &h, 2);
}
QT_INLINE float get_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return qt_f16_to_f32(h);
}

/* IQ4_NL's 16 values (kvalues_iq4nl) */
static const int8_t iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* -- the searches, at the machine's vector width (kquant_lanes.h) --------------------------------- */

#if defined(__GNUC__) && defined(__x86_64__)
#define QT_KQ_X86 1
#define NW 8
#define KQ(name) name##_avx2
#define KQ_TARGET __attribute__((target("avx2")))
#include "kquant_lanes.h"
#undef NW
#undef KQ
#undef KQ_TARGET
#endif

#define NW 4
#define KQ(name) name##_v4
#define KQ_TARGET
#include "kquant_lanes.h"
#undef NW
#undef KQ
#undef KQ_TARGET

/* The widest build the CPU runs (AVX2 8 lanes, else 4: SSE2 on x86, NEON elsewhere), capped by
 * qt_kquant_set_lanes. Both give the same bytes: a lane's arithmetic is the same whatever the
 * width. (A 16-lane AVX-512 build of the same code measured slower than AVX2 here, so there is
 * none.) */
static int qt_kq_max_lanes = 8;
void qt_kquant_set_lanes(int lanes) { qt_kq_max_lanes = lanes; }
PyObject *qt_py_kquant_set_lanes(PyObject *self, PyObject *args) {
    (void)self;
    int lanes;
    if (!PyArg_ParseTuple(args, "i", &lanes)) return NULL;
    qt_kquant_set_lanes(lanes);
    Py_RETURN_NONE;
}

static int kq_lanes(void) {
#ifdef QT_KQ_X86
    if (qt_kq_max_lanes >= 8 && __builtin_cpu_supports("avx2")) return 8;
#endif
    return 4;
}
#ifdef QT_KQ_X86
#define QT_KQ_CALL(lanes, name, ...) \
    ((lanes) == 8 ? name##_avx2(__VA_ARGS__) : name##_v4(__VA_ARGS__))
#else
#define QT_KQ_CALL(lanes, name, ...) name##_v4(__VA_ARGS__)
#endif

/* -- super-blocks: the scalar parts, once per 256 values ------------------------------------------ */

/* 2-bit codes: byte 32*(j/128) + j%32 holds codes j, j+32, j+64, j+96 (j%128 < 32), low bits first */
QT_INLINE void pack2(const uint8_t *L, uint8_t *qs) {
    for (int j = 0; j < 256; j += 128)
        for (int l = 0; l < 32; l++)
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

/* the 6-bit scale and min codes of Q4_K/Q5_K sub-blocks 0..7 into 12 bytes, and back
 * (ggml's get_scale_min_k4) */
QT_INLINE void pack_k4_scales(const uint8_t *ls, const uint8_t *lm, uint8_t *s) {
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            s[j] = ls[j];
            s[j + 4] = lm[j];
        } else {
            s[j + 4] = (uint8_t)((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
            s[j - 4] |= (uint8_t)((ls[j] >> 4) << 6);
            s[j] |= (uint8_t)((lm[j] >> 4) << 6);
        }
    }
}
QT_INLINE void k4_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63, *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* the largest value above 0, else 0 (`if (v > best) best = v` from 0: NaN never taken) */
QT_INLINE float positive_max(const float *v, int n) {
    float m = 0.0f;
    for (int j = 0; j < n; j++) m = v[j] > m ? v[j] : m;
    return m;
}

/* Q4_K / Q5_K: L's codes redone from the rounded scales at y where d * scale is not 0 */
QT_INLINE void k4_requantize(const float *x, int nmax, uint8_t *L, const uint8_t *y) {
    const float d_all = get_f16(y), dmin_all = get_f16(y + 2);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        k4_scale_min(y + 4, j, &sc, &m);
        const float d = d_all * (float)sc;
        if (d == 0.0f) continue;
        const float dm = dmin_all * (float)m;
        for (int i = 0; i < 32; i++) {
            const int l = nearest((x[32 * j + i] + dm) / d);
            L[32 * j + i] = (uint8_t)(l < 0 ? 0 : l > nmax ? nmax : l);
        }
    }
}

/* Q4_K / Q5_K after the search: d, dmin and the 12 scale bytes at y; L's codes redone from the
 * rounded scales where d * scale is not 0 */
QT_INLINE void k4_finish(const float *x, const float *scales, const float *mins, int nmax, uint8_t *L, uint8_t *y) {
    const float max_scale = positive_max(scales, 8), max_min = positive_max(mins, 8);
    const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
    const float inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
    uint8_t ls[8], lm[8];
    for (int j = 0; j < 8; j++) {
        const uint8_t a = (uint8_t)nearest(inv_scale * scales[j]), b = (uint8_t)nearest(inv_min * mins[j]);
        ls[j] = a < 63 ? a : 63;
        lm[j] = b < 63 ? b : 63;
    }
    put_f16(y, max_scale / 63.0f);
    put_f16(y + 2, max_min / 63.0f);
    pack_k4_scales(ls, lm, y + 4);
    k4_requantize(x, nmax, L, y);
}

/* Q4_K's 128 code bytes: per 64 values, 32 bytes, value j low nibble, j+32 high */
QT_INLINE void pack_q4_k(const uint8_t *L, uint8_t *q) {
    for (int j = 0; j < 256; j += 64, q += 32)
        for (int l = 0; l < 32; l++) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
}

/* Q5_K's 32 B fifth bits (bit 2r of qh[j] for value 64r + j, 2r+1 for 64r + 32 + j), then 128 B
 * low nibbles as Q4_K */
QT_INLINE void pack_q5_k(const uint8_t *L, uint8_t *qh) {
    uint8_t *ql = qh + 32;
    memset(qh, 0, 32);
    uint8_t m1 = 1, m2 = 2;
    for (int n = 0; n < 256; n += 64, ql += 32, m1 <<= 2, m2 <<= 2) {
        for (int j = 0; j < 32; j++) {
            int l1 = L[n + j], l2 = L[n + j + 32];
            if (l1 > 15) l1 -= 16, qh[j] |= m1;
            if (l2 > 15) l2 -= 16, qh[j] |= m2;
            ql[j] = (uint8_t)(l1 | (l2 << 4));
        }
    }
}

/* Q4_K: [d][dmin][12 B scales][128 B: per 64 values, 32 bytes, value j low nibble, j+32 high] */
static QT_HOT void q4_k_blocks(const float *x, Py_ssize_t nb, uint8_t *out) {
    uint8_t L2[512];
    float scales2[16], mins2[16];
    const int lanes = kq_lanes();
    for (Py_ssize_t b = 0; b < nb; b++) {
        const float *xb = x + 256 * b;
        const int second = b & 1; /* super-blocks searched in pairs: 16 sub-blocks, whole vectors at any width */
        if (!second) QT_KQ_CALL(lanes, k4_search, xb, nb - b > 1 ? 16 : 8, 15, -1.0f, 20, L2, scales2, mins2);
        uint8_t *L = L2 + 256 * second;
        const float *scales = scales2 + 8 * second, *mins = mins2 + 8 * second;
        uint8_t *y = out + 144 * b;
        k4_finish(xb, scales, mins, 15, L, y);
        pack_q4_k(L, y + 16);
    }
}

/* Q5_K: [d][dmin][12 B scales][32 B fifth bits: bit 2r of qh[j] for value 64r + j, 2r+1 for
 * 64r + 32 + j][128 B low nibbles as Q4_K] */
static QT_HOT void q5_k_blocks(const float *x, Py_ssize_t nb, uint8_t *out) {
    uint8_t L2[512];
    float scales2[16], mins2[16];
    const int lanes = kq_lanes();
    for (Py_ssize_t b = 0; b < nb; b++) {
        const float *xb = x + 256 * b;
        const int second = b & 1; /* super-blocks searched in pairs: 16 sub-blocks, whole vectors at any width */
        if (!second) QT_KQ_CALL(lanes, k4_search, xb, nb - b > 1 ? 16 : 8, 31, -0.5f, 15, L2, scales2, mins2);
        uint8_t *L = L2 + 256 * second;
        const float *scales = scales2 + 8 * second, *mins = mins2 + 8 * second;
        uint8_t *y = out + 176 * b;
        k4_finish(xb, scales, mins, 31, L, y);
        pack_q5_k(L, y + 16);
    }
}

/* Q2_K: L's codes redone from the stored scales and d, dmin where d * scale is not 0, packed */
QT_INLINE void q2_k_requantize(const float *xb, uint8_t *L, uint8_t *y) {
    const uint8_t *sc = y;
    const float d_all = get_f16(y + 80), dmin_all = get_f16(y + 82);
    for (int j = 0; j < 16; j++) {
        const float d = d_all * (float)(sc[j] & 0xF);
        if (d == 0.0f) continue;
        const float dm = dmin_all * (float)(sc[j] >> 4);
        for (int i = 0; i < 16; i++) {
            const int l = nearest((xb[16 * j + i] + dm) / d);
            L[16 * j + i] = (uint8_t)(l < 0 ? 0 : l > 3 ? 3 : l);
        }
    }
    pack2(L, y + 16);
}

/* Q2_K: [16 B: scale code | min code << 4][64 B 2-bit codes][d][dmin], sub-blocks of 16 */
static QT_HOT void q2_k_blocks(const float *x, Py_ssize_t nb, uint8_t *out) {
    uint8_t L[256];
    float scales[16], mins[16];
    const int lanes = kq_lanes();
    for (Py_ssize_t b = 0; b < nb; b++) {
        const float *xb = x + 256 * b;
        uint8_t *y = out + 84 * b, *sc = y;
        QT_KQ_CALL(lanes, q2_search, xb, 16, L, scales, mins);
        const float max_scale = positive_max(scales, 16), max_min = positive_max(mins, 16);
        if (max_scale > 0) {
            const float iscale = 15.0f / max_scale;
            for (int j = 0; j < 16; j++) sc[j] = (uint8_t)nearest(iscale * scales[j]);
            put_f16(y + 80, max_scale / 15.0f);
        } else {
            memset(sc, 0, 16);
            put_f16(y + 80, 0.0f);
        }
        if (max_min > 0) {
            const float iscale = 15.0f / max_min;
            for (int j = 0; j < 16; j++) sc[j] |= (uint8_t)((uint32_t)nearest(iscale * mins[j]) << 4);
            put_f16(y + 82, max_min / 15.0f);
        } else {
            put_f16(y + 82, 0.0f);
        }
        q2_k_requantize(xb, L, y);
    }
}

/* Q3_K after the scales: the codes redone from the stored scales where d * scale is not 0, the
 * high bits into hmask, the low two packed */
QT_INLINE void q3_k_requantize(const float *xb, uint8_t *L, uint8_t *y) {
    const uint8_t *s = y + 96;
    const float d_all = get_f16(y + 108);
    for (int j = 0; j < 16; j++) {
        const int low = j < 8 ? s[j] & 0xF : s[j - 8] >> 4;
        const int sc = (low | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
        const float d = d_all * (float)sc;
        if (d == 0.0f) continue;
        for (int i = 0; i < 16; i++) {
            const int l = nearest(xb[16 * j + i] / d);
            L[16 * j + i] = (uint8_t)((l < -4 ? -4 : l > 3 ? 3 : l) + 4);
        }
    }
    uint8_t *hmask = y; /* bit p of hmask[j]: code 32p + j is above 3 (and loses its 4) */
    for (int j = 0; j < 32; j++) {
        uint8_t h = 0;
        for (int p = 0; p < 8; p++) {
            const uint8_t high = L[32 * p + j] > 3;
            h |= (uint8_t)(high << p);
            L[32 * p + j] -= (uint8_t)(4 * high);
        }
        hmask[j] = h;
    }
    pack2(L, y + 32);
}

/* Q3_K: [32 B high bits: bit j/32 of hmask[j%32]][64 B low 2 bits as Q2_K][12 B 6-bit scales][d] */
static QT_HOT void q3_k_blocks(const float *x, Py_ssize_t nb, uint8_t *out) {
    uint8_t L[256];
    float scales[16];
    const int lanes = kq_lanes();
    for (Py_ssize_t b = 0; b < nb; b++) {
        const float *xb = x + 256 * b;
        uint8_t *y = out + 110 * b, *s = y + 96;
        QT_KQ_CALL(lanes, q3_search, xb, 16, L, scales);
        float max_scale = 0.0f, amax = 0.0f;
        for (int j = 0; j < 16; j++) {
            const float a = __builtin_fabsf(scales[j]);
            if (a > amax) amax = a, max_scale = scales[j];
        }
        memset(s, 0, 12);
        if (max_scale != 0.0f) { /* NaN too, as C's `if (max_scale)` */
            const float iscale = -32.0f / max_scale;
            for (int j = 0; j < 16; j++) {
                int l = (int8_t)(uint8_t)(uint32_t)nearest(iscale * scales[j]); /* ggml keeps it in an int8_t */
                l = (l < -32 ? -32 : l > 31 ? 31 : l) + 32;
                if (j < 8) s[j] = (uint8_t)(l & 0xF);
                else s[j - 8] |= (uint8_t)((l & 0xF) << 4);
                s[j % 4 + 8] |= (uint8_t)((l >> 4) << (2 * (j / 4)));
            }
            put_f16(y + 108, 1.0f / iscale);
        } else {
            put_f16(y + 108, 0.0f);
        }
        q3_k_requantize(xb, L, y);
    }
}

/* Q6_K after the search: d and the 16 int8 scales from the sub-blocks' scales, the codes redone
 * from them where d * scale is not 0, packed (all zero where every scale is below 1e-15) */
QT_INLINE void q6_k_finish(const float *xb, const float *scales, uint8_t *L, uint8_t *y) {
    float max_scale = 0.0f, max_abs_scale = 0.0f;
    for (int j = 0; j < 16; j++) {
        const float a = __builtin_fabsf(scales[j]);
        if (a > max_abs_scale) max_abs_scale = a, max_scale = scales[j];
    }
    if (max_abs_scale < 1e-15f) {
        memset(y, 0, 210);
        return;
    }
    const float iscale = -128.0f / max_scale;
    put_f16(y + 208, 1.0f / iscale);
    int8_t *sc = (int8_t *)(y + 192);
    for (int j = 0; j < 16; j++) {
        const int32_t l = nearest(iscale * scales[j]);
        sc[j] = (int8_t)(uint8_t)(uint32_t)(l < 127 ? l : 127);
    }
    const float d_all = get_f16(y + 208);
    for (int j = 0; j < 16; j++) {
        const float d = d_all * (float)sc[j];
        if (d == 0.0f) continue;
        for (int i = 0; i < 16; i++) {
            const int l = nearest(xb[16 * j + i] / d);
            L[16 * j + i] = (uint8_t)((l < -32 ? -32 : l > 31 ? 31 : l) + 32);
        }
    }
    uint8_t *ql = y, *qh = y + 128;
    for (int j = 0; j < 256; j += 128, ql += 64, qh += 32) {
        for (int l = 0; l < 32; l++) {
            const uint8_t *c = L + j + l;
            ql[l] = (uint8_t)((c[0] & 0xF) | ((c[64] & 0xF) << 4));
            ql[l + 32] = (uint8_t)((c[32] & 0xF) | ((c[96] & 0xF) << 4));
            qh[l] = (uint8_t)((c[0] >> 4) | ((c[32] >> 4) << 2) | ((c[64] >> 4) << 4) | ((c[96] >> 4) << 6));
        }
    }
}

/* Q6_K: [128 B low nibbles][64 B high 2 bits][16 x i8 scales][d] (layout in gguf.c's dq_q6_k) */
static QT_HOT void q6_k_blocks(const float *x, Py_ssize_t nb, uint8_t *out) {
    uint8_t L[256];
    float scales[16];
    const int lanes = kq_lanes();
    for (Py_ssize_t b = 0; b < nb; b++) {
        const float *xb = x + 256 * b;
        uint8_t *y = out + 210 * b;
        QT_KQ_CALL(lanes, q6_search, xb, 16, L, scales);
        q6_k_finish(xb, scales, L, y);
    }
}


/* -- with an importance matrix: llama.cpp's quantize_qN(..., quant_weights) ----------------------
 *
 * llama.cpp takes another path for every type once quant_weights is given (the `_impl` row
 * functions): each value's weight is qw * sqrt(sigma2 + x^2), sigma2 a mean square of the values
 * (over the super-block, or the whole row for Q4_0..Q5_1), the sub-block searches use those
 * weights (make_qkx3_quants, make_qx_quants), and the super-block scales are searched too,
 * weighted by each sub-block's summed weights (make_qp_quants, make_qx_quants). Q6_K weights by
 * qw alone. The searches run in lanes as above; the rest is scalar, in ggml's order. */

/* sum of x^2 in order, as ggml's loops add it */
QT_INLINE float sum_squares(const float *x, Py_ssize_t n) {
    float s = 0.0f;
    for (Py_ssize_t i = 0; i < n; i++) s += x[i] * x[i];
    return s;
}

/* w = qw * sqrt(sigma2 + x^2), and the sums of each `per` weights in order into sw (if given) */
QT_INLINE void importance_weights(const float *x, const float *qw, float sigma2, int n, float *w, int per, float *sw) {
    for (int i = 0; i < n; i++) w[i] = qw[i] * __builtin_sqrtf(sigma2 + x[i] * x[i]);
    if (!sw) return;
    for (int j = 0; j < n / per; j++) {
        float sum = 0.0f;
        for (int i = 0; i < per; i++) sum += w[per * j + i];
        sw[j] = sum;
    }
}

/* make_qx_quants(n, nmax, x, L, 1, w), one at a time: Q3_K's scale of the 16 sub-block scales */
static float qx_quants(int n, int nmax, const float *x, const float *w, int8_t *L) {
    float max = 0.0f, amax = 0.0f;
    for (int i = 0; i < n; i++) {
        const float ax = __builtin_fabsf(x[i]);
        if (ax > amax) amax = ax, max = x[i];
    }
    if (amax < 1e-15f) {
        memset(L, 0, (size_t)n);
        return 0.0f;
    }
    float iscale = (float)(-nmax) / max, sumlx = 0.0f, suml2 = 0.0f;
    for (int i = 0; i < n; i++) {
        int l = nearest(iscale * x[i]);
        l = l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l;
        L[i] = (int8_t)(l + nmax);
        sumlx += w[i] * x[i] * (float)l;
        suml2 += w[i] * (float)l * (float)l;
    }
    float scale = suml2 != 0.0f ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -((float)nmax + 0.1f * (float)is) / max;
        sumlx = suml2 = 0.0f;
        for (int i = 0; i < n; i++) {
            int l = nearest(iscale * x[i]);
            l = l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l;
            sumlx += w[i] * x[i] * (float)l;
            suml2 += w[i] * (float)l * (float)l;
        }
        if (suml2 > 0.0f && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++) {
                int l = nearest(iscale * x[i]);
                L[i] = (int8_t)(nmax + (l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l));
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* Q4_K / Q5_K (quantize_row_q4_K_impl, _q5_K_impl): sigma2 = 2 mean x^2 over the super-block,
 * make_qkx3_quants(32, nmax, ...) per sub-block, make_qp_quants(8, 63, ...) for d and dmin */
static QT_HOT void k4_w_blocks(const float *x, const float *qw, Py_ssize_t nb, int nmax, uint8_t *out) {
    uint8_t L2[512];
    float scales2[16], mins2[16], w2[512], sw2[16];
    const int lanes = kq_lanes(), q5 = nmax == 31, ts = q5 ? 176 : 144;
    for (Py_ssize_t b = 0; b < nb; b++) {
        const float *xb = x + 256 * b;
        const int second = b & 1;
        if (!second) {
            const int pair = nb - b > 1 ? 2 : 1;
            for (int h = 0; h < pair; h++) {
                const float sigma2 = 2.0f * sum_squares(xb + 256 * h, 256) / 256.0f;
                importance_weights(xb + 256 * h, qw + 256 * (b + h), sigma2, 256, w2 + 256 * h, 32, sw2 + 8 * h);
            }
            QT_KQ_CALL(lanes, qkx3_search, xb, w2, 32, 8 * pair, nmax, L2, scales2, mins2);
        }
        uint8_t *L = L2 + 256 * second, *y = out + ts * b;
        const float *sw = sw2 + 8 * second;
        uint8_t ls[8], lm[8];
        const float d_block = qt_qp_quants(8, 63, scales2 + 8 * second, ls, sw);
        const float m_block = qt_qp_quants(8, 63, mins2 + 8 * second, lm, sw);
        if (q5)
            for (int j = 0; j < 8; j++) ls[j] = ls[j] < 63 ? ls[j] : 63, lm[j] = lm[j] < 63 ? lm[j] : 63;
        pack_k4_scales(ls, lm, y + 4);
        put_f16(y, d_block);
        put_f16(y + 2, m_block);
        k4_requantize(xb, nmax, L, y);
        if (q5) pack_q5_k(L, y + 16);
        else pack_q4_k(L, y + 16);
    }
}

/* Q2_K (quantize_row_q2_K_impl): sigma2 = mean x^2, make_qkx3_quants(16, 3, ...) per sub-block,
 * make_qp_quants(16, 15, ...) for d and dmin */
static QT_HOT void q2_k_w_blocks(const float *x, const float *qw, Py_ssize_t nb, uint8_t *out) {
    uint8_t L[256], ls[16], lm[16];
    float scales[16], mins[16], w[256], sw[16];
    const int lanes = kq_lanes();
    for (Py_ssize_t b = 0; b < nb; b++) {
        const float *xb = x + 256 * b;
        uint8_t *y = out + 84 * b;
        importance_weights(xb, qw + 256 * b, sum_squares(xb, 256) / 256.0f, 256, w, 16, sw);
        QT_KQ_CALL(lanes, qkx3_search, xb, w, 16, 16, 3, L, scales, mins);
        const float dm = qt_qp_quants(16, 15, scales, ls, sw), mm = qt_qp_quants(16, 15, mins, lm, sw);
        put_f16(y + 80, dm);
        put_f16(y + 82, mm);
        for (int j = 0; j < 16; j++) y[j] = (uint8_t)(ls[j] | (lm[j] << 4));
        q2_k_requantize(xb, L, y);
    }
}

/* Q3_K (quantize_row_q3_K_impl): sigma2 = 2 mean x^2, make_qx_quants(16, 4, ...) per sub-block,
 * make_qx_quants(16, 32, ...) for d */
static QT_HOT void q3_k_w_blocks(const float *x, const float *qw, Py_ssize_t nb, uint8_t *out) {
    uint8_t L[256];
    int8_t Ls[16];
    float scales[16], w[256], sw[16];
    const int lanes = kq_lanes();
    for (Py_ssize_t b = 0; b < nb; b++) {
        const float *xb = x + 256 * b;
        uint8_t *y = out + 110 * b, *s = y + 96;
        importance_weights(xb, qw + 256 * b, 2.0f * sum_squares(xb, 256) / 256.0f, 256, w, 16, sw);
        QT_KQ_CALL(lanes, qx_search, xb, w, 16, 16, 4, L, scales);
        memset(s, 0, 12);
        const float d_block = qx_quants(16, 32, scales, sw, Ls);
        for (int j = 0; j < 16; j++) {
            int l = Ls[j];
            if (j < 8) s[j] = (uint8_t)(l & 0xF);
            else s[j - 8] |= (uint8_t)((l & 0xF) << 4);
            l >>= 4;
            s[j % 4 + 8] |= (uint8_t)(l << (2 * (j / 4)));
        }
        put_f16(y + 108, d_block);
        q3_k_requantize(xb, L, y);
    }
}

/* Q6_K (quantize_row_q6_K_impl): make_qx_quants(16, 32, x, L, 1, qw), qw as it comes */
static QT_HOT void q6_k_w_blocks(const float *x, const float *qw, Py_ssize_t nb, uint8_t *out) {
    uint8_t L[256];
    float scales[16];
    const int lanes = kq_lanes();
    for (Py_ssize_t b = 0; b < nb; b++) {
        const float *xb = x + 256 * b;
        QT_KQ_CALL(lanes, qx_search, xb, qw + 256 * b, 16, 16, 32, L, scales);
        q6_k_finish(xb, scales, L, out + 210 * b);
    }
}

/* ggml's best_index_int8(16, kvalues_iq4nl, x) */
QT_INLINE int iq4nl_best(float x) {
    if (x <= (float)iq4nl_values[0]) return 0;
    if (x >= (float)iq4nl_values[15]) return 15;
    int ml = 0, mu = 15;
    while (mu - ml > 1) {
        const int mav = (ml + mu) / 2;
        if (x < (float)iq4nl_values[mav]) mu = mav;
        else ml = mav;
    }
    return x - (float)iq4nl_values[mu - 1] < (float)iq4nl_values[mu] - x ? mu - 1 : mu;
}

/* IQ4_XS (quantize_iq4_xs: quantize_row_iq4_nl_impl(256, 32, ..., ntry 7)): each block of 32
 * searched as IQ4_NL's, then d = -max_scale / 32 and 6-bit sub-block scales, the codes redone;
 * [d f16][scales_h u16][4 B scales_l][128 B: per 32 values, 16 bytes, j low nibble, j+16 high] */
enum { IQ4_XS_CHUNK = 16 };
static QT_HOT void iq4_xs_blocks(const float *x, const float *qw, Py_ssize_t nb, uint8_t *out) {
    float scales[8 * IQ4_XS_CHUNK], w[256 * IQ4_XS_CHUNK];
    const int lanes = kq_lanes();
    for (Py_ssize_t b0 = 0; b0 < nb; b0 += IQ4_XS_CHUNK) {
        const int n = nb - b0 < IQ4_XS_CHUNK ? (int)(nb - b0) : IQ4_XS_CHUNK;
        const float *xc = x + 256 * b0;
        if (qw) {
            for (int k = 0; k < n; k++) {
                const float sigma2 = sum_squares(xc + 256 * k, 256) * (2.0f / 256.0f);
                importance_weights(xc + 256 * k, qw + 256 * (b0 + k), sigma2, 256, w + 256 * k, 32, NULL);
            }
        }
        QT_KQ_CALL(lanes, iq4_search, xc, qw ? w : NULL, 8 * n, scales);
        for (int k = 0; k < n; k++) {
            const float *xb = xc + 256 * k, *sc = scales + 8 * k;
            uint8_t *y = out + 136 * (b0 + k), *scales_l = y + 4, *q = y + 8;
            float max_scale = 0.0f, amax_scale = 0.0f;
            for (int ib = 0; ib < 8; ib++) {
                const float a = __builtin_fabsf(sc[ib]);
                if (a > amax_scale) amax_scale = a, max_scale = sc[ib];
            }
            const float d = -max_scale / 32.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            put_f16(y, d);
            uint16_t scales_h = 0;
            for (int ib = 0; ib < 8; ib++) {
                int l = nearest(id * sc[ib]);
                l = l < -32 ? -32 : l > 31 ? 31 : l;
                const float dl = d * (float)l, idl = dl != 0.0f ? 1.0f / dl : 0.0f;
                const float *xs = xb + 32 * ib;
                for (int j = 0; j < 16; j++) q[16 * ib + j] = (uint8_t)(iq4nl_best(idl * xs[j]) | (iq4nl_best(idl * xs[j + 16]) << 4));
                l += 32;
                if (ib % 2 == 0) scales_l[ib / 2] = (uint8_t)(l & 0xF);
                else scales_l[ib / 2] |= (uint8_t)((l & 0xF) << 4);
                scales_h |= (uint16_t)((l >> 4) << (2 * ib));
            }
            memcpy(y + 2, &scales_h, 2);
        }
    }
}

/* Q4_0 / Q5_0 (make_qx_quants(32, 8 or 16, ..., weights)) and Q4_1 / Q5_1 (make_qkx3_quants(32,
 * 15 or 31, ...)) with an imatrix: sigma2 = mean x^2 over the whole row */
enum { LEGACY_CHUNK = 64 };
static QT_HOT void legacy_w_blocks(const float *x, const float *qw, Py_ssize_t nb, int nmax, int affine, uint8_t *out) {
    uint8_t L[32 * LEGACY_CHUNK];
    float w[32 * LEGACY_CHUNK], d[LEGACY_CHUNK], mins[LEGACY_CHUNK];
    const int lanes = kq_lanes(), five = nmax == 16 || nmax == 31;
    const int ts = 18 + 2 * affine + 4 * five;
    const float sigma2 = sum_squares(x, 32 * nb) / (float)(32 * nb);
    for (Py_ssize_t b0 = 0; b0 < nb; b0 += LEGACY_CHUNK) {
        const int n = nb - b0 < LEGACY_CHUNK ? (int)(nb - b0) : LEGACY_CHUNK;
        const float *xc = x + 32 * b0;
        importance_weights(xc, qw + 32 * b0, sigma2, 32 * n, w, 32, NULL);
        if (affine) QT_KQ_CALL(lanes, qkx3_search, xc, w, 32, n, nmax, L, d, mins);
        else QT_KQ_CALL(lanes, qx_search, xc, w, 32, n, nmax, L, d);
        for (int k = 0; k < n; k++) {
            uint8_t *y = out + ts * (b0 + k), *q = y + 2 + 2 * affine;
            const uint8_t *l = L + 32 * k;
            put_f16(y, d[k]);
            if (affine) put_f16(y + 2, -mins[k]);
            if (five) {
                uint32_t qh = 0;
                for (int j = 0; j < 16; j++) qh |= (uint32_t)((l[j] & 0x10u) >> 4) << j | (uint32_t)((l[j + 16] & 0x10u) >> 4) << (j + 16);
                memcpy(q, &qh, 4);
                q += 4;
            }
            for (int j = 0; j < 16; j++) q[j] = (uint8_t)((l[j] & 0x0F) | ((l[j + 16] & 0x0F) << 4));
        }
    }
}

/* IQ4_NL with an imatrix: sigma2 = 2 mean x^2 over each block of 32 */
static QT_HOT void iq4_nl_w_blocks(const float *x, const float *qw, Py_ssize_t nb, uint8_t *out) {
    float w[32 * LEGACY_CHUNK];
    const int lanes = kq_lanes();
    for (Py_ssize_t b0 = 0; b0 < nb; b0 += LEGACY_CHUNK) {
        const int n = nb - b0 < LEGACY_CHUNK ? (int)(nb - b0) : LEGACY_CHUNK;
        for (int k = 0; k < n; k++) {
            const float *xb = x + 32 * (b0 + k);
            const float sigma2 = sum_squares(xb, 32) * (2.0f / 32.0f);
            importance_weights(xb, qw + 32 * (b0 + k), sigma2, 32, w + 32 * k, 32, NULL);
        }
        QT_KQ_CALL(lanes, iq4_nl_blocks, x + 32 * b0, w, n, out + 18 * b0);
    }
}

/* -- rows: qt_encode_row's contract (qtool_native.h): blocks' bytes into out, decoded into rec;
 * qw NULL quantizes without an imatrix -- */

void qt_q2_k_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec) {
    if (qw) q2_k_w_blocks(x, qw, blocks, out);
    else q2_k_blocks(x, blocks, out);
    qt_gguf_decode_f32("Q2_K", out, rec, blocks);
}
void qt_q3_k_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec) {
    if (qw) q3_k_w_blocks(x, qw, blocks, out);
    else q3_k_blocks(x, blocks, out);
    qt_gguf_decode_f32("Q3_K", out, rec, blocks);
}
void qt_q4_k_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec) {
    if (qw) k4_w_blocks(x, qw, blocks, 15, out);
    else q4_k_blocks(x, blocks, out);
    qt_gguf_decode_f32("Q4_K", out, rec, blocks);
}
void qt_q5_k_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec) {
    if (qw) k4_w_blocks(x, qw, blocks, 31, out);
    else q5_k_blocks(x, blocks, out);
    qt_gguf_decode_f32("Q5_K", out, rec, blocks);
}
void qt_q6_k_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec) {
    if (qw) q6_k_w_blocks(x, qw, blocks, out);
    else q6_k_blocks(x, blocks, out);
    qt_gguf_decode_f32("Q6_K", out, rec, blocks);
}
void qt_iq4_nl_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec) {
    if (qw) iq4_nl_w_blocks(x, qw, blocks, out);
    else
        for (Py_ssize_t b = 0; b < blocks; b += 1024) /* int counts inside */
            QT_KQ_CALL(kq_lanes(), iq4_nl_blocks, x + 32 * b, NULL, blocks - b < 1024 ? (int)(blocks - b) : 1024, out + 18 * b);
    qt_gguf_decode_f32("IQ4_NL", out, rec, blocks);
}
void qt_iq4_xs_row(const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec) {
    iq4_xs_blocks(x, qw, blocks, out);
    qt_gguf_decode_f32("IQ4_XS", out, rec, blocks);
}
/* the 32-value types with an imatrix (without one gguf_encode.c has them) */
void qt_legacy_w_row(const char *type_name, const float *x, const float *qw, Py_ssize_t blocks, uint8_t *out, float *rec) {
    const int nmax = type_name[1] == '4' ? (type_name[3] == '0' ? 8 : 15) : (type_name[3] == '0' ? 16 : 31);
    legacy_w_blocks(x, qw, blocks, nmax, type_name[3] == '1', out);
    qt_gguf_decode_f32(type_name, out, rec, blocks);
}
